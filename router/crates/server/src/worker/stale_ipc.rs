//! IPC directories left behind by a daemon that was killed (`SIGKILL` runs no destructor): each
//! worker's rings live in `/dev/shm/deltaserve-<daemon pid>-w<index>-<random>` (or the same
//! name under the temp dir), and a directory whose daemon pid no longer runs is removed when
//! the next daemon starts its first worker. A live daemon's directories are never touched.

use std::path::{Path, PathBuf};
use std::sync::Once;

/// Where worker IPC directories are made (`/dev/shm`, else the temp dir).
fn ipc_parents() -> Vec<PathBuf> {
    vec![PathBuf::from("/dev/shm"), std::env::temp_dir()]
}

/// Runs [`remove_stale_ipc_dirs`] over the IPC parents once per process.
pub(super) fn remove_stale_once() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for parent in ipc_parents() {
            for removed in remove_stale_ipc_dirs(&parent, pid_is_running) {
                tracing::info!(
                    "removed {} left by a daemon that is no longer running",
                    removed.display()
                );
            }
        }
    });
}

/// The daemon pid in an IPC directory's name (`deltaserve-<pid>-w<index>-...`), if it is one.
pub fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("deltaserve-")?;
    let (pid, rest) = rest.split_once('-')?;
    let index = rest.strip_prefix('w')?.split_once('-')?.0;
    index.parse::<usize>().ok()?;
    pid.parse().ok()
}

/// Whether a process with this pid exists (`kill(pid, 0)`: only `ESRCH` means it does not).
pub fn pid_is_running(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists; nothing is sent.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Removes the IPC directories in `parent` whose daemon is not running (per `running`); never
/// this process's. Returns what it removed.
pub fn remove_stale_ipc_dirs(parent: &Path, running: impl Fn(u32) -> bool) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Vec::new();
    };
    let me = std::process::id();
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(owner_pid) else {
            continue;
        };
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if pid == me || !is_dir || running(pid) {
            continue;
        }
        let path = entry.path();
        if std::fs::remove_dir_all(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_ipc_dirs_give_their_daemon_pid() {
        assert_eq!(owner_pid("deltaserve-1234-w0-Ab3xYz"), Some(1234));
        assert_eq!(owner_pid("deltaserve-1234-w12-x"), Some(1234));
        for other in [
            "deltaserve-x-w0-a",
            "deltaserve-1234-0-a",
            "deltaserve-1234-w0",
            "deltaserve-1234-wx-a",
            "deltaserve-demo",
            "other-1234-w0-a",
        ] {
            assert_eq!(owner_pid(other), None, "{other}");
        }
    }

    #[test]
    fn only_dead_daemons_dirs_are_removed() {
        let parent = tempfile::tempdir().unwrap();
        let me = std::process::id();
        let make = |name: &str| {
            let d = parent.path().join(name);
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("to_worker.ring"), b"x").unwrap();
            d
        };
        let dead = make("deltaserve-999999-w0-abc");
        let alive = make("deltaserve-1-w0-abc");
        let mine = make(&format!("deltaserve-{me}-w0-abc"));
        let unrelated = make("deltaserve-demo");
        std::fs::write(parent.path().join("deltaserve-999998-w0-file"), b"x").unwrap();
        let removed = remove_stale_ipc_dirs(parent.path(), |pid| pid == 1);
        assert_eq!(removed, vec![dead.clone()]);
        assert!(!dead.exists() && alive.exists() && mine.exists() && unrelated.exists());
        assert!(pid_is_running(me) && !pid_is_running(u32::MAX));
    }
}
