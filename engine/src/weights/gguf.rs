//! A GGUF file as a [`WeightStore`]: its tensors under their Hugging Face
//! names ([`crate::gguf::hf_tensor_names`]).
//!
//! Which path each tensor type takes:
//! - `F32`, `F16`, `BF16`: read in place, as a safetensors tensor is (Llama's
//!   Q and K, whose rows llama.cpp permuted, are copied once in Hugging Face
//!   row order; Gemma's norms, stored `1 + w`, are decoded to f32 less 1).
//! - `Q8_0`, `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q4_K`, `Q5_K`, `Q6_K`: a linear
//!   layer's weight (and the output head) is kept in its blocks
//!   ([`WeightStore::quantized_rows`], [`WeightStore::quantized_cols`]: a
//!   copy of only the rows or block-aligned columns a rank holds) and run by
//!   [`crate::kernels::ggml`]; `--quantize int4` re-quantizes it from its
//!   decoded values like any checkpoint. Everything else read from a
//!   quantized tensor (the embedding's rows, a column range that splits a
//!   block) is decoded to f16.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use half::{bf16, f16};
use safetensors::Dtype;
use tandem_gguf::GgmlType;

use super::{Backing, Buf, Entry, Stored, WeightData, WeightStore};
use crate::error::{EngineError, Result};
use crate::kernels::GgmlMatrix;

impl WeightStore {
    /// Opens a GGUF file (all shards of a split).
    pub(super) fn open_gguf(path: &Path) -> Result<Self> {
        let g = crate::gguf::open(path)?;
        let map = crate::gguf::hf_tensor_names(&g)?;
        let mut entries = HashMap::with_capacity(map.names.len());
        let mut maps = Vec::new();
        let mut files: HashMap<*const u8, usize> = HashMap::new();
        for (hf, name) in &map.names {
            let (Some((mmap, bytes)), Some(t)) = (g.mapped(name), g.tensor(name)) else {
                continue;
            };
            let file = *files.entry(mmap.as_ptr()).or_insert_with(|| {
                maps.push(Arc::new(Backing::Mapped(Arc::clone(mmap))));
                maps.len() - 1
            });
            let shape = t.shape();
            let rows = map.rope_rows(hf, shape[0]).map(Arc::from);
            let shift = map.shift(hf);
            let dtype = match t.ty {
                // Shifted tensors (norms) are decoded to f32.
                _ if shift != 0.0 => Dtype::F32,
                GgmlType::F32 => Dtype::F32,
                GgmlType::Bf16 => Dtype::BF16,
                // F16, and what quantized types decode to.
                _ => Dtype::F16,
            };
            let stored = match (t.ty.is_float(), rows, shift) {
                (true, None, 0.0) => Stored::Plain,
                (_, rows, shift) => Stored::Gguf {
                    ty: t.ty,
                    rows,
                    shift,
                },
            };
            let start = bytes.as_ptr() as usize - mmap.as_ptr() as usize;
            entries.insert(
                hf.clone(),
                Entry {
                    file,
                    dtype,
                    stored,
                    shape,
                    start,
                    end: start + bytes.len(),
                },
            );
        }
        Ok(Self { maps, entries })
    }

    /// Rows `rows` (Hugging Face order) of a GGUF entry, decoded: float
    /// types keep their dtype, quantized ones become f16.
    pub(super) fn decode_rows(
        &self,
        name: &str,
        e: &Entry,
        rows: std::ops::Range<usize>,
    ) -> Result<WeightData> {
        let Stored::Gguf {
            ty,
            rows: order,
            shift,
        } = &e.stored
        else {
            return Err(EngineError::InvalidCheckpoint(format!(
                "tensor `{name}` is not a GGUF tensor"
            )));
        };
        let cols = if e.shape.len() == 1 {
            e.shape[0]
        } else {
            e.shape[1..].iter().product()
        };
        let row_bytes = ty.bytes_for(cols);
        let bytes = &self.maps[e.file][e.start..e.end];
        let stored_row = |r: usize| {
            let s = order.as_ref().map_or(r, |o| o[r]);
            &bytes[s * row_bytes..(s + 1) * row_bytes]
        };
        Ok(match ty {
            // Shifted norms become f32 whatever their stored float type.
            _ if ty.is_float() && *shift != 0.0 => {
                let mut out = Vec::with_capacity(rows.len() * cols);
                let mut row = vec![0.0f32; cols];
                for r in rows {
                    tandem_gguf::dequantize(*ty, stored_row(r), &mut row);
                    out.extend(row.iter().map(|&w| w - shift));
                }
                WeightData::F32(Buf::from(out))
            }
            GgmlType::F32 => WeightData::F32(Buf::from(pod_rows::<f32>(rows, stored_row))),
            GgmlType::Bf16 => WeightData::Bf16(Buf::from(pod_rows::<bf16>(rows, stored_row))),
            GgmlType::F16 => WeightData::F16(Buf::from(pod_rows::<f16>(rows, stored_row))),
            _ => {
                let mut out = Vec::with_capacity(rows.len() * cols);
                let mut row = vec![0.0f32; cols];
                for r in rows {
                    tandem_gguf::dequantize(*ty, stored_row(r), &mut row);
                    out.extend(row.iter().map(|&w| f16::from_f32(w - shift)));
                }
                WeightData::F16(Buf::from(out))
            }
        })
    }
}

