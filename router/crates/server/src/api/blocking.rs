//! CPU-heavy work of one request (tokenizing a large prompt, rendering a chat template) run
//! without holding one of the async runtime's threads: there are as many as cores, so a few
//! megabyte prompts tokenizing at once (about half a second each) stalled `/health`, `/metrics`
//! and every other stream for that long.

use tokio::runtime::{Handle, RuntimeFlavor};

/// Runs `f` on this thread after handing the runtime thread's other tasks to another thread
/// (`block_in_place`), so they go on meanwhile. On a current-thread runtime (unit tests) it
/// simply runs `f`.
pub(crate) fn off_runtime<T>(f: impl FnOnce() -> T) -> T {
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// On a runtime of one thread, a task blocked in `off_runtime` waits for a message that only
    /// another task of the same runtime sends: without the hand-off it would never come.
    #[test]
    fn other_tasks_run_while_one_blocks() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let got = runtime.block_on(async {
            let (tx, rx) = mpsc::channel::<u32>();
            let blocked =
                tokio::spawn(
                    async move { off_runtime(|| rx.recv_timeout(Duration::from_secs(10))) },
                );
            tokio::task::yield_now().await;
            let sender = tokio::spawn(async move { tx.send(7).unwrap() });
            sender.await.unwrap();
            blocked.await.unwrap()
        });
        assert_eq!(got, Ok(7));
    }

    #[tokio::test]
    async fn a_current_thread_runtime_runs_it_in_place() {
        assert_eq!(off_runtime(|| 3), 3);
    }
}
