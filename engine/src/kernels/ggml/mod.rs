//! `out = x · wᵀ` with a GGUF-quantized `w` kept in its file's blocks
//! ([`GgmlMatrix`]): `Q8_0`, `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q4_K`, `Q5_K`
//! and `Q6_K`.
//!
//! Decode and small batches (`m <= GEMV_MAX_ROWS`, or any `m` under
//! [`MatmulPolicy::BatchInvariant`]) run llama.cpp's CPU arithmetic: each
//! token row is quantized to int8 in the block shape the weight type pairs
//! with ([`act`]: 32-element blocks for the legacy types, 256 for the
//! K-quants), and each output is a sum over blocks of integer dot products
//! times the two scales. A step reads the weights' own 4.5–8.5 bits per
//! weight rather than a 16-bit copy, and sees the activations llama.cpp
//! sees, but for each block's dominant entry, which is multiplied exactly
//! ([`act`]). Rows of `w` are split over rayon's pool as in the dense row
//! kernel; each weight row is dotted with every token row while it is in
//! L1. The AVX2 kernels ([`avx2`]) cover every type; other CPUs run
//! [`scalar`], the reference the SIMD kernels are tested against.
//!
//! Prefill (`m > GEMV_MAX_ROWS`) decodes the matrix to f32 once per call and
//! runs the dense GEMM: O(n·k) extra work against the GEMM's O(m·n·k), and
//! exact weights.

pub mod act;
mod avx2;
mod scalar;

use tandem_gguf::GgmlType;

use super::{linear_gemm, MatmulPolicy};
use crate::error::{EngineError, Result};
use crate::weights::{Matrix, WeightData};
use act::Activations;

/// A `[rows, cols]` weight in a GGUF block type, row-major: each row is
/// `cols / block_len` whole blocks.
#[derive(Debug)]
pub struct GgmlMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl GgmlMatrix {
    /// Checks that `data` is `rows` rows of `cols` columns in `ty`'s blocks.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self> {
        if ty.is_float() {
            return Err(EngineError::Unsupported(format!(
                "{} is a float type, not a block-quantized one",
                ty.name()
            )));
        }
        if !cols.is_multiple_of(ty.block_len()) || data.len() != rows * ty.bytes_for(cols) {
            return Err(EngineError::InvalidCheckpoint(format!(
                "{} matrix [{rows}, {cols}]: {} bytes, expected rows of whole {}-element blocks ({} bytes)",
                ty.name(),
                data.len(),
                ty.block_len(),
                rows * ty.bytes_for(cols.next_multiple_of(ty.block_len()))
            )));
        }
        Ok(Self {
            ty,
            rows,
            cols,
            data,
        })
    }

    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes the blocks occupy.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    fn row_bytes(&self) -> usize {
        self.ty.bytes_for(self.cols)
    }

    /// Row `r`'s blocks.
    #[inline]
    pub fn row(&self, r: usize) -> &[u8] {
        &self.data[r * self.row_bytes()..(r + 1) * self.row_bytes()]
    }

    /// Every weight decoded to f32, row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols).enumerate() {
            tandem_gguf::dequantize(self.ty, self.row(r), o);
        }
        out
    }

    /// The decoded matrix (for re-quantizing to INT4).
    pub fn to_dense(&self) -> Matrix {
        Matrix {
            rows: self.rows,
            cols: self.cols,
            data: WeightData::F32(self.to_f32().into()),
        }
    }

    /// The decoded matrix rounded to f16, what the dense kernels read (as
    /// a GGUF file's quantized tensors were loaded before they ran in
    /// their blocks).
    pub fn to_f16(&self) -> Matrix {
        let mut values = Vec::with_capacity(self.rows * self.cols);
        let mut row = vec![0f32; self.cols];
        for r in 0..self.rows {
            tandem_gguf::dequantize(self.ty, self.row(r), &mut row);
            values.extend(row.iter().map(|&v| half::f16::from_f32(v)));
        }
        Matrix {
            rows: self.rows,
            cols: self.cols,
            data: WeightData::F16(values.into()),
        }
    }

    /// Whether the weight pairs with 256-element activation blocks.
    fn k_quant(&self) -> bool {
        self.ty.block_len() == act::QK_K
    }
}

/// Which implementation runs the dot products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    Scalar,
    Avx2,
}

impl Kernel {
    /// The fastest one this CPU runs.
    pub(crate) fn best() -> Self {
        if super::int4_simd::is_supported(super::int4_simd::Kernel::Avx2) {
            Self::Avx2
        } else {
            Self::Scalar
        }
    }

    /// [`ROW_TILE`] weight rows (`ty`'s blocks) dotted with activation row
    /// `t`.
    fn dot_rows(
        self,
        ty: GgmlType,
        w: [&[u8]; ROW_TILE],
        x: &Activations,
        t: usize,
    ) -> [f32; ROW_TILE] {
        match (self, x) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Avx2` is only chosen where the CPU has AVX2, FMA and
            // F16C (`best`, and the tests' `is_supported` check); the
            // kernels check the rows' and activations' lengths.
            (Self::Avx2, Activations::Q8(rows)) => unsafe { avx2::dot_q8_rows(ty, w, &rows[t]) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            (Self::Avx2, Activations::Q8K(rows)) => {
                w.map(|w| unsafe { avx2::dot_q8k(ty, w, &rows[t]) })
            }
            (_, Activations::Q8(rows)) => w.map(|w| scalar::dot_q8(ty, w, &rows[t])),
            (_, Activations::Q8K(rows)) => w.map(|w| scalar::dot_q8k(ty, w, &rows[t])),
        }
    }
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias)` for a block-quantized `w`.
pub fn linear_ggml(
    x: &[f32],
    m: usize,
    w: &GgmlMatrix,
    bias: Option<&[f32]>,
    policy: MatmulPolicy,
    out: &mut [f32],
) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), m * k, "x holds m × k activations");
    assert_eq!(out.len(), m * n, "out holds m × n values");
    if policy.uses_row_kernel(m) {
        linear_ggml_rows(x, m, w, out, Kernel::best());
    } else {
        linear_gemm(x, m, &w.to_dense(), out);
    }
    if let Some(b) = bias {
        super::add_bias(out, n, b);
    }
}

/// The row kernel: activations quantized once, weight rows split over
/// rayon's pool.
fn linear_ggml_rows(x: &[f32], m: usize, w: &GgmlMatrix, out: &mut [f32], kernel: Kernel) {
    let (n, k) = (w.rows, w.cols);
    let xa = Activations::quantize(x, m, k, w.k_quant());
    // The outliers' exact products with weight row `r`.
    let exact = |t: usize, r: usize| -> f32 {
        xa.outliers(t)
            .iter()
            .map(|&(col, x)| x * scalar::weight_at(w.ty, w.row(r), col))
            .sum()
    };
    super::par_row_ranges(n, m, out, |r0, r1, out| {
        // Eight rows share each activation block's load; a last tile of
        // fewer repeats its last row.
        for r in (r0..r1).step_by(ROW_TILE) {
            let len = ROW_TILE.min(r1 - r);
            let rows = std::array::from_fn(|i| w.row(r + i.min(len - 1)));
            for t in 0..m {
                let values = kernel.dot_rows(w.ty, rows, &xa, t);
                for (i, v) in values.into_iter().take(len).enumerate() {
                    out[t * n + r + i] = v + exact(t, r + i);
                }
            }
        }
    });
}

/// Weight rows the row kernel dots at once.
const ROW_TILE: usize = 8;

#[cfg(test)]
mod tests;