impl WeightStore {
    /// Rows `rows` of a `[total_rows, cols]` tensor in its GGUF blocks, when
    /// it is stored block-quantized; `None` for any other tensor (read it
    /// with [`matrix_rows`](Self::matrix_rows)).
    pub fn quantized_rows(
        &self,
        name: &str,
        total_rows: usize,
        cols: usize,
        rows: std::ops::Range<usize>,
    ) -> Result<Option<GgmlMatrix>> {
        self.quantized_part(name, [total_rows, cols], rows, 0..cols)
    }

    /// Columns `cols` of a `[rows, total_cols]` tensor in its GGUF blocks,
    /// when it is stored block-quantized and the range starts and ends on
    /// block boundaries; `None` otherwise (read it with
    /// [`matrix_cols`](Self::matrix_cols)).
    pub fn quantized_cols(
        &self,
        name: &str,
        rows: usize,
        total_cols: usize,
        cols: std::ops::Range<usize>,
    ) -> Result<Option<GgmlMatrix>> {
        self.quantized_part(name, [rows, total_cols], 0..rows, cols)
    }

    /// Rows `rows` × columns `cols` of a `shape` tensor in its GGUF blocks
    /// (each row's bytes of the blocks `cols` spans), or `None` for a
    /// tensor not stored block-quantized or a column range that splits a
    /// block. A whole row is always whole blocks (the parser checks).
    fn quantized_part(
        &self,
        name: &str,
        shape: [usize; 2],
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
    ) -> Result<Option<GgmlMatrix>> {
        let e = self.entry(name, &shape)?;
        let Some((ty, order)) = quantized(e) else {
            return Ok(None);
        };
        let [total_rows, total_cols] = shape;
        if rows.start > rows.end || rows.end > total_rows {
            return Err(EngineError::InvalidCheckpoint(format!(
                "rows {rows:?} of tensor `{name}` are outside its {total_rows} rows"
            )));
        }
        let block = ty.block_len();
        if !cols.start.is_multiple_of(block)
            || !cols.end.is_multiple_of(block)
            || cols.end > total_cols
        {
            return Ok(None);
        }
        let row_bytes = ty.bytes_for(total_cols);
        let (from, to) = (ty.bytes_for(cols.start), ty.bytes_for(cols.end));
        let bytes = &self.maps[e.file][e.start..e.end];
        let mut data = Vec::with_capacity(rows.len() * (to - from));
        for r in rows.clone() {
            let row = order.map_or(r, |o| o[r]) * row_bytes;
            data.extend_from_slice(&bytes[row + from..row + to]);
        }
        GgmlMatrix::new(ty, rows.len(), cols.len(), data).map(Some)
    }
}

/// A block-quantized GGUF entry's type and row order (`None` for float or
/// shifted tensors, which are decoded instead).
fn quantized(e: &Entry) -> Option<(GgmlType, Option<&[usize]>)> {
    match &e.stored {
        Stored::Gguf { ty, rows, shift } if !ty.is_float() && *shift == 0.0 => {
            Some((*ty, rows.as_deref()))
        }
        _ => None,
    }
}

/// Rows copied out as `T`s.
fn pod_rows<'a, T: bytemuck::Pod>(
    rows: std::ops::Range<usize>,
    row: impl Fn(usize) -> &'a [u8],
) -> Vec<T> {
    rows.flat_map(|r| {
        row(r)
            .chunks_exact(std::mem::size_of::<T>())
            .map(bytemuck::pod_read_unaligned::<T>)
    })
    .collect()
}
