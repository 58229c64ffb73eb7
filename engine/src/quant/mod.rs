//! Weight-only INT4 quantization.
//!
//! A quantized matrix keeps the `[rows, cols]` (`[out, in]`) shape of the
//! dense one. Each row is cut along `cols` into groups of `group_size`
//! (32, 64 or 128; 32 unless told, [`DEFAULT_GROUP_SIZE`]) input columns;
//! a weight is a 4-bit code `q` in `0..=15` with, per (row, group), a scale
//! `s` and a zero point `z` in sixteenths, `0..=15 15/16`:
//!
//! ```text
//! w = s · (q − z) = s · q + m      with m = −s · z
//! ```
//!
//! This is the asymmetric scheme of AWQ and GPTQ, whose zero points are
//! integers, so their checkpoints convert into it exactly ([`hf`]; their
//! scales are f16, as stored here). [`Int4Matrix::quantize`] makes it from a
//! dense matrix at load: round to nearest over each group's min..max, the
//! zero point either the fraction that places the grid's ends on the
//! group's min and max to a sixteenth of a step, or the integer that keeps
//! 0.0 on the grid, whichever errs less for that group. The fraction is
//! what makes a GGUF `Q4_1` block (`w = d·q + min`, groups of 32)
//! re-encode almost exactly at g32. Per group that is 2 bytes of f16 scale and 1 byte of zero point:
//! decode reads every byte of the weights every step, so the side data is
//! kept small. The zero-point term of a dot
//! product is `Σ_g m_g · Σ_{i∈g} x_i`, one multiply per group against the
//! activation's group sums (see [`crate::kernels::int4`]).
//!
//! Codes are packed two per byte in blocks of 64 columns: byte `j` of a
//! block holds column `j` in its low nibble and column `j + 32` in its high
//! nibble, so one 32-byte load, a mask and a shift give two registers of 32
//! codes each in column order. The input size must be a multiple of 64
//! (true of every real model's hidden and intermediate sizes).

pub mod eval;
pub mod hf;
mod residual;

pub use residual::ResidualInt4;

use half::f16;

use crate::error::{EngineError, Result};
use crate::weights::Matrix;

/// Columns per packed block (two nibbles per byte, low half then high half).
pub const BLOCK: usize = 64;

/// Where column `col` of a packed row lives: the byte's offset in the row
/// and the shift of its nibble (the packing of the module docs).
#[inline]
pub fn nibble(col: usize) -> (usize, u32) {
    let within = col % BLOCK;
    let byte = col / BLOCK * (BLOCK / 2) + within % (BLOCK / 2);
    (byte, if within < BLOCK / 2 { 0 } else { 4 })
}

/// Group sizes the kernels accept.
pub const GROUP_SIZES: [usize; 3] = [32, 64, 128];

/// The group size `--quantize int4` uses unless told: llama.cpp's block
/// size, and the only one that kept a real small model within 1% of its
/// perplexity (bench/RESULTS.md, `quality-bench`), at 0.79–0.95x of g128's
/// batch-1 decode speed on bench-100m.
pub const DEFAULT_GROUP_SIZE: usize = 32;

/// How the decode kernels code token rows against INT4 weights
/// ([`crate::kernels::int4`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ActivationCodes {
    /// One int8 code per entry: each group's step is 1/127 of its loudest
    /// entry (W4A8).
    Int8,
    /// A second int8 code per entry for what the first left, in steps 128
    /// times finer (about 15 bits, close to the W4A16 of GPU INT4 kernels):
    /// the kernels sum the second codes beside the first and join them per
    /// group, so the fold per group stays one multiply-add.
    #[default]
    TwoPass,
}

impl ActivationCodes {
    /// The name flags and reports use: `two-pass` or `int8`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Int8 => "int8",
            Self::TwoPass => "two-pass",
        }
    }
}

impl std::str::FromStr for ActivationCodes {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "int8" => Ok(Self::Int8),
            "two-pass" => Ok(Self::TwoPass),
            other => Err(EngineError::InvalidRequest(format!(
                "INT4 activations `{other}`: expected `two-pass` or `int8`"
            ))),
        }
    }
}

