//! The schema as data: canonical text and its hash (the Python mirror is generated from the same
//! tables by [`crate::gen_py`]).
//!
//! Both are derived from [`wire::SCHEMA`](crate::wire::SCHEMA) and
//! [`wire::ENUMS`](crate::wire::ENUMS), the tables the `wire_structs!` and `wire_enums!` macros
//! build from the definitions themselves:
//!
//! ```text
//!  wire.rs structs, enums ──macros──▶ SCHEMA, ENUMS ──▶ schema_text() ──FNV-1a 64──▶ schema_hash()   (handshake)
//!                                                └──▶ gen_python()  ──ipc-schema gen-py──▶ pyworker/deltaserve/wire.py
//! ```
//!
//! Canonical text: one line per struct, `Name=KIND{field:Type,field:Type}`, with all whitespace
//! removed from the type strings (`stringify!` writes `Vec < u32 >`), then one line per enum,
//! `Name:u8{label=value,label=value}`; lines joined by `\n` with no trailing newline. The
//! generated Python computes the same hash from the same text at import, so a worker built from a
//! stale mirror announces a different hash and is refused.

use crate::wire::{ENUMS, SCHEMA};

pub use crate::gen_py::{gen_python, GEN_PY_COMMAND};

/// The canonical schema text (see the module doc).
pub fn schema_text() -> String {
    let mut text = canonical_text(SCHEMA);
    for line in enum_lines(ENUMS) {
        text.push('\n');
        text.push_str(&line);
    }
    text
}

/// FNV-1a 64-bit of [`schema_text`], as 16 lowercase hex digits.
pub fn schema_hash() -> String {
    fnv1a64_hex(&schema_text())
}

/// A schema table: `(struct name, kind, [(field, type)])` per struct, like [`SCHEMA`].
pub type SchemaTable<'a> = [(&'a str, u8, &'a [(&'a str, &'a str)])];

/// An enum table: `(enum name, [(variant, value, label)])` per enum, like [`ENUMS`].
pub type EnumTable<'a> = [(&'a str, &'a [(&'a str, u8, &'a str)])];

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

/// The canonical lines of any enum table, one per enum: `Name:u8{label=value,...}`.
pub fn enum_lines(enums: &EnumTable) -> Vec<String> {
    enums
        .iter()
        .map(|(name, variants)| {
            let variants = variants
                .iter()
                .map(|(_, value, label)| format!("{label}={value}"))
                .collect::<Vec<_>>()
                .join(",");
            format!("{name}:u8{{{variants}}}")
        })
        .collect()
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

/// `s` without whitespace (`stringify!` spaces out type tokens).
pub(crate) fn strip_ws(s: &str) -> String {
    s.chars().filter(|c| !c.is_whitespace()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_has_one_canonical_line_per_struct() {
        let text = schema_text();
        assert_eq!(text.lines().count(), SCHEMA.len() + ENUMS.len());
        assert!(!text.contains(' ') && !text.ends_with('\n'));
        assert!(text.contains("StepPlan=2{step_id:u64,new_requests:Vec<NewRequest>,running:Vec<RunningRequest>,released:Vec<u64>,adapter_ops:Vec<VariantOp>}"), "{text}");
        assert!(text.starts_with("LogitBias=0{token_id:u32,bias:f64}\nPenalties=0{presence:f64,frequency:f64,repetition:f64}\n"), "{text}");
        assert!(text.contains("\nSamplingParams=0{temperature:f64,top_p:f64,top_k:u32,seed:Option<u64>,logprobs:Option<u32>,logit_bias:Vec<LogitBias>,penalties:Option<Penalties>,min_tokens:u32,min_tokens_banned:Vec<u32>,prompt_logprobs:Option<u32>,grammar:Option<String>}\n"), "{text}");
        assert!(text.contains("VariantOp=0{adapter_id:u32,op:TierOp,path:String,block_ids:Vec<u32>,kind:VariantKind,slot:Option<u32>}\n"), "{text}");
        assert!(text.contains("\nVariantKind:u8{lora=0,delta=1}\nTierOp:u8{to_host=0,to_gpu=1,drop_gpu=2,drop_host=3}\n"), "{text}");
        assert!(
            text.ends_with("\nKernelBackend:u8{auto=0,torch=1,triton=2}"),
            "{text}"
        );
    }

    #[test]
    fn enum_lines_follow_every_value_and_label() {
        let base: &EnumTable = &[("K", &[("A", 0, "a"), ("B", 1, "b")])];
        assert_eq!(enum_lines(base), vec!["K:u8{a=0,b=1}".to_string()]);
        for changed in [
            &[("K", &[("A", 0, "a"), ("B", 2, "b")][..])][..],
            &[("K", &[("A", 0, "a"), ("B", 1, "c")][..])],
            &[("K", &[("A", 0, "a"), ("B", 1, "b"), ("C", 2, "c")][..])],
            &[("L", &[("A", 0, "a"), ("B", 1, "b")][..])],
        ] {
            assert_ne!(enum_lines(changed), enum_lines(base));
        }
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
}
