//! Checkpoint tensors: safetensors files, or a GGUF file ([`gguf`]) under
//! the Hugging Face names, memory-mapped or read once onto huge pages
//! ([`Residency`]).
//!
//! Matrices stay in the file's dtype (f32, bf16 or f16) and are read in
//! place: the kernels convert to f32 in registers, so a bf16
//! model costs two bytes per weight of memory and of bandwidth. Only small
//! vectors (norm weights, biases) are copied out and widened to f32. A tensor
//! whose offset in the file is not aligned for its element type is copied
//! once into an owned buffer rather than read misaligned.

use std::collections::HashMap;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::config::read_json;
use crate::error::{EngineError, Result};

mod gguf;
mod resident;

use resident::Backing;
pub(crate) use resident::HugePageBytes;
pub use resident::Residency;

/// Element types a weight matrix may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    Bf16,
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 | Self::F16 => 2,
        }
    }
}

/// A read-only slice that is either borrowed from a memory map or owned.
pub struct Buf<T: 'static> {
    inner: BufInner<T>,
}

enum BufInner<T: 'static> {
    Mapped {
        // Keeps the file's bytes alive for as long as `ptr` is used.
        _map: Arc<Backing>,
        ptr: *const T,
        len: usize,
    },
    Owned(Vec<T>),
}

// SAFETY: a `Buf` is immutable after construction; the mapped variant points
// into a file's bytes (a read-only map or an owned copy) kept alive by the
// `Arc`, which is itself Send + Sync.
unsafe impl<T: Sync> Send for Buf<T> {}
// SAFETY: as above, shared references only ever read.
unsafe impl<T: Sync> Sync for Buf<T> {}

impl<T> std::fmt::Debug for Buf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.inner {
            BufInner::Mapped { .. } => "mapped",
            BufInner::Owned(_) => "owned",
        };
        write!(f, "Buf({kind}, {} elements)", self.len())
    }
}

impl<T> Deref for Buf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.inner {
            // SAFETY: `ptr` was checked to be aligned for `T`, points to `len`
            // initialised elements inside the mapping, and the mapping lives
            // as long as `self` through `_map`.
            BufInner::Mapped { ptr, len, .. } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
            BufInner::Owned(v) => v,
        }
    }
}

impl<T> From<Vec<T>> for Buf<T> {
    fn from(v: Vec<T>) -> Self {
        Self {
            inner: BufInner::Owned(v),
        }
    }
}

impl<T> Buf<T> {
    /// Whether the data is read in place from the checkpoint file's bytes
    /// (mapped or resident), not copied out per tensor.
    pub fn is_mapped(&self) -> bool {
        matches!(self.inner, BufInner::Mapped { .. })
    }

    /// Drops the whole pages of these elements from the process's resident
    /// set where they are a mapped file's ([`Backing::release_pages`]): for
    /// a matrix copied elsewhere (packed), whose pages the copy read.
    fn release_pages(&self) {
        if let BufInner::Mapped { _map, ptr, len } = &self.inner {
            _map.release_pages(ptr.cast(), len * std::mem::size_of::<T>());
        }
    }
}

impl<T: bytemuck::Pod> Buf<T> {
    fn from_map(map: &Arc<Backing>, bytes: &[u8]) -> Self {
        let size = std::mem::size_of::<T>();
        let len = bytes.len() / size;
        if (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
            Self {
                inner: BufInner::Mapped {
                    _map: Arc::clone(map),
                    ptr: bytes.as_ptr().cast(),
                    len,
                },
            }
        } else {
            let v: Vec<T> = bytes
                .chunks_exact(size)
                .map(bytemuck::pod_read_unaligned::<T>)
                .collect();
            Self::from(v)
        }
    }
}

/// The elements of a weight matrix in their stored type.
#[derive(Debug)]
pub enum WeightData {
    F32(Buf<f32>),
    Bf16(Buf<bf16>),
    F16(Buf<f16>),
}

impl WeightData {
    /// The elements' bytes (a copy).
    fn into_bytes(self) -> Vec<u8> {
        match self {
            Self::F32(b) => bytemuck::cast_slice(&b).to_vec(),
            Self::Bf16(b) => bytemuck::cast_slice(&b).to_vec(),
            Self::F16(b) => bytemuck::cast_slice(&b).to_vec(),
        }
    }
}

