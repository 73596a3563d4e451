//! `ipc-schema`: developer tool over the wire schema.
//!
//! ```text
//! ipc-schema gen-py [PATH]   write the generated Python mirror (default: pyworker/deltaserve/wire.py)
//! ipc-schema check [PATH]    fail (exit 1) when the checked-in mirror differs from gen-py's output
//! ipc-schema hash            print the schema hash
//! ipc-schema text            print the canonical schema text
//! ```
//!
//! Run through cargo: `cargo run -p deltaserve-ipc --bin ipc-schema -- gen-py`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use deltaserve_ipc::schema::{gen_python, schema_hash, schema_text, GEN_PY_COMMAND};

const USAGE: &str = "usage: ipc-schema gen-py [PATH] | check [PATH] | hash | text";

/// The mirror's path in the repository, unless the command names another.
fn mirror_path(arg: Option<&&str>) -> PathBuf {
    match arg {
        Some(p) => PathBuf::from(p),
        None => {
            let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../..");
            root.canonicalize()
                .unwrap_or(root)
                .join("pyworker/deltaserve/wire.py")
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["gen-py", rest @ ..] if rest.len() <= 1 => {
            let path = mirror_path(rest.first());
            if let Err(e) = std::fs::write(&path, gen_python()) {
                eprintln!("ipc-schema: cannot write {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
            println!("wrote {} (schema hash {})", path.display(), schema_hash());
            ExitCode::SUCCESS
        }
        ["check", rest @ ..] if rest.len() <= 1 => {
            let path = mirror_path(rest.first());
            let current = std::fs::read_to_string(&path).unwrap_or_default();
            if current == gen_python() {
                println!(
                    "{} is up to date (schema hash {})",
                    path.display(),
                    schema_hash()
                );
                ExitCode::SUCCESS
            } else {
                eprintln!(
                    "{} is stale or missing: regenerate it with `{GEN_PY_COMMAND}`",
                    path.display()
                );
                ExitCode::FAILURE
            }
        }
        ["hash"] => {
            println!("{}", schema_hash());
            ExitCode::SUCCESS
        }
        ["text"] => {
            println!("{}", schema_text());
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}
