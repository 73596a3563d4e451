//! Accuracy-aware substitution under load (BlockLLM §4.4), opt-in per zoo variant.
//!
//! A zoo variant added with `zoo add --substitute-min-similarity X` records which of its own
//! blocks are at least `X` similar to the base's (logit lens) and a *substitute*: the variant
//! with those blocks run as the base's (`<zoo>/substitutes/<name>`, a smaller partial delta, or
//! the base model itself when no own block is left). With `--substitute-above F`, the daemon
//! registers each substitute as the delta `<name>.substitute` and, while the server is loaded,
//! serves the variant's requests with it:
//!
//! ```text
//!  capacity    = --max-queued-per-worker x workers   (where new requests start getting 429)
//!  outstanding = requests queued or running on every worker when the request arrives
//!  substitute  ⇔ the variant opted in  ∧  outstanding > F x capacity
//! ```
//!
//! A substituted request says so (`x-deltaserve-substituted: true` on its HTTP response;
//! `api/substitution.rs`), keeps the name it asked for in `model`, and its tokens (each
//! choice's prompt and completion) count in `deltaserve_zoo_substituted_tokens_total{variant}`.
//! A variant that did not opt in is never substituted, whatever the load.

use std::collections::BTreeMap;
use std::sync::{Mutex, RwLock};

/// The suffix of a substitute's registered name: `<variant>.substitute`.
pub const SUBSTITUTE_SUFFIX: &str = ".substitute";

/// What a variant runs while substituted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Substitute {
    /// The base model (every own block of the variant is substitutable).
    Base,
    /// The registered variant of this name (its remaining own blocks).
    Variant(String),
}

/// The substitution table and its counters, shared by the request path and `/metrics`.
#[derive(Debug, Default)]
pub struct Substitutions {
    table: RwLock<Table>,
    /// Variant name -> tokens served substituted.
    tokens: Mutex<BTreeMap<String, u64>>,
}

#[derive(Debug, Default)]
struct Table {
    /// `--substitute-above`: None turns substitution off.
    above: Option<f64>,
    /// Opted-in variant name -> its substitute.
    targets: BTreeMap<String, Substitute>,
}

/// Whether `outstanding` requests are beyond `above` of `capacity` (module docs).
pub fn loaded(outstanding: usize, capacity: usize, above: f64) -> bool {
    outstanding as f64 > above * capacity as f64
}

impl Substitutions {
    /// Turns substitution on at `above` (or off with `None`) for the opted-in `targets`.
    pub fn configure(&self, above: Option<f64>, targets: BTreeMap<String, Substitute>) {
        let mut t = self.table.write().expect("substitution table lock");
        t.above = above;
        t.targets = targets;
    }

    /// The substitute of `variant` when it opted in and the load is beyond the threshold.
    pub fn pick(&self, variant: &str, outstanding: usize, capacity: usize) -> Option<Substitute> {
        let t = self.table.read().expect("substitution table lock");
        let above = t.above?;
        let target = t.targets.get(variant)?;
        loaded(outstanding, capacity, above).then(|| target.clone())
    }

    /// Whether `name` is the registered substitute of a variant (`<variant>.substitute`): internal,
    /// left out of `/v1/models` (the admin listing `/v1/adapters` shows it).
    pub fn is_substitute(&self, name: &str) -> bool {
        let t = self.table.read().expect("substitution table lock");
        t.targets
            .values()
            .any(|s| matches!(s, Substitute::Variant(v) if v == name))
    }

    /// Counts `tokens` served substituted for `variant`.
    pub fn count(&self, variant: &str, tokens: u64) {
        let mut counts = self.tokens.lock().expect("substitution counts lock");
        *counts.entry(variant.to_string()).or_default() += tokens;
    }

    /// `(variant, tokens served substituted)`, by name.
    pub fn counts(&self) -> Vec<(String, u64)> {
        let counts = self.tokens.lock().expect("substitution counts lock");
        counts.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }
}

/// Turns substitution on for the zoo variants that opted in (`--substitute-above`): each one
/// served, whose substitute is the base or a served `<name>.substitute`. Entries the zoo's
/// manifest gets wrong are logged (file and field) and left unsubstituted; the rest is served.
pub fn configure_from_zoos(
    cfg: &crate::config::ServerConfig,
    registry: &crate::registry::VariantRegistry,
) {
    let Some(above) = cfg.substitute_above else {
        return;
    };
    let mut targets = BTreeMap::new();
    for sub in cfg.zoo_substitutions() {
        let sub = match sub {
            Ok(sub) => sub,
            Err(e) => {
                tracing::error!("zoo substitution not used: {e}");
                continue;
            }
        };
        if registry.active_id(&sub.variant).is_none() {
            continue; // not served (its refusal was logged)
        }
        let target = match sub.dir {
            None => Substitute::Base,
            Some(_) => {
                let name = format!("{}{SUBSTITUTE_SUFFIX}", sub.variant);
                if registry.active_id(&name).is_none() {
                    tracing::error!(variant = %sub.variant, "zoo substitution not used: its substitute {name} is not served");
                    continue;
                }
                Substitute::Variant(name)
            }
        };
        tracing::info!(variant = %sub.variant, substitute = ?target, above, "substitution under load on");
        targets.insert(sub.variant, target);
    }
    registry.substitutions().configure(Some(above), targets);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_opted_in_variants_and_only_beyond_the_threshold() {
        let s = Substitutions::default();
        let targets = BTreeMap::from([
            ("a".to_string(), Substitute::Base),
            ("b".to_string(), Substitute::Variant("b.substitute".into())),
        ]);
        s.configure(None, targets.clone());
        assert_eq!(s.pick("a", 100, 4), None, "off without --substitute-above");
        s.configure(Some(0.5), targets);
        assert_eq!(s.pick("a", 2, 4), None, "2 of 4 is not beyond half");
        assert_eq!(s.pick("a", 3, 4), Some(Substitute::Base));
        assert_eq!(
            s.pick("b", 3, 4),
            Some(Substitute::Variant("b.substitute".into()))
        );
        assert_eq!(s.pick("c", 1000, 4), None, "c did not opt in");
        assert!(s.is_substitute("b.substitute"));
        assert!(!s.is_substitute("b") && !s.is_substitute("a.substitute"));
        s.count("a", 5);
        s.count("a", 2);
        assert_eq!(s.counts(), vec![("a".to_string(), 7)]);
    }
}
