//! bf16 weights against many token rows on AMX tiles (Intel Sapphire Rapids
//! and later).
//!
//! A prefill chunk or a large decode batch is compute-bound in the row
//! kernel: AVX-512 widens each bf16 weight to f32 and retires 32 FMAs a
//! cycle. One AMX `tdpbf16ps` multiplies a 16 × 32 bf16 tile by a 32 × 16
//! one into 16 × 16 f32 sums, 1,024 FMAs a cycle.
//!
//! **Layout.** AMX wants its right operand pair-interleaved ("VNNI": row `p`
//! holds elements `2p, 2p + 1` of every column). Rather than re-lay the
//! weights (a second copy beside the row kernel's, or a re-pack per call
//! that would cost a decode step as much as reading them), the product is
//! computed transposed, `outᵀ = W · xᵀ`: the weights, `[n][k]` row-major as
//! loaded, are the *left* tile as they lie in memory (16 rows, 64 bytes
//! each, stride `2k`), and the activations are packed into the pair layout
//! per call, `O(m·k)` against the product's `O(m·n·k)`. Each 16 × 16 result
//! tile is written back transposed.
//!
//! **Precision.** Activations are f32 and AMX multiplies bf16, so each is
//! split in two bf16 halves, `x ≈ hi + lo` with `hi = bf16(x)` and
//! `lo = bf16(x − hi)`, and both halves run through the same weight tile
//! into the same f32 sums (two `tdpbf16ps` per weight tile): 16 significant
//! bits, a relative error under 2⁻¹⁶ per activation, where one bf16 pass
//! would round to 8 bits. The weights are bf16 already, so each product is
//! what the f32 kernels compute to within that, and the sums are f32 as
//! theirs are (in another order, as the GEMM's are).
//!
//! **Tiles.** Eight tile registers: four 16 × 16 accumulators (two weight
//! blocks of 16 rows × two token blocks of 16), two weight tiles and two
//! activation tiles. A thread owns a range of weight rows (a multiple of
//! 32), walks the tokens in chunks of [`CHUNK_BLOCKS`] blocks so that their
//! packed activations stay in L2 while it passes over its weight rows, and
//! loads the tile configuration at the start of its range and releases the
//! tiles at the end (so the kernel does not save 8 KiB of tile state at
//! every context switch in between).
//!
//! The kernel is used where the CPU has AMX-TILE and AMX-BF16 and Linux
//! grants this process the tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`),
//! for bf16 weights with `k` a multiple of 32; everything else keeps the
//! AVX kernels.

use std::sync::OnceLock;

use half::bf16;
use rayon::prelude::*;

/// Rows of a tile: weight rows per weight tile, tokens per activation tile.
const TILE_ROWS: usize = 16;
/// bf16 elements in a tile row (64 bytes): the `k` step of one `tdpbf16ps`.
const TILE_K: usize = 32;
/// How many tile steps ahead the weight rows are prefetched.
const PREFETCH_STEPS: usize = 4;
/// Token blocks a thread keeps hot while it passes over its weight rows:
/// 128 tokens, whose two packed halves take `512·k` bytes (768 KiB at
/// `k` = 1536), inside a 2 MiB L2.
const CHUNK_BLOCKS: usize = 8;

/// Whether this CPU and OS run AMX bf16 tiles for this process (asked once).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    // CPUID leaf 7: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
    let leaf = std::arch::x86_64::__cpuid_count(7, 0);
    if leaf.edx & (1 << 22) == 0 || leaf.edx & (1 << 24) == 0 {
        return false;
    }
    // The packing and write-back around the tiles are AVX-512 (every AMX
    // CPU has both).
    if !is_x86_feature_detected!("avx512f") || !is_x86_feature_detected!("avx512bf16") {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM) only asks the kernel to let
    // this process use the tile-data state component; it reads and writes
    // no memory of ours.
    let granted = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    granted == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// Whether a bf16 matrix of `k` columns runs on tiles (its rows past
/// [`tiled_rows`] on the row kernel).
pub fn fits(k: usize) -> bool {
    k > 0 && k.is_multiple_of(TILE_K)
}

/// Weight rows [`rows`] runs on tiles; rows past it take the row kernel.
pub fn tiled_rows(n: usize) -> usize {
    n / TILE_ROWS * TILE_ROWS
}

