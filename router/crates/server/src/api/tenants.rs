//! Tenants: who may call the API (keys), which variants each may use, and how much (quotas).
//!
//! The key file (`--api-keys FILE`, JSON; reread on SIGHUP):
//!
//! ```text
//!  {"tenants": [{"name": "acme",
//!                "keys": ["sk-acme-1", "sha256:<64 hex digits of a key>"],
//!                "variants": ["mybase", "mybase:acme-*"],          exact names and globs (* and ?)
//!                "max_concurrent": 8, "tokens_per_minute": 100000, "requests_per_minute": 600}],
//!   "admin_keys": ["sk-admin"]}
//! ```
//!
//! Variant patterns match the canonical model name: the bare base name is the base model,
//! `<base>:<variant>` a variant. Quotas are optional (absent: unlimited). Keys are kept only as
//! SHA-256 digests: a presented key is hashed and looked up, so no key is ever compared byte by
//! byte or kept in memory in the clear.
//!
//! ```text
//!  AccessControl ── reload() ──▶ Keys (digest → Caller) ── Caller { tenant: Option<Arc<Tenant>>, admin }
//!                                                              Tenant { name, patterns, quota: Arc<Quota> }
//! ```
//!
//! The three modes: no keys at all (everything open, as before keys existed), admin keys only
//! (inference open, state-changing routes need an admin key), a key file (every route but
//! `/health` and `/ready` needs a key). A reload keeps each tenant's quota state (running
//! requests, bucket levels) by name, so in-flight requests stay counted.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::quotas::{Limits, Quota};
use super::usage::UsageMeter;

/// Most tenants a key file may name (their names label metrics, so the set stays bounded).
pub const MAX_TENANTS: usize = 1000;

/// A key's SHA-256 digest.
pub type KeyDigest = [u8; 32];

/// The key file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyFile {
    /// The tenants.
    #[serde(default)]
    pub tenants: Vec<TenantSpec>,
    /// Keys that may use every route and variant, without quotas.
    #[serde(default)]
    pub admin_keys: Vec<String>,
}

/// One tenant as written in the key file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    /// Its name (in logs and metrics).
    pub name: String,
    /// Its API keys: plain, or `sha256:<hex>` of the key.
    pub keys: Vec<String>,
    /// The models it may use: exact names or globs of `<base>` / `<base>:<variant>`.
    #[serde(default)]
    pub variants: Vec<String>,
    /// Most requests running at once.
    pub max_concurrent: Option<u32>,
    /// Prompt plus completion tokens per minute.
    pub tokens_per_minute: Option<u64>,
    /// Requests per minute.
    pub requests_per_minute: Option<u64>,
}

/// A tenant as the server uses it.
#[derive(Debug)]
pub struct Tenant {
    /// Its name.
    pub name: String,
    /// The model names it may use.
    patterns: Vec<String>,
    /// Its quota state, kept across reloads.
    pub quota: Arc<Quota>,
}

impl Tenant {
    /// Whether the tenant may use the model named `canonical` (`<base>` or `<base>:<variant>`).
    pub fn may_use(&self, canonical: &str) -> bool {
        self.patterns.iter().any(|p| glob_match(p, canonical))
    }
}

/// Who is calling, once their key (or its absence) was looked up.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The tenant, when the key is a tenant's: limits what it may use, and how much.
    pub tenant: Option<Arc<Tenant>>,
    /// Whether it may use the admin routes (an admin key, or no keys configured at all).
    pub admin: bool,
}

impl Caller {
    /// A caller with no limits (no keys configured).
    pub fn open() -> Self {
        Caller {
            tenant: None,
            admin: true,
        }
    }

    /// A caller that may use nothing (a WebSocket before its first message authenticates it).
    pub fn nobody() -> Self {
        Caller {
            tenant: Some(Arc::new(Tenant {
                name: "unauthenticated".into(),
                patterns: Vec::new(),
                quota: Arc::new(Quota::new(Limits::default())),
            })),
            admin: false,
        }
    }

    /// Whether it may use the model named `canonical`.
    pub fn may_use(&self, canonical: &str) -> bool {
        self.tenant.as_ref().is_none_or(|t| t.may_use(canonical))
    }

