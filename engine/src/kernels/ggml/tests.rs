use half::f16;

use super::*;
use crate::kernels::{linear, GEMV_MAX_ROWS};

const TYPES: [GgmlType; 8] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

struct Rng(u32);

impl Rng {
    fn next(&mut self) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 17;
        self.0 ^= self.0 << 5;
        self.0
    }

    fn unit(&mut self) -> f32 {
        (self.next() % 2001) as f32 / 1000.0 - 1.0
    }
}

/// Byte offsets of a block's f16 scales (random bits there could be NaN).
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => unreachable!(),
    }
}

/// Random codes under sane scales (every bit pattern of the code fields
/// is a valid block): the file's row-major blocks and their tiles.
fn random_matrix(ty: GgmlType, rows: usize, cols: usize, seed: u32) -> (Vec<u8>, GgmlMatrix) {
    let mut rng = Rng(seed.wrapping_mul(2654435761) | 1);
    let mut data: Vec<u8> = (0..rows * ty.bytes_for(cols))
        .map(|_| rng.next() as u8)
        .collect();
    for b in data.chunks_exact_mut(ty.block_bytes()) {
        for &at in scale_offsets(ty) {
            let s = f16::from_f32(0.002 + (rng.next() % 1000) as f32 * 2e-5);
            b[at..at + 2].copy_from_slice(&s.to_le_bytes());
        }
    }
    let w = GgmlMatrix::new(ty, rows, cols, data.clone()).expect("whole blocks");
    (data, w)
}

fn random_x(n: usize, seed: u32) -> Vec<f32> {
    let mut rng = Rng(seed.wrapping_mul(40503) | 1);
    (0..n).map(|_| rng.unit()).collect()
}

fn kernels() -> Vec<Kernel> {
    super::super::int4_simd::supported_kernels()
}

/// The tiles hold every byte of the file's blocks: each row rebuilds
/// exactly, rows past a whole tile included; they take the file's size
/// (the K-quants' scales unpacked: 16 bytes for 12).
#[test]
fn tiles_rebuild_the_files_blocks() {
    let (rows, cols) = (11, 512);
    for ty in TYPES {
        let (data, w) = random_matrix(ty, rows, cols, 23);
        let row_bytes = ty.bytes_for(cols);
        for r in 0..rows {
            assert_eq!(
                w.row_blocks(r),
                data[r * row_bytes..(r + 1) * row_bytes],
                "{} row {r}",
                ty.name()
            );
        }
        let per_block = match ty {
            GgmlType::Q4_K | GgmlType::Q5_K => ty.block_bytes() + 4,
            _ => ty.block_bytes(),
        };
        assert_eq!(
            w.bytes(),
            16 * cols / ty.block_len() * per_block,
            "{}",
            ty.name()
        );
    }
}

/// The interleaved runs land where the layout (and so the kernels) put
/// the code sections, end the tile-block, and do not overlap.
#[test]
fn interleaved_runs_match_the_layout() {
    for ty in TYPES {
        let layout = TileLayout::of(ty);
        let spans: Vec<(usize, usize)> = layout
            .interleaved()
            .iter()
            .map(|&(_, len, to)| (to, to + TILE * len))
            .collect();
        let starts: Vec<usize> = spans.iter().map(|s| s.0).collect();
        assert!(starts.contains(&layout.codes), "{}", ty.name());
        if matches!(ty, GgmlType::Q5_K | GgmlType::Q6_K) {
            assert!(
                starts.contains(&layout.high.expect("high bits")),
                "{}",
                ty.name()
            );
        }
        assert_eq!(
            spans.iter().map(|s| s.1).max(),
            Some(layout.bytes),
            "{}",
            ty.name()
        );
        if let [a, b] = spans[..] {
            assert!(a.1 <= b.0 || b.1 <= a.0, "{} runs overlap", ty.name());
        }
    }
}

/// One weight decoded alone, in its tile, is the block decoder's value.
#[test]
fn single_weights_decode_as_their_blocks_do() {
    let (rows, cols) = (9, 512);
    for ty in TYPES {
        let (data, w) = random_matrix(ty, rows, cols, 17);
        let dense = w.to_f32();
        let row_bytes = ty.bytes_for(cols);
        for r in 0..rows {
            let row = &data[r * row_bytes..(r + 1) * row_bytes];
            for col in 0..cols {
                let want = dense[r * cols + col];
                assert_eq!(
                    scalar::weight_at(ty, row, col),
                    want,
                    "{} {r},{col}",
                    ty.name()
                );
                assert_eq!(w.weight_at(r, col), want, "{} tile {r},{col}", ty.name());
            }
        }
    }
}

