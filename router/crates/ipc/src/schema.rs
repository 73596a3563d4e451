//! The schema as data: canonical text, its hash, and the generated Python mirror.
//!
//! All three are derived from [`wire::SCHEMA`](crate::wire::SCHEMA), the table the `wire_structs!`
//! macro builds from the struct definitions themselves:
//!
//! ```text
//!  wire.rs structs ──macro──▶ SCHEMA ──▶ schema_text() ──FNV-1a 64──▶ schema_hash()   (handshake)
//!                                   └──▶ gen_python()  ──ipc-schema gen-py──▶ pyworker/deltaserve/wire.py
//! ```
//!
//! Canonical text: one line per struct, `Name=KIND{field:Type,field:Type}`, with all whitespace
//! removed from the type strings (`stringify!` writes `Vec < u32 >`), lines joined by `\n` with
//! no trailing newline. The generated Python computes the same hash from the same text at import,
//! so a worker built from a stale mirror announces a different hash and is refused.

use std::fmt::Write as _;

use crate::wire::{SCHEMA, SCHEMA_DOCS};

/// The command that regenerates the Python mirror; named in its header and in drift errors.
pub const GEN_PY_COMMAND: &str = "cargo run -p deltaserve-ipc --bin ipc-schema -- gen-py";

/// The canonical schema text (see the module doc).
pub fn schema_text() -> String {
    canonical_text(SCHEMA)
}

/// FNV-1a 64-bit of [`schema_text`], as 16 lowercase hex digits.
pub fn schema_hash() -> String {
    fnv1a64_hex(&schema_text())
}

/// A schema table: `(struct name, kind, [(field, type)])` per struct, like [`SCHEMA`].
pub type SchemaTable<'a> = [(&'a str, u8, &'a [(&'a str, &'a str)])];