/// A row-major `[rows, cols]` weight matrix (Hugging Face `[out, in]`).
#[derive(Debug)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
}

impl Matrix {
    /// The stored element type.
    pub fn dtype(&self) -> DType {
        match self.data {
            WeightData::F32(_) => DType::F32,
            WeightData::Bf16(_) => DType::Bf16,
            WeightData::F16(_) => DType::F16,
        }
    }

    /// Bytes the matrix occupies.
    pub fn bytes(&self) -> usize {
        self.rows * self.cols * self.dtype().size()
    }

    /// Whether the matrix is read in place from the checkpoint file.
    pub fn is_mapped(&self) -> bool {
        match &self.data {
            WeightData::F32(b) => b.is_mapped(),
            WeightData::Bf16(b) => b.is_mapped(),
            WeightData::F16(b) => b.is_mapped(),
        }
    }

    /// Drops the matrix's pages from the resident set if it is read from a
    /// mapped file (a no-op otherwise): called when a copy replaces it.
    pub fn release_pages(&self) {
        match &self.data {
            WeightData::F32(b) => b.release_pages(),
            WeightData::Bf16(b) => b.release_pages(),
            WeightData::F16(b) => b.release_pages(),
        }
    }

    /// Copies row `r` into `out`, widened to f32.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let range = r * self.cols..(r + 1) * self.cols;
        match &self.data {
            WeightData::F32(b) => out.copy_from_slice(&b[range]),
            WeightData::Bf16(b) => {
                for (o, x) in out.iter_mut().zip(&b[range]) {
                    *o = x.to_f32();
                }
            }
            WeightData::F16(b) => {
                for (o, x) in out.iter_mut().zip(&b[range]) {
                    *o = x.to_f32();
                }
            }
        }
    }
}

/// Bytes per element of a float weight dtype.
fn dtype_size(name: &str, dtype: Dtype) -> Result<usize> {
    match dtype {
        Dtype::F32 => Ok(4),
        Dtype::BF16 | Dtype::F16 => Ok(2),
        other => Err(EngineError::Unsupported(format!(
            "tensor `{name}` has dtype {other:?} (supported: F32, BF16, F16)"
        ))),
    }
}

struct Entry {
    file: usize,
    /// The stored dtype; for a [`Stored::Gguf`] tensor, the one it is
    /// decoded to.
    dtype: Dtype,
    stored: Stored,
    shape: Vec<usize>,
    /// Byte range inside the mapped file.
    start: usize,
    end: usize,
}

/// How an entry's bytes are laid out.
#[derive(Debug, Clone)]
enum Stored {
    /// Row-major in `dtype`, as safetensors stores it: read in place.
    Plain,
    /// A GGUF tensor that is quantized, or whose rows are permuted:
    /// decoded (only the rows asked for) when read.
    Gguf {
        ty: tandem_gguf::GgmlType,
        /// The stored row of each Hugging Face row, when they differ.
        rows: Option<Arc<[usize]>>,
        /// Subtracted from every weight (Gemma's norms, stored `1 + w`).
        shift: f32,
    },
}

/// All tensors of a checkpoint, by name, over one or more files.
pub struct WeightStore {
    maps: Vec<Arc<Backing>>,
    entries: HashMap<String, Entry>,
}

impl std::fmt::Debug for WeightStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightStore")
            .field("files", &self.maps.len())
            .field("tensors", &self.entries.len())
            .finish()
    }
}

/// A checkpoint's safetensors files: `model.safetensors`, or every shard
/// named in `model.safetensors.index.json`.
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    if single.is_file() {
        return Ok(vec![single]);
    }
    if !index.is_file() {
        return Err(EngineError::MissingFile {
            path: single,
            what: "no model.safetensors or model.safetensors.index.json in the checkpoint",
        });
    }
    let value = read_json(&index)?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| {
            EngineError::InvalidCheckpoint(format!("{} has no weight_map", index.display()))
        })?;
    let mut names: Vec<&str> = map.values().filter_map(|v| v.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}

impl WeightStore {
    /// Opens `model.safetensors`, or every shard listed in
    /// `model.safetensors.index.json`.
    ///
    /// A path to a `.gguf` file opens that file instead ([`gguf`]).
    pub fn open(dir: &Path) -> Result<Self> {
        Self::open_with(dir, Residency::Mapped)
    }

