//! [`MatmulPolicy::Bf16Activations`](crate::kernels::MatmulPolicy) on CPUs
//! with AVX2 and FMA but no AVX512-BF16 (AMD Zen 2–3, Intel before Ice
//! Lake, and VMs that hide AVX-512): `vdpbf16ps`'s arithmetic from FMAs.
//!
//! **Numerics.** The activations are rounded to bf16 (to nearest, ties to
//! even) as for `vdpbf16ps`, and kept widened to f32 ([`F32Tokens`]). A
//! bf16 × bf16 product is exact in f32, so an FMA adds it with one
//! rounding, as each half of a `vdpbf16ps` lane does; a pair is added odd
//! column first, then even, as Intel's definition of the instruction
//! orders them. An output is one chain over the pairs in column order,
//! whatever tile or batch it ran in: batch invariant by construction.
//!
//! **Tiles.** The panels of [`crate::kernels::Panels`] as packed for
//! AVX-512 (16 rows, a 64-byte line per pair of columns), read as two
//! halves of 8 rows: a 32-byte load is 8 rows' pairs, and one AND and one
//! shift widen it into the odd and the even column (a bf16 is the top half
//! of an f32). A tile is one panel (2 halves, 4 weight registers) × up to
//! 4 tokens (8 accumulators, 2 broadcast registers, of AVX2's 16), or a
//! lone token against 2 panels. Each accumulator is 8 finished outputs: no
//! reduction follows. The blocks and passes are [`super::panels::rows`]'s;
//! the hardware prefetcher streams the panels.
//!
//! Without this kernel the f32-activation row kernel ran a batch of 8–32
//! at about half the two cores' FMA peak (86–107 GFLOP/s of ~180 in a probe
//! of one linear; the panels here 100–124): it widens each weight once per
//! 3 tokens and reduces every output across lanes.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::panels::{PanelKernel, Tile, TokenRows};
use crate::kernels::panels::LANES;
use half::bf16;

/// Rows of a panel half: one f32 lane each in a 256-bit register.
const HALF: usize = LANES / 2;
/// Token rows per tile, at most (with one panel).
const MAX_TOKENS: usize = 4;

/// Whether this CPU runs the kernel (asked once).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// `m` token rows of `k` activations rounded to bf16 and kept as f32,
/// each row zero-padded to `stride`, a multiple of 8.
#[derive(Debug)]
pub struct F32Tokens {
    x: Vec<f32>,
    m: usize,
    k: usize,
    stride: usize,
}

impl F32Tokens {
    /// Rounds `x` (`m × k`, row-major).
    pub fn new(x: &[f32], m: usize, k: usize) -> Self {
        assert!(x.len() >= m * k, "x holds m × k values");
        let stride = k.next_multiple_of(HALF);
        let mut rounded = vec![0.0; m * stride];
        for (src, dst) in x.chunks_exact(k).zip(rounded.chunks_exact_mut(stride)) {
            round_into(src, dst);
        }
        Self {
            x: rounded,
            m,
            k,
            stride,
        }
    }

    pub(crate) fn rows(&self) -> TokenRows<f32> {
        TokenRows {
            x: self.x.as_ptr(),
            m: self.m,
            k: self.k,
            stride: self.stride,
        }
    }
}

/// `x` rounded to bf16, as f32: what the unpacked weights' row kernel
/// takes under the policy on this CPU.
pub fn rounded(x: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    round_into(x, &mut out);
    out
}

/// `src` rounded to bf16 (as `half` rounds: to nearest, ties to even,
/// NaN kept quiet) into the front of `dst`.
fn round_into(src: &[f32], dst: &mut [f32]) {
    assert!(dst.len() >= src.len());
    let mut whole = 0;
    if available() {
        whole = src.len() / 8 * 8;
        // SAFETY: `available()` holds; both slices hold `whole` elements.
        unsafe { round8s(src.as_ptr(), dst.as_mut_ptr(), whole) };
    }
    for (d, &s) in dst[whole..].iter_mut().zip(&src[whole..]) {
        *d = bf16::from_f32(s).to_f32();
    }
}

