//! A matrix at about 8 bits made of two INT4 matrices: the codes of the
//! weights, and the codes of what those codes missed.
//!
//! The output head is read every decode step and decides every token, and
//! 4 bits are too few for it: on SmolLM2-135M (bench/RESULTS.md) an INT4
//! head alone cost 4.4 points of perplexity. Quantizing the error again
//! (`w ≈ Q(w) + Q(w − Q(w))`, each `Q` an [`Int4Matrix`] of the same group
//! size) gives 16 levels inside each coarse step, 256 in all: 8-bit
//! precision through the same INT4 kernels and the same int8 activations
//! (quantized once for both), at the bytes of an 8-bit matrix. A dedicated
//! 8-bit kernel would read the same bytes; this one reuses the tested
//! INT4 kernels.

use super::Int4Config;
use super::Int4Matrix;
use crate::error::Result;
use crate::weights::{Matrix, WeightData};

/// `w ≈ coarse + fine`: both INT4 with one group size.
#[derive(Debug, Clone)]
pub struct ResidualInt4 {
    coarse: Int4Matrix,
    fine: Int4Matrix,
}

impl ResidualInt4 {
    /// Quantizes `w`, then quantizes what the first codes missed.
    pub fn quantize(w: &Matrix, config: Int4Config) -> Result<Self> {
        let coarse = Int4Matrix::quantize(w, config)?;
        let mut error = vec![0f32; w.rows * w.cols];
        let mut row = vec![0f32; w.cols];
        for (r, e) in error.chunks_exact_mut(w.cols).enumerate() {
            w.row_to_f32(r, e);
            coarse.row_to_f32(r, &mut row);
            for (e, q) in e.iter_mut().zip(&row) {
                *e -= q;
            }
        }
        let error = Matrix {
            rows: w.rows,
            cols: w.cols,
            data: WeightData::F32(error.into()),
        };
        let fine = Int4Matrix::quantize(
            &error,
            Int4Config {
                group_size: coarse.group_size(),
                ..config
            },
        )?;
        Ok(Self { coarse, fine })
    }

    /// The two parts, coarse first.
    pub fn parts(&self) -> [&Int4Matrix; 2] {
        [&self.coarse, &self.fine]
    }

    pub fn rows(&self) -> usize {
        self.coarse.rows()
    }

    pub fn cols(&self) -> usize {
        self.coarse.cols()
    }

    /// Bytes held by both parts.
    pub fn bytes(&self) -> usize {
        self.coarse.bytes() + self.fine.bytes()
    }

    /// The matrix dequantized to row-major f32 (the sum of the parts).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = self.coarse.to_f32();
        for (o, f) in out.iter_mut().zip(self.fine.to_f32()) {
            *o += f;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The residual's error is a small fraction of one INT4 matrix's: about
    /// 1/16 of it, the fine part's 16 levels inside each coarse step.
    #[test]
    fn the_fine_part_divides_the_error_by_more_than_ten() {
        let (rows, cols) = (8, 256);
        let mut s = 7u32;
        let values: Vec<f32> = (0..rows * cols)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / (1 << 24) as f32 - 0.5
            })
            .collect();
        let w = Matrix {
            rows,
            cols,
            data: WeightData::F32(values.clone().into()),
        };
        let config = Int4Config::new(32).expect("group");
        let rms = |approx: &[f32]| {
            let sum: f32 = approx
                .iter()
                .zip(&values)
                .map(|(a, v)| (a - v) * (a - v))
                .sum();
            (sum / values.len() as f32).sqrt()
        };
        let int4 = rms(&Int4Matrix::quantize(&w, config).expect("int4").to_f32());
        let residual = ResidualInt4::quantize(&w, config).expect("residual");
        let both = rms(&residual.to_f32());
        assert!(both * 10.0 < int4, "residual rms {both} vs int4 rms {int4}");
        assert_eq!(
            residual.bytes(),
            2 * Int4Matrix::quantize(&w, config).expect("int4").bytes()
        );
    }
}
