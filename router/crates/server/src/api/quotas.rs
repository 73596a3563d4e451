//! Per-tenant quotas: concurrent requests, requests per minute and tokens per minute (prompt +
//! completion), as token buckets. Time is passed in (`now`, since any fixed epoch), so every
//! rule is tested without sleeping.
//!
//! ```text
//!  admit(prompt, now) ── all three checked first; a refusal changes nothing ──▶ QuotaLease
//!     running < max_concurrent · requests bucket ≥ 1 · tokens bucket ≥ prompt
//!     then: running += 1, requests −= 1, tokens −= prompt
//!  QuotaLease::finish(completion, now) ── running −= 1, tokens −= completion (may go below 0:
//!                                          the debt delays the tenant's next requests)
//! ```
//!
//! A bucket holds at most one minute's allowance and refills continuously at limit / 60 per
//! second. A refusal says which limit and when a retry can succeed (`Retry-After`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A tenant's limits; `None` is unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Limits {
    /// Most requests running at once.
    pub max_concurrent: Option<u32>,
    /// Prompt plus completion tokens per minute.
    pub tokens_per_minute: Option<u64>,
    /// Requests per minute.
    pub requests_per_minute: Option<u64>,
}

impl Limits {
    /// Refuses zeros (a limit of 0 would refuse everything; leave the field out for none).
    pub fn check(&self) -> Result<(), String> {
        for (name, value) in [
            ("max_concurrent", self.max_concurrent.map(u64::from)),
            ("tokens_per_minute", self.tokens_per_minute),
            ("requests_per_minute", self.requests_per_minute),
        ] {
            if value == Some(0) {
                return Err(format!(
                    "{name}: must be at least 1 (leave it out for no limit)"
                ));
            }
        }
        Ok(())
    }
}

/// Why a request was refused (429).
#[derive(Debug, Clone, PartialEq)]
pub struct QuotaExceeded {
    /// The limit: `max_concurrent`, `requests_per_minute` or `tokens_per_minute`.
    pub limit: &'static str,
    /// Seconds until a retry can succeed (at least 1).
    pub retry_after_secs: u64,
    /// For people: the limit, its value and what the request needed.
    pub message: String,
}

/// A refilling allowance.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// What it holds now (may be negative: a debt).
    level: f64,
    /// When `level` was last brought up to date.
    at: Duration,
}

impl Bucket {
    fn full(per_minute: u64, now: Duration) -> Self {
        Bucket {
            level: per_minute as f64,
            at: now,
        }
    }

    /// Refills for the time since `at` (at most a minute's worth held).
    fn refill(&mut self, per_minute: u64, now: Duration) {
        let elapsed = now.saturating_sub(self.at).as_secs_f64();
        self.level = (self.level + elapsed * per_minute as f64 / 60.0).min(per_minute as f64);
        self.at = self.at.max(now);
    }

    /// Seconds until it holds `need` (after a refill at `now`).
    fn wait_for(&self, need: f64, per_minute: u64) -> f64 {
        ((need - self.level) * 60.0 / per_minute as f64).max(0.0)
    }
}

/// One tenant's quota state.
#[derive(Debug)]
pub struct Quota {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    limits: Limits,
    running: u32,
    /// `None` until first used (then full).
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

impl Quota {
    /// A fresh quota (buckets full).
    pub fn new(limits: Limits) -> Self {
        Quota {
            state: Mutex::new(State {
                limits,
                running: 0,
                requests: None,
                tokens: None,
            }),
        }
    }

    /// New limits (a reload); running requests and bucket levels stay, capped at the new sizes.
    pub fn set_limits(&self, limits: Limits) {
        let mut guard = self.state.lock().expect("quota lock");
        let s = &mut *guard;
        s.limits = limits;
        for (bucket, per_minute) in [
            (&mut s.requests, limits.requests_per_minute),
            (&mut s.tokens, limits.tokens_per_minute),
        ] {
            match per_minute {
                Some(cap) => {
                    if let Some(b) = bucket.as_mut() {
                        b.level = b.level.min(cap as f64);
                    }
                }
                None => *bucket = None,
            }
        }
    }