/// `m` token rows of `k` activations split into bf16 halves and packed
/// pair-interleaved per block of 16 tokens: element `(token t, column c)`
/// of block `b` is at `((b·k/2 + c/2)·16 + t)·2 + c%2`. Tokens past `m` in
/// the last block are zeros.
#[derive(Debug)]
pub struct PackedTokens {
    hi: Vec<bf16>,
    lo: Vec<bf16>,
    m: usize,
    k: usize,
}

impl PackedTokens {
    /// Packs `x` (`m × k`, row-major), a block of 16 tokens per task.
    pub fn new(x: &[f32], m: usize, k: usize) -> Self {
        assert!(
            fits(k) && x.len() >= m * k,
            "x holds m × k values, k a multiple of 32"
        );
        assert!(available(), "AMX tiles are not available");
        let block_len = k * TILE_ROWS;
        let len = m.div_ceil(TILE_ROWS) * block_len;
        let (mut hi, mut lo) = (vec![bf16::ZERO; len], vec![bf16::ZERO; len]);
        hi.par_chunks_mut(block_len)
            .zip(lo.par_chunks_mut(block_len))
            .enumerate()
            .for_each(|(b, (hi, lo))| {
                let first = b * TILE_ROWS;
                let rows = &x[first * k..(first + TILE_ROWS).min(m) * k];
                // SAFETY: `available()` (asserted above) includes AVX-512F
                // and AVX512-BF16; the block is 16·k elements and `rows` at
                // most 16 rows of k.
                unsafe { simd::pack_block(rows, k, hi, lo) };
            });
        Self { hi, lo, m, k }
    }

    fn blocks(&self) -> usize {
        self.m.div_ceil(TILE_ROWS)
    }

    /// The first tile row of block `b`'s packed half.
    fn block(half: &[bf16], k: usize, b: usize) -> *const bf16 {
        half[b * k * TILE_ROWS..].as_ptr()
    }
}

/// Weight rows `r0..r1` (multiples of 16, `r1 ≤ tiled_rows(n)`) of
/// `out = x · wᵀ`, `w` the whole `[n, k]` bf16 matrix, `out` the whole
/// `m × n` result; writes only columns `r0..r1`.
///
/// # Panics
/// If [`available`] is false or the shapes do not fit.
pub fn rows(w: &[bf16], n: usize, x: &PackedTokens, r0: usize, r1: usize, out: &mut [f32]) {
    let k = x.k;
    assert!(available(), "AMX tiles are not available");
    assert!(
        fits(k) && w.len() == n * k,
        "w is n × k with k a multiple of 32"
    );
    assert!(r0.is_multiple_of(TILE_ROWS) && r1.is_multiple_of(TILE_ROWS) && r1 <= n);
    assert!(out.len() >= x.m * n, "out holds m × n values");
    let tiles = Tiles::configure();
    let blocks = x.blocks();
    for chunk in (0..blocks).step_by(CHUNK_BLOCKS) {
        let chunk_end = (chunk + CHUNK_BLOCKS).min(blocks);
        for row in (r0..r1).step_by(2 * TILE_ROWS) {
            for token_block in (chunk..chunk_end).step_by(2) {
                let pair = Pair {
                    row,
                    both_rows: row + 2 * TILE_ROWS <= r1,
                    token_block,
                    both_tokens: token_block + 1 < chunk_end,
                    first_of_rows: token_block == chunk,
                };
                let sums = tiles.pair(w, x, pair);
                pair.write_back(&sums, x.m, n, out);
            }
        }
    }
}

/// The four 16 × 16 accumulators of one [`Pair`], as stored:
/// `[weight block][token block][weight row][token]`.
type Sums = [[[[f32; TILE_ROWS]; TILE_ROWS]; 2]; 2];

/// Two blocks of 16 weight rows from `row` by two blocks of 16 tokens from
/// `token_block`; at the end of a range only one of either may be real.
#[derive(Debug, Clone, Copy)]
struct Pair {
    row: usize,
    both_rows: bool,
    token_block: usize,
    both_tokens: bool,
    /// The first pair over these weight rows in its chunk (later ones find
    /// them in cache).
    first_of_rows: bool,
}

