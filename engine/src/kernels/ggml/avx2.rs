//! AVX2 dot products of GGUF-quantized rows with int8 activations: the
//! integer sums of [`super::scalar`], 32 elements per instruction, eight
//! rows at a time for the 32-element types.
//!
//! Codes are unpacked in registers to unsigned bytes in column order (a
//! nibble mask and shift; fifth and sixth bits or-ed in from their planes)
//! and multiplied into the signed activations with `vpmaddubsw` (pairs to
//! i16: at most 2·63·127, so no saturation), then `vpmaddwd` against ones
//! or against a sub-block's scale (pairs to i32). `Q8_0`'s signed codes
//! take the sign trick: `|q|` times `y` with `q`'s sign.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use tandem_gguf::{k_scale_min, GgmlType};

use super::act::{Q8KRow, Q8Row, QK8, QK_K};

/// `Σ w·x` over eight rows at once for the 32-element types: each
/// activation block is loaded once for all of them, and the rows' integer
/// sums are reduced together, so each block's scales, offset and float
/// accumulate are one vector operation for all eight (the rows' f16 scales
/// gathered into one register) rather than scalar work per row. A caller
/// with fewer rows repeats one.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q8_rows(ty: GgmlType, rows: [&[u8]; 8], y: &Q8Row) -> [f32; 8] {
    let blocks = y.d.len();
    for r in rows {
        assert_eq!(r.len(), blocks * ty.block_bytes(), "whole blocks for y");
    }
    assert!(y.q.len() >= blocks * QK8 && y.s.len() >= blocks && y.sum.len() >= blocks);
    // SAFETY: the CPU features are the caller's contract; the lengths are
    // checked above, so every load below lies inside a row's block `i` or
    // activation block `i`.
    unsafe {
        match ty {
            GgmlType::Q8_0 => legacy_rows8::<0>(rows, y),
            GgmlType::Q4_0 => legacy_rows8::<1>(rows, y),
            GgmlType::Q4_1 => legacy_rows8::<2>(rows, y),
            GgmlType::Q5_0 => legacy_rows8::<3>(rows, y),
            GgmlType::Q5_1 => legacy_rows8::<4>(rows, y),
            _ => unreachable!("dot_q8_rows on {}", ty.name()),
        }
    }
}

/// [`dot_q8_rows`] for one type (`T`: `Q8_0`, `Q4_0`, `Q4_1`, `Q5_0`,
/// `Q5_1`), so the block's unpacking is straight-line code; one
/// horizontal-add tree gives the eight rows' integer sums in one register.
///
/// # Safety
/// As [`dot_q8_rows`], lengths checked.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_rows8<const T: u8>(rows: [&[u8]; 8], y: &Q8Row) -> [f32; 8] {
    // SAFETY: the caller checked every row to hold `y.d.len()` blocks of
    // this type's size and `y` to hold as many activation blocks.
    unsafe {
        let bytes = [34, 18, 20, 22, 24][usize::from(T)];
        let low = _mm256_set1_epi8(0x0F);
        let mut acc = _mm256_setzero_ps();
        let mut mins = _mm256_setzero_ps();
        // Rows a constant distance apart (a matrix's consecutive rows) have
        // their blocks' scale words gathered by one instruction.
        let stride = rows[1].as_ptr() as isize - rows[0].as_ptr() as isize;
        let strided = stride.abs() < (i32::MAX / 8) as isize
            && (0..8).all(|r| {
                rows[r].as_ptr() as isize - rows[0].as_ptr() as isize == r as isize * stride
            });
        let offsets = _mm256_mullo_epi32(
            _mm256_set1_epi32(stride as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        );
        for i in 0..y.d.len() {
            let yv = _mm256_loadu_si256(y.q.as_ptr().add(i * QK8).cast());
            let b: [*const u8; 8] = std::array::from_fn(|r| rows[r].as_ptr().add(i * bytes));
            let sums: [__m256i; 8] = std::array::from_fn(|r| match T {
                0 => {
                    let x = _mm256_loadu_si256(b[r].add(2).cast());
                    pair_sums(_mm256_sign_epi8(x, x), _mm256_sign_epi8(yv, x))
                }
                1 => pair_sums(nibbles(b[r].add(2), low), yv),
                2 => pair_sums(nibbles(b[r].add(4), low), yv),
                3 => pair_sums(
                    _mm256_or_si256(nibbles(b[r].add(6), low), fifth_bits(b[r].add(2))),
                    yv,
                ),
                _ => pair_sums(
                    _mm256_or_si256(nibbles(b[r].add(8), low), fifth_bits(b[r].add(4))),
                    yv,
                ),
            });
            let mut isum = reduce8(sums);
            // Q4_0 and Q5_0 codes are offset by 8 and 16: Σ (q − o)·y.
            match T {
                1 => isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * *y.sum.get_unchecked(i))),
                3 => isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(16 * *y.sum.get_unchecked(i))),
                _ => {}
            }
            let dy = _mm256_set1_ps(*y.d.get_unchecked(i));
            // Each block's first four bytes: its scale and, for Q4_1 and
            // Q5_1, its min (every block is at least 18 bytes).
            let words = strided.then(|| _mm256_i32gather_epi32::<1>(b[0].cast(), offsets));
            let dx = match words {
                Some(w) => f16_lanes(w),
                None => halves8(b, 0),
            };
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dx, dy), acc);
            if T == 2 || T == 4 {
                let m = match words {
                    Some(w) => f16_lanes(_mm256_srli_epi32(w, 16)),
                    None => halves8(b, 2),
                };
                mins = _mm256_fmadd_ps(m, _mm256_set1_ps(*y.s.get_unchecked(i)), mins);
            }
        }
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(acc, mins));
        out
    }
}

