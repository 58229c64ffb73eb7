//! The header: magic, version, metadata and the tensor table.
//!
//! Everything is read from one byte slice with a cursor that checks each
//! read against the slice's end, and every count is checked against the
//! bytes left before anything is allocated for it, so a hostile header
//! costs at most its own size in memory (`fuzz/fuzz_targets/gguf_header.rs`).

use std::collections::HashMap;

use crate::blocks::GgmlType;
use crate::error::{GgufError, Result};
use crate::value::Value;

/// Where the tensor data starts unless `general.alignment` says otherwise.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Arrays of arrays deeper than this are refused.
const MAX_NESTING: usize = 4;

/// One tensor of the table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` varies fastest (a matrix's input features).
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    /// Byte range in the file (absolute, checked to lie inside it).
    pub start: usize,
    pub end: usize,
}

impl TensorInfo {
    /// Elements in the tensor.
    pub fn len(&self) -> usize {
        self.dims.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape in row-major order, slowest first (`[out, in]` for a
    /// matrix, as PyTorch would print it).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

/// A parsed header.
#[derive(Debug, Clone)]
pub struct Header {
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    /// In file order.
    pub tensors: Vec<TensorInfo>,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> u64 {
        (self.bytes.len() - self.at) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(GgufError::Truncated {
                what: what(),
                needed: self.at as u64 + n,
                len: self.bytes.len() as u64,
            });
        }
        let n = n as usize;
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Checks that `count` entries of at least `min_size` bytes each can
    /// fit in what is left.
    fn fits(&self, count: u64, min_size: u64, what: &dyn Fn() -> String) -> Result<usize> {
        if count.saturating_mul(min_size) > self.left() {
            return Err(GgufError::Count {
                what: what(),
                count,
                left: self.left(),
            });
        }
        Ok(count as usize)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::Utf8 { what: what() })
    }

    fn value(&mut self, code: u32, key: &str, depth: usize) -> Result<Value> {
        let what = || format!("metadata `{key}`");
        Ok(match code {
            0 => Value::U8(self.array::<1>(&what)?[0]),
            1 => Value::I8(self.array::<1>(&what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => Value::U32(self.u32(&what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => match self.array::<1>(&what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    return Err(GgufError::Metadata {
                        key: key.to_owned(),
                        msg: format!("bool byte {b} is neither 0 nor 1"),
                    })
                }
            },
            8 => Value::String(self.string(&what)?),
            9 => {
                if depth >= MAX_NESTING {
                    return Err(GgufError::Nesting {
                        key: key.to_owned(),
                        max: MAX_NESTING,
                    });
                }
                let elem = self.u32(&what)?;
                let count = self.u64(&what)?;
                let n = self.fits(count, min_value_size(elem), &what)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(&what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            _ => {
                return Err(GgufError::ValueType {
                    key: key.to_owned(),
                    code,
                })
            }
        })
    }
}

/// The fewest bytes a value of type `code` takes (so a count can be
/// checked before allocating); 1 for codes that will fail anyway.
fn min_value_size(code: u32) -> u64 {
    match code {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        9 => 12,
        10..=12 => 8,
        _ => 1,
    }
}

/// Parses the header of the GGUF file held in `bytes`, checking that each
/// tensor's data lies inside it.
pub fn parse(bytes: &[u8]) -> Result<Header> {
    let mut c = Cursor { bytes, at: 0 };
    let magic: [u8; 4] = c.array(&|| "the magic".into())?;
    if &magic != b"GGUF" {
        return Err(GgufError::BadMagic(magic));
    }
    let version = c.u32(&|| "the version".into())?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::Version(version));
    }
    let n_tensors = c.u64(&|| "the tensor count".into())?;
    let n_kv = c.u64(&|| "the metadata count".into())?;
    // A key and type code take at least 12 bytes, a value one more.
    let n_kv = c.fits(n_kv, 13, &|| "metadata".into())?;
    let mut metadata = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = c.string(&|| format!("metadata key {i}"))?;
        let code = c.u32(&|| format!("metadata `{key}`'s type"))?;
        let value = c.value(code, &key, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(GgufError::DuplicateKey(key));
        }
    }
    // Name length, dims count, one dim, type and offset: 32 bytes at least.
    let n_tensors = c.fits(n_tensors, 32, &|| "the tensor table".into())?;
    let mut raw = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        raw.push(raw_tensor(&mut c, i)?);
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
            _ => {
                return Err(GgufError::Metadata {
                    key: "general.alignment".into(),
                    msg: format!("{v:?} is not a power of two up to 1 MiB"),
                })
            }
        },
    };
    let data_start = (c.at as u64).div_ceil(alignment) * alignment;
    let tensors = place(raw, data_start, alignment, bytes.len() as u64)?;
    Ok(Header {
        version,
        metadata,
        tensors,
    })
}

struct RawTensor {
    name: String,
    dims: Vec<usize>,
    ty: GgmlType,
    offset: u64,
}

fn raw_tensor(c: &mut Cursor<'_>, i: usize) -> Result<RawTensor> {
    let name = c.string(&|| format!("tensor {i}'s name"))?;
    let what = || format!("tensor `{name}`");
    let n_dims = c.u32(&what)? as usize;
    let bad = |msg: String| GgufError::Tensor {
        name: name.clone(),
        msg,
    };
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(bad(format!(
            "{n_dims} dimensions (1 to {MAX_DIMS} allowed)"
        )));
    }
    let mut dims = Vec::with_capacity(n_dims);
    for _ in 0..n_dims {
        dims.push(c.u64(&what)?);
    }
    let code = c.u32(&what)?;
    let ty = GgmlType::from_code(code).map_err(|known| match known {
        Some(n) => bad(format!(
            "tensor type {n} ({code}) is not supported (supported: {})",
            supported_types()
        )),
        None => GgufError::UnknownType {
            name: name.clone(),
            code,
        },
    })?;
    let offset = c.u64(&what)?;
    let dims = dims
        .into_iter()
        .map(|d| usize::try_from(d).map_err(|_| bad(format!("dimension {d} is too large"))))
        .collect::<Result<Vec<_>>>()?;
    if dims.contains(&0) {
        return Err(bad(format!("a zero dimension in {dims:?}")));
    }
    if !dims[0].is_multiple_of(ty.block_len()) {
        return Err(bad(format!(
            "rows of {} are not whole {} blocks of {}",
            dims[0],
            ty.name(),
            ty.block_len()
        )));
    }
    Ok(RawTensor {
        name,
        dims,
        ty,
        offset,
    })
}

fn supported_types() -> String {
    GgmlType::ALL.map(GgmlType::name).join(", ")
}

/// Turns offsets into checked absolute byte ranges.
fn place(
    raw: Vec<RawTensor>,
    data_start: u64,
    alignment: u64,
    file_len: u64,
) -> Result<Vec<TensorInfo>> {
    let mut seen = std::collections::HashSet::with_capacity(raw.len());
    raw.into_iter()
        .map(|t| {
            let bad = |msg: String| GgufError::Tensor {
                name: t.name.clone(),
                msg,
            };
            if !seen.insert(t.name.clone()) {
                return Err(GgufError::DuplicateTensor(t.name.clone()));
            }
            if !t.offset.is_multiple_of(alignment) {
                return Err(bad(format!(
                    "data offset {} is not a multiple of the alignment {alignment}",
                    t.offset
                )));
            }
            let elems = t
                .dims
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
                .ok_or_else(|| bad(format!("{:?} elements overflow", t.dims)))?;
            let size = (elems / t.ty.block_len() as u64)
                .checked_mul(t.ty.block_bytes() as u64)
                .ok_or_else(|| bad("its size overflows".into()))?;
            let start = data_start
                .checked_add(t.offset)
                .ok_or_else(|| bad("its offset overflows".into()))?;
            let end = start
                .checked_add(size)
                .filter(|&e| e <= file_len)
                .ok_or_else(|| {
                    bad(format!(
                        "its {size} bytes at {start} run past the end of the file ({file_len} bytes)"
                    ))
                })?;
            Ok(TensorInfo {
                name: t.name,
                dims: t.dims,
                ty: t.ty,
                start: start as usize,
                end: end as usize,
            })
        })
        .collect()
}