/// How weights are quantized at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Int4Config {
    /// Input columns sharing one scale and zero point: 32, 64 or 128. A
    /// matrix whose input size it does not divide uses the largest smaller
    /// one that does ([`Int4Config::group_for`]).
    pub group_size: usize,
    /// How the decode kernels code activations against these weights.
    pub activations: ActivationCodes,
}

impl Default for Int4Config {
    fn default() -> Self {
        Self {
            group_size: DEFAULT_GROUP_SIZE,
            activations: ActivationCodes::default(),
        }
    }
}

impl Int4Config {
    /// A configuration with the given group size, checked.
    pub fn new(group_size: usize) -> Result<Self> {
        if !GROUP_SIZES.contains(&group_size) {
            return Err(EngineError::InvalidRequest(format!(
                "INT4 group size {group_size} is not one of {GROUP_SIZES:?}"
            )));
        }
        Ok(Self {
            group_size,
            activations: ActivationCodes::default(),
        })
    }

    /// The same configuration with activations coded as `activations`.
    pub fn with_activations(self, activations: ActivationCodes) -> Self {
        Self {
            activations,
            ..self
        }
    }

    /// What this group size and activation coding cost in perplexity where
    /// they were measured
    /// (`quality-bench` on SmolLM2-135M-Instruct against bf16 weights,
    /// bench/RESULTS.md), for the start-up log.
    pub fn measured_cost(&self) -> &'static str {
        match (self.group_size, self.activations) {
            (32, ActivationCodes::TwoPass) => "+0.21% perplexity, 13/13 answers kept",
            (32, ActivationCodes::Int8) => "+0.64% perplexity, 12-13/13 answers kept",
            (64, ActivationCodes::TwoPass) => "+30% perplexity, 11/13 answers kept",
            (64, ActivationCodes::Int8) => "+30% perplexity, 9/13 answers kept",
            (_, ActivationCodes::TwoPass) => "+35% perplexity, 11/13 answers kept",
            (_, ActivationCodes::Int8) => "+37% perplexity, 10/13 answers kept",
        }
    }

    /// The group size used for a matrix of `cols` input columns: the
    /// configured one, or the largest smaller one dividing `cols`; `None`
    /// when `cols` is not a multiple of the 64-column packing block.
    pub fn group_for(&self, cols: usize) -> Option<usize> {
        if !cols.is_multiple_of(BLOCK) {
            return None;
        }
        GROUP_SIZES
            .iter()
            .rev()
            .copied()
            .find(|&g| g <= self.group_size && cols.is_multiple_of(g))
    }
}

/// A `[rows, cols]` matrix of 4-bit codes with per-group scales and mins.
#[derive(Debug, Clone)]
pub struct Int4Matrix {
    rows: usize,
    cols: usize,
    group_size: usize,
    /// `rows × cols / 2` bytes, row-major, blocks of 32 columns as described
    /// in the module docs.
    packed: Vec<u8>,
    /// `rows × cols / group_size` scales, row-major.
    scales: Vec<f16>,
    /// `rows × cols / group_size` zero points in sixteenths (`z · 16`,
    /// `0..=255`), row-major.
    zeros: Vec<u8>,
    /// How the decode kernels code activations against this matrix.
    activations: ActivationCodes,
}

impl Int4Matrix {
    /// Builds a matrix from unpacked codes (`rows × cols`, each `0..=15`, in
    /// column order), scales (rounded to f16) and integer zero points
    /// (`rows × groups` each), as AWQ and GPTQ store them.
    pub fn from_codes(
        rows: usize,
        cols: usize,
        group_size: usize,
        codes: &[u8],
        scales: &[f32],
        zeros: &[u8],
    ) -> Result<Self> {
        if let Some(bad) = zeros.iter().find(|&&z| z > 15) {
            return Err(EngineError::InvalidCheckpoint(format!(
                "INT4: zero point {bad} is outside 0..=15"
            )));
        }
        let sixteenths: Vec<u8> = zeros.iter().map(|z| z * 16).collect();
        Self::from_parts(rows, cols, group_size, codes, scales, &sixteenths)
    }

