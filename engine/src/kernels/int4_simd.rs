//! The INT4 × int8 integer row kernels (see `int4.rs` for the arithmetic).
//!
//! One 32-byte load holds 64 codes of a row (low nibbles: columns 0..32,
//! high nibbles: 32..64); a mask and a shift give two registers of 32 codes
//! in column order, the order of the int8 activations. A tile is `R` weight
//! rows × `T` token rows: each weight block is unpacked once and multiplied
//! into every token row, with i32 accumulators per group (folded into f32
//! accumulators at each group's end) and f32 accumulators across groups.
//!
//! The unsigned×signed byte dot product has three forms, one kernel each,
//! picked at run time: AVX-VNNI `vpdpbusd` (VEX), AVX-512 VNNI `vpdpbusd` on
//! 256-bit registers (EVEX, AVX-512VL), and AVX2 `vpmaddubsw` + `vpmaddwd`
//! (codes are at most 15 and activations at most 127 in magnitude, so the
//! i16 pair sums cannot saturate). Other CPUs use the scalar kernel.

use super::int4::{rows_int4_scalar, Int4Rows, QuantizedActivations};

/// Which implementation runs the integer dot products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Scalar,
    Avx2,
    AvxVnni,
    Avx512Vnni,
}

/// Whether this CPU can run `kernel`.
pub fn is_supported(kernel: Kernel) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        match kernel {
            Kernel::Scalar => true,
            Kernel::Avx2 => avx2,
            Kernel::AvxVnni => avx2 && is_x86_feature_detected!("avxvnni"),
            Kernel::Avx512Vnni => {
                avx2 && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("avx512vl")
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        kernel == Kernel::Scalar
    }
}

/// Every kernel this CPU can run (the scalar one always).
#[cfg(test)]
pub fn supported_kernels() -> Vec<Kernel> {
    [
        Kernel::Scalar,
        Kernel::Avx2,
        Kernel::AvxVnni,
        Kernel::Avx512Vnni,
    ]
    .into_iter()
    .filter(|&k| is_supported(k))
    .collect()
}

/// The fastest kernel this CPU runs.
pub fn best_kernel() -> Kernel {
    // The EVEX form first: the same instruction, with 32 vector registers
    // for the tile's accumulators instead of 16.
    [Kernel::Avx512Vnni, Kernel::AvxVnni, Kernel::Avx2]
        .into_iter()
        .find(|&k| is_supported(k))
        .unwrap_or(Kernel::Scalar)
}

/// `out[t * n + r0 + r] = w_row(r) · x_row(t)` for the rows of `w`, with
/// `kernel` (which must be in [`supported_kernels`]; unsupported ones fall
/// back to the scalar kernel).
pub(crate) fn rows_int4(
    kernel: Kernel,
    w: &Int4Rows<'_>,
    xa: &QuantizedActivations,
    m: usize,
    out: &mut [f32],
    n: usize,
    r0: usize,
) {
    debug_assert!(w.k.is_multiple_of(w.group) && w.k.is_multiple_of(64));
    debug_assert!(out.len() >= m * n && xa.codes.len() >= m * w.k);
    #[cfg(target_arch = "x86_64")]
    if is_supported(kernel) {
        // SAFETY: the CPU supports the features of the chosen kernel (checked
        // just above); the slices' sizes are those `rows` documents.
        unsafe {
            match kernel {
                Kernel::Avx2 => avx2::rows(w, xa, m, out, n, r0),
                Kernel::AvxVnni => avxvnni::rows(w, xa, m, out, n, r0),
                Kernel::Avx512Vnni => avx512vnni::rows(w, xa, m, out, n, r0),
                Kernel::Scalar => rows_int4_scalar(w, xa, m, out, n, r0),
            }
        }
        return;
    }
    let _ = kernel;
    rows_int4_scalar(w, xa, m, out, n, r0);
}

/// How many tiles ahead the kernels prefetch weights.
#[cfg(target_arch = "x86_64")]
const PREFETCH_TILES: usize = 2;

