//! Frames: turns a wire message into the bytes of one ring frame and back.
//!
//! A frame is the msgpack 2-array `[KIND, body]` described in [`crate::wire`]: the header bytes
//! `0x92 <kind>` followed by the struct in rmp-serde's compact (array) form. Encoding is
//! `rmp_serde::to_vec` (never `to_vec_named`), which writes unsigned integers in their smallest
//! form, `f64` as float64, `None` as nil and strings as str, so Python's
//! `msgpack.packb([kind, body], use_bin_type=True)` produces the same bytes.
//!
//! Decoding is direction-typed: the worker only ever accepts [`ToWorker`] and the router only
//! [`FromWorker`], so a frame of the wrong direction is an error, not a silent surprise.

use std::io::Cursor;

use crate::wire::{
    Hello, InspectVariant, Shutdown, StepOutput, StepPlan, VariantInfo, WireStruct, WorkerConfig,
    WorkerError,
};

/// First byte of every frame: msgpack fixarray of length 2.
pub const FRAME_HEADER: u8 = 0x92;

/// Why a frame could not be decoded. Every message names what was wrong and where.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// Fewer than the two header bytes.
    #[error("frame too short: {len} bytes, a frame starts with the 2 bytes 0x92 <kind>")]
    TooShort {
        /// Length of the frame received.
        len: usize,
    },
    /// The first byte is not the msgpack 2-array marker.
    #[error(
        "bad frame header byte 0x{byte:02x}: expected 0x92 (msgpack array of 2: [kind, body])"
    )]
    BadHeader {
        /// The byte found instead of 0x92.
        byte: u8,
    },
    /// The kind byte names no message this direction accepts.
    #[error("unknown message kind {kind} for {direction}: expected one of {expected}")]
    UnknownKind {
        /// The kind byte found.
        kind: u8,
        /// Which decoder rejected it (`router -> worker` or `worker -> router`).
        direction: &'static str,
        /// The kinds that decoder accepts, as `name=kind` pairs.
        expected: String,
    },
    /// The body is not a valid encoding of the struct the kind names.
    #[error("cannot decode {name} body (kind {kind}): {source}")]
    Body {
        /// The struct the kind selected.
        name: &'static str,
        /// The kind byte.
        kind: u8,
        /// What rmp-serde reported.
        #[source]
        source: rmp_serde::decode::Error,
    },
    /// The body decoded but bytes are left over after it.
    #[error("{name} frame has {extra} trailing bytes after its body")]
    TrailingBytes {
        /// The struct the kind selected.
        name: &'static str,
        /// How many bytes were left.
        extra: usize,
    },
}

/// Encodes `msg` as one frame: `[T::KIND, body]`.
///
/// # Panics
/// If `T` is a nested-only struct (`KIND == 0`): those are never sent on their own.
pub fn encode<T: WireStruct>(msg: &T) -> Vec<u8> {
    assert!(
        T::KIND != 0 && T::KIND < 0x80,
        "{} has kind {}: only top-level messages (kind 1..=127) are framed",
        T::NAME,
        T::KIND
    );
    let mut out = Vec::with_capacity(64);
    out.push(FRAME_HEADER);
    out.push(T::KIND);
    // Writing into a Vec cannot fail, and every wire type is serialisable by construction.
    rmp_serde::encode::write(&mut out, msg).expect("wire structs always serialise to a Vec");
    out
}

/// Messages the router sends to a worker.
#[derive(Debug, Clone, PartialEq)]
pub enum ToWorker {
    /// One scheduling step to execute.
    StepPlan(StepPlan),
    /// Exit cleanly.
    Shutdown(Shutdown),
    /// Validate an adapter directory and report its footprint.
    InspectVariant(InspectVariant),
    /// The worker's configuration: the first frame on a link.
    WorkerConfig(WorkerConfig),
}

/// Messages a worker sends to the router.
#[derive(Debug, Clone, PartialEq)]
pub enum FromWorker {
    /// Handshake, first frame after start-up.
    Hello(Hello),
    /// The answer to one `StepPlan`.
    StepOutput(StepOutput),
    /// A failure instead of a `StepOutput`.
    WorkerError(WorkerError),
    /// The answer to one `InspectVariant`.
    VariantInfo(VariantInfo),
}