/// Canonical text of any schema table.
pub fn canonical_text(schema: &SchemaTable) -> String {
    schema
        .iter()
        .map(|(name, kind, fields)| {
            let fields = fields
                .iter()
                .map(|(f, ty)| format!("{f}:{}", strip_ws(ty)))
                .collect::<Vec<_>>()
                .join(",");
            format!("{name}={kind}{{{fields}}}")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// FNV-1a 64-bit hash of `text`'s UTF-8 bytes, as 16 lowercase hex digits.
pub fn fnv1a64_hex(text: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn strip_ws(s: &str) -> String {
    s.chars().filter(|c| !c.is_whitespace()).collect()
}

/// A wire type as the generator understands it.
#[derive(Debug, Clone, PartialEq)]
enum Ty {
    Int,
    Float,
    Bool,
    Str,
    Opt(Box<Ty>),
    List(Box<Ty>),
    Struct(String),
}

impl Ty {
    /// Parses a whitespace-free Rust type string. `known` are the structs defined before the one
    /// being parsed (Python needs a nested class defined before its default factory names it).
    fn parse(ty: &str, known: &[&str], owner: &str) -> Ty {
        if let Some(inner) = ty.strip_prefix("Option<").and_then(|t| t.strip_suffix('>')) {
            return Ty::Opt(Box::new(Ty::parse(inner, known, owner)));
        }
        if let Some(inner) = ty.strip_prefix("Vec<").and_then(|t| t.strip_suffix('>')) {
            return Ty::List(Box::new(Ty::parse(inner, known, owner)));
        }
        match ty {
            "u8" | "u16" | "u32" | "u64" => Ty::Int,
            "f64" => Ty::Float,
            "bool" => Ty::Bool,
            "String" => Ty::Str,
            name if known.contains(&name) => Ty::Struct(name.to_string()),
            other => panic!(
                "wire type `{other}` in {owner} is not allowed: use u8/u16/u32/u64, f64, bool, \
                 String, Option<_>, Vec<_> or a wire struct defined earlier in wire.rs"
            ),
        }
    }

    fn py_annotation(&self) -> String {
        match self {
            Ty::Int => "int".into(),
            Ty::Float => "float".into(),
            Ty::Bool => "bool".into(),
            Ty::Str => "str".into(),
            Ty::Opt(t) => format!("Optional[{}]", t.py_annotation()),
            Ty::List(t) => format!("list[{}]", t.py_annotation()),
            Ty::Struct(n) => n.clone(),
        }
    }

    fn py_default(&self) -> String {
        match self {
            Ty::Int => "0".into(),
            Ty::Float => "0.0".into(),
            Ty::Bool => "False".into(),
            Ty::Str => "\"\"".into(),
            Ty::Opt(_) => "None".into(),
            Ty::List(_) => "field(default_factory=list)".into(),
            Ty::Struct(n) => format!("field(default_factory={n})"),
        }
    }

    /// Whether a value of this type needs converting between the dataclass and msgpack.
    /// Floats do on the way out (an `int` assigned to a float field must still pack as float64).
    fn needs_conv(&self, out: bool) -> bool {
        match self {
            Ty::Int | Ty::Bool | Ty::Str => false,
            Ty::Float => out,
            Ty::Struct(_) => true,
            Ty::Opt(t) | Ty::List(t) => t.needs_conv(out),
        }
    }

    /// Python expression converting `e` to its wire form.
    fn encode_expr(&self, e: &str, depth: usize) -> String {
        match self {
            Ty::Int | Ty::Bool | Ty::Str => e.into(),
            Ty::Float => format!("float({e})"),
            Ty::Struct(_) => format!("{e}.to_wire()"),
            Ty::Opt(t) if t.needs_conv(true) => {
                format!("(None if {e} is None else {})", t.encode_expr(e, depth))
            }
            Ty::List(t) if t.needs_conv(true) => {
                let x = format!("x{depth}");
                format!("[{} for {x} in {e}]", t.encode_expr(&x, depth + 1))
            }
            Ty::Opt(_) | Ty::List(_) => e.into(),
        }
    }

    /// Python expression converting the wire value `e` to the dataclass field's value.
    fn decode_expr(&self, e: &str, depth: usize) -> String {
        match self {
            Ty::Int | Ty::Bool | Ty::Str | Ty::Float => e.into(),
            Ty::Struct(n) => format!("{n}.from_wire({e})"),
            Ty::Opt(t) if t.needs_conv(false) => {
                format!("(None if {e} is None else {})", t.decode_expr(e, depth))
            }
            Ty::List(t) if t.needs_conv(false) => {
                let x = format!("x{depth}");
                format!("[{} for {x} in {e}]", t.decode_expr(&x, depth + 1))
            }
            Ty::Opt(_) | Ty::List(_) => e.into(),
        }
    }
}

/// A Python string literal holding `s`.
fn py_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Doc lines from a `concat!`ed `///` doc: one per line, the single leading space removed.
fn doc_lines(doc: &str) -> Vec<String> {
    doc.lines()
        .map(|l| l.strip_prefix(' ').unwrap_or(l).replace('\\', "\\\\"))
        .collect()
}

/// The generated Python mirror, `pyworker/deltaserve/wire.py` (see that file's header).
pub fn gen_python() -> String {
    let mut o = String::new();
    let w = &mut o;
    let messages: Vec<(&str, u8)> = SCHEMA
        .iter()
        .filter(|(_, k, _)| *k != 0)
        .map(|(n, k, _)| (*n, *k))
        .collect();
    let kinds_list = messages
        .iter()
        .map(|(n, k)| format!("{n}={k}"))
        .collect::<Vec<_>>()
        .join(", ");

    // Header. Text in this function is Python; `{{`/`}}` are format escapes.
    writeln!(
        w,
        r#""""Python mirror of the wire schema owned by the Rust ``ipc`` crate (``router/crates/ipc/src/wire.rs``).

GENERATED FILE, DO NOT EDIT. Regenerate with::

    {GEN_PY_COMMAND}

A Rust test fails when this file is stale, and ``tests/test_wire_golden.py`` decodes and re-encodes
the golden frames written by Rust byte-identically.

Framing: a frame is the msgpack 2-array ``[KIND, body]``; ``body`` is the struct's fields as a
positional array in declaration order (nested structs are nested arrays). Evolution is
append-only: fields missing at the end of a body take their defaults, extra trailing fields from a
newer peer are ignored. ``SCHEMA_HASH`` is computed here from ``SCHEMA_TEXT`` at import, so a stale
mirror announces a hash the router refuses.

Messages: {kinds_list}.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union

import msgpack

__all__ = [
    "SCHEMA_TEXT",
    "SCHEMA_HASH","#
    )
    .unwrap();
    for (name, _, _) in SCHEMA {
        writeln!(w, "    {},", py_str(name)).unwrap();
    }
    writeln!(w, "    \"Message\",\n    \"encode\",\n    \"decode\",\n]\n").unwrap();

    // Schema text and hash.
    writeln!(
        w,
        "#: Canonical schema text, identical to Rust's `ipc::schema::schema_text()`."
    )
    .unwrap();
    writeln!(w, "SCHEMA_TEXT = (").unwrap();
    let text = schema_text();
    let lines: Vec<&str> = text.split('\n').collect();
    for (i, line) in lines.iter().enumerate() {
        let lit = if i + 1 < lines.len() {
            format!("{line}\n")
        } else {
            line.to_string()
        };
        writeln!(w, "    {}", py_str(&lit)).unwrap();
    }
    writeln!(
        w,
        r#")


def _fnv1a64(text: str) -> str:
    """FNV-1a 64-bit hash of ``text``'s UTF-8 bytes as 16 lowercase hex digits (same as Rust)."""
    h = 0xCBF29CE484222325
    for b in text.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{{h:016x}}"


#: Hash of ``SCHEMA_TEXT``, computed here; the worker sends it in ``Hello``.
SCHEMA_HASH: str = _fnv1a64(SCHEMA_TEXT)
"#
    )
    .unwrap();

    // One dataclass per struct.
    let mut known: Vec<&str> = Vec::new();
    for ((name, kind, fields), (doc_name, doc, field_docs)) in SCHEMA.iter().zip(SCHEMA_DOCS) {
        assert_eq!(
            name, doc_name,
            "SCHEMA and SCHEMA_DOCS are built by one macro"
        );
        let tys: Vec<Ty> = fields
            .iter()
            .map(|(_, t)| Ty::parse(&strip_ws(t), &known, name))
            .collect();
        let n = fields.len();

        writeln!(w, "\n\n@dataclass(slots=True)\nclass {name}:").unwrap();
        let mut dl = doc_lines(doc);
        if dl.is_empty() {
            dl.push(format!("Wire struct ``{name}``."));
        }
        if dl.len() == 1 {
            writeln!(w, "    \"\"\"{}\"\"\"\n", dl[0]).unwrap();
        } else {
            writeln!(w, "    \"\"\"{}", dl[0]).unwrap();
            for l in &dl[1..] {
                writeln!(w, "    {l}").unwrap();
            }
            writeln!(w, "    \"\"\"\n").unwrap();
        }
        let kind_doc = if *kind == 0 {
            "0: only ever nested inside a message"
        } else {
            "frame kind"
        };
        writeln!(w, "    KIND: ClassVar[int] = {kind}  # {kind_doc}\n").unwrap();
        for (((fname, _), ty), (_, fdoc)) in fields.iter().zip(&tys).zip(field_docs.iter()) {
            for l in doc_lines(fdoc) {
                writeln!(w, "    #: {l}").unwrap();
            }
            writeln!(
                w,
                "    {fname}: {} = {}",
                ty.py_annotation(),
                ty.py_default()
            )
            .unwrap();
        }

        // to_wire
        writeln!(w, "\n    def to_wire(self) -> list:").unwrap();
        writeln!(
            w,
            "        \"\"\"The positional array this struct is encoded as.\"\"\""
        )
        .unwrap();
        let items: Vec<String> = fields
            .iter()
            .zip(&tys)
            .map(|((f, _), t)| t.encode_expr(&format!("self.{f}"), 0))
            .collect();
        writeln!(w, "        return [{}]", items.join(", ")).unwrap();

        // from_wire
        writeln!(
            w,
            "\n    @classmethod\n    def from_wire(cls, a: list) -> {name}:"
        )
        .unwrap();
        writeln!(
            w,
            "        \"\"\"Builds the struct from its positional array; missing trailing fields take their defaults.\"\"\""
        )
        .unwrap();
        if n == 0 {
            writeln!(w, "        return cls()").unwrap();
        } else {
            let args: Vec<String> = tys
                .iter()
                .enumerate()
                .map(|(i, t)| t.decode_expr(&format!("a[{i}]"), 0))
                .collect();
            writeln!(w, "        n = len(a)\n        if n >= {n}:").unwrap();
            writeln!(w, "            return cls({})", args.join(", ")).unwrap();
            writeln!(w, "        m = cls()").unwrap();
            for (i, ((f, _), t)) in fields.iter().zip(&tys).enumerate() {
                writeln!(
                    w,
                    "        if n > {i}:\n            m.{f} = {}",
                    t.decode_expr(&format!("a[{i}]"), 0)
                )
                .unwrap();
            }
            writeln!(w, "        return m").unwrap();
        }
        known.push(name);
    }

    // Framing.
    let union = messages
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ");
    let by_kind = messages
        .iter()
        .map(|(n, k)| format!("{k}: {n}"))
        .collect::<Vec<_>>()
        .join(", ");
    writeln!(
        w,
        r#"

#: Every top-level message (the structs with a non-zero ``KIND``).
Message = Union[{union}]

_BY_KIND: dict[int, type] = {{{by_kind}}}
_KINDS = "{kinds_list}"
_packb = msgpack.packb
_unpackb = msgpack.unpackb


def encode(msg: Message) -> bytes:
    """One frame: ``msgpack([msg.KIND, msg.to_wire()])``, byte-identical to Rust's ``codec::encode``."""
    return _packb([msg.KIND, msg.to_wire()], use_bin_type=True)


def decode(frame: bytes) -> Message:
    """Decodes one frame into its message; raises ``ValueError`` saying what is wrong with a bad frame."""
    try:
        obj = _unpackb(frame, raw=False)
    except Exception as e:  # msgpack raises several types for malformed input
        raise ValueError(f"bad frame: not one msgpack value ({{e}})") from e
    if type(obj) is not list or len(obj) != 2:
        raise ValueError(f"bad frame: expected a msgpack array [kind, body], got {{type(obj).__name__}}")
    kind, body = obj
    cls = _BY_KIND.get(kind) if type(kind) is int else None
    if cls is None:
        raise ValueError(f"unknown message kind {{kind!r}}: expected one of {{_KINDS}}")
    if type(body) is not list:
        raise ValueError(f"bad {{cls.__name__}} frame: body is {{type(body).__name__}}, expected an array")
    try:
        return cls.from_wire(body)
    except (TypeError, IndexError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot decode {{cls.__name__}} body (kind {{kind}}): {{e}}") from e"#
    )
    .unwrap();
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_has_one_canonical_line_per_struct() {
        let text = schema_text();
        assert_eq!(text.lines().count(), SCHEMA.len());
        assert!(!text.contains(' ') && !text.ends_with('\n'));
        assert!(text.contains("StepPlan=2{step_id:u64,new_requests:Vec<NewRequest>,running:Vec<RunningRequest>,released:Vec<u64>,adapter_ops:Vec<AdapterOp>}"), "{text}");
        assert!(text.starts_with("SamplingParams=0{temperature:f64,top_p:f64,top_k:u32,seed:Option<u64>,logprobs:Option<u32>}\n"), "{text}");
    }

    #[test]
    fn fnv1a64_matches_reference_vectors() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a64_hex(""), "cbf29ce484222325");
        assert_eq!(fnv1a64_hex("a"), "af63dc4c8601ec8c");
        assert_eq!(fnv1a64_hex("foobar"), "85944171f73967e8");
    }

    #[test]
    fn hash_is_stable_and_follows_the_text() {
        let h = schema_hash();
        assert_eq!(h.len(), 16);
        assert!(h
            .chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_eq!(h, schema_hash());
        assert_eq!(h, fnv1a64_hex(&schema_text()));

        // Any change to a name, kind, order or type changes the hash.
        let base: &SchemaTable = &[("A", 1, &[("x", "u32"), ("y", "Vec < u64 >")])];
        let h0 = fnv1a64_hex(&canonical_text(base));
        assert_eq!(canonical_text(base), "A=1{x:u32,y:Vec<u64>}");
        for changed in [
            &[("A", 1, &[("x", "u64"), ("y", "Vec<u64>")][..])][..],
            &[("A", 2, &[("x", "u32"), ("y", "Vec<u64>")][..])],
            &[("A", 1, &[("y", "Vec<u64>"), ("x", "u32")][..])],
            &[("B", 1, &[("x", "u32"), ("y", "Vec<u64>")][..])],
            &[(
                "A",
                1,
                &[("x", "u32"), ("y", "Vec<u64>"), ("z", "bool")][..],
            )],
        ] {
            assert_ne!(
                fnv1a64_hex(&canonical_text(changed)),
                h0,
                "{}",
                canonical_text(changed)
            );
        }
        // Whitespace inside types is not part of the schema.
        let spaced: &SchemaTable = &[("A", 1, &[("x", "u32"), ("y", "Vec<u64>")])];
        assert_eq!(fnv1a64_hex(&canonical_text(spaced)), h0);
    }

    #[test]
    fn type_mapping() {
        let known = ["SamplingParams", "TokenLogprob"];
        let t = |s: &str| Ty::parse(s, &known, "T");
        assert_eq!(t("Option<u64>").py_annotation(), "Optional[int]");
        assert_eq!(t("Vec<TokenLogprob>").py_annotation(), "list[TokenLogprob]");
        assert_eq!(
            t("Vec<TokenLogprob>").decode_expr("a[3]", 0),
            "[TokenLogprob.from_wire(x0) for x0 in a[3]]"
        );
        assert_eq!(t("Vec<u32>").decode_expr("a[1]", 0), "a[1]");
        assert_eq!(
            t("Option<f64>").encode_expr("self.p", 0),
            "(None if self.p is None else float(self.p))"
        );
        assert_eq!(
            t("Vec<Vec<f64>>").encode_expr("self.m", 0),
            "[[float(x1) for x1 in x0] for x0 in self.m]"
        );
        assert_eq!(
            t("SamplingParams").py_default(),
            "field(default_factory=SamplingParams)"
        );
    }

    #[test]
    #[should_panic(expected = "wire type `i32` in T is not allowed")]
    fn signed_ints_are_refused() {
        Ty::parse("i32", &[], "T");
    }

    #[test]
    #[should_panic(expected = "wire type `Later` in T is not allowed")]
    fn structs_must_be_defined_before_use() {
        Ty::parse("Later", &["Earlier"], "T");
    }

    #[test]
    fn checked_in_python_mirror_is_current() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../pyworker/deltaserve/wire.py"
        );
        let current = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            current == gen_python(),
            "{path} is stale or missing: regenerate it with `{GEN_PY_COMMAND}`"
        );
    }
}