/// Generates one kernel module: `$features` are the target features, `$dot`
/// the i32 accumulate of unsigned codes × signed activations.
#[cfg(target_arch = "x86_64")]
macro_rules! int4_kernel {
    ($name:ident, $features:literal, |$acc:ident, $w:ident, $x:ident| $dot:expr) => {
        mod $name {
            use super::super::int4::{Int4Rows, QuantizedActivations};
            use super::PREFETCH_TILES;
            use std::arch::x86_64::*;

            #[inline]
            #[target_feature(enable = $features)]
            fn dot($acc: __m256i, $w: __m256i, $x: __m256i) -> __m256i {
                $dot
            }

            #[inline]
            #[target_feature(enable = $features)]
            fn f16_to_f32(bits: u16) -> f32 {
                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
            }

            #[inline]
            #[target_feature(enable = $features)]
            fn hsum(v: __m256) -> f32 {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
                _mm_cvtss_f32(s)
            }

            /// Prefetches the weight bytes `PREFETCH_TILES` tiles ahead of
            /// 64-column step `c`. The tile's rows are one contiguous run of
            /// R·k/2 bytes, read as R short interleaved streams that the
            /// hardware prefetcher follows badly: R/2 cache lines per step,
            /// so the run is all requested by the time this tile ends. (A
            /// prefetch never faults, so the address may pass the end.)
            #[inline]
            #[target_feature(enable = $features)]
            fn prefetch_ahead<const R: usize>(w: *const u8, k: usize, c: usize) {
                let ahead = w.wrapping_add(PREFETCH_TILES * R * k / 2 + c / 64 * R * 32);
                for line in 0..R.div_ceil(2) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line * 64).cast());
                }
            }

            /// The int8 activations of one 64-column block of `T` token
            /// rows: columns c..c+32 (the weights' low nibbles) and
            /// c+32..c+64 (the high ones).
            ///
            /// # Safety
            /// `c + 64 <= k` and `xq` holds `T` rows of `k` codes.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn load_block<const T: usize>(
                xq: *const i8,
                k: usize,
                c: usize,
            ) -> ([__m256i; T], [__m256i; T]) {
                let mut x_lo = [_mm256_setzero_si256(); T];
                let mut x_hi = [_mm256_setzero_si256(); T];
                for t in 0..T {
                    // SAFETY: c + 64 <= k inside token row t (the caller).
                    unsafe {
                        x_lo[t] = _mm256_loadu_si256(xq.add(t * k + c).cast());
                        x_hi[t] = _mm256_loadu_si256(xq.add(t * k + c + 32).cast());
                    }
                }
                (x_lo, x_hi)
            }

            /// One tile of `R` weight rows × `T` token rows.
            ///
            /// # Safety
            /// `w` holds `R` rows of `k / 2` packed bytes, `ws` (f16 bits)
            /// and `wz` `R` rows of `k / group` values; `xq` holds `T` rows of `k`
            /// codes, `xs`/`xsum` `T` rows of `k / group`; `out` reaches
            /// `(T - 1) * n + col + R - 1`.
            #[inline]
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn tile<const R: usize, const T: usize, const FINE: bool>(
                w: *const u8,
                ws: *const u16,
                wz: *const u8,
                k: usize,
                group: usize,
                xq: *const i8,
                xf: *const i8,
                xs: *const f32,
                xsum: *const f32,
                out: *mut f32,
                n: usize,
                col: usize,
            ) {
                let gpr = k / group;
                let mask = _mm256_set1_epi8(0x0f);
                let mut facc = [[_mm256_setzero_ps(); T]; R];
                let mut iacc = [[_mm256_setzero_si256(); T]; R];
                // The fine codes' sums (`FINE`), joined to the coarse ones
                // as `coarse · 128 + fine` at each group's end.
                let mut iacc_fine = [[_mm256_setzero_si256(); T]; R];
                // Each row's weight scales for groups 8j..8j+8, in f32:
                // eight converted at once, so a group's flush only picks
                // its lane (the flush is most of the work at 32 columns a
                // group). A last window of fewer than eight groups is read
                // one scale at a time.
                let mut sw8 = [_mm256_setzero_ps(); R];
                let full_windows = gpr / 8 * 8;
                // Folds the integer sums of group `g` into the float
                // accumulators and clears them. Groups arrive in order.
                macro_rules! flush {
                    ($g:expr) => {
                        let g = $g;
                        if g % 8 == 0 && g < full_windows {
                            for r in 0..R {
                                // SAFETY: groups g..g + 8 of weight row r.
                                sw8[r] = _mm256_cvtph_ps(unsafe {
                                    _mm_loadu_si128(ws.add(r * gpr + g).cast())
                                });
                            }
                        }
                        let lane = _mm256_set1_epi32((g % 8) as i32);
                        let mut sx = [_mm256_setzero_ps(); T];
                        for t in 0..T {
                            // SAFETY: group g of token row t.
                            sx[t] = _mm256_set1_ps(unsafe { *xs.add(t * gpr + g) });
                        }
                        for r in 0..R {
                            let sw = if g < full_windows {
                                _mm256_permutevar8x32_ps(sw8[r], lane)
                            } else {
                                // SAFETY: group g of weight row r.
                                _mm256_set1_ps(f16_to_f32(unsafe { *ws.add(r * gpr + g) }))
                            };
                            for t in 0..T {
                                if FINE {
                                    iacc[r][t] = _mm256_add_epi32(
                                        _mm256_slli_epi32(iacc[r][t], 7),
                                        iacc_fine[r][t],
                                    );
                                    iacc_fine[r][t] = _mm256_setzero_si256();
                                }
                                facc[r][t] = _mm256_fmadd_ps(
                                    _mm256_cvtepi32_ps(iacc[r][t]),
                                    _mm256_mul_ps(sw, sx[t]),
                                    facc[r][t],
                                );
                                iacc[r][t] = _mm256_setzero_si256();
                            }
                        }
                    };
                }
                let mut c = 0;
                while c < k {
                    prefetch_ahead::<R>(w, k, c);
                    // SAFETY: c + 64 <= k inside each of the T token rows.
                    let (x_lo, x_hi) = unsafe { load_block::<T>(xq, k, c) };
                    let (f_lo, f_hi) = if FINE {
                        // SAFETY: the fine codes have the coarse ones' shape.
                        unsafe { load_block::<T>(xf, k, c) }
                    } else {
                        (x_lo, x_hi)
                    };
                    if group == 32 {
                        // The two halves belong to different groups.
                        for r in 0..R {
                            // SAFETY: bytes c/2 .. c/2 + 32 of weight row r.
                            let raw =
                                unsafe { _mm256_loadu_si256(w.add(r * k / 2 + c / 2).cast()) };
                            let lo = _mm256_and_si256(raw, mask);
                            for t in 0..T {
                                iacc[r][t] = dot(iacc[r][t], lo, x_lo[t]);
                                if FINE {
                                    iacc_fine[r][t] = dot(iacc_fine[r][t], lo, f_lo[t]);
                                }
                            }
                        }
                        flush!(c / 32);
                        for r in 0..R {
                            // SAFETY: as above.
                            let raw =
                                unsafe { _mm256_loadu_si256(w.add(r * k / 2 + c / 2).cast()) };
                            let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
                            for t in 0..T {
                                iacc[r][t] = dot(iacc[r][t], hi, x_hi[t]);
                                if FINE {
                                    iacc_fine[r][t] = dot(iacc_fine[r][t], hi, f_hi[t]);
                                }
                            }
                        }
                    } else {
                        for r in 0..R {
                            // SAFETY: bytes c/2 .. c/2 + 32 of weight row r.
                            let raw =
                                unsafe { _mm256_loadu_si256(w.add(r * k / 2 + c / 2).cast()) };
                            let lo = _mm256_and_si256(raw, mask);
                            let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
                            for t in 0..T {
                                iacc[r][t] = dot(iacc[r][t], lo, x_lo[t]);
                                iacc[r][t] = dot(iacc[r][t], hi, x_hi[t]);
                                if FINE {
                                    iacc_fine[r][t] = dot(iacc_fine[r][t], lo, f_lo[t]);
                                    iacc_fine[r][t] = dot(iacc_fine[r][t], hi, f_hi[t]);
                                }
                            }
                        }
                    }
                    c += 64;
                    if c.is_multiple_of(group) {
                        flush!(c / group - 1);
                    }
                }
                let mut dots = [[0f32; T]; R];
                for r in 0..R {
                    for t in 0..T {
                        dots[r][t] = hsum(facc[r][t]);
                    }
                }
                // SAFETY: the tile's R weight rows and T token rows of group
                // data (this function's contract).
                let sums = unsafe { minus_zero_terms::<R, T>(dots, ws, wz, xsum, gpr) };
                for r in 0..R {
                    for t in 0..T {
                        // SAFETY: within the bounds promised by the caller.
                        unsafe { *out.add(t * n + col + r) = sums[r][t] };
                    }
                }
            }

            /// `dots` less a tile's zero-point terms, `Σ_g s_g · z_g · Σx_g`
            /// per (weight row, token row): eight groups at a time, then the
            /// last window's one at a time.
            ///
            /// # Safety
            /// `ws` and `wz` hold `R` rows of `gpr` values, `xsum` `T` rows.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn minus_zero_terms<const R: usize, const T: usize>(
                mut dots: [[f32; T]; R],
                ws: *const u16,
                wz: *const u8,
                xsum: *const f32,
                gpr: usize,
            ) -> [[f32; T]; R] {
                let full_windows = gpr / 8 * 8;
                let sixteenth = _mm256_set1_ps(1.0 / 16.0);
                let mut zacc = [[_mm256_setzero_ps(); T]; R];
                for g in (0..full_windows).step_by(8) {
                    for r in 0..R {
                        // SAFETY: groups g..g + 8 of weight row r.
                        let (sw, z) = unsafe {
                            (
                                _mm256_cvtph_ps(_mm_loadu_si128(ws.add(r * gpr + g).cast())),
                                _mm_loadl_epi64(wz.add(r * gpr + g).cast()),
                            )
                        };
                        let z = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(z)), sixteenth);
                        let swz = _mm256_mul_ps(sw, z);
                        for t in 0..T {
                            // SAFETY: groups g..g + 8 of token row t.
                            let xsums = unsafe { _mm256_loadu_ps(xsum.add(t * gpr + g)) };
                            zacc[r][t] = _mm256_fmadd_ps(swz, xsums, zacc[r][t]);
                        }
                    }
                }
                for r in 0..R {
                    for t in 0..T {
                        let mut s = dots[r][t] - hsum(zacc[r][t]);
                        for g in full_windows..gpr {
                            // SAFETY: group g of weight row r and token row t.
                            let (sw, z, xs) = unsafe {
                                (
                                    *ws.add(r * gpr + g),
                                    *wz.add(r * gpr + g),
                                    *xsum.add(t * gpr + g),
                                )
                            };
                            s -= f16_to_f32(sw) * crate::quant::zero_point(z) * xs;
                        }
                        dots[r][t] = s;
                    }
                }
                dots
            }

            /// # Safety
            /// The CPU supports `$features`; `out` holds `m * n` floats and
            /// the rows of `w` are rows `r0..` of an `n`-row matrix.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn rows(
                w: &Int4Rows<'_>,
                xa: &QuantizedActivations,
                m: usize,
                out: &mut [f32],
                n: usize,
                r0: usize,
            ) {
                let (k, group) = (w.k, w.group);
                let gpr = k / group;
                let rows = w.len();
                // Fine codes double the accumulators: one token row a tile
                // keeps them in registers.
                let fine = xa.fine.as_deref();
                let max_t = if fine.is_some() { 1 } else { 2 };
                let mut r = 0;
                while r < rows {
                    let rr = (rows - r).min(4);
                    let mut t = 0;
                    while t < m {
                        let tt = (m - t).min(max_t);
                        // SAFETY: rows r..r+rr of this run and token rows
                        // t..t+tt exist; out index (t+tt-1)*n + r0+r+rr-1 <
                        // m*n <= out.len().
                        unsafe {
                            let args = (
                                w.packed.as_ptr().add(r * k / 2),
                                w.scales.as_ptr().add(r * gpr).cast::<u16>(),
                                w.zeros.as_ptr().add(r * gpr),
                                xa.codes.as_ptr().add(t * k),
                                fine.map_or(std::ptr::null(), |f| f.as_ptr().add(t * k)),
                                xa.scales.as_ptr().add(t * gpr),
                                xa.sums.as_ptr().add(t * gpr),
                                out.as_mut_ptr().add(t * n),
                            );
                            macro_rules! go {
                                ($r:literal, $t:literal, $fine:literal) => {
                                    tile::<$r, $t, $fine>(
                                        args.0,
                                        args.1,
                                        args.2,
                                        k,
                                        group,
                                        args.3,
                                        args.4,
                                        args.5,
                                        args.6,
                                        args.7,
                                        n,
                                        r0 + r,
                                    )
                                };
                            }
                            match (rr, tt, fine.is_some()) {
                                (4, _, true) => go!(4, 1, true),
                                (3, _, true) => go!(3, 1, true),
                                (2, _, true) => go!(2, 1, true),
                                (_, _, true) => go!(1, 1, true),
                                (4, 2, _) => go!(4, 2, false),
                                (4, _, _) => go!(4, 1, false),
                                (3, 2, _) => go!(3, 2, false),
                                (3, _, _) => go!(3, 1, false),
                                (2, 2, _) => go!(2, 2, false),
                                (2, _, _) => go!(2, 1, false),
                                (_, 2, _) => go!(1, 2, false),
                                _ => go!(1, 1, false),
                            }
                        }
                        t += tt;
                    }
                    r += rr;
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
int4_kernel!(avx2, "avx2,fma,f16c", |acc, w, x| _mm256_add_epi32(
    acc,
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
));
#[cfg(target_arch = "x86_64")]
int4_kernel!(avxvnni, "avx2,fma,f16c,avxvnni", |acc, w, x| {
    _mm256_dpbusd_avx_epi32(acc, w, x)
});
#[cfg(target_arch = "x86_64")]
int4_kernel!(
    avx512vnni,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    |acc, w, x| _mm256_dpbusd_epi32(acc, w, x)
);
