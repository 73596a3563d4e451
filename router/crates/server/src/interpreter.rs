//! Which Python interpreter runs the workers and the offline tools: the one that has the
//! `deltaserve` package, found without the user having to name it.
//!
//! Order (the first candidate whose interpreter can import `deltaserve` wins):
//!
//! 1. `--python` / `DELTASERVE_PYTHON`, when given: used as is, never second-guessed;
//! 2. the interpreter deltaserve runs inside, when it does (the wheel's `deltaserve` console
//!    script, `deltaserve.Server`, `deltaserve.LLM`: Python's `sys.executable`): it imported
//!    this very package, so it is used unchecked ([`find_from`]);
//! 3. `$VIRTUAL_ENV/bin/python` (an activated venv);
//! 4. `python` beside the invoked binary (a copy of, or link to, the daemon binary in a venv's
//!    `bin/`: `<venv>/bin/deltaserve` → `<venv>/bin/python`);
//! 5. the venv the binary was built beside (`<workspace>/.venv/bin/python`, fixed at build time);
//! 6. `python3` on `PATH`.
//!
//! When no candidate has the package the first one that exists is returned anyway, so the
//! interpreter's own error (`No module named 'deltaserve'`) reaches the user through
//! [`child_error`] instead of a guess.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// The interpreter to use and how it was chosen (logged at start-up).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interpreter {
    /// Path or command name handed to `Command::new`.
    pub path: PathBuf,
    /// Why this one: "--python", "$VIRTUAL_ENV", "beside the binary", ...
    pub source: &'static str,
    /// Whether a check showed it can import `deltaserve` (always true for an explicit choice,
    /// which is not checked).
    pub has_package: bool,
}

/// The workspace's venv, as seen from this crate's manifest at build time.
fn built_beside_venv() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../.venv/bin/python")
}

/// The candidates of the module docs' order 3–6, as `(path, source)`.
pub fn candidates() -> Vec<(PathBuf, &'static str)> {
    let mut out = Vec::new();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV").filter(|v| !v.is_empty()) {
        out.push((Path::new(&venv).join("bin/python"), "$VIRTUAL_ENV"));
    }
    if let Some(dir) = std::env::args_os().next().map(PathBuf::from).and_then(|p| {
        let p = if p.components().count() > 1 {
            Some(p)
        } else {
            None
        }?;
        p.parent().map(Path::to_path_buf)
    }) {
        out.push((dir.join("python"), "beside the binary"));
    }
    out.push((built_beside_venv(), "the venv the binary was built beside"));
    out.push((PathBuf::from("python3"), "python3 on PATH"));
    out
}

