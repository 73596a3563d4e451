//! Copying 2-D tensors of a safetensors file into one caller-owned buffer: dtype conversion,
//! optional transpose and a finiteness check, all without Python.
//!
//! Why it exists: the worker's host tier packs every LoRA adapter it reads (hundreds of small
//! `lora_A` / `lora_B` tensors) into one page-locked buffer. Done tensor by tensor in Python, a
//! 7B-shaped adapter held the GIL for about 15 ms, and the background threads doing it slowed every
//! torch call of the worker's main thread (the one launching steps) several times over while
//! adapters streamed in. The `py` crate wraps [`read_into`] with the GIL released.
//!
//! File format (safetensors): an 8-byte little-endian header length `N`, `N` bytes of JSON
//! `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {..}}`, then the data;
//! offsets are relative to the data's start.
//!
//! Semantics of one [`TensorCopy`] (`rows x cols` source tensor `s`, destination `d` of [`Dtype`] `out`,
//! element offset `o`):
//!
//! ```text
//! transpose = false:  d[o + i * cols + j] = out(s[i, j])
//! transpose = true:   d[o + j * rows + i] = out(s[i, j])
//! ```
//!
//! `out(x)` rounds to nearest even (as torch's `Tensor.to`). A source value that is NaN or
//! infinite, or a finite one that the conversion makes infinite, is an error naming the tensor.
//! With no destination, everything is checked and nothing is written. The destination is never
//! touched outside the copies' ranges; on error it may hold a part of the copies.
//!
//! [`read_header`] lists every tensor's dtype and shape, reading only the header.
//!
//! The file is read with positioned reads (one per tensor, into a per-thread scratch buffer that
//! is kept), never mapped: mapping a file, populating the map and unmapping it take the process's
//! address-space lock and flush every core's TLB, which stalls the worker's other threads (the
//! one launching steps) while adapters of a hundred MB or more stream in.

use std::cell::RefCell;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};
use serde::Deserialize;

/// Element types a copy reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F16,
    BF16,
    F32,
}

impl Dtype {
    /// The safetensors name (`F16`, `BF16`, `F32`), or None for any other type.
    pub fn parse(name: &str) -> Option<Dtype> {
        match name {
            "F16" => Some(Dtype::F16),
            "BF16" => Some(Dtype::BF16),
            "F32" => Some(Dtype::F32),
            _ => None,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::F32 => 4,
        }
    }

    /// The exponent field's bits: all of them set is NaN or an infinity.
    fn exponent_bits(self) -> u32 {
        match self {
            Dtype::F16 => 0x7c00,
            Dtype::BF16 => 0x7f80,
            Dtype::F32 => 0x7f80_0000,
        }
    }

    /// The torch name, as error messages print it.
    pub fn torch_name(self) -> &'static str {
        match self {
            Dtype::F16 => "torch.float16",
            Dtype::BF16 => "torch.bfloat16",
            Dtype::F32 => "torch.float32",
        }
    }
}

/// One tensor to copy (module docs: semantics).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorCopy {
    /// Its name in the file.
    pub name: String,
    /// The shape the caller expects it to have: `[rows, cols]`.
    pub rows: usize,
    /// See `rows`.
    pub cols: usize,
    /// Destination element offset of its first value.
    pub dst_offset: usize,
    /// Write it transposed (`cols x rows`).
    pub transpose: bool,
}

/// Why a read failed; the message names the file or the tensor.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a well-formed safetensors file.
    #[error("{path} is not a valid safetensors file: {why}")]
    Format { path: String, why: String },
    /// A tensor is missing, has another shape or type, or holds values that are not finite.
    #[error("tensor '{name}' {problem}")]
    Tensor { name: String, problem: String },
    /// A copy does not fit the destination (the caller's bug).
    #[error("copy of tensor '{name}' ({elems} elements at {offset}) does not fit a destination of {len} elements")]
    Destination {
        name: String,
        offset: usize,
        elems: usize,
        len: usize,
    },
}

