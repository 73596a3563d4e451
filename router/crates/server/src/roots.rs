//! [`VariantRoots`]: where variant directories may live (`--adapter-root DIR`, repeatable).
//!
//! With roots, a variant's directory is accepted at registration, and again before each request
//! that uses it, only when all of this holds (each refusal is a 400 naming its rule):
//!
//! ```text
//!  no `..` component · relative paths are taken inside the first root
//!  inside a root as written (checked before the file system is touched: outside the roots,
//!    nothing tells whether a path exists)
//!  not under /proc, /sys or /dev
//!  still inside a root once every symlink is followed (the directory and each of its entries)
//!  a directory, whose entries are regular files or directories (no devices, sockets or pipes)
//! ```
//!
//! Without roots, any directory is accepted as before (the operator trusts whoever reaches the
//! admin routes), only canonicalized. Messages never quote a file's contents.

use std::path::{Component, Path, PathBuf};

/// Most entries a variant directory may hold (each is checked).
pub const MAX_DIR_ENTRIES: usize = 4096;

/// Trees no variant may come from, whatever the roots say.
const FORBIDDEN: [&str; 3] = ["/proc", "/sys", "/dev"];

/// The configured roots (canonical), or none.
#[derive(Debug, Clone, Default)]
pub struct VariantRoots {
    /// Each root as given (absolute) and canonical.
    roots: Vec<(PathBuf, PathBuf)>,
}

impl VariantRoots {
    /// Checks and canonicalizes the `--adapter-root` directories (none: no confinement).
    pub fn new(dirs: &[PathBuf]) -> Result<Self, String> {
        let mut roots = Vec::new();
        for dir in dirs {
            let canonical = std::fs::canonicalize(dir)
                .map_err(|e| format!("--adapter-root {}: {e}", dir.display()))?;
            if !canonical.is_dir() {
                return Err(format!("--adapter-root {}: not a directory", dir.display()));
            }
            if forbidden(&canonical) {
                return Err(format!(
                    "--adapter-root {}: variants cannot come from /proc, /sys or /dev",
                    dir.display()
                ));
            }
            let given = if dir.is_absolute() {
                dir.clone()
            } else {
                canonical.clone()
            };
            roots.push((given, canonical));
        }
        Ok(Self { roots })
    }

    /// Whether any root is configured.
    pub fn confined(&self) -> bool {
        !self.roots.is_empty()
    }

    /// The canonical directory a registration of `requested` may use, or why not.
    pub fn resolve(&self, requested: &Path) -> Result<PathBuf, String> {
        if !self.confined() {
            return std::fs::canonicalize(requested)
                .map_err(|e| format!("adapter path {}: {e}", requested.display()));
        }
        if requested.components().any(|c| c == Component::ParentDir) {
            return Err("the adapter path must not contain `..`".into());
        }
        let path = if requested.is_absolute() {
            requested.to_path_buf()
        } else {
            self.roots[0].1.join(requested)
        };
        if forbidden(&path) {
            return Err("variants cannot come from /proc, /sys or /dev".into());
        }
        let lexically_inside = self
            .roots
            .iter()
            .any(|(given, canonical)| path.starts_with(given) || path.starts_with(canonical));
        if !lexically_inside {
            return Err(self.outside("is outside"));
        }
        let dir = std::fs::canonicalize(&path).map_err(|_| {
            format!(
                "the adapter path {} does not exist or cannot be read",
                path.display()
            )
        })?;
        self.check_dir(&dir)?;
        Ok(dir)
    }

    /// Checks again, before a request uses it, that a registered directory still passes.
    pub fn recheck(&self, dir: &Path) -> Result<(), String> {
        if !self.confined() {
            return Ok(());
        }
        let canonical = std::fs::canonicalize(dir)
            .map_err(|_| "its directory no longer exists or cannot be read".to_string())?;
        self.check_dir(&canonical)
    }

    /// The checks on a canonical directory (see the module docs).
    fn check_dir(&self, dir: &Path) -> Result<(), String> {
        if !self.inside(dir) {
            return Err(self.outside("resolves (through a symlink) outside"));
        }
        if !dir.is_dir() {
            return Err("the adapter path is not a directory".into());
        }
        let entries = std::fs::read_dir(dir)
            .map_err(|_| "the adapter directory cannot be listed".to_string())?;
        for (i, entry) in entries.enumerate() {
            if i >= MAX_DIR_ENTRIES {
                return Err(format!(
                    "the adapter directory holds more than {MAX_DIR_ENTRIES} entries"
                ));
            }
            let entry = entry.map_err(|_| "the adapter directory cannot be listed".to_string())?;
            let name = printable(&entry.file_name().to_string_lossy());
            let target = std::fs::canonicalize(entry.path())
                .map_err(|_| format!("{name}: a broken symlink or unreadable entry"))?;
            if !self.inside(&target) {
                return Err(format!(
                    "{name}: {}",
                    self.outside("resolves (through a symlink) outside")
                ));
            }
            let meta =
                std::fs::metadata(&target).map_err(|_| format!("{name}: an unreadable entry"))?;
            if !(meta.is_file() || meta.is_dir()) {
                return Err(format!(
                    "{name}: not a regular file or directory (a device, socket or pipe)"
                ));
            }
        }
        Ok(())
    }