impl Pair {
    /// Writes the real parts of `sums` into `out` (`m × n`): each tile
    /// transposed, token `t`'s row, the pair's columns.
    fn write_back(self, sums: &Sums, m: usize, n: usize, out: &mut [f32]) {
        let weight_blocks = 1 + usize::from(self.both_rows);
        let token_blocks = 1 + usize::from(self.both_tokens);
        for (wi, by_tokens) in sums.iter().enumerate().take(weight_blocks) {
            let col = self.row + wi * TILE_ROWS;
            for (ti, tile) in by_tokens.iter().enumerate().take(token_blocks) {
                let first = (self.token_block + ti) * TILE_ROWS;
                let tokens = TILE_ROWS.min(m - first);
                let dst = &mut out[first * n + col..];
                assert!(dst.len() >= (tokens - 1) * n + TILE_ROWS);
                // SAFETY: `available()` (asserted by `rows`) includes
                // AVX-512F; `dst` holds rows 0..tokens of 16 floats at
                // stride n (checked above).
                unsafe { simd::store_transposed(tile, tokens, dst, n) };
            }
        }
    }
}

/// The tile configuration, loaded on this thread for as long as it lives
/// (released on drop).
struct Tiles(());

/// `ldtilecfg`'s 64-byte operand.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    /// Bytes per row of tiles 0..16.
    colsb: [u16; 16],
    /// Rows of tiles 0..16.
    rows: [u8; 16],
}

impl Tiles {
    /// Eight tiles of 16 rows × 64 bytes: 0–3 accumulators, 4–5 weights,
    /// 6–7 activations.
    fn configure() -> Self {
        let mut cfg = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for t in 0..8 {
            cfg.colsb[t] = 64;
            cfg.rows[t] = TILE_ROWS as u8;
        }
        // SAFETY: `available()` (asserted by the caller) means the CPU has
        // AMX-TILE and the OS grants its state; `cfg` is a valid 64-byte
        // palette-1 configuration that outlives the instruction.
        unsafe {
            std::arch::asm!("ldtilecfg [{0}]", in(reg) &cfg, options(nostack, readonly));
        }
        Self(())
    }

    /// One [`Pair`] over all of `k`. A lone block (the last of a range)
    /// repeats its neighbour's operand, whose sums are then not written
    /// back, so no load leaves the buffers.
    fn pair(&self, w: &[bf16], x: &PackedTokens, pair: Pair) -> Sums {
        let k = x.k;
        let w0 = w[pair.row * k..].as_ptr();
        let w1 = if pair.both_rows {
            w[(pair.row + TILE_ROWS) * k..].as_ptr()
        } else {
            w0
        };
        let (b0, b1) = (
            pair.token_block,
            pair.token_block + usize::from(pair.both_tokens),
        );
        let (h0, h1) = (
            PackedTokens::block(&x.hi, k, b0),
            PackedTokens::block(&x.hi, k, b1),
        );
        let (l0, l1) = (
            PackedTokens::block(&x.lo, k, b0),
            PackedTokens::block(&x.lo, k, b1),
        );
        let w_stride = k * 2;
        let step_bytes = TILE_K * 2;
        let pack_step = TILE_ROWS * TILE_K;
        // SAFETY: the tiles are configured on this thread (`self`). Each
        // weight load reads 16 rows of 64 bytes at stride 2k from a block
        // of 16 rows inside w (`rows` checks r1 ≤ n) at column s·32 < k; each
        // activation load reads 1 KiB at element s·512 of a block, which
        // holds k·16 elements. Tiles 0–3 are zeroed first and stored into
        // `sums` (4 × 1 KiB, stride 64 bytes).
        unsafe {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
            let steps = k / TILE_K;
            for s in 0..steps {
                if pair.first_of_rows && s + PREFETCH_STEPS < steps {
                    // The weight rows are 32 streams at stride 2k, more
                    // than the hardware prefetcher follows: fetch each
                    // row's bytes a few steps ahead.
                    let ahead = (s + PREFETCH_STEPS) * step_bytes;
                    for r in 0..TILE_ROWS {
                        let at = r * w_stride + ahead;
                        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                        _mm_prefetch::<_MM_HINT_T0>(w0.cast::<i8>().add(at));
                        _mm_prefetch::<_MM_HINT_T0>(w1.cast::<i8>().add(at));
                    }
                }
                std::arch::asm!(
                    "tileloadd tmm4, [{w0} + {ws}*1]",
                    "tileloadd tmm5, [{w1} + {ws}*1]",
                    "tileloadd tmm6, [{h0} + {ps}*1]",
                    "tileloadd tmm7, [{h1} + {ps}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    "tileloadd tmm6, [{l0} + {ps}*1]",
                    "tileloadd tmm7, [{l1} + {ps}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    w0 = in(reg) w0.cast::<u8>().add(s * step_bytes),
                    w1 = in(reg) w1.cast::<u8>().add(s * step_bytes),
                    h0 = in(reg) h0.add(s * pack_step),
                    h1 = in(reg) h1.add(s * pack_step),
                    l0 = in(reg) l0.add(s * pack_step),
                    l1 = in(reg) l1.add(s * pack_step),
                    ws = in(reg) w_stride,
                    ps = in(reg) 64usize,
                    options(nostack, readonly)
                );
            }
            let mut sums: Sums = [[[[0.0; TILE_ROWS]; TILE_ROWS]; 2]; 2];
            let base = sums.as_mut_ptr().cast::<f32>();
            let tile_floats = TILE_ROWS * TILE_ROWS;
            std::arch::asm!(
                "tilestored [{c0} + {st}*1], tmm0",
                "tilestored [{c1} + {st}*1], tmm1",
                "tilestored [{c2} + {st}*1], tmm2",
                "tilestored [{c3} + {st}*1], tmm3",
                c0 = in(reg) base,
                c1 = in(reg) base.add(tile_floats),
                c2 = in(reg) base.add(2 * tile_floats),
                c3 = in(reg) base.add(3 * tile_floats),
                st = in(reg) 64usize,
                options(nostack)
            );
            sums
        }
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured on this thread by `configure`;
        // releasing returns them to the init state.
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem));
        }
    }
}