/// The first `len` (a multiple of 8) of `src` rounded into `dst`.
///
/// # Safety
/// AVX2; `src` and `dst` valid for `len` elements.
#[target_feature(enable = "avx2")]
unsafe fn round8s(src: *const f32, dst: *mut f32, len: usize) {
    let one = _mm256_set1_epi32(1);
    let half_ulp = _mm256_set1_epi32(0x7fff);
    let top = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    let quiet = _mm256_set1_epi32(0x0040_0000);
    for i in (0..len).step_by(8) {
        // SAFETY: i + 8 <= len.
        let v = unsafe { _mm256_loadu_ps(src.add(i)) };
        let b = _mm256_castps_si256(v);
        let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(b), one);
        let near = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(half_ulp, odd)), top);
        let nan = _mm256_and_si256(_mm256_or_si256(b, quiet), top);
        let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
        let r = _mm256_blendv_epi8(near, nan, is_nan);
        // SAFETY: i + 8 <= len.
        unsafe { _mm256_storeu_ps(dst.add(i), _mm256_castsi256_ps(r)) };
    }
}

/// The FMA panel kernel.
pub(crate) struct Fma;

impl PanelKernel for Fma {
    type X = f32;
    /// Software prefetches of the next block slowed a batch of 8 by a
    /// fifth on AMD Zen 3 (the hardware prefetcher follows the panels).
    const PREFETCH: bool = false;

    /// A lone token takes two panels a tile (four independent chains);
    /// more take one panel × up to 4 tokens, passes as even as that allows
    /// (5 tokens, 10 accumulators, measured no faster: 16 registers).
    fn shape(m: usize) -> (usize, usize) {
        match m {
            0 | 1 => (1, 2),
            _ => (m.div_ceil(MAX_TOKENS), 1),
        }
    }

    unsafe fn run(t: Tile<f32>, count: usize, tokens: usize) {
        // SAFETY: the caller's promise.
        unsafe { run(t, count, tokens) }
    }
}

/// The tile of `count` (1–2) panels × `tokens` (1–4) tokens.
///
/// # Safety
/// As [`tile`].
#[target_feature(enable = "avx2,fma")]
unsafe fn run(t: Tile<f32>, count: usize, tokens: usize) {
    // SAFETY (every arm): the caller's promise, for this shape.
    unsafe {
        match (count, tokens) {
            (2, 1) => store(t, &tile::<4, 1>(t)),
            (1, 1) => store(t, &tile::<2, 1>(t)),
            (1, 2) => store(t, &tile::<2, 2>(t)),
            (1, 3) => store(t, &tile::<2, 3>(t)),
            (1, 4) => store(t, &tile::<2, 4>(t)),
            // `Fma::shape` asks for nothing else.
            _ => {
                for one in t.singles(count, tokens) {
                    store(one, &tile::<2, 1>(one));
                }
            }
        }
    }
}

/// `H` panel halves (8 rows each, `H / 2` panels) against `T` token rows:
/// `[half][token]` accumulators, each the 8 outputs of one half for one
/// token.
///
/// # Safety
/// `t.w` starts `H / 2` panels of `t.pairs` pairs; `t.x` starts `T` token
/// rows `t.stride` apart, each readable for `2 * t.pairs` elements; AVX2
/// and FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const H: usize, const T: usize>(t: Tile<f32>) -> [[__m256; T]; H] {
    let mut acc = [[_mm256_setzero_ps(); T]; H];
    let step = 2 * LANES;
    let odd_mask = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    // No software prefetches (`Fma::PREFETCH`): `t.prefetch` is None.
    for j in 0..t.pairs {
        let mut odd = [_mm256_setzero_ps(); H];
        let mut even = [_mm256_setzero_ps(); H];
        for h in 0..H {
            let at = (h / 2) * t.panel_len + j * step + (h % 2) * LANES;
            // SAFETY: half h of pair j of panel h / 2 < H / 2.
            let v = unsafe { _mm256_loadu_si256(t.w.add(at).cast()) };
            odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, odd_mask));
            even[h] = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
        }
        for tok in 0..T {
            // SAFETY: token row tok < T holds 2 * pairs elements.
            let (xe, xo) = unsafe {
                let p = t.x.add(tok * t.stride + 2 * j);
                (_mm256_broadcast_ss(&*p), _mm256_broadcast_ss(&*p.add(1)))
            };
            for ((acc_h, &o), &e) in acc.iter_mut().zip(&odd).zip(&even) {
                acc_h[tok] = _mm256_fmadd_ps(o, xo, acc_h[tok]);
                acc_h[tok] = _mm256_fmadd_ps(e, xe, acc_h[tok]);
            }
        }
    }
    acc
}

