//! The generated Python mirror of the wire schema, `pyworker/deltaserve/wire.py`: one `IntEnum`
//! per wire enum, one dataclass per wire struct (with `to_wire` / `from_wire`), the schema text and
//! hash, and the framing (`encode` / `decode`). Written by `ipc-schema gen-py` from the tables of
//! [`crate::wire`]; `ipc-schema check` and a test here fail when the checked-in file is stale.

use std::fmt::Write as _;

use crate::schema::{schema_text, strip_ws};
use crate::wire::{ENUMS, ENUM_DOCS, SCHEMA, SCHEMA_DOCS};

/// The command that regenerates the Python mirror; named in its header and in drift errors.
pub const GEN_PY_COMMAND: &str = "cargo run -p deltaserve-ipc --bin ipc-schema -- gen-py";

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
    /// A wire enum: an `IntEnum` in Python, its value on the wire.
    Enum(String),
}

/// The Python member name of an enum variant: its label, upper-cased (`to_gpu` -> `TO_GPU`).
fn py_member(label: &str) -> String {
    label.to_ascii_uppercase()
}

/// `Name.MEMBER` of the default (value 0) variant of wire enum `name`.
fn enum_default(name: &str) -> String {
    let (_, variants) = ENUMS
        .iter()
        .find(|(n, _)| *n == name)
        .expect("Ty::Enum names a wire enum");
    let (_, _, label) = variants
        .iter()
        .find(|(_, value, _)| *value == 0)
        .unwrap_or_else(|| panic!("wire enum {name} has no variant of value 0 (its default)"));
    format!("{name}.{}", py_member(label))
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
            name if ENUMS.iter().any(|(n, _)| *n == name) => Ty::Enum(name.to_string()),
            other => panic!(
                "wire type `{other}` in {owner} is not allowed: use u8/u16/u32/u64, f64, bool, \
                 String, Option<_>, Vec<_>, a wire enum or a wire struct defined earlier in wire.rs"
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
            Ty::Struct(n) | Ty::Enum(n) => n.clone(),
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
            Ty::Enum(n) => enum_default(n),
        }
    }

    /// Whether a value of this type needs converting between the dataclass and msgpack.
    /// Floats do on the way out (an `int` assigned to a float field must still pack as float64);
    /// enums on the way in (the wire's int becomes its member; msgpack packs members as ints).
    fn needs_conv(&self, out: bool) -> bool {
        match self {
            Ty::Int | Ty::Bool | Ty::Str => false,
            Ty::Float => out,
            Ty::Enum(_) => !out,
            Ty::Struct(_) => true,
            Ty::Opt(t) | Ty::List(t) => t.needs_conv(out),
        }
    }

    /// Python expression converting `e` to its wire form.
    fn encode_expr(&self, e: &str, depth: usize) -> String {
        match self {
            Ty::Int | Ty::Bool | Ty::Str | Ty::Enum(_) => e.into(),
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
            Ty::Enum(n) => format!("{n}({e})"),
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

/// Writes `lines` as a class docstring (indented 4), then an empty line.
fn write_docstring(w: &mut String, lines: &[String]) {
    if lines.len() == 1 {
        writeln!(w, "    \"\"\"{}\"\"\"\n", lines[0]).unwrap();
    } else {
        writeln!(w, "    \"\"\"{}", lines[0]).unwrap();
        for l in &lines[1..] {
            writeln!(w, "    {l}").unwrap();
        }
        writeln!(w, "    \"\"\"\n").unwrap();
    }
}

/// `ToGpu` -> `to_gpu`: a Rust variant name in snake_case.
fn snake_case(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
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
from enum import IntEnum
from typing import ClassVar, Optional, Union

import msgpack

__all__ = [
    "SCHEMA_TEXT",
    "SCHEMA_HASH","#
    )
    .unwrap();
    for (name, _) in ENUMS {
        writeln!(w, "    {},", py_str(name)).unwrap();
    }
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

    // One IntEnum per wire enum, before the structs whose fields default to them.
    for ((name, variants), (doc_name, doc, variant_docs)) in ENUMS.iter().zip(ENUM_DOCS) {
        assert_eq!(name, doc_name, "ENUMS and ENUM_DOCS are built by one macro");
        writeln!(w, "\n\nclass {name}(IntEnum):").unwrap();
        let mut dl = doc_lines(doc);
        if dl.is_empty() {
            dl.push(format!("Wire enum ``{name}``."));
        }
        write_docstring(w, &dl);
        for ((variant, value, label), (_, vdoc)) in variants.iter().zip(variant_docs.iter()) {
            assert_eq!(
                *label,
                snake_case(variant),
                "wire enum {name}: the label of {variant} must be its snake_case name"
            );
            for l in doc_lines(vdoc) {
                writeln!(w, "    #: {l}").unwrap();
            }
            writeln!(w, "    {} = {value}", py_member(label)).unwrap();
        }
        writeln!(
            w,
            r#"
    @property
    def label(self) -> str:
        """The lower-case label logs, errors and the HTTP API show (Rust's ``label()``)."""
        return self.name.lower()"#
        )
        .unwrap();
    }

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
        write_docstring(w, &dl);
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

_BY_KIND: dict[int, type[Message]] = {{{by_kind}}}
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
    fn enums_are_int_enums_named_by_their_labels() {
        let t = |s: &str| Ty::parse(s, &[], "T");
        assert_eq!(t("TierOp"), Ty::Enum("TierOp".into()));
        assert_eq!(t("VariantKind").py_default(), "VariantKind.LORA");
        assert_eq!(t("TierOp").decode_expr("a[1]", 0), "TierOp(a[1])");
        assert_eq!(t("TierOp").encode_expr("self.op", 0), "self.op");
        assert_eq!(
            t("Option<VariantKind>").decode_expr("a[4]", 0),
            "(None if a[4] is None else VariantKind(a[4]))"
        );
        assert_eq!(snake_case("DropHost"), "drop_host");
        let py = gen_python();
        assert!(py.contains("class TierOp(IntEnum):"), "{py}");
        assert!(
            py.contains("    TO_GPU = 1\n") && py.contains("    DELTA = 1\n"),
            "{py}"
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
