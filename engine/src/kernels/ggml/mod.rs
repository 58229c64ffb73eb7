//! `out = x · wᵀ` with a GGUF-quantized `w` kept in its file's blocks
//! ([`GgmlMatrix`]): `Q8_0`, `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q4_K`, `Q5_K`
//! and `Q6_K`.
//!
//! At load the blocks are repacked eight rows a tile ([`tiles`]): scales
//! in planes, code bytes interleaved four at a time, so one 32-byte load
//! is four codes of eight rows and one integer dot-product instruction
//! leaves each row's sum in its own lane. The bytes are the file's, moved.
//!
//! Decode and small batches (`m <= GEMV_MAX_ROWS`, or any `m` under
//! [`MatmulPolicy::BatchInvariant`]) run llama.cpp's CPU arithmetic: each
//! token row is quantized to int8 in 32-element blocks ([`act`], ggml's
//! `Q8_0` shape), and each output is a sum over blocks of integer dot
//! products times the two scales. A step reads the weights' own 4.5–8.5
//! bits per weight rather than a 16-bit copy, and sees the activations
//! llama.cpp sees for the 32-element types, but for each block's dominant
//! entry, which is multiplied exactly; the K-quants, which ggml pairs with
//! one activation scale per 256, take the 32-element blocks too ([`act`]
//! says why). Tiles are split over rayon's pool; each tile is dotted with
//! every token row while it is in L1. The x86 kernels ([`avx2`]: AVX-VNNI,
//! AVX-512 VNNI or AVX2, as the INT4 kernels pick) cover every type; other
//! CPUs run [`scalar`] on rebuilt rows, the reference the SIMD kernels are
//! tested against.
//!
//! Prefill (`m > GEMV_MAX_ROWS`) decodes the matrix to f32 once per call and
//! runs the dense GEMM: O(n·k) extra work against the GEMM's O(m·n·k), and
//! exact weights.

pub mod act;
mod avx2;
mod scalar;
mod tiles;

use tandem_gguf::GgmlType;

use super::int4_simd::{best_kernel, is_supported, Kernel};
use super::{linear_gemm, MatmulPolicy};
use crate::error::{EngineError, Result};
use crate::weights::{Matrix, WeightData};
use act::Activations;
use tiles::{TileLayout, TILE};

/// A `[rows, cols]` weight in a GGUF block type, kept in the file's blocks
/// repacked eight rows a tile ([`tiles`]).
#[derive(Debug)]
pub struct GgmlMatrix {
    layout: TileLayout,
    rows: usize,
    cols: usize,
    /// Tile-major: tile `i`'s tile-blocks, one per block column.
    tiles: Vec<u8>,
}