mod simd {
    //! The AVX-512 halves of packing and write-back: both are 16 × 16
    //! transposes of 32-bit lanes.

    use std::arch::x86_64::*;

    use half::bf16;

    use super::{TILE_K, TILE_ROWS};
    use crate::kernels::simd512::transpose16 as transpose;

    /// 16 floats as bf16 and what that left, each 16 bf16 in a half.
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn split(v: __m512) -> (__m256i, __m256i) {
        // SAFETY: both are 32 bytes of plain lanes, any bits valid.
        let bits = |h: __m256bh| unsafe { std::mem::transmute::<__m256bh, __m256i>(h) };
        let hi = bits(_mm512_cvtneps_pbh(v));
        let hi_f32 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi)));
        let lo = bits(_mm512_cvtneps_pbh(_mm512_sub_ps(v, hi_f32)));
        (hi, lo)
    }

    /// One block of up to 16 token rows (`rows`, row-major of `k`) into
    /// its two packed halves (`16·k` elements each; tokens past the rows
    /// stay zero): per 32 columns, the 16 × 16 matrix of bf16 pairs
    /// (token × pair) transposed into a tile (pair × token).
    ///
    /// # Safety
    /// The CPU must have AVX-512F and AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn pack_block(rows: &[f32], k: usize, hi: &mut [bf16], lo: &mut [bf16]) {
        let tokens = rows.len() / k;
        assert!(tokens <= TILE_ROWS && hi.len() == k * TILE_ROWS && lo.len() == hi.len());
        for s in 0..k / TILE_K {
            let mut hi_rows = [_mm512_setzero_si512(); 16];
            let mut lo_rows = [_mm512_setzero_si512(); 16];
            for t in 0..tokens {
                let at = &rows[t * k + s * TILE_K..t * k + (s + 1) * TILE_K];
                // SAFETY: `at` holds 32 floats.
                let (a, b) = unsafe {
                    (
                        _mm512_loadu_ps(at.as_ptr()),
                        _mm512_loadu_ps(at.as_ptr().add(16)),
                    )
                };
                let ((ha, la), (hb, lb)) = (split(a), split(b));
                hi_rows[t] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ha), hb);
                lo_rows[t] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(la), lb);
            }
            let tile = s * TILE_ROWS * TILE_K;
            for (half, rows) in [(&mut *hi, hi_rows), (&mut *lo, lo_rows)] {
                let dst = &mut half[tile..tile + TILE_ROWS * TILE_K];
                for (p, row) in transpose(rows).into_iter().enumerate() {
                    // SAFETY: `dst` holds 16 rows of 32 bf16 (64 bytes).
                    unsafe { _mm512_storeu_si512(dst[p * TILE_K..].as_mut_ptr().cast(), row) };
                }
            }
        }
    }

    /// Rows `0..tokens` of `tile`'s transpose (`tile[r][t]` → row `t`,
    /// lane `r`) into `dst` at stride `n`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `dst` must hold `(tokens − 1)·n + 16`
    /// floats.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn store_transposed(
        tile: &[[f32; TILE_ROWS]; TILE_ROWS],
        tokens: usize,
        dst: &mut [f32],
        n: usize,
    ) {
        // SAFETY: each row of `tile` is 16 floats.
        let rows = std::array::from_fn(|r| unsafe { _mm512_loadu_si512(tile[r].as_ptr().cast()) });
        for (t, row) in transpose(rows).into_iter().take(tokens).enumerate() {
            // SAFETY: t < tokens, so t·n + 16 ≤ dst.len() (the caller's
            // contract).
            unsafe { _mm512_storeu_si512(dst.as_mut_ptr().add(t * n).cast(), row) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{linear, MatmulPolicy};
    use crate::weights::{Matrix, WeightData};

    fn pseudo(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                // Spread over several binades, as activations are.
                let mag = 2f32.powi((s % 7) as i32 - 3);
                mag * (((s >> 11) % 2001) as f32 / 1000.0 - 1.0)
            })
            .collect()
    }

    /// `x · wᵀ` in f64 with `x` first rounded by `round`.
    fn reference(x: &[f32], m: usize, w: &[bf16], n: usize, round: fn(f32) -> f32) -> Vec<f64> {
        let k = w.len() / n;
        let mut out = vec![0.0; m * n];
        for t in 0..m {
            for r in 0..n {
                out[t * n + r] = (0..k)
                    .map(|i| f64::from(round(x[t * k + i])) * f64::from(w[r * k + i].to_f32()))
                    .sum();
            }
        }
        out
    }

    #[test]
    fn tiles_are_f32_grade_and_two_halves_beat_one_by_far() {
        if !available() {
            eprintln!("this CPU or OS has no AMX tiles: nothing to check");
            return;
        }
        // Odd token counts (a lone last block), weight rows past the last
        // full tile (row kernel), one and several tile steps of k, and more
        // tokens than a chunk.
        for &(m, n, k) in &[
            (8, 16, 32),
            (17, 48, 64),
            (33, 200, 96),
            (150, 64, 576),
            (40, 1000, 64),
        ] {
            let x = pseudo(m * k, (m * n) as u64);
            let w: Vec<bf16> = pseudo(n * k, k as u64)
                .into_iter()
                .map(bf16::from_f32)
                .collect();
            let matrix = Matrix {
                rows: n,
                cols: k,
                data: WeightData::Bf16(w.clone().into()),
            };
            let mut got = vec![f32::NAN; m * n];
            linear(&x, m, &matrix, None, MatmulPolicy::Fastest, &mut got);
            let exact = reference(&x, m, &w, n, |v| v);
            let one_half = reference(&x, m, &w, n, |v| bf16::from_f32(v).to_f32());
            let abs = reference(
                &x.iter().map(|v| v.abs()).collect::<Vec<_>>(),
                m,
                &w.iter()
                    .map(|v| bf16::from_f32(v.to_f32().abs()))
                    .collect::<Vec<_>>(),
                n,
                |v| v,
            );
            let (mut worst, mut worst_one) = (0f64, 0f64);
            for i in 0..m * n {
                let scale = abs[i].max(1e-30);
                worst = worst.max((f64::from(got[i]) - exact[i]).abs() / scale);
                worst_one = worst_one.max((one_half[i] - exact[i]).abs() / scale);
            }
            assert!(worst < 2e-5, "{m}x{n}x{k}: error {worst:e} of Σ|x·w|");
            assert!(
                worst * 30.0 < worst_one,
                "{m}x{n}x{k}: {worst:e} vs one bf16 pass {worst_one:e}"
            );
        }
    }
}
