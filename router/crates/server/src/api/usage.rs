//! A generation's life as the API accounts it: the tenant's quota is checked and held, the
//! engine's events are forwarded to the handler through one small task that counts them, and at
//! the end the quota is charged, usage is metered per tenant and variant, and one structured log
//! line says how it went. Every generation (JSON, SSE, WebSocket) goes through [`start`], or
//! [`start_choices`] for the `n` / `best_of` choices of one request (one forward task per
//! choice; the last to end settles the request's quota, usage and log line).
//!
//! ```text
//!  handler ── start() ── quota.admit ── Backend::generate ──▶ engine events
//!                                                                 │ forward task (counts tokens,
//!     ◀── events ── (the handler's receiver) ◀────────────────────┘  first-token time, the end)
//!  end (finished, failed, or the handler's receiver dropped = cancelled):
//!     lease.finish(completion tokens) · UsageMeter::record · log "request finished"
//! ```
//!
//! Cancellation stays by ownership (STYLE.md #14): when the handler drops its receiver, the
//! task sees its sender closed at once and drops the engine's receiver.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus::core::Collector;
use prometheus::proto::MetricFamily;
use prometheus::{IntCounterVec, Opts};
use tokio::sync::mpsc::{self, UnboundedReceiver};
use tracing::Instrument;

use super::auth::Requester;
use super::error::ApiError;
use super::quotas::QuotaLease;
use super::Backend;
use crate::engine::{GenerateEvent, GenerateRequest};

/// Most `(tenant, variant)` label pairs in `/metrics`; later pairs are counted as
/// `("other", "other")`, so a flood of names cannot grow the scrape without bound.
pub const MAX_LABEL_PAIRS: usize = 1024;

/// Queues `req` for `who` and returns its events (see the module docs). A quota refusal is a
/// 429 naming the limit; an engine refusal passes through.
pub async fn start<B: Backend>(
    backend: &B,
    who: &Requester,
    req: GenerateRequest,
) -> Result<UnboundedReceiver<GenerateEvent>, ApiError> {
    let mut receivers = start_choices(backend, who, vec![req]).await?;
    Ok(receivers.pop().expect("one choice, one receiver"))
}