    /// The tenant name for logs and metrics: the tenant's, `admin`, or `anonymous`.
    pub fn label(&self) -> &str {
        match &self.tenant {
            Some(t) => &t.name,
            None if self.admin => "admin",
            None => "anonymous",
        }
    }
}

/// Why a key was refused (401).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No `Authorization: Bearer` key while keys are required.
    #[error("this server requires an API key: send `Authorization: Bearer <key>`")]
    Missing,
    /// A key that matches no tenant or admin key.
    #[error("the API key is not valid")]
    Invalid,
}

/// The loaded keys: one immutable snapshot, swapped whole on reload.
#[derive(Debug, Default)]
struct Keys {
    /// Every key's digest, and who it is.
    by_digest: HashMap<KeyDigest, Caller>,
    /// The tenants, in file order.
    tenants: Vec<Arc<Tenant>>,
    /// Whether a key file is in force (every route but health needs a key).
    required: bool,
    /// Whether any admin key exists (admin routes need one).
    any_admin: bool,
}

/// The server's keys and tenants; shared by every request, reloadable.
#[derive(Debug)]
pub struct AccessControl {
    /// The key file, reread by [`AccessControl::reload`].
    file: Option<PathBuf>,
    /// Admin keys given on the command line (`--admin-key`), as digests.
    flag_admin_keys: Vec<KeyDigest>,
    /// The keys in force.
    keys: RwLock<Arc<Keys>>,
    /// The clock quotas read (seconds since `epoch`); tests drive quotas with explicit times.
    epoch: Instant,
    /// Usage per tenant and variant, for `/metrics`.
    pub usage: UsageMeter,
}

impl AccessControl {
    /// No keys: everything open.
    pub fn open() -> Self {
        Self::new(None, &[]).expect("no file, nothing to fail")
    }

    /// Keys from `file` (if any) and the `admin_keys` given as flags.
    pub fn new(file: Option<&Path>, admin_keys: &[String]) -> Result<Self, String> {
        let flag_admin_keys = admin_keys
            .iter()
            .map(|k| parse_key(k).map_err(|e| format!("--admin-key: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        let this = Self {
            file: file.map(Path::to_path_buf),
            flag_admin_keys,
            keys: RwLock::new(Arc::default()),
            epoch: Instant::now(),
            usage: UsageMeter::default(),
        };
        this.reload()?;
        Ok(this)
    }

    /// Rereads the key file (SIGHUP). On any error the keys in force stay, and the error says
    /// what is wrong (never quoting a key).
    pub fn reload(&self) -> Result<(), String> {
        let spec = match &self.file {
            None => KeyFile {
                tenants: Vec::new(),
                admin_keys: Vec::new(),
            },
            Some(path) => read_key_file(path)?,
        };
        let old = self.snapshot();
        let keys = build_keys(spec, &self.flag_admin_keys, &old, self.file.is_some())?;
        *self.keys.write().expect("keys lock") = Arc::new(keys);
        Ok(())
    }

    fn snapshot(&self) -> Arc<Keys> {
        self.keys.read().expect("keys lock").clone()
    }

    /// Who presents `key` (`None`: no key sent).
    pub fn authenticate(&self, key: Option<&str>) -> Result<Caller, AuthError> {
        let keys = self.snapshot();
        let found = key.and_then(|k| keys.by_digest.get(&digest(k)).cloned());
        match (found, key) {
            (Some(caller), _) => Ok(caller),
            (None, _) if !keys.required && !keys.any_admin => Ok(Caller::open()),
            // Admin keys only: inference stays open, admin routes are refused.
            (None, _) if !keys.required => Ok(Caller {
                tenant: None,
                admin: false,
            }),
            (None, None) => Err(AuthError::Missing),
            (None, Some(_)) => Err(AuthError::Invalid),
        }
    }

    /// Whether requests need a key at all (a key file is in force).
    pub fn keys_required(&self) -> bool {
        self.snapshot().required
    }

    /// Whether any admin key exists (without one, admin routes are open).
    pub fn has_admin_keys(&self) -> bool {
        self.snapshot().any_admin
    }

    /// The tenants in force, in file order.
    pub fn tenants(&self) -> Vec<Arc<Tenant>> {
        self.snapshot().tenants.clone()
    }

    /// Now, as the quotas count time.
    pub fn now(&self) -> Duration {
        self.epoch.elapsed()
    }
}

/// Reads and parses the key file; errors name the file and what is wrong.
fn read_key_file(path: &Path) -> Result<KeyFile, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("--api-keys {}: {e}", path.display()))?;
    parse_key_file(&text).map_err(|e| format!("--api-keys {}: {e}", path.display()))
}

