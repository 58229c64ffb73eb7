//! The INT4 × int8 integer row kernels (see `int4.rs` for the arithmetic).
//!
//! One 16-byte load holds 32 codes of a row (low nibbles: columns 0..16,
//! high nibbles: 16..32); masking and a shift put them in the two 128-bit
//! lanes of a 256-bit register in column order, which is the order of the
//! int8 activations. A tile is `R` weight rows × `T` token rows: each weight
//! block is unpacked once and multiplied into every token row, with i32
//! accumulators per group and f32 accumulators across groups.
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
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
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
    [Kernel::AvxVnni, Kernel::Avx512Vnni, Kernel::Avx2]
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
    debug_assert!(w.k.is_multiple_of(w.group) && w.group.is_multiple_of(32));
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

/// Generates one kernel module: `$features` are the target features, `$dot`
/// the i32 accumulate of unsigned codes × signed activations.
#[cfg(target_arch = "x86_64")]
macro_rules! int4_kernel {
    ($name:ident, $features:literal, |$acc:ident, $w:ident, $x:ident| $dot:expr) => {
        mod $name {
            use super::super::int4::{Int4Rows, QuantizedActivations};
            use std::arch::x86_64::*;

            #[inline]
            #[target_feature(enable = $features)]
            fn dot($acc: __m256i, $w: __m256i, $x: __m256i) -> __m256i {
                $dot
            }

            #[inline]
            #[target_feature(enable = $features)]
            fn hsum(v: __m256) -> f32 {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
                _mm_cvtss_f32(s)
            }

            /// One tile of `R` weight rows × `T` token rows.
            ///
            /// # Safety
            /// `w` holds `R` rows of `k / 2` packed bytes, `ws`/`wm` `R`
            /// rows of `k / group` floats; `xq` holds `T` rows of `k`
            /// codes, `xs`/`xsum` `T` rows of `k / group`; `out` reaches
            /// `(T - 1) * n + col + R - 1`.
            #[inline]
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn tile<const R: usize, const T: usize>(
                w: *const u8,
                ws: *const f32,
                wm: *const f32,
                k: usize,
                group: usize,
                xq: *const i8,
                xs: *const f32,
                xsum: *const f32,
                out: *mut f32,
                n: usize,
                col: usize,
            ) {
                let gpr = k / group;
                let mask = _mm_set1_epi8(0x0f);
                let mut facc = [[_mm256_setzero_ps(); T]; R];
                for g in 0..gpr {
                    let mut iacc = [[_mm256_setzero_si256(); T]; R];
                    let mut c = g * group;
                    while c < (g + 1) * group {
                        let mut xv = [_mm256_setzero_si256(); T];
                        for (t, v) in xv.iter_mut().enumerate() {
                            // SAFETY: c + 32 <= k inside token row t.
                            *v = unsafe { _mm256_loadu_si256(xq.add(t * k + c).cast()) };
                        }
                        for (r, acc_r) in iacc.iter_mut().enumerate() {
                            // SAFETY: bytes c/2 .. c/2 + 16 of weight row r.
                            let raw = unsafe { _mm_loadu_si128(w.add(r * k / 2 + c / 2).cast()) };
                            let lo = _mm_and_si128(raw, mask);
                            let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
                            let wv = _mm256_set_m128i(hi, lo);
                            for (a, &x) in acc_r.iter_mut().zip(&xv) {
                                *a = dot(*a, wv, x);
                            }
                        }
                        c += 32;
                    }
                    for r in 0..R {
                        // SAFETY: group g of weight row r.
                        let sw = unsafe { *ws.add(r * gpr + g) };
                        for t in 0..T {
                            // SAFETY: group g of token row t.
                            let d = sw * unsafe { *xs.add(t * gpr + g) };
                            facc[r][t] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(iacc[r][t]),
                                _mm256_set1_ps(d),
                                facc[r][t],
                            );
                        }
                    }
                }
                for r in 0..R {
                    for t in 0..T {
                        let mut s = hsum(facc[r][t]);
                        for g in 0..gpr {
                            // SAFETY: group g of weight row r and token row t.
                            s += unsafe { *wm.add(r * gpr + g) * *xsum.add(t * gpr + g) };
                        }
                        // SAFETY: within the bounds promised by the caller.
                        unsafe { *out.add(t * n + col + r) = s };
                    }
                }
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
                let mut r = 0;
                while r < rows {
                    let rr = (rows - r).min(4);
                    let mut t = 0;
                    while t < m {
                        let tt = (m - t).min(2);
                        // SAFETY: rows r..r+rr of this run and token rows
                        // t..t+tt exist; out index (t+tt-1)*n + r0+r+rr-1 <
                        // m*n <= out.len().
                        unsafe {
                            let args = (
                                w.packed.as_ptr().add(r * k / 2),
                                w.scales.as_ptr().add(r * gpr),
                                w.mins.as_ptr().add(r * gpr),
                                xa.codes.as_ptr().add(t * k),
                                xa.scales.as_ptr().add(t * gpr),
                                xa.sums.as_ptr().add(t * gpr),
                                out.as_mut_ptr().add(t * n),
                            );
                            macro_rules! go {
                                ($r:literal, $t:literal) => {
                                    tile::<$r, $t>(
                                        args.0,
                                        args.1,
                                        args.2,
                                        k,
                                        group,
                                        args.3,
                                        args.4,
                                        args.5,
                                        args.6,
                                        n,
                                        r0 + r,
                                    )
                                };
                            }
                            match (rr, tt) {
                                (4, 2) => go!(4, 2),
                                (4, _) => go!(4, 1),
                                (3, 2) => go!(3, 2),
                                (3, _) => go!(3, 1),
                                (2, 2) => go!(2, 2),
                                (2, _) => go!(2, 1),
                                (_, 2) => go!(1, 2),
                                _ => go!(1, 1),
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
int4_kernel!(avx2, "avx2,fma", |acc, w, x| _mm256_add_epi32(
    acc,
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
));
#[cfg(target_arch = "x86_64")]
int4_kernel!(avxvnni, "avx2,fma,avxvnni", |acc, w, x| {
    _mm256_dpbusd_avx_epi32(acc, w, x)
});
#[cfg(target_arch = "x86_64")]
int4_kernel!(
    avx512vnni,
    "avx2,fma,avx512f,avx512vl,avx512vnni",
    |acc, w, x| { _mm256_dpbusd_epi32(acc, w, x) }
);