    /// [`Self::open`], holding safetensors files as `residency` asks (a
    /// GGUF file is always mapped).
    pub fn open_with(dir: &Path, residency: Residency) -> Result<Self> {
        if crate::gguf::is_gguf(dir) {
            return Self::open_gguf(dir);
        }
        let files = safetensors_files(dir)?;
        let mut maps = Vec::with_capacity(files.len());
        let mut entries = HashMap::new();
        for path in &files {
            let map = Arc::new(Backing::open(path, residency)?);
            let tensors = SafeTensors::deserialize(&map)
                .map_err(|e| EngineError::InvalidCheckpoint(format!("{}: {e}", path.display())))?;
            let base = map.as_ptr() as usize;
            for (name, view) in tensors.tensors() {
                let start = view.data().as_ptr() as usize - base;
                entries.insert(
                    name,
                    Entry {
                        file: maps.len(),
                        dtype: view.dtype(),
                        stored: Stored::Plain,
                        shape: view.shape().to_vec(),
                        start,
                        end: start + view.data().len(),
                    },
                );
            }
            maps.push(map);
        }
        Ok(Self { maps, entries })
    }

    /// Whether a tensor of this name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    fn entry(&self, name: &str, shape: &[usize]) -> Result<&Entry> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| EngineError::InvalidCheckpoint(format!("tensor `{name}` is missing")))?;
        if e.shape != shape {
            return Err(EngineError::InvalidCheckpoint(format!(
                "tensor `{name}` has shape {:?}, the config implies {shape:?}",
                e.shape
            )));
        }
        Ok(e)
    }

    /// An entry whose bytes can be read as they lie (everything a
    /// safetensors file holds; a GGUF tensor only when it is a float
    /// type in Hugging Face row order).
    fn plain_entry(&self, name: &str, shape: &[usize]) -> Result<&Entry> {
        let e = self.entry(name, shape)?;
        match e.stored {
            Stored::Plain => Ok(e),
            Stored::Gguf { ty, .. } => Err(EngineError::Unsupported(format!(
                "tensor `{name}`: a GGUF {} tensor cannot be read this way (a stacked or packed layout)",
                ty.name()
            ))),
        }
    }

    fn data(&self, name: &str, e: &Entry) -> Result<WeightData> {
        if let Stored::Gguf { .. } = e.stored {
            // A vector is one row.
            let rows = if e.shape.len() == 1 { 1 } else { e.shape[0] };
            return self.decode_rows(name, e, 0..rows);
        }
        let map = &self.maps[e.file];
        let bytes = &map[e.start..e.end];
        Ok(match e.dtype {
            Dtype::F32 => WeightData::F32(Buf::from_map(map, bytes)),
            Dtype::BF16 => WeightData::Bf16(Buf::from_map(map, bytes)),
            Dtype::F16 => WeightData::F16(Buf::from_map(map, bytes)),
            other => {
                return Err(EngineError::Unsupported(format!(
                    "tensor `{name}` has dtype {other:?} (supported: F32, BF16, F16)"
                )))
            }
        })
    }

    /// A `[rows, cols]` matrix, mapped in place when aligned.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let e = self.entry(name, &[rows, cols])?;
        Ok(Matrix {
            rows,
            cols,
            data: self.data(name, e)?,
        })
    }

    /// Rows `rows` of a `[total_rows, cols]` matrix: a tensor-parallel
    /// shard of a column-parallel layer (its output features), mapped in
    /// place like [`matrix`](Self::matrix) — rows are contiguous.
    pub fn matrix_rows(
        &self,
        name: &str,
        total_rows: usize,
        cols: usize,
        rows: std::ops::Range<usize>,
    ) -> Result<Matrix> {
        let e = self.entry(name, &[total_rows, cols])?;
        if rows.start > rows.end || rows.end > total_rows {
            return Err(EngineError::InvalidCheckpoint(format!(
                "rows {rows:?} of tensor `{name}` are outside its {total_rows} rows"
            )));
        }
        if let Stored::Gguf { .. } = e.stored {
            return Ok(Matrix {
                rows: rows.len(),
                cols,
                data: self.decode_rows(name, e, rows)?,
            });
        }
        let size = dtype_size(name, e.dtype)?;
        let part = Entry {
            file: e.file,
            dtype: e.dtype,
            stored: Stored::Plain,
            shape: vec![rows.len(), cols],
            start: e.start + rows.start * cols * size,
            end: e.start + rows.end * cols * size,
        };
        Ok(Matrix {
            rows: rows.len(),
            cols,
            data: self.data(name, &part)?,
        })
    }

    /// Columns `cols` of a `[rows, total_cols]` matrix: a tensor-parallel
    /// shard of a row-parallel layer (its input features). Columns are
    /// strided in the file, so the shard (and only the shard) is copied out,
    /// in the stored dtype.
    pub fn matrix_cols(
        &self,
        name: &str,
        rows: usize,
        total_cols: usize,
        cols: std::ops::Range<usize>,
    ) -> Result<Matrix> {
        let e = self.entry(name, &[rows, total_cols])?;
        if cols.start > cols.end || cols.end > total_cols {
            return Err(EngineError::InvalidCheckpoint(format!(
                "columns {cols:?} of tensor `{name}` are outside its {total_cols} columns"
            )));
        }
        let size = dtype_size(name, e.dtype)?;
        let decoded;
        let bytes = match e.stored {
            Stored::Plain => &self.maps[e.file][e.start..e.end],
            Stored::Gguf { .. } => {
                decoded = self.decode_rows(name, e, 0..rows)?.into_bytes();
                &decoded[..]
            }
        };
        let mut shard = Vec::with_capacity(rows * cols.len() * size);
        for r in 0..rows {
            let row = r * total_cols * size;
            shard.extend_from_slice(&bytes[row + cols.start * size..row + cols.end * size]);
        }
        let data = owned_data(e.dtype, &shard);
        Ok(Matrix {
            rows,
            cols: cols.len(),
            data,
        })
    }

    /// One expert's projection out of a stacked, input-major `[experts,
    /// inputs, outputs]` tensor (gpt-oss), as an `[out, in]` matrix: row `r`
    /// is stored column `outputs[r]` of `expert`'s slice, over the stored
    /// rows `inputs`. Copied out (transposed), in the stored dtype.
    pub fn stacked_transposed(
        &self,
        name: &str,
        shape: [usize; 3],
        expert: usize,
        outputs: &[usize],
        inputs: std::ops::Range<usize>,
    ) -> Result<Matrix> {
        let e = self.plain_entry(name, &shape)?;
        let [experts, rows, cols] = shape;
        let outside = expert >= experts
            || inputs.end > rows
            || inputs.start > inputs.end
            || outputs.iter().any(|&c| c >= cols);
        if outside {
            return Err(EngineError::InvalidCheckpoint(format!(
                "expert {expert}'s part of tensor `{name}` is outside its shape {shape:?}"
            )));
        }
        let size = dtype_size(name, e.dtype)?;
        let bytes = &self.maps[e.file][e.start..e.end];
        let base = expert * rows * cols;
        let mut out = Vec::with_capacity(outputs.len() * inputs.len() * size);
        for &c in outputs {
            for r in inputs.clone() {
                let at = (base + r * cols + c) * size;
                out.extend_from_slice(&bytes[at..at + size]);
            }
        }
        Ok(Matrix {
            rows: outputs.len(),
            cols: inputs.len(),
            data: owned_data(e.dtype, &out),
        })
    }

    /// Rows `rows` (columns `inputs`) of one expert of an MXFP4 tensor
    /// (gpt-oss's published experts), dequantized to bf16 (exact: an FP4
    /// value times a power of two has at most two mantissa bits). The
    /// tensor `{prefix}_blocks` is `[experts, out, in / 32, 16]` bytes, two
    /// E2M1 codes each, the lower nibble the even element;
    /// `{prefix}_scales` is `[experts, out, in / 32]`, a power-of-two
    /// exponent biased by 127 per 32 inputs.
    pub fn mxfp4_rows(
        &self,
        prefix: &str,
        shape: [usize; 3],
        expert: usize,
        rows: &[usize],
        inputs: std::ops::Range<usize>,
    ) -> Result<Matrix> {
        const FP4: [f32; 16] = [
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        ];
        let [experts, out, inp] = shape;
        let (blocks_name, scales_name) = (format!("{prefix}_blocks"), format!("{prefix}_scales"));
        if !inp.is_multiple_of(32) {
            return Err(EngineError::InvalidCheckpoint(format!(
                "`{blocks_name}`: {inp} inputs are not whole blocks of 32"
            )));
        }
        let groups = inp / 32;
        let blocks = self.plain_entry(&blocks_name, &[experts, out, groups, 16])?;
        let scales = self.plain_entry(&scales_name, &[experts, out, groups])?;
        for (name, e) in [(&blocks_name, blocks), (&scales_name, scales)] {
            if e.dtype != Dtype::U8 {
                return Err(EngineError::InvalidCheckpoint(format!(
                    "tensor `{name}` has dtype {:?}, expected U8",
                    e.dtype
                )));
            }
        }
        let outside = expert >= experts
            || inputs.start > inputs.end
            || inputs.end > inp
            || rows.iter().any(|&r| r >= out);
        if outside {
            return Err(EngineError::InvalidCheckpoint(format!(
                "expert {expert}'s part of `{blocks_name}` is outside its shape"
            )));
        }
        let b = &self.maps[blocks.file][blocks.start..blocks.end];
        let s = &self.maps[scales.file][scales.start..scales.end];
        let mut data = Vec::with_capacity(rows.len() * inputs.len());
        let mut row = vec![0.0f32; inp];
        for &r in rows {
            let at = expert * out + r;
            for (g, chunk) in row.chunks_exact_mut(32).enumerate() {
                let scale = 2f32.powi(i32::from(s[at * groups + g]) - 127);
                let bytes = &b[(at * groups + g) * 16..(at * groups + g + 1) * 16];
                for (pair, &byte) in chunk.chunks_exact_mut(2).zip(bytes) {
                    pair[0] = FP4[usize::from(byte & 0x0f)] * scale;
                    pair[1] = FP4[usize::from(byte >> 4)] * scale;
                }
            }
            data.extend(row[inputs.clone()].iter().map(|&v| half::bf16::from_f32(v)));
        }
        Ok(Matrix {
            rows: rows.len(),
            cols: inputs.len(),
            data: WeightData::Bf16(Buf::from(data)),
        })
    }

    /// Elements `range` of a 1-D tensor widened to f32 (a shard of a bias).
    pub fn vector_part(
        &self,
        name: &str,
        len: usize,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<f32>> {
        let full = self.vector(name, len)?;
        full.get(range.clone()).map(<[f32]>::to_vec).ok_or_else(|| {
            EngineError::InvalidCheckpoint(format!(
                "elements {range:?} of tensor `{name}` are outside its {len}"
            ))
        })
    }

    /// An int32 tensor of the given shape, copied out (the packed codes and
    /// zero points of AWQ/GPTQ checkpoints).
    pub fn tensor_i32(&self, name: &str, shape: &[usize]) -> Result<Vec<i32>> {
        let e = self.plain_entry(name, shape)?;
        if e.dtype != Dtype::I32 {
            return Err(EngineError::InvalidCheckpoint(format!(
                "tensor `{name}` has dtype {:?}, expected I32",
                e.dtype
            )));
        }
        let bytes = &self.maps[e.file][e.start..e.end];
        Ok(bytes
            .chunks_exact(4)
            .map(bytemuck::pod_read_unaligned::<i32>)
            .collect())
    }

    /// A 1-D tensor widened to f32 (norm weights, biases).
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let e = self.entry(name, &[len])?;
        let row = Matrix {
            rows: 1,
            cols: len,
            data: self.data(name, e)?,
        };
        let mut out = vec![0.0; len];
        row.row_to_f32(0, &mut out);
        Ok(out)
    }

    /// An optional 1-D tensor: `None` when the checkpoint has no such name.
    pub fn optional_vector(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
        if self.contains(name) {
            self.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Stored bytes of a float dtype copied into an owned buffer.
fn owned_data(dtype: Dtype, bytes: &[u8]) -> WeightData {
    fn owned<T: bytemuck::Pod>(bytes: &[u8]) -> Buf<T> {
        Buf::from(
            bytes
                .chunks_exact(std::mem::size_of::<T>())
                .map(bytemuck::pod_read_unaligned::<T>)
                .collect::<Vec<T>>(),
        )
    }
    match dtype {
        Dtype::F32 => WeightData::F32(owned(bytes)),
        Dtype::BF16 => WeightData::Bf16(owned(bytes)),
        _ => WeightData::F16(owned(bytes)),
    }
}