/// Parses the key file's JSON. Serde's messages name fields and positions, never a value.
pub fn parse_key_file(text: &str) -> Result<KeyFile, String> {
    serde_json::from_str(text).map_err(|e| {
        // serde_json quotes an unknown variant or field name, not values; keep only the kind of
        // error and its position, so a mistyped key can never be echoed to a log.
        let what = match e.classify() {
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                "not valid JSON".to_string()
            }
            _ if e.to_string().contains("unknown field") => e.to_string(),
            _ if e.to_string().contains("missing field") => e.to_string(),
            _ => "a field has the wrong type".to_string(),
        };
        format!("{what} (line {}, column {})", e.line(), e.column())
    })
}

/// Checks a parsed key file and builds its lookup table; tenants keep their quota state from
/// `old` by name.
fn build_keys(
    spec: KeyFile,
    flag_admin_keys: &[KeyDigest],
    old: &Keys,
    required: bool,
) -> Result<Keys, String> {
    if spec.tenants.len() > MAX_TENANTS {
        return Err(format!(
            "{} tenants: at most {MAX_TENANTS}",
            spec.tenants.len()
        ));
    }
    let mut keys = Keys {
        required,
        ..Keys::default()
    };
    let admin = Caller {
        tenant: None,
        admin: true,
    };
    let mut seen_names = std::collections::HashSet::new();
    let mut insert = |digest: KeyDigest, caller: Caller, owner: &str| {
        if keys.by_digest.insert(digest, caller).is_some() {
            return Err(format!("{owner}: a key is listed twice"));
        }
        Ok(())
    };
    for (i, key) in spec.admin_keys.iter().enumerate() {
        insert(
            parse_key(key).map_err(|e| format!("admin_keys[{i}]: {e}"))?,
            admin.clone(),
            "admin_keys",
        )?;
    }
    for digest in flag_admin_keys {
        insert(*digest, admin.clone(), "--admin-key")?;
    }
    for (i, t) in spec.tenants.into_iter().enumerate() {
        let at = format!("tenants[{i}]");
        if t.name.is_empty()
            || t.name.len() > 64
            || !t
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(format!(
                "{at}.name: use 1 to 64 letters, digits, '-', '_' or '.'"
            ));
        }
        if !seen_names.insert(t.name.clone()) {
            return Err(format!("{at}.name: `{}` is listed twice", t.name));
        }
        if t.keys.is_empty() {
            return Err(format!("{at}.keys: a tenant needs at least one key"));
        }
        for (j, p) in t.variants.iter().enumerate() {
            if p.is_empty() || p.len() > 256 || p.chars().any(char::is_control) {
                return Err(format!(
                    "{at}.variants[{j}]: a pattern is 1 to 256 characters, none of them control characters"
                ));
            }
        }
        let limits = Limits {
            max_concurrent: t.max_concurrent,
            tokens_per_minute: t.tokens_per_minute,
            requests_per_minute: t.requests_per_minute,
        };
        limits.check().map_err(|e| format!("{at}.{e}"))?;
        let quota = match old.tenants.iter().find(|o| o.name == t.name) {
            Some(o) => {
                o.quota.set_limits(limits);
                o.quota.clone()
            }
            None => Arc::new(Quota::new(limits)),
        };
        let tenant = Arc::new(Tenant {
            name: t.name,
            patterns: t.variants,
            quota,
        });
        let caller = Caller {
            tenant: Some(tenant.clone()),
            admin: false,
        };
        for (j, key) in t.keys.iter().enumerate() {
            insert(
                parse_key(key).map_err(|e| format!("{at}.keys[{j}]: {e}"))?,
                caller.clone(),
                &at,
            )?;
        }
        keys.tenants.push(tenant);
    }
    keys.any_admin = keys.by_digest.values().any(|c| c.admin);
    Ok(keys)
}