#[derive(Deserialize)]
struct Entry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [usize; 2],
}

impl Entry {
    /// The entry's data span `[begin, end)`, checked to lie in the file's `data_len` data bytes and
    /// to hold `shape` × the dtype's size (when the dtype is one we read); else why not, worded as
    /// what follows "tensor 'name'". Both readers (`read_into`, `read_header`) check with this.
    fn span(&self, data_len: usize) -> Result<(usize, usize), String> {
        let [begin, end] = self.data_offsets;
        if begin > end || end > data_len {
            return Err(format!(
                "has data offsets [{begin}, {end}] outside the file's {data_len} data bytes (truncated?)"
            ));
        }
        let elems = self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if let (Some(dtype), Some(elems)) = (Dtype::parse(&self.dtype), elems) {
            if elems.checked_mul(dtype.size()) != Some(end - begin) {
                return Err(format!(
                    "has {} data bytes for shape {:?} of {}",
                    end - begin,
                    self.shape,
                    self.dtype
                ));
            }
        }
        Ok((begin, end))
    }
}

/// Reads `copies` from the safetensors file at `path` into `dst` (elements of `out`), or only
/// checks them when `dst` is None. Module docs: semantics and errors.
pub fn read_into(
    path: &Path,
    copies: &[TensorCopy],
    dst: Option<&mut [u8]>,
    out: Dtype,
) -> Result<(), Error> {
    let shown = path.display().to_string();
    let io = |source| Error::Io {
        path: shown.clone(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let (header, data_start, data_len) = header_of(&file, &shown)?;
    let mut dst = dst;
    if let Some(d) = dst.as_deref() {
        let len = d.len() / out.size();
        for c in copies {
            let elems = c.rows * c.cols;
            if c.dst_offset.checked_add(elems).is_none_or(|end| end > len) {
                return Err(Error::Destination {
                    name: c.name.clone(),
                    offset: c.dst_offset,
                    elems,
                    len,
                });
            }
        }
    }
    for c in copies {
        let tensor = |problem: String| Error::Tensor {
            name: c.name.clone(),
            problem,
        };
        let value = header
            .get(&c.name)
            .ok_or_else(|| tensor("is not in the file".into()))?;
        let entry = Entry::deserialize(value)
            .map_err(|e| tensor(format!("has a malformed header entry: {e}")))?;
        let dtype = Dtype::parse(&entry.dtype).ok_or_else(|| {
            tensor(format!(
                "has dtype {}; supported: F16, BF16, F32",
                entry.dtype
            ))
        })?;
        if entry.shape != [c.rows, c.cols] {
            return Err(tensor(format!(
                "has shape {:?}, expected {:?}",
                entry.shape,
                [c.rows, c.cols]
            )));
        }
        let (begin, end) = entry.span(data_len).map_err(tensor)?;
        let (start, stop) = (
            c.dst_offset * out.size(),
            (c.dst_offset + c.rows * c.cols) * out.size(),
        );
        let region = dst.as_deref_mut().map(|d| &mut d[start..stop]);
        SCRATCH.with_borrow_mut(|buf| {
            buf.resize(end - begin, 0);
            file.read_exact_at(buf, (data_start + begin) as u64)
                .map_err(io)?;
            copy_one(buf, dtype, c, region, out).map_err(|p| match p {
                Problem::NonFinite(k) => tensor(format!(
                    "contains non-finite values (NaN or inf), first at [{}, {}]",
                    k / c.cols,
                    k % c.cols
                )),
                Problem::Overflow(k) => tensor(format!(
                    "overflows {} (non-finite after the cast), first at [{}, {}]",
                    out.torch_name(),
                    k / c.cols,
                    k % c.cols
                )),
            })
        })?;
    }
    Ok(())
}

thread_local! {
    /// The bytes of the tensor being copied; grown to the largest one and kept for the thread's
    /// next read.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Every tensor of the safetensors file at `path` as `(name, dtype name, shape)`, sorted by name
/// (`__metadata__` left out); only the header is read.
pub fn read_header(path: &Path) -> Result<Vec<(String, String, Vec<usize>)>, Error> {
    let shown = path.display().to_string();
    let file = File::open(path).map_err(|source| Error::Io {
        path: shown.clone(),
        source,
    })?;
    let (header, _, data_len) = header_of(&file, &shown)?;
    header
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, value)| {
            let bad = |why: String| Error::Format {
                path: shown.clone(),
                why: format!("tensor '{name}' {why}"),
            };
            let entry = Entry::deserialize(value)
                .map_err(|e| bad(format!("has a malformed entry: {e}")))?;
            entry.span(data_len).map_err(bad)?;
            Ok((name, entry.dtype, entry.shape))
        })
        .collect()
}

/// The parsed header of an open safetensors file, where its data starts, and the data's length.
fn header_of(
    file: &File,
    shown: &str,
) -> Result<(serde_json::Map<String, serde_json::Value>, usize, usize), Error> {
    let io = |source| Error::Io {
        path: shown.to_string(),
        source,
    };
    let format = |why: String| Error::Format {
        path: shown.to_string(),
        why,
    };
    let size = file.metadata().map_err(io)?.len();
    if size < 8 {
        return Err(format(format!(
            "{size} bytes, shorter than the 8-byte header length"
        )));
    }
    let mut len = [0u8; 8];
    file.read_exact_at(&mut len, 0).map_err(io)?;
    let header_len = u64::from_le_bytes(len);
    if header_len > size - 8 {
        return Err(format(format!(
            "header length {header_len} exceeds the file's {size} bytes"
        )));
    }
    let mut text = vec![0u8; header_len as usize];
    file.read_exact_at(&mut text, 8).map_err(io)?;
    let header = serde_json::from_slice(&text).map_err(|e| format(format!("header: {e}")))?;
    Ok((
        header,
        8 + header_len as usize,
        (size - 8 - header_len) as usize,
    ))
}

/// What is wrong with a tensor's values: the row-major index of the first bad one.
enum Problem {
    /// NaN or an infinity in the file.
    NonFinite(usize),
    /// Finite in the file, infinite after the conversion.
    Overflow(usize),
}

/// Checks one tensor's values and, given its destination region, writes them there.
fn copy_one(
    src: &[u8],
    dtype: Dtype,
    c: &TensorCopy,
    dst: Option<&mut [u8]>,
    out: Dtype,
) -> Result<(), Problem> {
    // Same type: check the bits, then a plain or transposed copy of them.
    if dtype == out {
        return match dtype {
            Dtype::F16 | Dtype::BF16 => {
                same_type(&words::<u16>(src), dtype.exponent_bits() as u16, c, dst)
            }
            Dtype::F32 => same_type(&words::<u32>(src), dtype.exponent_bits(), c, dst),
        };
    }
    // Conversion through float32 (exact from float16 / bfloat16), in bulk with `half`'s slice
    // conversions (hardware ones where the CPU has them).
    let wide: Vec<f32> = match dtype {
        Dtype::F16 => words::<u16>(src).reinterpret_cast::<f16>().to_f32_vec(),
        Dtype::BF16 => words::<u16>(src).reinterpret_cast::<bf16>().to_f32_vec(),
        Dtype::F32 => words::<f32>(src).into_owned(),
    };
    if let Some(k) = first(&wide, |x| !x.is_finite()) {
        return Err(Problem::NonFinite(k));
    }
    match out {
        Dtype::F16 | Dtype::BF16 => {
            let mut narrow = vec![0u16; wide.len()];
            if out == Dtype::F16 {
                narrow
                    .reinterpret_cast_mut::<f16>()
                    .convert_from_f32_slice(&wide);
            } else {
                narrow
                    .reinterpret_cast_mut::<bf16>()
                    .convert_from_f32_slice(&wide);
            }
            let mask = out.exponent_bits() as u16;
            if let Some(k) = first(&narrow, |b| b & mask == mask) {
                return Err(Problem::Overflow(k));
            }
            place(&narrow, c, dst);
        }
        Dtype::F32 => place(&wide, c, dst),
    }
    Ok(())
}

/// Same-type copy: refuses NaN / infinities (exponent bits all set), then places the values.
fn same_type<T: Word + PartialEq + std::ops::BitAnd<Output = T>>(
    src: &[T],
    exponent: T,
    c: &TensorCopy,
    dst: Option<&mut [u8]>,
) -> Result<(), Problem> {
    if let Some(k) = first(src, |b| b & exponent == exponent) {
        return Err(Problem::NonFinite(k));
    }
    place(src, c, dst);
    Ok(())
}

/// Writes `values` (`rows x cols`, row-major) into `dst`, transposed when the copy says so.
fn place<T: Word>(values: &[T], c: &TensorCopy, dst: Option<&mut [u8]>) {
    let Some(dst) = dst else { return };
    // SAFETY: `T` is a plain number type for which every bit pattern is valid, and `align_to_mut`
    // only hands out the aligned middle; the pyo3 wrapper refuses unaligned buffers, so there is no
    // prefix (checked below).
    let (prefix, dst, _) = unsafe { dst.align_to_mut::<T>() };
    assert!(
        prefix.is_empty(),
        "destination not aligned to its element type"
    );
    if !c.transpose {
        dst[..values.len()].copy_from_slice(values);
        return;
    }
    // Transposed, in blocks of source rows, so every destination row is written in runs.
    const BLOCK: usize = 64;
    for i0 in (0..c.rows).step_by(BLOCK) {
        let i1 = (i0 + BLOCK).min(c.rows);
        for j in 0..c.cols {
            let row = &mut dst[j * c.rows + i0..j * c.rows + i1];
            for (i, d) in (i0..i1).zip(row.iter_mut()) {
                *d = values[i * c.cols + j];
            }
        }
    }
}

/// Index of the first element where `bad` holds: a branch-free pass per chunk (vectorised), and the
/// exact position only in the chunk that has one.
fn first<T: Copy>(v: &[T], bad: impl Fn(T) -> bool) -> Option<usize> {
    const CHUNK: usize = 4096;
    for (n, chunk) in v.chunks(CHUNK).enumerate() {
        if chunk.iter().fold(false, |any, &x| any | bad(x)) {
            return chunk.iter().position(|&x| bad(x)).map(|k| n * CHUNK + k);
        }
    }
    None
}

/// The plain number types values are moved as.
trait Word: Copy + 'static {
    fn from_le(bytes: &[u8]) -> Self;
}