impl GgmlMatrix {
    /// Repacks `data`, `rows` rows of `cols` columns in `ty`'s blocks
    /// (row-major, as a GGUF file stores them).
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
        let layout = TileLayout::of(ty);
        let blocks = cols / ty.block_len();
        let mut tiles = vec![0u8; Self::tiled_bytes(ty, rows, cols)];
        for (r, row) in data.chunks_exact(ty.bytes_for(cols)).enumerate() {
            for (b, block) in row.chunks_exact(ty.block_bytes()).enumerate() {
                let at = ((r / TILE) * blocks + b) * layout.bytes;
                layout.pack(block, r % TILE, &mut tiles[at..at + layout.bytes]);
            }
        }
        Ok(Self {
            layout,
            rows,
            cols,
            tiles,
        })
    }

    /// The bytes a `[rows, cols]` matrix of `ty` takes as tiles: the
    /// file's blocks, rows rounded up to a whole tile, the K-quants'
    /// sub-block scales unpacked (what `tandem plan` counts).
    pub fn tiled_bytes(ty: GgmlType, rows: usize, cols: usize) -> usize {
        rows.div_ceil(TILE) * (cols / ty.block_len()) * TileLayout::of(ty).bytes
    }

    pub fn ty(&self) -> GgmlType {
        self.layout.ty
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes the tiles occupy.
    pub fn bytes(&self) -> usize {
        self.tiles.len()
    }

    fn blocks_per_row(&self) -> usize {
        self.cols / self.ty().block_len()
    }

    /// Tile `i`'s tile-blocks.
    #[inline]
    fn tile(&self, i: usize) -> &[u8] {
        let len = self.blocks_per_row() * self.layout.bytes;
        &self.tiles[i * len..(i + 1) * len]
    }

    /// Row `r`'s blocks as the file stored them.
    pub fn row_blocks(&self, r: usize) -> Vec<u8> {
        let ty = self.ty();
        let mut out = vec![0u8; ty.bytes_for(self.cols)];
        let tile = self.tile(r / TILE);
        for (b, block) in out.chunks_exact_mut(ty.block_bytes()).enumerate() {
            let tb = &tile[b * self.layout.bytes..(b + 1) * self.layout.bytes];
            self.layout.unpack(tb, r % TILE, block);
        }
        out
    }

    /// The weight at row `r`, column `col`, decoded alone.
    #[inline]
    fn weight_at(&self, r: usize, col: usize) -> f32 {
        let n = self.ty().block_len();
        let tb = &self.tile(r / TILE)[col / n * self.layout.bytes..];
        tiles::weight_at(&self.layout, tb, r % TILE, col % n)
    }

    /// Decodes every row into `out` (`rows × cols`) as `store` converts.
    fn decode_into<T>(&self, out: &mut Vec<T>, store: impl Fn(f32) -> T) {
        let mut row = vec![0f32; self.cols];
        for r in 0..self.rows {
            tandem_gguf::dequantize(self.ty(), &self.row_blocks(r), &mut row);
            out.extend(row.iter().map(|&v| store(v)));
        }
    }

    /// Every weight decoded to f32, row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        self.decode_into(&mut out, |v| v);
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
        self.decode_into(&mut values, half::f16::from_f32);
        Matrix {
            rows: self.rows,
            cols: self.cols,
            data: WeightData::F16(values.into()),
        }
    }

    /// Tile `i` dotted with activation row `t` by `kernel` (a SIMD one
    /// this CPU supports; the portable one rebuilds the rows' blocks), the
    /// activation's outliers multiplied exactly.
    fn dot_tile(&self, kernel: Kernel, i: usize, x: &Activations, t: usize) -> [f32; TILE] {
        let (tile, l, y) = (self.tile(i), &self.layout, x.row(t));
        #[cfg(target_arch = "x86_64")]
        if kernel != Kernel::Scalar && is_supported(kernel) {
            macro_rules! run {
                ($k:ident) => {
                    // SAFETY: the CPU supports `$k` (checked above) and `l`
                    // is the type's layout; each kernel checks that the
                    // tile holds a tile-block per activation block.
                    unsafe {
                        match self.ty() {
                            GgmlType::Q8_0 => avx2::$k::legacy::<0>(tile, l, y),
                            GgmlType::Q4_0 => avx2::$k::legacy::<1>(tile, l, y),
                            GgmlType::Q4_1 => avx2::$k::legacy::<2>(tile, l, y),
                            GgmlType::Q5_0 => avx2::$k::legacy::<3>(tile, l, y),
                            GgmlType::Q5_1 => avx2::$k::legacy::<4>(tile, l, y),
                            GgmlType::Q4_K => avx2::$k::k4::<false>(tile, l, y),
                            GgmlType::Q5_K => avx2::$k::k4::<true>(tile, l, y),
                            GgmlType::Q6_K => avx2::$k::q6k(tile, l, y),
                            ty => unreachable!("no tile kernel for {}", ty.name()),
                        }
                    }
                };
            }
            return match kernel {
                Kernel::Avx512Vnni => run!(avx512vnni),
                Kernel::AvxVnni => run!(avxvnni),
                _ => run!(avx2),
            };
        }
        let _ = (kernel, tile, l, y);
        std::array::from_fn(|lane| {
            let r = (i * TILE + lane).min(self.rows - 1);
            let row = self.row_blocks(r);
            let dot = scalar::dot(self.ty(), &row, y);
            let outliers = x.outliers(t).iter();
            dot + outliers
                .map(|&(col, v)| v * self.weight_at(r, col))
                .sum::<f32>()
        })
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
        linear_ggml_rows(x, m, w, out, best_kernel());
    } else {
        linear_gemm(x, m, &w.to_dense(), out);
    }
    if let Some(b) = bias {
        super::add_bias(out, n, b);
    }
}

/// The row kernel: activations quantized once, tiles split over rayon's
/// pool.
fn linear_ggml_rows(x: &[f32], m: usize, w: &GgmlMatrix, out: &mut [f32], kernel: Kernel) {
    let (n, k) = (w.rows, w.cols);
    let xa = Activations::quantize(x, m, k);
    super::par_row_ranges_by(n, m, out, TILE, |r0, r1, out| {
        for r in (r0..r1).step_by(TILE) {
            for t in 0..m {
                let values = w.dot_tile(kernel, r / TILE, &xa, t);
                let len = values.len().min(r1 - r);
                out[t * n + r..t * n + r + len].copy_from_slice(&values[..len]);
            }
        }
    });
}

#[cfg(test)]
mod tests;