/// Every kernel's dot product is the exact one (decoded weights, f32
/// activations) up to the int8 activations' rounding.
#[test]
fn dots_match_the_decoded_weights() {
    let (rows, cols) = (8, 512);
    for ty in TYPES {
        let (_, w) = random_matrix(ty, rows, cols, 7);
        let dense = w.to_f32();
        let x = random_x(cols, 3);
        let xa = Activations::quantize(&x, 1, cols);
        for kernel in kernels() {
            let got = w.dot_tile(kernel, 0, &xa, 0);
            for (r, got) in got.into_iter().enumerate() {
                let row = &dense[r * cols..(r + 1) * cols];
                let exact: f32 = row.iter().zip(&x).map(|(a, b)| a * b).sum();
                let scale: f32 = row.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
                assert!(
                    (got - exact).abs() <= 0.01 * scale + 1e-5,
                    "{} {kernel:?} row {r}: {got} vs {exact} (Σ|wx| {scale})",
                    ty.name()
                );
            }
        }
    }
}

/// The SIMD kernels compute the scalar reference's integer sums on the
/// file's own blocks: only the float accumulation order differs. Extreme
/// activations (±127 codes) and a matrix of two tiles, the second partial.
#[test]
fn simd_kernels_match_the_scalar_reference() {
    let (rows, cols) = (13, 1024);
    for ty in TYPES {
        let (data, w) = random_matrix(ty, rows, cols, 11);
        let row_bytes = ty.bytes_for(cols);
        let mut x = random_x(2 * cols, 5);
        for v in x[cols..].iter_mut() {
            *v = v.signum();
        }
        // Outliers in both tokens, one per 256-column block, at varied places.
        for col in [5, 300, 600, cols - 1] {
            x[col] = 40.0;
            x[cols + col] = -40.0;
        }
        let xa = Activations::quantize(&x, 2, cols);
        for kernel in kernels() {
            for t in 0..2 {
                for tile in 0..2 {
                    let got = w.dot_tile(kernel, tile, &xa, t);
                    for (lane, got) in got.into_iter().enumerate().take(rows - tile * TILE) {
                        let r = tile * TILE + lane;
                        let row = &data[r * row_bytes..(r + 1) * row_bytes];
                        let dot = scalar::dot(ty, row, xa.row(t));
                        assert_eq!(xa.outliers(t).len(), 4);
                        let exact = xa.outliers(t).iter();
                        let want = dot
                            + exact
                                .map(|&(c, v)| v * scalar::weight_at(ty, row, c))
                                .sum::<f32>();
                        assert!(
                            (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                            "{} {kernel:?} token {t} row {r}: {got} vs {want}",
                            ty.name()
                        );
                    }
                }
            }
        }
    }
}

/// `linear_ggml` at decode and prefill sizes against the dense kernel on
/// the decoded matrix.
#[test]
fn linear_matches_the_dense_kernel_on_decoded_weights() {
    // 44 rows: every split of them over the pool leaves a partial tile.
    let (n, k) = (44, 256);
    for ty in TYPES {
        let (_, w) = random_matrix(ty, n, k, 13);
        let dense = w.to_dense();
        let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.01).collect();
        for m in [1, 3, GEMV_MAX_ROWS + 2] {
            let mut x = random_x(m * k, m as u32);
            // A loud channel in every token: the outlier path.
            for t in 0..m {
                x[t * k + 37] = 9.0;
            }
            let mut want = vec![0f32; m * n];
            linear(&x, m, &dense, Some(&bias), MatmulPolicy::Fastest, &mut want);
            let mut got = vec![0f32; m * n];
            linear_ggml(&x, m, &w, Some(&bias), MatmulPolicy::Fastest, &mut got);
            let worst = want
                .iter()
                .zip(&got)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let largest = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            // The row kernel's int8 activations against exact weights on
            // both sides of the GEMM path.
            let tolerance = if m > GEMV_MAX_ROWS { 1e-5 } else { 0.01 };
            assert!(
                worst <= tolerance * largest,
                "{} m={m}: worst {worst} of {largest}",
                ty.name()
            );
        }
    }
}

#[test]
fn a_matrix_of_partial_blocks_is_refused() {
    let err =
        GgmlMatrix::new(GgmlType::Q4_K, 2, 128, vec![0; 144]).expect_err("128 columns of Q4_K");
    assert!(err.to_string().contains("256-element blocks"), "{err}");
    let err = GgmlMatrix::new(GgmlType::Q4_0, 2, 64, vec![0; 71]).expect_err("71 bytes of Q4_0");
    assert!(err.to_string().contains("71 bytes"), "{err}");
    assert!(GgmlMatrix::new(GgmlType::F16, 1, 1, vec![0; 2]).is_err());
}