/// A key as written (plain, or `sha256:<64 hex digits>`) → its digest. Errors never quote it.
pub fn parse_key(written: &str) -> Result<KeyDigest, String> {
    if let Some(hex) = written.strip_prefix("sha256:") {
        let bytes = hex.as_bytes();
        if bytes.len() != 64 || !bytes.iter().all(u8::is_ascii_hexdigit) {
            return Err("`sha256:` must be followed by 64 hex digits".into());
        }
        let mut out = [0u8; 32];
        for (i, pair) in bytes.chunks(2).enumerate() {
            let text = std::str::from_utf8(pair).expect("hex digits are ASCII");
            out[i] = u8::from_str_radix(text, 16).expect("checked hex digits");
        }
        return Ok(out);
    }
    if written.len() < 8 || written.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("a key is at least 8 characters, without spaces or control characters".into());
    }
    Ok(digest(written))
}

/// SHA-256 of a key.
pub fn digest(key: &str) -> KeyDigest {
    Sha256::digest(key.as_bytes()).into()
}

/// Whether `name` matches `pattern`, where `*` is any run of characters (`:` included) and `?`
/// any one character; everything else matches itself. Linear in practice: one backtrack point.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    let (mut pi, mut ni) = (0, 0);
    // The last `*` seen and the name position it was tried at.
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ni));
            pi += 1;
        } else if let Some((sp, sn)) = star {
            // Let the last `*` eat one more character and retry.
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"{"tenants": [
        {"name": "acme", "keys": ["sk-acme-1", "sha256:KEY2"], "variants": ["mybase", "mybase:acme-*"],
         "max_concurrent": 8, "tokens_per_minute": 100000, "requests_per_minute": 600},
        {"name": "beta", "keys": ["sk-beta-1"], "variants": ["mybase:beta"]}],
        "admin_keys": ["sk-admin-1"]}"#;

    fn file_text() -> String {
        let hex: String = digest("sk-acme-2")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        FILE.replace("KEY2", &hex)
    }

    fn write(dir: &tempfile::TempDir, text: &str) -> PathBuf {
        let path = dir.path().join("keys.json");
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn globs() {
        for (p, n, want) in [
            ("mybase", "mybase", true),
            ("mybase", "mybase:x", false),
            ("mybase:acme-*", "mybase:acme-sql", true),
            ("mybase:acme-*", "mybase:acme-", true),
            ("mybase:acme-*", "mybase:beta", false),
            ("mybase:acme-*", "mybase", false),
            ("*", "anything:at-all", true),
            ("mybase:*", "mybase", false),
            ("a?c", "abc", true),
            ("a?c", "ac", false),
            ("*x*y", "axxbxy", true),
            ("*x*y", "axxbx", false),
            ("**", "", true),
            ("", "", true),
            ("", "a", false),
        ] {
            assert_eq!(glob_match(p, n), want, "{p:?} vs {n:?}");
        }
        // No exponential blow-up on many stars.
        let long = "a".repeat(5000);
        assert!(!glob_match("*a*a*a*a*a*a*a*b", &long));
    }

    #[test]
    fn key_file_parses_and_keys_resolve() {
        let dir = tempfile::tempdir().unwrap();
        let access = AccessControl::new(Some(&write(&dir, &file_text())), &[]).unwrap();
        assert!(access.keys_required() && access.has_admin_keys());
        let acme = access.authenticate(Some("sk-acme-1")).unwrap();
        assert_eq!(acme.label(), "acme");
        assert!(!acme.admin);
        assert!(acme.may_use("mybase") && acme.may_use("mybase:acme-x"));
        assert!(!acme.may_use("mybase:beta"));
        let by_digest = access.authenticate(Some("sk-acme-2")).unwrap();
        assert_eq!(by_digest.label(), "acme", "sha256: keys match their key");
        assert!(
            access
                .authenticate(Some(&format!("sha256:{}", "0".repeat(64))))
                .is_err(),
            "a digest is not itself a key"
        );
        let beta = access.authenticate(Some("sk-beta-1")).unwrap();
        assert!(beta.may_use("mybase:beta") && !beta.may_use("mybase"));
        let admin = access.authenticate(Some("sk-admin-1")).unwrap();
        assert!(admin.admin && admin.may_use("anything"));
        assert_eq!(access.authenticate(None).unwrap_err(), AuthError::Missing);
        assert_eq!(
            access.authenticate(Some("sk-nope-000")).unwrap_err(),
            AuthError::Invalid
        );
        assert_eq!(access.tenants().len(), 2);
    }

    #[test]
    fn modes_without_a_key_file() {
        let open = AccessControl::open();
        let c = open.authenticate(None).unwrap();
        assert!(c.admin && c.may_use("x") && !open.keys_required());
        assert_eq!(c.label(), "admin");
        let admin_only = AccessControl::new(None, &["sk-flag-admin".into()]).unwrap();
        let anon = admin_only.authenticate(None).unwrap();
        assert!(!anon.admin && anon.may_use("x"), "inference stays open");
        assert_eq!(anon.label(), "anonymous");
        assert!(
            admin_only
                .authenticate(Some("sk-flag-admin"))
                .unwrap()
                .admin
        );
        assert!(!admin_only.authenticate(Some("sk-wrong-key")).unwrap().admin);
        assert!(AccessControl::new(None, &["short".into()])
            .unwrap_err()
            .contains("--admin-key"));
    }

    #[test]
    fn bad_files_are_refused_without_quoting_keys() {
        let cases: [(&str, &str); 9] = [
            ("{", "not valid JSON"),
            (
                r#"{"tenants": [{"name": "a", "keys": ["sk-secret-1"], "colour": 1}]}"#,
                "unknown field `colour`",
            ),
            (
                r#"{"tenants": [{"name": "a", "keys": ["sk-secret-1"], "max_concurrent": "x"}]}"#,
                "wrong type",
            ),
            (
                r#"{"tenants": [{"name": "a b", "keys": ["sk-secret-1"]}]}"#,
                "tenants[0].name",
            ),
            (
                r#"{"tenants": [{"name": "a", "keys": []}]}"#,
                "at least one key",
            ),
            (
                r#"{"tenants": [{"name": "a", "keys": ["sk secret 1"]}]}"#,
                "tenants[0].keys[0]",
            ),
            (
                r#"{"tenants": [{"name": "a", "keys": ["sk-secret-1"]}, {"name": "b", "keys": ["sk-secret-1"]}]}"#,
                "listed twice",
            ),
            (
                r#"{"tenants": [{"name": "a", "keys": ["sk-secret-1"], "max_concurrent": 0}]}"#,
                "max_concurrent",
            ),
            (r#"{"admin_keys": ["sha256:abc"]}"#, "admin_keys[0]"),
        ];
        let dir = tempfile::tempdir().unwrap();
        for (text, want) in cases {
            let err = AccessControl::new(Some(&write(&dir, text)), &[]).unwrap_err();
            assert!(err.contains(want), "{text}: {err}");
            assert!(!err.contains("secret"), "{text}: a key was quoted: {err}");
        }
        let missing = AccessControl::new(Some(&dir.path().join("none.json")), &[]).unwrap_err();
        assert!(missing.contains("--api-keys"), "{missing}");
    }

    #[test]
    fn reload_swaps_keys_keeps_quota_state_and_survives_a_bad_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(&dir, &file_text());
        let access = AccessControl::new(Some(&path), &[]).unwrap();
        let acme = access.authenticate(Some("sk-acme-1")).unwrap();
        let quota = acme.tenant.as_ref().unwrap().quota.clone();
        let lease = quota.admit(10, Duration::ZERO).unwrap();
        std::fs::write(
            &path,
            r#"{"tenants": [{"name": "acme", "keys": ["sk-acme-new"], "variants": ["*"], "max_concurrent": 1}]}"#,
        )
        .unwrap();
        access.reload().unwrap();
        assert_eq!(
            access.authenticate(Some("sk-acme-1")).unwrap_err(),
            AuthError::Invalid
        );
        let acme = access.authenticate(Some("sk-acme-new")).unwrap();
        let same = &acme.tenant.as_ref().unwrap().quota;
        assert!(Arc::ptr_eq(same, &quota), "quota state kept by name");
        let refused = same.admit(1, Duration::ZERO).unwrap_err();
        assert_eq!(
            refused.limit, "max_concurrent",
            "the running request still counts"
        );
        drop(lease);
        std::fs::write(&path, "{ broken").unwrap();
        assert!(access.reload().is_err());
        assert!(
            access.authenticate(Some("sk-acme-new")).is_ok(),
            "a bad file keeps the keys in force"
        );
    }
}