impl Word for u16 {
    fn from_le(b: &[u8]) -> u16 {
        u16::from_le_bytes([b[0], b[1]])
    }
}

impl Word for u32 {
    fn from_le(b: &[u8]) -> u32 {
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl Word for f32 {
    fn from_le(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

/// `bytes` as little-endian `T`s: borrowed when aligned (the usual case: safetensors aligns its
/// data), else copied.
fn words<T: Word>(bytes: &[u8]) -> std::borrow::Cow<'_, [T]> {
    // SAFETY: plain number types, every bit pattern valid; only the aligned middle is used.
    let (prefix, middle, suffix) = unsafe { bytes.align_to::<T>() };
    if prefix.is_empty() && suffix.is_empty() {
        std::borrow::Cow::Borrowed(middle)
    } else {
        std::borrow::Cow::Owned(
            bytes
                .chunks_exact(std::mem::size_of::<T>())
                .map(T::from_le)
                .collect(),
        )
    }
}

#[cfg(target_endian = "big")]
compile_error!("safetensors data is little-endian; this reader moves it as native words");

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A safetensors file of `(name, dtype, shape, little-endian bytes)`, its header padded so the
    /// data starts 8-aligned (as safetensors writes it).
    fn write_file(tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> tempfile::NamedTempFile {
        write_file_padded(tensors, true)
    }

    fn write_file_padded(
        tensors: &[(&str, &str, Vec<usize>, Vec<u8>)],
        pad: bool,
    ) -> tempfile::NamedTempFile {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            let begin = data.len();
            data.extend_from_slice(bytes);
            header.insert(
                (*name).into(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, data.len()]}),
            );
        }
        header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
        let mut text = serde_json::to_vec(&header).unwrap();
        if pad {
            text.resize(text.len().next_multiple_of(8), b' ');
        } else {
            text.resize(text.len() | 1, b' '); // data at an odd address: no tensor is aligned
        }
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&(text.len() as u64).to_le_bytes()).unwrap();
        f.write_all(&text).unwrap();
        f.write_all(&data).unwrap();
        f
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn f16_bytes(v: &[f32]) -> Vec<u8> {
        v.iter()
            .flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes())
            .collect()
    }

    fn as_f16(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(2)
            .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect()
    }

    fn copy(
        name: &str,
        rows: usize,
        cols: usize,
        dst_offset: usize,
        transpose: bool,
    ) -> TensorCopy {
        TensorCopy {
            name: name.into(),
            rows,
            cols,
            dst_offset,
            transpose,
        }
    }

    #[test]
    fn copies_transposes_and_converts_at_offsets() {
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]; // [2, 3]
        let b = [0.5, -1.5, 2.5, -3.5, 4.5, 65504.0]; // [3, 2], in f32 on disk
        let f = write_file(&[
            ("a", "F16", vec![2, 3], f16_bytes(&a)),
            ("b", "F32", vec![3, 2], f32_bytes(&b)),
        ]);
        let mut dst = vec![0u8; 2 * 16];
        let copies = [copy("a", 2, 3, 1, false), copy("b", 3, 2, 8, true)];
        read_into(f.path(), &copies, Some(&mut dst), Dtype::F16).unwrap();
        let got = as_f16(&dst);
        assert_eq!(&got[..8], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0]);
        // b transposed: [2, 3] = [[0.5, 2.5, 4.5], [-1.5, -3.5, 65504]]
        assert_eq!(&got[8..14], &[0.5, 2.5, 4.5, -1.5, -3.5, 65504.0]);
        assert_eq!(&got[14..], &[0.0, 0.0], "nothing written past the copies");
    }

    #[test]
    fn unaligned_data_reads_the_same() {
        let a: Vec<f32> = (0..12).map(|k| k as f32 * 0.75 - 4.0).collect();
        let tensors = [
            ("a", "F16", vec![3, 4], f16_bytes(&a)),
            ("b", "F32", vec![4, 3], f32_bytes(&a)),
        ];
        let copies = [copy("a", 3, 4, 0, true), copy("b", 4, 3, 12, false)];
        let mut got = Vec::new();
        for pad in [true, false] {
            let f = write_file_padded(&tensors, pad);
            let mut dst = vec![0u8; 2 * 24];
            read_into(f.path(), &copies, Some(&mut dst), Dtype::F16).unwrap();
            got.push(as_f16(&dst));
        }
        assert_eq!(got[0], got[1]);
        assert_eq!(&got[0][12..], &a[..]);
        assert_eq!(&got[0][..4], &[a[0], a[4], a[8], a[1]]);
    }

    #[test]
    fn conversion_rounds_to_nearest_even() {
        // 1 + 2^-11 is halfway between two f16 values: ties go to the even one (1.0);
        // 1 + 3 * 2^-11 goes up to 1 + 2^-9.
        let v = [1.0 + 2f32.powi(-11), 1.0 + 3.0 * 2f32.powi(-11)];
        let f = write_file(&[("v", "F32", vec![1, 2], f32_bytes(&v))]);
        let mut dst = vec![0u8; 4];
        read_into(
            f.path(),
            &[copy("v", 1, 2, 0, false)],
            Some(&mut dst),
            Dtype::F16,
        )
        .unwrap();
        assert_eq!(as_f16(&dst), vec![1.0, 1.0 + 2f32.powi(-9)]);
        let mut dst = vec![0u8; 4];
        let bf = write_file(&[(
            "v",
            "BF16",
            vec![1, 2],
            [bf16::from_f32(3.0), bf16::from_f32(-0.25)]
                .iter()
                .flat_map(|x| x.to_bits().to_le_bytes())
                .collect(),
        )]);
        read_into(
            bf.path(),
            &[copy("v", 1, 2, 0, false)],
            Some(&mut dst),
            Dtype::F16,
        )
        .unwrap();
        assert_eq!(as_f16(&dst), vec![3.0, -0.25]);
    }

    #[test]
    fn non_finite_values_and_overflow_are_named() {
        let f = write_file(&[
            ("ok", "F16", vec![1, 2], f16_bytes(&[1.0, 2.0])),
            (
                "nan",
                "F16",
                vec![2, 2],
                f16_bytes(&[1.0, 2.0, 3.0, f32::NAN]),
            ),
            (
                "inf",
                "F32",
                vec![1, 3],
                f32_bytes(&[0.0, f32::INFINITY, 1.0]),
            ),
            ("big", "F32", vec![1, 2], f32_bytes(&[1.0, 1e6])),
        ]);
        let err = |c: TensorCopy, dst: Option<&mut [u8]>| {
            read_into(f.path(), &[c], dst, Dtype::F16)
                .unwrap_err()
                .to_string()
        };
        let mut dst = vec![0u8; 16];
        assert_eq!(
            err(copy("nan", 2, 2, 0, false), Some(&mut dst)),
            "tensor 'nan' contains non-finite values (NaN or inf), first at [1, 1]"
        );
        assert!(err(copy("inf", 1, 3, 0, false), None)
            .starts_with("tensor 'inf' contains non-finite values"));
        // 1e6 is finite in f32 but not in f16: caught with and without a destination.
        let overflow =
            "tensor 'big' overflows torch.float16 (non-finite after the cast), first at [0, 1]";
        assert_eq!(err(copy("big", 1, 2, 0, false), Some(&mut dst)), overflow);
        assert_eq!(err(copy("big", 1, 2, 0, false), None), overflow);
        read_into(f.path(), &[copy("big", 1, 2, 0, false)], None, Dtype::F32).unwrap();
        read_into(f.path(), &[copy("ok", 1, 2, 0, false)], None, Dtype::F16).unwrap();
    }

    #[test]
    fn a_changed_file_is_refused_by_name() {
        let f = write_file(&[
            ("a", "F16", vec![2, 3], f16_bytes(&[0.0; 6])),
            ("i", "I8", vec![1, 1], vec![7]),
        ]);
        let err = |c: TensorCopy| {
            read_into(f.path(), &[c], None, Dtype::F16)
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err(copy("b", 2, 3, 0, false)),
            "tensor 'b' is not in the file"
        );
        assert_eq!(
            err(copy("a", 3, 2, 0, false)),
            "tensor 'a' has shape [2, 3], expected [3, 2]"
        );
        assert_eq!(
            err(copy("i", 1, 1, 0, false)),
            "tensor 'i' has dtype I8; supported: F16, BF16, F32"
        );
    }

    #[test]
    fn the_header_lists_every_tensor_without_reading_data() {
        let f = write_file(&[
            ("z.lora_B", "BF16", vec![8, 2], vec![0; 32]),
            ("a.lora_A", "F32", vec![2, 8], vec![0; 64]),
            ("i", "I8", vec![1, 1], vec![7]),
        ]);
        let h = read_header(f.path()).unwrap();
        assert_eq!(
            h,
            [
                ("a.lora_A".to_string(), "F32".to_string(), vec![2, 8]),
                ("i".to_string(), "I8".to_string(), vec![1, 1]),
                ("z.lora_B".to_string(), "BF16".to_string(), vec![8, 2]),
            ]
        );
        let mut truncated = tempfile::NamedTempFile::new().unwrap();
        truncated.write_all(&100u64.to_le_bytes()).unwrap();
        truncated.write_all(b"{}").unwrap();
        let e = read_header(truncated.path()).unwrap_err().to_string();
        assert!(
            e.contains("header length 100 exceeds the file's 10 bytes"),
            "{e}"
        );
        let cut = write_file(&[("a", "F16", vec![2, 3], f16_bytes(&[0.0; 6]))]);
        let len = std::fs::metadata(cut.path()).unwrap().len();
        cut.as_file().set_len(len - 2).unwrap();
        let e = read_header(cut.path()).unwrap_err().to_string();
        assert!(e.contains("is not a valid safetensors file: tensor 'a' has data offsets [0, 12] outside the file's 10 data bytes"), "{e}");
        let odd = write_file(&[("a", "F32", vec![2, 3], vec![0; 12])]);
        let e = read_header(odd.path()).unwrap_err().to_string();
        assert!(
            e.contains("tensor 'a' has 12 data bytes for shape [2, 3] of F32"),
            "{e}"
        );
        let e = read_header(Path::new("/nonexistent/x.safetensors")).unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e}");
    }

    #[test]
    fn copies_outside_the_destination_write_nothing() {
        let f = write_file(&[("a", "F16", vec![2, 2], f16_bytes(&[1.0, 2.0, 3.0, 4.0]))]);
        let mut dst = vec![0u8; 2 * 6];
        let copies = [copy("a", 2, 2, 0, false), copy("a", 2, 2, 3, false)];
        let e = read_into(f.path(), &copies, Some(&mut dst), Dtype::F16).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Destination {
                    offset: 3,
                    elems: 4,
                    len: 6,
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            dst.iter().all(|&b| b == 0),
            "checked before the first write"
        );
    }

    #[test]
    fn malformed_files_are_refused() {
        let mut short = tempfile::NamedTempFile::new().unwrap();
        short.write_all(&[1, 2, 3]).unwrap();
        let e = read_into(short.path(), &[], None, Dtype::F16).unwrap_err();
        assert!(
            e.to_string()
                .contains("shorter than the 8-byte header length"),
            "{e}"
        );
        let mut long = tempfile::NamedTempFile::new().unwrap();
        long.write_all(&1000u64.to_le_bytes()).unwrap();
        long.write_all(b"{}").unwrap();
        let e = read_into(long.path(), &[], None, Dtype::F16).unwrap_err();
        assert!(e.to_string().contains("header length 1000 exceeds"), "{e}");
        // Data offsets past the end of the data.
        let f = write_file(&[("a", "F16", vec![2, 2], f16_bytes(&[1.0; 4]))]);
        let mut bytes = std::fs::read(f.path()).unwrap();
        bytes.truncate(bytes.len() - 2);
        let cut = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(cut.path(), &bytes).unwrap();
        let e = read_into(cut.path(), &[copy("a", 2, 2, 0, false)], None, Dtype::F16).unwrap_err();
        assert!(
            e.to_string().contains(
                "tensor 'a' has data offsets [0, 8] outside the file's 6 data bytes (truncated?)"
            ),
            "{e}"
        );
        let h = read_header(cut.path()).unwrap_err();
        assert!(
            h.to_string().ends_with(
                "tensor 'a' has data offsets [0, 8] outside the file's 6 data bytes (truncated?)"
            ),
            "one wording for both readers: {h}"
        );
        let e = read_into(
            Path::new("/nonexistent/x.safetensors"),
            &[],
            None,
            Dtype::F16,
        )
        .unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e}");
    }
}