/// Decodes a frame the router sent (worker side).
pub fn decode_to_worker(frame: &[u8]) -> Result<ToWorker, CodecError> {
    let (kind, body) = split_header(frame)?;
    match kind {
        StepPlan::KIND => decode_body(kind, body).map(ToWorker::StepPlan),
        Shutdown::KIND => decode_body(kind, body).map(ToWorker::Shutdown),
        InspectVariant::KIND => decode_body(kind, body).map(ToWorker::InspectVariant),
        WorkerConfig::KIND => decode_body(kind, body).map(ToWorker::WorkerConfig),
        _ => Err(unknown(
            kind,
            "router -> worker",
            &[
                kinded::<StepPlan>(),
                kinded::<Shutdown>(),
                kinded::<InspectVariant>(),
                kinded::<WorkerConfig>(),
            ],
        )),
    }
}

/// Decodes a frame a worker sent (router side).
pub fn decode_from_worker(frame: &[u8]) -> Result<FromWorker, CodecError> {
    let (kind, body) = split_header(frame)?;
    match kind {
        Hello::KIND => decode_body(kind, body).map(FromWorker::Hello),
        StepOutput::KIND => decode_body(kind, body).map(FromWorker::StepOutput),
        WorkerError::KIND => decode_body(kind, body).map(FromWorker::WorkerError),
        VariantInfo::KIND => decode_body(kind, body).map(FromWorker::VariantInfo),
        _ => Err(unknown(
            kind,
            "worker -> router",
            &[
                kinded::<Hello>(),
                kinded::<StepOutput>(),
                kinded::<WorkerError>(),
                kinded::<VariantInfo>(),
            ],
        )),
    }
}

/// Checks the `0x92 <kind>` header and returns `(kind, body)`.
fn split_header(frame: &[u8]) -> Result<(u8, &[u8]), CodecError> {
    match frame {
        [FRAME_HEADER, kind, body @ ..] => Ok((*kind, body)),
        [byte, _, ..] => Err(CodecError::BadHeader { byte: *byte }),
        _ => Err(CodecError::TooShort { len: frame.len() }),
    }
}

/// Decodes `body` as `T`, requiring that it is consumed exactly.
fn decode_body<T: WireStruct>(kind: u8, body: &[u8]) -> Result<T, CodecError> {
    let mut de = rmp_serde::Deserializer::new(Cursor::new(body));
    let msg = T::deserialize(&mut de).map_err(|source| CodecError::Body {
        name: T::NAME,
        kind,
        source,
    })?;
    let extra = body.len() - de.position() as usize;
    if extra != 0 {
        return Err(CodecError::TrailingBytes {
            name: T::NAME,
            extra,
        });
    }
    Ok(msg)
}

fn kinded<T: WireStruct>() -> (&'static str, u8) {
    (T::NAME, T::KIND)
}