    /// As [`from_codes`](Self::from_codes), with zero points in sixteenths
    /// (`z · 16`).
    fn from_parts(
        rows: usize,
        cols: usize,
        group_size: usize,
        codes: &[u8],
        scales: &[f32],
        zeros: &[u8],
    ) -> Result<Self> {
        Int4Config::new(group_size)?;
        if !cols.is_multiple_of(group_size) || !cols.is_multiple_of(BLOCK) {
            return Err(EngineError::InvalidCheckpoint(format!(
                "INT4: {cols} input columns are not a multiple of the group size {group_size} and of {BLOCK}"
            )));
        }
        let groups = rows * cols / group_size;
        if codes.len() != rows * cols || scales.len() != groups || zeros.len() != groups {
            return Err(EngineError::InvalidCheckpoint(format!(
                "INT4: {} codes, {} scales, {} zeros for a {rows}×{cols} matrix in groups of {group_size}",
                codes.len(),
                scales.len(),
                zeros.len()
            )));
        }
        if let Some(bad) = codes.iter().find(|&&c| c > 15) {
            return Err(EngineError::InvalidCheckpoint(format!(
                "INT4: code {bad} is outside 0..=15"
            )));
        }
        let mut packed = vec![0u8; rows * cols / 2];
        for (src, dst) in codes
            .chunks_exact(BLOCK)
            .zip(packed.chunks_exact_mut(BLOCK / 2))
        {
            for j in 0..BLOCK / 2 {
                dst[j] = src[j] | (src[j + BLOCK / 2] << 4);
            }
        }
        Ok(Self {
            rows,
            cols,
            group_size,
            packed,
            scales: scales.iter().map(|&s| f16::from_f32(s)).collect(),
            zeros: zeros.to_vec(),
            activations: ActivationCodes::default(),
        })
    }

    /// Quantizes a dense matrix group by group: asymmetric round to nearest
    /// over each group's min..max, the zero point chosen by [`best_zero`].
    pub fn quantize(w: &Matrix, config: Int4Config) -> Result<Self> {
        Int4Config::new(config.group_size)?;
        let g = config.group_for(w.cols).ok_or_else(|| {
            EngineError::Unsupported(format!(
                "INT4 quantization: a {}×{} matrix has {} input columns, not a multiple of {BLOCK}",
                w.rows, w.cols, w.cols
            ))
        })?;
        let groups_per_row = w.cols / g;
        let mut codes = vec![0u8; w.rows * w.cols];
        let mut scales = vec![0f32; w.rows * groups_per_row];
        let mut zeros = vec![0u8; w.rows * groups_per_row];
        let mut row = vec![0f32; w.cols];
        for r in 0..w.rows {
            w.row_to_f32(r, &mut row);
            for (gi, group) in row.chunks_exact(g).enumerate() {
                let (lo, hi) = group
                    .iter()
                    .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                        (lo.min(v), hi.max(v))
                    });
                // The range covers zero (the zero point is unsigned), so an
                // all-positive or all-negative group keeps its small values
                // and a zero group has a well-defined scale.
                let (lo, hi) = (lo.min(0.0), hi.max(0.0));
                // The f16 the matrix will store, so codes match it.
                let scale = if hi > lo { (hi - lo) / 15.0 } else { 1.0 };
                let scale = f16::from_f32(scale)
                    .to_f32()
                    .max(f32::from(f16::MIN_POSITIVE));
                let z16 = best_zero(group, scale, lo);
                let zero = z16 / 16.0;
                let idx = r * groups_per_row + gi;
                scales[idx] = scale;
                zeros[idx] = z16 as u8;
                let out = &mut codes[r * w.cols + gi * g..r * w.cols + (gi + 1) * g];
                for (c, &v) in out.iter_mut().zip(group) {
                    *c = (v / scale + zero).round().clamp(0.0, 15.0) as u8;
                }
            }
        }
        Ok(
            Self::from_parts(w.rows, w.cols, g, &codes, &scales, &zeros)?
                .with_activations(config.activations),
        )
    }

    /// The same matrix, its activations coded as `activations`.
    pub fn with_activations(self, activations: ActivationCodes) -> Self {
        Self {
            activations,
            ..self
        }
    }

    /// How the decode kernels code activations against this matrix.
    pub fn activations(&self) -> ActivationCodes {
        self.activations
    }

    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Input columns per scale.
    pub fn group_size(&self) -> usize {
        self.group_size
    }

    /// Groups in one row.
    pub fn groups_per_row(&self) -> usize {
        self.cols / self.group_size
    }

    /// The packed codes of rows `r0..r1`.
    pub fn packed_rows(&self, r0: usize, r1: usize) -> &[u8] {
        &self.packed[r0 * self.cols / 2..r1 * self.cols / 2]
    }

    /// The scales of rows `r0..r1` (`groups_per_row` each).
    pub fn scale_rows(&self, r0: usize, r1: usize) -> &[f16] {
        let g = self.groups_per_row();
        &self.scales[r0 * g..r1 * g]
    }

    /// The zero points of rows `r0..r1`, in sixteenths.
    pub fn zero_rows(&self, r0: usize, r1: usize) -> &[u8] {
        let g = self.groups_per_row();
        &self.zeros[r0 * g..r1 * g]
    }

    /// Bytes held: packed codes plus the f16 scales and u8 zero points.
    pub fn bytes(&self) -> usize {
        self.packed.len() + 2 * self.scales.len() + self.zeros.len()
    }

    /// The 4-bit code of element `(r, c)`.
    pub fn code(&self, r: usize, c: usize) -> u8 {
        let (byte, shift) = nibble(c);
        (self.packed[r * self.cols / 2 + byte] >> shift) & 0x0f
    }

    /// Row `r` dequantized to f32.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let g = self.groups_per_row();
        for (c, o) in out.iter_mut().enumerate().take(self.cols) {
            let gi = r * g + c / self.group_size;
            *o = self.scales[gi].to_f32()
                * (f32::from(self.code(r, c)) - zero_point(self.zeros[gi]));
        }
    }

    /// The whole matrix dequantized to row-major f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.row_to_f32(r, row);
        }
        out
    }
}

