//! A GGUF file as a [`WeightStore`]: its tensors under their Hugging Face
//! names ([`crate::gguf::hf_tensor_names`]).
//!
//! Which path each tensor type takes:
//! - `F32`, `F16`, `BF16`: read in place, as a safetensors tensor is (Llama's
//!   Q and K, whose rows llama.cpp permuted, are copied once in Hugging Face
//!   row order; Gemma's norms, stored `1 + w`, are decoded to f32 less 1).
//! - `Q8_0`, `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q4_K`, `Q5_K`, `Q6_K`: decoded to f16 when
//!   loaded, only the rows a rank holds (a 16-bit matrix the dense kernels
//!   read; `--quantize int4` re-quantizes it at load like any checkpoint).
//!   Mapping the 4-bit blocks straight into the INT4 kernels' matrices was
//!   tried and kept off: the codes carry over exactly, but the kernels'
//!   int8 activations cost the tiny test model's top-1 agreement with
//!   transformers 0.90–0.94 (bench/RESULTS.md, "GGUF").

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use half::{bf16, f16};
use safetensors::Dtype;
use tandem_gguf::GgmlType;

use super::{Buf, Entry, Stored, WeightData, WeightStore};
use crate::error::{EngineError, Result};

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
                maps.push(Arc::clone(mmap));
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