fn unknown(kind: u8, direction: &'static str, expected: &[(&'static str, u8)]) -> CodecError {
    let expected = expected
        .iter()
        .map(|(n, k)| format!("{n}={k}"))
        .collect::<Vec<_>>()
        .join(", ");
    CodecError::UnknownKind {
        kind,
        direction,
        expected,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::examples;

    #[test]
    fn every_message_round_trips() {
        let plan = examples::step_plan();
        let shutdown = examples::shutdown();
        assert_eq!(
            decode_to_worker(&encode(&plan)).unwrap(),
            ToWorker::StepPlan(plan)
        );
        assert_eq!(
            decode_to_worker(&encode(&shutdown)).unwrap(),
            ToWorker::Shutdown(shutdown)
        );

        let hello = examples::hello();
        let out = examples::step_output();
        let err = examples::worker_error();
        assert_eq!(
            decode_from_worker(&encode(&hello)).unwrap(),
            FromWorker::Hello(hello)
        );
        assert_eq!(
            decode_from_worker(&encode(&out)).unwrap(),
            FromWorker::StepOutput(out)
        );
        assert_eq!(
            decode_from_worker(&encode(&err)).unwrap(),
            FromWorker::WorkerError(err)
        );
        let config = examples::worker_config();
        assert_eq!(
            decode_to_worker(&encode(&config)).unwrap(),
            ToWorker::WorkerConfig(config)
        );
        let inspect = examples::inspect_adapter();
        let info = examples::adapter_info();
        assert_eq!(
            decode_to_worker(&encode(&inspect)).unwrap(),
            ToWorker::InspectVariant(inspect)
        );
        assert_eq!(
            decode_from_worker(&encode(&info)).unwrap(),
            FromWorker::VariantInfo(info)
        );
    }

    #[test]
    fn default_messages_round_trip() {
        let plan = StepPlan::default();
        assert_eq!(
            decode_to_worker(&encode(&plan)).unwrap(),
            ToWorker::StepPlan(plan)
        );
        let hello = Hello::default();
        assert_eq!(
            decode_from_worker(&encode(&hello)).unwrap(),
            FromWorker::Hello(hello)
        );
    }

    #[test]
    fn frame_starts_with_array2_and_kind() {
        assert_eq!(&encode(&examples::hello())[..2], &[0x92, 1]);
        assert_eq!(&encode(&examples::step_plan())[..2], &[0x92, 2]);
        assert_eq!(&encode(&examples::step_output())[..2], &[0x92, 3]);
        assert_eq!(&encode(&examples::shutdown())[..2], &[0x92, 4]);
        assert_eq!(&encode(&examples::worker_error())[..2], &[0x92, 5]);
    }

    #[test]
    fn encoding_is_compact_msgpack() {
        // Shutdown { reason: "bye" } = [4, ["bye"]]: fixarray(2), fixint 4, fixarray(1), fixstr(3).
        let frame = encode(&Shutdown {
            reason: "bye".into(),
        });
        assert_eq!(frame, [0x92, 0x04, 0x91, 0xa3, b'b', b'y', b'e']);

        // Unsigned ints take their smallest form; f64 is always float64 (0xcb); None is nil;
        // bool is 0xc2/0xc3.
        let sp = crate::wire::SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 300,
            seed: Some(u64::MAX),
            logprobs: None,
            ..Default::default()
        };
        let body = rmp_serde::to_vec(&sp).unwrap();
        let mut want = vec![0x9b, 0xcb];
        want.extend(0.0f64.to_be_bytes());
        want.push(0xcb);
        want.extend(1.0f64.to_be_bytes());
        want.extend([0xcd, 0x01, 0x2c]);
        want.push(0xcf);
        want.extend(u64::MAX.to_be_bytes());
        want.push(0xc0);
        // No logit bias, no penalties, no min_tokens, no prompt logprobs, no grammar: one byte
        // each.
        want.extend([0x90, 0xc0, 0x00, 0x90, 0xc0, 0xc0]);
        assert_eq!(body, want);

        let err = WorkerError {
            step_id: 7,
            message: String::new(),
            fatal: true,
            req_ids: vec![],
        };
        assert_eq!(encode(&err), [0x92, 0x05, 0x94, 0x07, 0xa0, 0xc3, 0x90]);
    }

    #[test]
    fn missing_trailing_fields_take_defaults() {
        // An older peer's WorkerError without `fatal` and `req_ids`: [5, [9, "x"]].
        let frame = [0x92, 0x05, 0x92, 0x09, 0xa1, b'x'];
        let FromWorker::WorkerError(err) = decode_from_worker(&frame).unwrap() else {
            panic!("expected WorkerError")
        };
        assert_eq!(
            err,
            WorkerError {
                step_id: 9,
                message: "x".into(),
                fatal: false,
                req_ids: vec![]
            }
        );
    }

    #[test]
    fn bad_frames_give_clear_errors() {
        let e = decode_to_worker(&[]).unwrap_err().to_string();
        assert!(e.contains("too short"), "{e}");

        let e = decode_to_worker(&[0x93, 2, 0x90]).unwrap_err().to_string();
        assert!(e.contains("bad frame header byte 0x93"), "{e}");

        let e = decode_to_worker(&[0x92, 9, 0x90]).unwrap_err().to_string();
        assert!(
            e.contains("unknown message kind 9") && e.contains("StepPlan=2"),
            "{e}"
        );

        // A worker -> router kind sent the wrong way is unknown to this direction.
        let e = decode_to_worker(&encode(&examples::hello()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown message kind 1"), "{e}");

        // Garbage body: a string where the StepPlan array should be.
        let e = decode_to_worker(&[0x92, 2, 0xa1, b'x'])
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot decode StepPlan body (kind 2)"), "{e}");

        // Truncated body.
        let frame = encode(&examples::step_output());
        let e = decode_from_worker(&frame[..frame.len() - 3])
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot decode StepOutput body"), "{e}");

        // Trailing garbage after a complete body.
        let mut frame = encode(&examples::shutdown());
        frame.push(0xc0);
        let e = decode_to_worker(&frame).unwrap_err().to_string();
        assert!(e.contains("Shutdown frame has 1 trailing bytes"), "{e}");
    }
}