    /// Whether a canonical path is inside a root and not a forbidden tree.
    fn inside(&self, canonical: &Path) -> bool {
        !forbidden(canonical)
            && self
                .roots
                .iter()
                .any(|(_, root)| canonical.starts_with(root))
    }

    /// "the adapter path <what> every --adapter-root (A, B)".
    fn outside(&self, what: &str) -> String {
        let roots: Vec<String> = self
            .roots
            .iter()
            .map(|(given, _)| given.display().to_string())
            .collect();
        format!(
            "the adapter path {what} every --adapter-root ({})",
            roots.join(", ")
        )
    }
}

/// Whether `path` is under /proc, /sys or /dev.
fn forbidden(path: &Path) -> bool {
    FORBIDDEN.iter().any(|f| path.starts_with(f))
}

/// A file name safe to quote: control characters replaced, at most 64 characters.
fn printable(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .take(64)
        .collect();
    if name.chars().count() > 64 {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A root with a good adapter `good`, and a secret file outside it.
    fn setup() -> (tempfile::TempDir, VariantRoots, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let good = root.join("good");
        std::fs::create_dir_all(&good).unwrap();
        std::fs::write(good.join("adapter_config.json"), "{}").unwrap();
        std::fs::write(tmp.path().join("secret.txt"), "sk-SECRET").unwrap();
        let roots = VariantRoots::new(std::slice::from_ref(&root)).unwrap();
        (tmp, roots, root)
    }

    #[track_caller]
    fn refused(roots: &VariantRoots, path: &Path, rule: &str) {
        let err = roots.resolve(path).unwrap_err();
        assert!(err.contains(rule), "{}: {err}", path.display());
        assert!(!err.contains("SECRET"), "{err}");
    }

    #[test]
    fn paths_inside_the_root_pass() {
        let (_tmp, roots, root) = setup();
        let canonical = std::fs::canonicalize(root.join("good")).unwrap();
        assert_eq!(roots.resolve(&root.join("good")).unwrap(), canonical);
        assert_eq!(
            roots.resolve(Path::new("good")).unwrap(),
            canonical,
            "relative to the root"
        );
        assert!(roots.recheck(&canonical).is_ok());
    }

    #[test]
    fn escapes_are_refused_naming_the_rule() {
        let (tmp, roots, root) = setup();
        refused(&roots, &root.join("../secret.txt"), "`..`");
        refused(&roots, Path::new("/etc"), "outside every --adapter-root");
        refused(&roots, Path::new("/proc/self/cwd"), "/proc");
        refused(&roots, Path::new("/dev/null"), "/proc, /sys or /dev");
        // Outside the roots, a missing path and an existing one get the same answer.
        let a = roots.resolve(Path::new("/nonexistent/x")).unwrap_err();
        let b = roots.resolve(Path::new("/etc/hostname")).unwrap_err();
        assert_eq!(a, b);
        // A symlinked directory or file that leads out of the root.
        symlink(tmp.path(), root.join("out")).unwrap();
        refused(&roots, &root.join("out"), "through a symlink");
        let sneaky = root.join("sneaky");
        std::fs::create_dir(&sneaky).unwrap();
        symlink(
            tmp.path().join("secret.txt"),
            sneaky.join("adapter_config.json"),
        )
        .unwrap();
        refused(
            &roots,
            &sneaky,
            "adapter_config.json: the adapter path resolves",
        );
        // Not a directory.
        std::fs::write(root.join("file"), "x").unwrap();
        refused(&roots, &root.join("file"), "not a directory");
        refused(&roots, &root.join("missing"), "does not exist");
    }

    #[test]
    fn a_directory_swapped_after_registration_fails_the_recheck() {
        let (tmp, roots, root) = setup();
        let dir = roots.resolve(&root.join("good")).unwrap();
        std::fs::remove_file(dir.join("adapter_config.json")).unwrap();
        symlink(
            tmp.path().join("secret.txt"),
            dir.join("adapter_config.json"),
        )
        .unwrap();
        let err = roots.recheck(&dir).unwrap_err();
        assert!(err.contains("outside"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(roots
            .recheck(&dir)
            .unwrap_err()
            .contains("no longer exists"));
    }

    #[test]
    fn sockets_are_refused_and_no_roots_means_no_confinement() {
        let (_tmp, roots, root) = setup();
        let dir = root.join("sock");
        std::fs::create_dir(&dir).unwrap();
        let _listener = std::os::unix::net::UnixListener::bind(dir.join("s")).unwrap();
        refused(&roots, &dir, "a device, socket or pipe");
        let open = VariantRoots::default();
        assert!(!open.confined());
        assert!(open.resolve(&root.join("good")).is_ok());
        assert!(open
            .resolve(Path::new("/nonexistent"))
            .unwrap_err()
            .contains("/nonexistent"));
        assert!(VariantRoots::new(&[PathBuf::from("/proc")])
            .unwrap_err()
            .contains("/proc"));
    }
}