    /// Requests running now.
    pub fn running(&self) -> u32 {
        self.state.lock().expect("quota lock").running
    }

    /// Admits a request with `prompt_tokens` at `now`, or says which limit refuses it.
    pub fn admit(
        self: &Arc<Self>,
        prompt_tokens: u32,
        now: Duration,
    ) -> Result<QuotaLease, QuotaExceeded> {
        let mut s = self.state.lock().expect("quota lock");
        let limits = s.limits;
        if let Some(max) = limits.max_concurrent {
            if s.running >= max {
                return Err(QuotaExceeded {
                    limit: "max_concurrent",
                    retry_after_secs: 1,
                    message: format!(
                        "max_concurrent quota exceeded: {max} requests are already running"
                    ),
                });
            }
        }
        let mut requests = None;
        if let Some(rpm) = limits.requests_per_minute {
            let mut b = s.requests.unwrap_or_else(|| Bucket::full(rpm, now));
            b.refill(rpm, now);
            if b.level < 1.0 {
                return Err(QuotaExceeded {
                    limit: "requests_per_minute",
                    retry_after_secs: ceil_secs(b.wait_for(1.0, rpm)),
                    message: format!("requests_per_minute quota exceeded ({rpm} per minute)"),
                });
            }
            requests = Some((b, rpm));
        }
        let mut tokens = None;
        if let Some(tpm) = limits.tokens_per_minute {
            let mut b = s.tokens.unwrap_or_else(|| Bucket::full(tpm, now));
            b.refill(tpm, now);
            let need = f64::from(prompt_tokens);
            if u64::from(prompt_tokens) > tpm {
                return Err(QuotaExceeded {
                    limit: "tokens_per_minute",
                    retry_after_secs: 60,
                    message: format!(
                        "tokens_per_minute quota exceeded: the prompt alone has {prompt_tokens} tokens, more than the {tpm} allowed per minute"
                    ),
                });
            }
            if b.level < need {
                return Err(QuotaExceeded {
                    limit: "tokens_per_minute",
                    retry_after_secs: ceil_secs(b.wait_for(need, tpm)),
                    message: format!(
                        "tokens_per_minute quota exceeded ({tpm} per minute, prompt and completion tokens; this prompt has {prompt_tokens})"
                    ),
                });
            }
            tokens = Some((b, need));
        }
        if let Some((mut b, _)) = requests {
            b.level -= 1.0;
            s.requests = Some(b);
        }
        if let Some((mut b, need)) = tokens {
            b.level -= need;
            s.tokens = Some(b);
        }
        s.running += 1;
        Ok(QuotaLease {
            quota: Some(self.clone()),
        })
    }

    /// Ends a request: frees its slot and charges its completion tokens at `now`.
    fn release(&self, completion_tokens: Option<(u32, Duration)>) {
        let mut s = self.state.lock().expect("quota lock");
        s.running = s.running.saturating_sub(1);
        if let (Some((n, now)), Some(tpm)) = (completion_tokens, s.limits.tokens_per_minute) {
            let mut b = s.tokens.unwrap_or_else(|| Bucket::full(tpm, now));
            b.refill(tpm, now);
            b.level -= f64::from(n);
            s.tokens = Some(b);
        }
    }
}

/// Whole seconds, rounded up, at least 1.
fn ceil_secs(s: f64) -> u64 {
    (s.ceil() as u64).max(1)
}

/// A running request's hold on its tenant's quota. [`QuotaLease::finish`] charges its completion
/// tokens; dropping it unfinished only frees the slot.
#[derive(Debug)]
pub struct QuotaLease {
    /// `None` once finished.
    quota: Option<Arc<Quota>>,
}

impl QuotaLease {
    /// A lease that holds nothing (callers without a quota).
    pub fn none() -> Self {
        QuotaLease { quota: None }
    }