/// Whether `python` starts and can find the `deltaserve` package (without importing it: no
/// torch import, a few tens of milliseconds).
pub fn has_package(python: &Path) -> bool {
    Command::new(python)
        .args([
            "-c",
            "import importlib.util, sys; sys.exit(importlib.util.find_spec('deltaserve') is None)",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Whether `python` can be started at all (a path that exists, or a name found on `PATH`).
fn exists(python: &Path) -> bool {
    if python.components().count() > 1 {
        return python.is_file();
    }
    Command::new(python)
        .args(["-c", ""])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

/// Picks the interpreter (see the module docs); `explicit` is `--python` / `DELTASERVE_PYTHON`.
pub fn find(explicit: Option<&Path>) -> Interpreter {
    if let Some(p) = explicit {
        return Interpreter {
            path: p.to_path_buf(),
            source: "--python",
            has_package: true,
        };
    }
    pick(candidates(), has_package, exists)
}

/// [`find`], for a caller that may run inside a Python interpreter (`host`: `sys.executable`
/// of the process that loaded `deltaserve._native`): an explicit choice still wins, then the
/// host, which has the package by construction; without either, [`find`]'s search.
pub fn find_from(explicit: Option<&Path>, host: Option<&Path>) -> Interpreter {
    match (explicit, host) {
        (None, Some(host)) => Interpreter {
            path: host.to_path_buf(),
            source: "the interpreter running deltaserve",
            has_package: true,
        },
        _ => find(explicit),
    }
}

/// The choice itself, over given candidates and checks (unit-testable).
fn pick(
    candidates: Vec<(PathBuf, &'static str)>,
    has_package: impl Fn(&Path) -> bool,
    exists: impl Fn(&Path) -> bool,
) -> Interpreter {
    let mut first_existing = None;
    let mut seen: Vec<PathBuf> = Vec::new();
    for (path, source) in candidates {
        if seen.contains(&path) {
            continue;
        }
        seen.push(path.clone());
        if has_package(&path) {
            return Interpreter {
                path,
                source,
                has_package: true,
            };
        }
        if first_existing.is_none() && exists(&path) {
            first_existing = Some((path, source));
        }
    }
    let (path, source) = first_existing.unwrap_or((PathBuf::from("python3"), "python3 on PATH"));
    Interpreter {
        path,
        source,
        has_package: false,
    }
}

/// The error of a Python child that failed: names the interpreter and quotes the child's own
/// last stderr lines (its traceback's tail, e.g. `ModuleNotFoundError: No module named
/// 'deltaserve'`), so the cause is never hidden behind a generic hint.
pub fn child_error(python: &Path, what: &str, out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = stderr
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.is_empty())
        .collect();
    let tail = &tail[tail.len().saturating_sub(3)..];
    let said = if tail.is_empty() {
        "it printed nothing on stderr".to_string()
    } else {
        format!("it said: {}", tail.join(" | "))
    };
    let hint = if stderr.contains("No module named 'deltaserve'") {
        "; this interpreter lacks the deltaserve package: run `make setup`, activate the venv \
         (`source .venv/bin/activate`) or pass --python .venv/bin/python"
    } else {
        ""
    };
    format!(
        "{what} with {} failed ({}); {said}{hint}",
        python.display(),
        out.status
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(paths: &[&'static str]) -> Vec<(PathBuf, &'static str)> {
        paths.iter().map(|p| (PathBuf::from(p), *p)).collect()
    }

    #[test]
    fn first_with_the_package_wins() {
        let got = pick(
            c(&["/a", "/b", "/c"]),
            |p| p == Path::new("/b") || p == Path::new("/c"),
            |_| true,
        );
        assert_eq!((got.path, got.has_package), (PathBuf::from("/b"), true));
    }

    #[test]
    fn without_the_package_the_first_existing_is_kept_for_its_error() {
        let got = pick(
            c(&["/missing", "/bare", "/other"]),
            |_| false,
            |p| p != Path::new("/missing"),
        );
        assert_eq!(
            (got.path, got.source, got.has_package),
            (PathBuf::from("/bare"), "/bare", false)
        );
        let none = pick(c(&["/x"]), |_| false, |_| false);
        assert_eq!(none.path, PathBuf::from("python3"));
    }

    #[test]
    fn explicit_choice_is_not_second_guessed() {
        let got = find(Some(Path::new("/opt/py/bin/python")));
        assert_eq!(
            (got.path, got.source),
            (PathBuf::from("/opt/py/bin/python"), "--python")
        );
    }

    #[test]
    fn the_host_interpreter_wins_unless_one_is_named() {
        let host = Path::new("/wheel/venv/bin/python");
        let got = find_from(None, Some(host));
        assert_eq!(
            (got.path.as_path(), got.has_package),
            (host, true),
            "{got:?}"
        );
        let named = find_from(Some(Path::new("/opt/py")), Some(host));
        assert_eq!(named.path, PathBuf::from("/opt/py"));
    }

    #[test]
    fn child_error_quotes_the_child() {
        use std::os::unix::process::ExitStatusExt;
        let out = Output {
            status: std::process::ExitStatus::from_raw(1 << 8),
            stdout: vec![],
            stderr: b"Traceback (most recent call last):\n  File x\nModuleNotFoundError: No module named 'deltaserve'\n".to_vec(),
        };
        let msg = child_error(
            Path::new("/usr/bin/python3"),
            "preparing the demo model",
            &out,
        );
        assert!(msg.contains("/usr/bin/python3"), "{msg}");
        assert!(msg.contains("No module named 'deltaserve'"), "{msg}");
        assert!(msg.contains("--python .venv/bin/python"), "{msg}");
    }
}
