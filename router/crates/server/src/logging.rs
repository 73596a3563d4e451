//! The process's log subscriber, set up once for the daemon (`cli.rs`) and the embedded server
//! (`embedded.rs`): to stderr, filtered by `RUST_LOG` (default `info`), as text (no colour codes
//! when stderr is not a terminal) or, with `--log-format json`, one JSON object per line (the
//! event's fields under `fields`, its spans, with the request's `request_id`, under `spans`).
//! Every generation ends with one `request finished` line (`api/usage.rs`).

use std::io::IsTerminal;

/// `--log-format`'s values.
pub const LOG_FORMATS: [&str; 2] = ["text", "json"];

/// Sets the subscriber up in `format` (one of [`LOG_FORMATS`]; anything else is text). A second
/// call (the daemon started twice in one Python process) keeps the first set-up.
pub fn init(format: &str) {
    let filter =
        || tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    if format == "json" {
        let _ = tracing_subscriber::fmt()
            .json()
            .with_current_span(false)
            .with_span_list(true)
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            .try_init();
    } else {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .try_init();
    }
}