/// The zero point, in sixteenths, of a group quantized with `scale` over a
/// range starting at `lo`: the fraction that puts the grid's ends on the
/// group's min and max, or the integer that makes 0.0 a grid point,
/// whichever leaves the smaller squared error. Measured on SmolLM2-135M
/// (bench/RESULTS.md): the fraction alone took g32 from +35% to +7%
/// perplexity but g128 from +55% to +63%; weights crowd around zero, and
/// a grid that holds 0.0 rounds the crowd to it.
fn best_zero(group: &[f32], scale: f32, lo: f32) -> f32 {
    let exact = -lo / scale;
    let sse = |z16: f32| -> f32 {
        let z = z16 / 16.0;
        group
            .iter()
            .map(|&v| {
                let q = (v / scale + z).round().clamp(0.0, 15.0);
                let e = scale * (q - z) - v;
                e * e
            })
            .sum()
    };
    let fraction = (exact * 16.0).round().clamp(0.0, 255.0);
    let integer = exact.round().clamp(0.0, 15.0) * 16.0;
    if sse(fraction) < sse(integer) {
        fraction
    } else {
        integer
    }
}

/// A stored zero point (sixteenths) as a number of steps.
#[inline]
pub fn zero_point(sixteenths: u8) -> f32 {
    f32::from(sixteenths) * (1.0 / 16.0)
}