/// The f16 at byte `at` of each of eight blocks, as eight f32 lanes.
///
/// # Safety
/// Each `b[r] + at` points at 2 readable bytes.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn halves8(b: [*const u8; 8], at: usize) -> __m256 {
    // SAFETY: the caller's contract.
    let h: [i16; 8] =
        std::array::from_fn(|r| unsafe { b[r].add(at).cast::<i16>().read_unaligned() });
    _mm256_cvtph_ps(_mm_set_epi16(
        h[7], h[6], h[5], h[4], h[3], h[2], h[1], h[0],
    ))
}

/// The low 16 bits of each 32-bit lane, as f16, widened to f32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn f16_lanes(v: __m256i) -> __m256 {
    let low = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    // Per 128-bit half: the four halves twice; qwords 0 and 2 hold all eight.
    let packed = _mm256_packus_epi32(low, low);
    let ordered = _mm256_permute4x64_epi64::<0b1000>(packed);
    _mm256_cvtph_ps(_mm256_castsi256_si128(ordered))
}

/// Lane `r` of the result is the sum of `v[r]`'s eight lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn reduce8(v: [__m256i; 8]) -> __m256i {
    let t0 = _mm256_hadd_epi32(v[0], v[1]);
    let t1 = _mm256_hadd_epi32(v[2], v[3]);
    let t2 = _mm256_hadd_epi32(v[4], v[5]);
    let t3 = _mm256_hadd_epi32(v[6], v[7]);
    // Per 128-bit half: rows 0..4 (u0) and 4..8 (u1), each half's partials.
    let u0 = _mm256_hadd_epi32(t0, t1);
    let u1 = _mm256_hadd_epi32(t2, t3);
    _mm256_add_epi32(
        _mm256_permute2x128_si256(u0, u1, 0x20),
        _mm256_permute2x128_si256(u0, u1, 0x31),
    )
}

/// `Σ w·x` over one row for the K-quants.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q8k(ty: GgmlType, w: &[u8], y: &Q8KRow) -> f32 {
    let blocks = y.d.len();
    assert_eq!(w.len(), blocks * ty.block_bytes(), "whole blocks for y");
    assert!(y.q.len() >= blocks * QK_K && y.bsums.len() >= blocks * 16);
    // SAFETY: the CPU features are the caller's contract; with the lengths
    // checked above, the block helpers read inside block `i` and the 256
    // activations at `yq`.
    unsafe {
        let mut acc = _mm256_setzero_ps();
        let mut rest = 0f32;
        for (i, b) in w.chunks_exact(ty.block_bytes()).enumerate() {
            let yq = y.q.as_ptr().add(i * QK_K);
            let bsums = &y.bsums[i * 16..(i + 1) * 16];
            let (sumi, scale, offset) = match ty {
                GgmlType::Q6_K => {
                    let (sumi, offset) = q6k_block(b, yq, bsums);
                    (sumi, half(b, 208), offset as f32 * half(b, 208))
                }
                _ => {
                    let (sumi, mins) = k4_block(ty, b, yq, bsums);
                    (sumi, half(b, 0), mins as f32 * half(b, 2))
                }
            };
            let dy = y.d[i];
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(scale * dy), acc);
            rest -= offset * dy;
        }
        hsum(acc) + rest
    }
}