/// Queues the choices of one request (`n` / `best_of`: the same prompt and variant, each its
/// own engine request, queued together on one worker so that they share the prompt's KV
/// pages) as one request of the tenant's: one quota slot, the prompt's tokens charged once per
/// choice, every choice's completion tokens at the end, one usage record
/// (prompt counted once, as in the response's `usage`) and one log line when the last choice
/// ends. If a choice is refused, the ones already queued are cancelled (their receivers
/// dropped) and the refusal is the answer.
pub async fn start_choices<B: Backend>(
    backend: &B,
    who: &Requester,
    mut reqs: Vec<GenerateRequest>,
) -> Result<Vec<UnboundedReceiver<GenerateEvent>>, ApiError> {
    let started = Instant::now();
    let first = reqs.first().expect("at least one choice");
    let choices = reqs.len() as u32;
    let prompt_tokens = first.prompt_token_ids.len() as u32;
    let adapter_id = first.adapter_id;
    let variant = backend.model().display_name(adapter_id);
    let tenant = who.caller.label().to_string();
    let access = who.access.clone();
    if adapter_id != 0 {
        recheck_variant_dir(backend, adapter_id, &variant)?;
    }
    let lease = match &who.caller.tenant {
        Some(t) => t
            .quota
            .admit(prompt_tokens.saturating_mul(choices), access.now())
            .map_err(|e| {
                access.usage.reject(&tenant, &variant, e.limit);
                tracing::info!(tenant = %tenant, variant = %variant, limit = e.limit, "quota refused the request");
                ApiError::QuotaExceeded(e)
            })?,
        None => QuotaLease::none(),
    };
    // Under load, an opted-in zoo variant runs its substitute (`crate::substitution`); the
    // request keeps its name, is metered as asked, and its response says so.
    let substituted = backend.substitute(adapter_id).inspect(|&sub| {
        for req in &mut reqs {
            req.adapter_id = sub;
        }
        super::substitution::mark();
    });
    let registry = backend.model().adapters.clone();
    let engine_rxs = backend.generate_choices(reqs).await?;
    let tally = Arc::new(Mutex::new(Tally {
        remaining: choices,
        completion_tokens: 0,
        first_token_ms: None,
        finish_reasons: Vec::new(),
        lease: Some(lease),
    }));
    let mut receivers = Vec::with_capacity(engine_rxs.len());
    for mut engine_rx in engine_rxs {
        let (tx, rx) = mpsc::unbounded_channel();
        receivers.push(rx);
        let tally = tally.clone();
        let (tenant, variant, access) = (tenant.clone(), variant.clone(), access.clone());
        let registry = registry.clone();
        // Its own root span: the handler's `request` span (request_id.rs) has ended by the time a
        // stream does.
        let span = tracing::info_span!(parent: None, "request", request_id = %who.request_id);
        let task = async move {
            let mut completion_tokens = 0u32;
            let mut first_token_ms: Option<f64> = None;
            let mut finish_reason = "abort";
            loop {
                tokio::select! {
                    biased;
                    event = engine_rx.recv() => {
                        let Some(event) = event else {
                            finish_reason = "error";
                            break;
                        };
                        let last = match &event {
                            GenerateEvent::PromptLogprobs { .. } => false,
                            GenerateEvent::Token { .. } => {
                                completion_tokens += 1;
                                first_token_ms.get_or_insert_with(|| ms_since(started));
                                false
                            }
                            GenerateEvent::Finished { reason, completion_tokens: n, .. } => {
                                finish_reason = reason.as_str();
                                completion_tokens = *n;
                                true
                            }
                            GenerateEvent::Error { .. } => {
                                finish_reason = "error";
                                true
                            }
                        };
                        if tx.send(event).is_err() {
                            finish_reason = "abort";
                            break;
                        }
                        if last {
                            break;
                        }
                    }
                    _ = tx.closed() => break,
                }
            }
            drop(engine_rx);
            let mut t = tally.lock().expect("tally lock");
            t.completion_tokens += completion_tokens;
            t.first_token_ms = match (t.first_token_ms, first_token_ms) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            t.finish_reasons.push(finish_reason);
            t.remaining -= 1;
            if t.remaining > 0 {
                return;
            }
            if let Some(lease) = t.lease.take() {
                lease.finish(t.completion_tokens, access.now());
            }
            access
                .usage
                .record(&tenant, &variant, prompt_tokens, t.completion_tokens);
            if substituted.is_some() {
                let tokens =
                    u64::from(prompt_tokens) * u64::from(choices) + u64::from(t.completion_tokens);
                registry.substitutions().count(&variant, tokens);
            }
            tracing::info!(
                target: "deltaserve::requests",
                tenant = %tenant,
                variant = %variant,
                prompt_tokens,
                completion_tokens = t.completion_tokens,
                choices,
                ttft_ms = t.first_token_ms,
                duration_ms = ms_since(started),
                finish_reason = %t.finish_reasons.join(","),
                "request finished"
            );
        };
        tokio::spawn(task.instrument(span));
    }
    Ok(receivers)
}

/// What the choices of one request have used so far; the last one to end settles it.
struct Tally {
    /// Choices still running.
    remaining: u32,
    /// Tokens generated by the choices that ended.
    completion_tokens: u32,
    /// The earliest first token of any choice.
    first_token_ms: Option<f64>,
    /// How each ended choice ended.
    finish_reasons: Vec<&'static str>,
    /// The quota hold, until the last choice ends.
    lease: Option<QuotaLease>,
}

/// A variant's directory must still pass the `--adapter-root` checks when a request uses it
/// (its files may have been swapped since registration). The refusal names the variant, not
/// its path, which goes to the log.
fn recheck_variant_dir<B: Backend>(backend: &B, id: u32, variant: &str) -> Result<(), ApiError> {
    let registry = &backend.model().adapters;
    let Some(dir) = registry.path_of(id) else {
        return Ok(());
    };
    registry.roots().recheck(&dir).map_err(|why| {
        tracing::warn!(variant = %variant, path = %dir.display(), "variant refused at request time: {why}");
        ApiError::invalid(
            "model",
            format!("the variant `{variant}` cannot be served: its files no longer pass the adapter-root checks ({why}); an operator must register it again"),
        )
    })
}

fn ms_since(t: Instant) -> f64 {
    (t.elapsed().as_secs_f64() * 1e6).round() / 1e3
}

/// Usage counts of one `(tenant, variant)` pair.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    requests: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
    /// Quota refusals by limit: max_concurrent, requests_per_minute, tokens_per_minute.
    refused: [u64; 3],
}

/// The limits in `Counts::refused` order.
const LIMITS: [&str; 3] = ["max_concurrent", "requests_per_minute", "tokens_per_minute"];

/// Per-tenant, per-variant usage since start, for `/metrics`.
#[derive(Debug, Default)]
pub struct UsageMeter {
    by_pair: Mutex<BTreeMap<(String, String), Counts>>,
}

