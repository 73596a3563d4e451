//! Golden frames: one msgpack file per message kind in `tests/golden/` at the repository root,
//! plus `schema_hash.txt`. Written from [`deltaserve_ipc::examples`]; `tests/test_wire_golden.py`
//! decodes and re-encodes them byte-identically in Python.
//!
//! A missing file is written. An existing file must match byte for byte: a change in the bytes
//! means the encoding changed, which every peer must agree on, so it fails until re-blessed
//! with `DELTASERVE_BLESS=1 cargo test -p deltaserve-ipc --test golden`.

use std::path::{Path, PathBuf};

use deltaserve_ipc::codec::{decode_from_worker, decode_to_worker, encode, FromWorker, ToWorker};
use deltaserve_ipc::examples;
use deltaserve_ipc::schema::schema_hash;
use deltaserve_ipc::wire::{WireStruct, SCHEMA};

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../tests/golden")
}

/// Writes `bytes` to `name` if missing or blessing; otherwise fails when they differ.
fn check(name: &str, bytes: &[u8]) {
    let dir = golden_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    let bless = std::env::var("DELTASERVE_BLESS").is_ok_and(|v| v == "1");
    match std::fs::read(&path) {
        Ok(old) if !bless => assert!(
            old == bytes,
            "golden file {} changed ({} bytes on disk, {} now): the wire encoding differs. If the \
             change is intended, regenerate with `DELTASERVE_BLESS=1 cargo test -p deltaserve-ipc \
             --test golden` and update the Python mirror",
            path.display(),
            old.len(),
            bytes.len()
        ),
        _ => std::fs::write(&path, bytes).unwrap(),
    }
}

fn frame<T: WireStruct>(msg: &T) -> (String, Vec<u8>) {
    (format!("{}.msgpack", T::NAME), encode(msg))
}

#[test]
fn golden_frames_match() {
    let frames = [
        frame(&examples::hello()),
        frame(&examples::step_plan()),
        frame(&examples::step_output()),
        frame(&examples::shutdown()),
        frame(&examples::worker_error()),
        frame(&examples::inspect_adapter()),
        frame(&examples::adapter_info()),
        frame(&examples::worker_config()),
    ];
    // Exactly one golden per top-level message kind in the schema.
    let mut kinds: Vec<&str> = SCHEMA
        .iter()
        .filter(|(_, k, _)| *k != 0)
        .map(|(n, _, _)| *n)
        .collect();
    let mut named: Vec<&str> = frames
        .iter()
        .map(|(n, _)| n.trim_end_matches(".msgpack"))
        .collect();
    kinds.sort();
    named.sort();
    assert_eq!(kinds, named, "add an example for every message kind");

    for (name, bytes) in &frames {
        check(name, bytes);
    }
    check("schema_hash.txt", format!("{}\n", schema_hash()).as_bytes());

    // The files on disk decode back to the examples.
    let read = |n: &str| std::fs::read(golden_dir().join(n)).unwrap();
    assert_eq!(
        decode_to_worker(&read("StepPlan.msgpack")).unwrap(),
        ToWorker::StepPlan(examples::step_plan())
    );
    assert_eq!(
        decode_to_worker(&read("Shutdown.msgpack")).unwrap(),
        ToWorker::Shutdown(examples::shutdown())
    );
    assert_eq!(
        decode_from_worker(&read("Hello.msgpack")).unwrap(),
        FromWorker::Hello(examples::hello())
    );
    assert_eq!(
        decode_from_worker(&read("StepOutput.msgpack")).unwrap(),
        FromWorker::StepOutput(examples::step_output())
    );
    assert_eq!(
        decode_to_worker(&read("InspectVariant.msgpack")).unwrap(),
        ToWorker::InspectVariant(examples::inspect_adapter())
    );
    assert_eq!(
        decode_from_worker(&read("VariantInfo.msgpack")).unwrap(),
        FromWorker::VariantInfo(examples::adapter_info())
    );
    assert_eq!(
        decode_to_worker(&read("WorkerConfig.msgpack")).unwrap(),
        ToWorker::WorkerConfig(examples::worker_config())
    );
    assert_eq!(
        decode_from_worker(&read("WorkerError.msgpack")).unwrap(),
        FromWorker::WorkerError(examples::worker_error())
    );
}