/// A tile's accumulators into `out[token][8 · half ..]`, rows past `n`
/// masked off.
///
/// # Safety
/// The tile's halves start at rows `< n` or hold only rows past it; its
/// tokens are rows of the `m × n` output; AVX2.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store<const H: usize, const T: usize>(t: Tile<f32>, acc: &[[__m256; T]; H]) {
    for (h, acc_h) in acc.iter().enumerate() {
        let r0 = t.panel * LANES + h * HALF;
        if r0 >= t.n {
            continue;
        }
        let lanes = (t.n - r0).min(HALF);
        for (tok, &a) in acc_h.iter().enumerate() {
            let dst = t.out.wrapping_add((t.token + tok) * t.n + r0);
            if lanes == HALF {
                // SAFETY: row (t.token + tok) of the output, columns r0..r0
                // + 8 inside it (the caller's promise).
                unsafe { _mm256_storeu_ps(dst, a) };
            } else {
                // A masked store (`vmaskmovps`) is slow on AMD: the partial
                // half goes through the stack.
                let mut lane = [0f32; HALF];
                // SAFETY: `lane` holds 8 floats.
                unsafe { _mm256_storeu_ps(lane.as_mut_ptr(), a) };
                // SAFETY: columns r0..r0 + lanes of the row (as above).
                unsafe { std::ptr::copy_nonoverlapping(lane.as_ptr(), dst, lanes) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values as pseudo;
    use crate::kernels::Panels;
    use crate::weights::{Matrix, WeightData};

    /// `vdpbf16ps`'s chain, one output at a time: for each pair of columns
    /// the odd product, then the even one, each added with one rounding
    /// (`mul_add` is fused; a product of two bf16 is exact in f32).
    fn chain(w: &[bf16], x: &[f32], k: usize) -> f32 {
        let round = |v: f32| bf16::from_f32(v).to_f32();
        let mut acc = 0f32;
        for j in 0..k.div_ceil(2) {
            let (even, odd) = (2 * j, 2 * j + 1);
            if odd < k {
                acc = w[odd].to_f32().mul_add(round(x[odd]), acc);
            }
            acc = w[even].to_f32().mul_add(round(x[even]), acc);
        }
        acc
    }

    /// Every tile shape (a lone token's two panels; 1–4 tokens and several
    /// token tiles; partial last panels; an odd k) gives the chain's bits,
    /// so a token's outputs are the same alone and in any batch.
    #[test]
    fn tiles_compute_the_dpbf16_chain_bit_for_bit() {
        if !available() {
            return;
        }
        for (n, k, m) in [
            (37, 81, 9),
            (16, 64, 1),
            (150, 32, 7),
            (5, 200, 3),
            (96, 70, 13),
            (40, 33, 1),
        ] {
            let data: Vec<bf16> = pseudo(n * k, 3).into_iter().map(bf16::from_f32).collect();
            let w = Matrix {
                rows: n,
                cols: k,
                data: WeightData::Bf16(data.clone().into()),
            };
            let packed = Panels::pack(&w).expect("bf16 packs");
            let x = pseudo(m * k, 4);
            let tokens = F32Tokens::new(&x, m, k);
            let mut out = vec![f32::NAN; m * n];
            // SAFETY: `available()` holds; the range is the matrix's panels.
            unsafe {
                super::super::panels::rows::<Fma>(
                    &packed,
                    tokens.rows(),
                    &mut out,
                    0..packed.panels(),
                )
            };
            for t in 0..m {
                for r in 0..n {
                    let want = chain(&data[r * k..][..k], &x[t * k..][..k], k);
                    assert_eq!(
                        out[t * n + r].to_bits(),
                        want.to_bits(),
                        "n{n} k{k} m{m}: token {t} row {r}"
                    );
                }
            }
        }
    }

    /// The vector rounding is `half`'s: ties to even, overflow to infinity,
    /// NaN stays NaN, subnormals and signs kept.
    #[test]
    fn rounding_is_halfs() {
        let mut x = pseudo(1000, 9);
        x.extend([
            f32::from_bits(0x3f80_8000), // a tie, even below
            f32::from_bits(0x3f81_8000), // a tie, odd below
            f32::from_bits(0x3f80_8001),
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001), // a NaN whose payload rounding would lose
            f32::from_bits(0x0000_8000), // a subnormal tie
            -0.0,
            1e-40,
        ]);
        let got = rounded(&x);
        for (&v, &r) in x.iter().zip(&got) {
            let want = bf16::from_f32(v).to_f32();
            if want.is_nan() {
                assert!(r.is_nan(), "{v:e} ({:#x}) -> {r:e}", v.to_bits());
            } else {
                assert_eq!(r.to_bits(), want.to_bits(), "{v:e} ({:#x})", v.to_bits());
            }
        }
    }
}