impl UsageMeter {
    /// Counts a finished (or cancelled, or failed) request.
    pub fn record(&self, tenant: &str, variant: &str, prompt: u32, completion: u32) {
        self.with(tenant, variant, |c| {
            c.requests += 1;
            c.prompt_tokens += u64::from(prompt);
            c.completion_tokens += u64::from(completion);
        });
    }

    /// Counts a quota refusal.
    pub fn reject(&self, tenant: &str, variant: &str, limit: &str) {
        let i = LIMITS.iter().position(|l| *l == limit).unwrap_or(0);
        self.with(tenant, variant, |c| c.refused[i] += 1);
    }

    fn with(&self, tenant: &str, variant: &str, f: impl FnOnce(&mut Counts)) {
        let mut map = self.by_pair.lock().expect("usage lock");
        let mut key = (tenant.to_string(), variant.to_string());
        if !map.contains_key(&key) && map.len() >= MAX_LABEL_PAIRS {
            key = ("other".into(), "other".into());
        }
        f(map.entry(key).or_default());
    }

    /// The Prometheus families: requests, prompt and completion tokens by tenant and variant,
    /// and quota refusals by tenant, variant and limit.
    pub fn families(&self) -> Vec<MetricFamily> {
        let map = self.by_pair.lock().expect("usage lock").clone();
        let vec = |name: &str, help: &str, labels: &[&str]| {
            IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric names")
        };
        let requests = vec(
            "deltaserve_tenant_requests_total",
            "Requests that ended (finished, cancelled or failed), by tenant and variant.",
            &["tenant", "variant"],
        );
        let prompt = vec(
            "deltaserve_tenant_prompt_tokens_total",
            "Prompt tokens of the requests that ended, by tenant and variant.",
            &["tenant", "variant"],
        );
        let completion = vec(
            "deltaserve_tenant_completion_tokens_total",
            "Tokens generated for the requests that ended, by tenant and variant.",
            &["tenant", "variant"],
        );
        let refused = vec(
            "deltaserve_tenant_quota_refusals_total",
            "Requests refused (429) by a tenant's quota, by tenant, variant and limit.",
            &["tenant", "variant", "limit"],
        );
        for ((tenant, variant), c) in &map {
            let pair = [tenant.as_str(), variant.as_str()];
            if c.requests > 0 {
                requests.with_label_values(&pair).inc_by(c.requests);
                prompt.with_label_values(&pair).inc_by(c.prompt_tokens);
                completion
                    .with_label_values(&pair)
                    .inc_by(c.completion_tokens);
            }
            for (limit, n) in LIMITS.iter().zip(c.refused) {
                if n > 0 {
                    refused
                        .with_label_values(&[tenant.as_str(), variant.as_str(), limit])
                        .inc_by(n);
                }
            }
        }
        [requests, prompt, completion, refused]
            .iter()
            .flat_map(|v| v.collect())
            .filter(|f| !f.get_metric().is_empty())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::metrics::text;

    #[test]
    fn usage_is_labelled_by_tenant_and_variant_with_a_bound() {
        let meter = UsageMeter::default();
        meter.record("acme", "base:x", 5, 7);
        meter.record("acme", "base:x", 1, 1);
        meter.reject("acme", "base", "tokens_per_minute");
        let body = text(&meter.families());
        for line in [
            "deltaserve_tenant_requests_total{tenant=\"acme\",variant=\"base:x\"} 2",
            "deltaserve_tenant_prompt_tokens_total{tenant=\"acme\",variant=\"base:x\"} 6",
            "deltaserve_tenant_completion_tokens_total{tenant=\"acme\",variant=\"base:x\"} 8",
            "deltaserve_tenant_quota_refusals_total{limit=\"tokens_per_minute\",tenant=\"acme\",variant=\"base\"} 1",
        ] {
            assert!(body.contains(line), "{line} missing from\n{body}");
        }
        for i in 0..MAX_LABEL_PAIRS + 10 {
            meter.record("t", &format!("v{i}"), 1, 1);
        }
        let body = text(&meter.families());
        let series = body
            .lines()
            .filter(|l| l.starts_with("deltaserve_tenant_requests_total{"))
            .count();
        // Label pairs: acme's two, 1,022 of t's, and `other` (acme's refusal-only pair has no
        // request series).
        assert_eq!(series, MAX_LABEL_PAIRS, "the rest counted as other");
        assert!(
            body.contains("tenant=\"other\",variant=\"other\"} 12"),
            "{body}"
        );
    }
}