/// A `Q4_K`/`Q5_K` block: the scaled code sums per lane, and
/// `Σ_g m_g · Σ y` (to be scaled by `dmin`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_block(ty: GgmlType, b: &[u8], y: *const i8, bsums: &[i16]) -> (__m256i, i32) {
    // SAFETY: the caller's `b` is one whole `Q4_K`/`Q5_K` block (loads at
    // 16..48 and `qs + 32c` for c < 4 lie inside its 144/176 bytes) and `y`
    // points at its 256 activations.
    unsafe {
        let low = _mm256_set1_epi8(0x0F);
        let one = _mm256_set1_epi8(1);
        let (qh, qs) = match ty {
            GgmlType::Q5_K => (Some(_mm256_loadu_si256(b.as_ptr().add(16).cast())), 48),
            _ => (None, 16),
        };
        let mut sumi = _mm256_setzero_si256();
        let mut mins = 0i32;
        for c in 0..4 {
            let q = _mm256_loadu_si256(b.as_ptr().add(qs + 32 * c).cast());
            let mut halves = [
                _mm256_and_si256(q, low),
                _mm256_and_si256(_mm256_srli_epi16(q, 4), low),
            ];
            for (h, codes) in halves.iter_mut().enumerate() {
                let g = 2 * c + h;
                if let Some(qh) = qh {
                    let count = _mm_cvtsi32_si128(g as i32);
                    let bit = _mm256_and_si256(_mm256_srl_epi16(qh, count), one);
                    *codes = _mm256_or_si256(*codes, _mm256_slli_epi16(bit, 4));
                }
                let (sc, m) = k_scale_min(&b[4..16], g);
                let yv = _mm256_loadu_si256(y.add(32 * g).cast());
                let pairs = _mm256_maddubs_epi16(*codes, yv);
                let scaled = _mm256_madd_epi16(pairs, _mm256_set1_epi16(i16::from(sc)));
                sumi = _mm256_add_epi32(sumi, scaled);
                mins += i32::from(m) * (i32::from(bsums[2 * g]) + i32::from(bsums[2 * g + 1]));
            }
        }
        (sumi, mins)
    }
}

/// A `Q6_K` block: the scaled code sums per lane, and `Σ_g sc_g · 32 ·
/// Σ y` (the offset, to be scaled by `d`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_block(b: &[u8], y: *const i8, bsums: &[i16]) -> (__m256i, i32) {
    // SAFETY: the caller's `b` is one whole `Q6_K` block (loads at
    // 64h, 64h + 32, 128 + 32h for h < 2 lie inside its 210 bytes) and `y`
    // points at its 256 activations.
    unsafe {
        let low = _mm256_set1_epi8(0x0F);
        let two_bits = _mm256_set1_epi8(0x03);
        let scales = &b[192..208];
        let mut sumi = _mm256_setzero_si256();
        for h in 0..2 {
            let ql0 = _mm256_loadu_si256(b.as_ptr().add(64 * h).cast());
            let ql1 = _mm256_loadu_si256(b.as_ptr().add(64 * h + 32).cast());
            let qh = _mm256_loadu_si256(b.as_ptr().add(128 + 32 * h).cast());
            let lows = [
                _mm256_and_si256(ql0, low),
                _mm256_and_si256(ql1, low),
                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low),
                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
            ];
            for (c, codes) in lows.into_iter().enumerate() {
                let count = _mm_cvtsi32_si128(2 * c as i32);
                let high = _mm256_and_si256(_mm256_srl_epi16(qh, count), two_bits);
                let codes = _mm256_or_si256(codes, _mm256_slli_epi16(high, 4));
                let yv = _mm256_loadu_si256(y.add(128 * h + 32 * c).cast());
                let g = 8 * h + 2 * c;
                let scale = _mm256_set_m128i(
                    _mm_set1_epi16(i16::from(scales[g + 1] as i8)),
                    _mm_set1_epi16(i16::from(scales[g] as i8)),
                );
                let pairs = _mm256_maddubs_epi16(codes, yv);
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(pairs, scale));
            }
        }
        let offset: i32 = (0..16)
            .map(|g| 32 * i32::from(scales[g] as i8) * i32::from(bsums[g]))
            .sum();
        (sumi, offset)
    }
}

/// The little-endian f16 at `b[at..at + 2]`, widened by F16C (the `half`
/// crate's conversion checks the CPU on every call).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn half(b: &[u8], at: usize) -> f32 {
    let bits = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// 32 codes from 16 bytes of nibbles: low nibbles first, then high.
///
/// # Safety
/// `qs` points at 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles(qs: *const u8, low: __m256i) -> __m256i {
    // SAFETY: the caller's contract.
    let packed = unsafe { _mm_loadu_si128(qs.cast()) };
    let both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    _mm256_and_si256(both, low)
}

/// `0x10` in byte `j` where bit `j` of the 32-bit plane is set.
///
/// # Safety
/// `qh` points at 4 readable bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn fifth_bits(qh: *const u8) -> __m256i {
    // SAFETY: the caller's contract.
    let plane = u32::from_le(unsafe { qh.cast::<u32>().read_unaligned() });
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(plane as i32),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    // Each byte or-ed with all bits but its own is all ones iff its bit is set.
    let others = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    let set = _mm256_cmpeq_epi8(others, _mm256_set1_epi64x(-1));
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// Unsigned bytes times signed bytes, summed in fours to i32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn pair_sums(unsigned: __m256i, signed: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned, signed), _mm256_set1_epi16(1))
}

#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}