    /// Ends the request, charging `completion_tokens` at `now`.
    pub fn finish(mut self, completion_tokens: u32, now: Duration) {
        if let Some(q) = self.quota.take() {
            q.release(Some((completion_tokens, now)));
        }
    }
}

impl Drop for QuotaLease {
    fn drop(&mut self) {
        if let Some(q) = self.quota.take() {
            q.release(None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    fn quota(limits: Limits) -> Arc<Quota> {
        Arc::new(Quota::new(limits))
    }

    #[test]
    fn concurrency_is_a_slot_per_running_request() {
        let q = quota(Limits {
            max_concurrent: Some(2),
            ..Limits::default()
        });
        let a = q.admit(5, secs(0.0)).unwrap();
        let b = q.admit(5, secs(0.0)).unwrap();
        let err = q.admit(5, secs(0.0)).unwrap_err();
        assert_eq!((err.limit, err.retry_after_secs), ("max_concurrent", 1));
        assert!(err.message.contains("2 requests"), "{}", err.message);
        a.finish(3, secs(1.0));
        let c = q.admit(5, secs(1.0)).unwrap();
        drop(b);
        drop(c);
        assert_eq!(q.running(), 0);
    }

    #[test]
    fn requests_per_minute_refill_continuously() {
        let q = quota(Limits {
            requests_per_minute: Some(60),
            ..Limits::default()
        });
        for _ in 0..60 {
            q.admit(1, secs(0.0)).unwrap().finish(0, secs(0.0));
        }
        let err = q.admit(1, secs(0.0)).unwrap_err();
        assert_eq!(
            (err.limit, err.retry_after_secs),
            ("requests_per_minute", 1)
        );
        assert!(q.admit(1, secs(0.5)).is_err(), "half a request refilled");
        q.admit(1, secs(1.0)).unwrap();
        assert!(q.admit(1, secs(1.0)).is_err());
        // A long idle time refills at most one minute's worth.
        for _ in 0..60 {
            q.admit(1, secs(1000.0)).unwrap();
        }
        assert!(q.admit(1, secs(1000.0)).is_err());
    }

    #[test]
    fn tokens_count_prompt_at_admission_and_completion_at_the_end() {
        let q = quota(Limits {
            tokens_per_minute: Some(600), // 10 per second
            ..Limits::default()
        });
        let lease = q.admit(100, secs(0.0)).unwrap();
        lease.finish(450, secs(0.0)); // 550 used, 50 left
        let err = q.admit(60, secs(0.0)).unwrap_err();
        assert_eq!(err.limit, "tokens_per_minute");
        assert_eq!(err.retry_after_secs, 1, "10 tokens short at 10 per second");
        q.admit(60, secs(1.0)).unwrap().finish(0, secs(1.0)); // 60 - 60 = 0 left
                                                              // A completion larger than what is left is a debt that delays the next request.
        q.admit(0, secs(1.0)).unwrap().finish(300, secs(1.0)); // -300
        let err = q.admit(10, secs(1.0)).unwrap_err();
        assert_eq!(err.retry_after_secs, 31, "310 tokens at 10 per second");
        q.admit(10, secs(32.0)).unwrap();
        // A prompt above a whole minute's allowance can never pass: said so.
        let err = q.admit(601, secs(500.0)).unwrap_err();
        assert!(err.message.contains("the prompt alone"), "{}", err.message);
    }

    #[test]
    fn a_refusal_charges_nothing_and_limits_can_change() {
        let q = quota(Limits {
            requests_per_minute: Some(2),
            tokens_per_minute: Some(100),
            max_concurrent: None,
        });
        // Tokens refuse: the request bucket keeps its two.
        assert!(q.admit(101, secs(0.0)).is_err());
        let _a = q.admit(90, secs(0.0)).unwrap();
        assert_eq!(
            q.admit(50, secs(0.0)).unwrap_err().limit,
            "tokens_per_minute"
        );
        let _b = q.admit(10, secs(0.0)).unwrap();
        assert_eq!(
            q.admit(0, secs(0.0)).unwrap_err().limit,
            "requests_per_minute"
        );
        q.set_limits(Limits {
            requests_per_minute: None,
            tokens_per_minute: None,
            max_concurrent: Some(2),
        });
        assert_eq!(q.running(), 2, "the running requests still count");
        assert_eq!(q.admit(0, secs(0.0)).unwrap_err().limit, "max_concurrent");
        assert!(Limits {
            tokens_per_minute: Some(0),
            ..Limits::default()
        }
        .check()
        .unwrap_err()
        .contains("tokens_per_minute"));
    }
}