/// Bytes an INT4 matrix of this shape takes (codes plus an f16 scale and a
/// u8 zero point per group), for capacity planning without quantizing.
pub fn int4_bytes(rows: usize, cols: usize, group_size: usize) -> usize {
    rows * cols / 2 + 3 * rows * cols.div_ceil(group_size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::WeightData;

    fn dense(rows: usize, cols: usize, seed: u32) -> Matrix {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(7);
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect();
        Matrix {
            rows,
            cols,
            data: WeightData::F32(v.into()),
        }
    }

    #[test]
    fn quantize_round_trips_within_half_a_step() {
        for g in GROUP_SIZES {
            let w = dense(5, 256, g as u32);
            let q = Int4Matrix::quantize(&w, Int4Config::new(g).expect("group")).expect("q");
            let mut orig = vec![0f32; 256];
            let mut back = vec![0f32; 256];
            for r in 0..5 {
                w.row_to_f32(r, &mut orig);
                q.row_to_f32(r, &mut back);
                for (c, (a, b)) in orig.iter().zip(&back).enumerate() {
                    let step = q.scales[r * q.groups_per_row() + c / g].to_f32();
                    assert!(
                        (a - b).abs() <= step * 0.5 + 1e-6,
                        "g{g} ({r},{c}): {a} vs {b}"
                    );
                }
            }
            assert_eq!(q.bytes(), int4_bytes(5, 256, g));
        }
    }

    /// One row quantized in groups of 32, and dequantized back.
    fn g32_round_trip(row: &[f32]) -> (Int4Matrix, Vec<f32>) {
        let w = Matrix {
            rows: 1,
            cols: row.len(),
            data: WeightData::F32(row.to_vec().into()),
        };
        let q = Int4Matrix::quantize(&w, Int4Config::new(32).expect("g")).expect("q");
        let mut back = vec![0f32; row.len()];
        q.row_to_f32(0, &mut back);
        (q, back)
    }

    #[test]
    fn a_q4_1_block_re_encodes_to_a_sixteenth_of_its_step() {
        // GGUF Q4_1: w = d·q + min, with min not a multiple of d.
        let (d, min) = (0.0123f32, -0.0871f32);
        let v: Vec<f32> = (0..64).map(|i| d * ((i * 7 % 16) as f32) + min).collect();
        let (_, back) = g32_round_trip(&v);
        for (a, b) in v.iter().zip(&back) {
            assert!((a - b).abs() <= d / 32.0 + 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn a_group_crowded_at_zero_keeps_zero_on_the_grid() {
        // One large weight sets the step; the rest sit near 0.0, where an
        // integer zero point rounds them to exactly 0.0.
        let mut v = vec![0.0f32; 64];
        v[3] = 1.0;
        v[9] = -0.37;
        let (q, back) = g32_round_trip(&v);
        assert_eq!(q.zero_rows(0, 1)[0] % 16, 0, "an integer zero point");
        assert!(back
            .iter()
            .enumerate()
            .all(|(i, &b)| i == 3 || i == 9 || b == 0.0));
    }

    #[test]
    fn packing_puts_column_j_and_j_plus_32_in_one_byte() {
        let codes: Vec<u8> = (0..128).map(|i| ((i * 7 + i / 32) % 16) as u8).collect();
        let m = Int4Matrix::from_codes(1, 128, 64, &codes, &[1.0, 1.0], &[0, 0]).expect("m");
        for j in 0..32 {
            assert_eq!(m.packed[j], codes[j] | (codes[j + 32] << 4));
            assert_eq!(m.packed[32 + j], codes[64 + j] | (codes[96 + j] << 4));
        }
        for (c, &want) in codes.iter().enumerate() {
            assert_eq!(m.code(0, c), want);
        }
    }

    #[test]
    fn bad_shapes_and_codes_are_errors() {
        assert!(Int4Config::new(48).is_err());
        let w = dense(2, 96, 1);
        assert!(Int4Matrix::quantize(&w, Int4Config::new(64).expect("g")).is_err());
        // 192 columns: groups of 128 do not divide it, 64 does.
        let w = dense(2, 192, 1);
        let q = Int4Matrix::quantize(&w, Int4Config::new(128).expect("g")).expect("fits");
        assert_eq!(q.group_size(), 64);
        assert!(Int4Matrix::from_codes(1, 64, 32, &[16; 64], &[1.0; 2], &[0; 2]).is_err());
        assert!(Int4Matrix::from_codes(1, 64, 32, &[0; 63], &[1.0; 2], &[0; 2]).is_err());
        assert!(Int4Matrix::from_codes(1, 32, 32, &[0; 32], &[1.0], &[0]).is_err());
    }
}
