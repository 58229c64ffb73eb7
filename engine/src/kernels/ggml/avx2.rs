//! x86 dot products of one tile of GGUF-quantized rows ([`super::tiles`])
//! with one int8 activation row: the integer sums of [`super::scalar`],
//! eight rows at once.
//!
//! A 32-byte load of a tile's code section is four consecutive codes of
//! each of eight rows (once unpacked: a nibble mask and shift, high bits
//! or-ed in from their bytes); the activation's matching four bytes are
//! broadcast to every lane, and one unsigned × signed byte dot product
//! (`vpdpbusd` with AVX-VNNI or AVX-512 VNNI, else `vpmaddubsw` +
//! `vpmaddwd`) adds each row's four products into its own i32 lane. No
//! horizontal sums: a block's eight row sums are one register, scaled by
//! the eight rows' f16 scales (one load) in one multiply-add. Codes are at
//! most 63 and activations at most 127 in magnitude, so `vpmaddubsw`'s i16
//! pair sums cannot saturate. `Q8_0`'s signed codes take `vpmaddubsw`'s
//! sign trick (`|q|` times `y` with `q`'s sign), or with VNNI are offset
//! to unsigned (`q ^ 0x80 = q + 128`) and the offset taken out against the
//! activation sums, as `Q4_0`'s 8 is.

#![cfg(target_arch = "x86_64")]

/// Generates one kernel module: `$features` are the target features,
/// `$dot` the i32 accumulate of unsigned codes × signed activations, and
/// `$sdot` of signed codes, which adds `$bias · Σ y` to the true sum.
macro_rules! tile_kernels {
    ($name:ident, $features:literal,
     |$acc:ident, $w:ident, $x:ident| $dot:expr,
     |$sacc:ident, $sw:ident, $sx:ident| $sdot:expr, $bias:expr) => {
        pub(super) mod $name {
            use std::arch::x86_64::*;

            use super::super::act::{Q8Row, QK8, QK_K};
            use super::super::tiles::{TileLayout, TILE};

            #[inline]
            #[target_feature(enable = $features)]
            fn dot($acc: __m256i, $w: __m256i, $x: __m256i) -> __m256i {
                $dot
            }

            #[inline]
            #[target_feature(enable = $features)]
            fn sdot($sacc: __m256i, $sw: __m256i, $sx: __m256i) -> __m256i {
                $sdot
            }

            /// What [`sdot`] adds per unit of `Σ y`.
            const SIGNED_BIAS: i32 = $bias;

            /// The four activation bytes at `y`, in every lane.
            ///
            /// # Safety
            /// `y` points at 4 readable bytes.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn four(y: *const i8) -> __m256i {
                // SAFETY: the caller's contract.
                _mm256_set1_epi32(unsafe { y.cast::<i32>().read_unaligned() })
            }

            /// 32 bytes at `p`.
            ///
            /// # Safety
            /// `p` points at 32 readable bytes.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn load(p: *const u8) -> __m256i {
                // SAFETY: the caller's contract.
                unsafe { _mm256_loadu_si256(p.cast()) }
            }

            /// Eight f16 at `p`, widened.
            ///
            /// # Safety
            /// `p` points at 16 readable bytes.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn halves(p: *const u8) -> __m256 {
                // SAFETY: the caller's contract.
                _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
            }

            /// Eight bytes at `p` (unsigned, or signed when `SIGNED`), as
            /// i32 lanes.
            ///
            /// # Safety
            /// `p` points at 8 readable bytes.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn bytes8<const SIGNED: bool>(p: *const u8) -> __m256i {
                // SAFETY: the caller's contract.
                let v = unsafe { _mm_loadl_epi64(p.cast()) };
                if SIGNED {
                    _mm256_cvtepi8_epi32(v)
                } else {
                    _mm256_cvtepu8_epi32(v)
                }
            }

            /// Lane `r` is `a[r]·u + b[r]·v`, for the eight bytes `a` and
            /// `b` at `pa`, `pb` (unsigned, or signed when `SIGNED`) and
            /// the i16 pair `(u, v)`.
            ///
            /// # Safety
            /// `pa` and `pb` point at 8 readable bytes.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn pair_products<const SIGNED: bool>(
                pa: *const u8,
                pb: *const u8,
                u: i16,
                v: i16,
            ) -> __m256i {
                // SAFETY: the caller's contract.
                let (a, b) = unsafe { (_mm_loadl_epi64(pa.cast()), _mm_loadl_epi64(pb.cast())) };
                let pairs = _mm_unpacklo_epi8(a, b);
                let wide = if SIGNED {
                    _mm256_cvtepi8_epi16(pairs)
                } else {
                    _mm256_cvtepu8_epi16(pairs)
                };
                let uv = (i32::from(v) << 16) | i32::from(u as u16);
                _mm256_madd_epi16(wide, _mm256_set1_epi32(uv))
            }

            /// Moves bit `from` of each byte to bit `to` (`from - 3 <= to
            /// <= from + 4`; other bits move too, the caller masks).
            #[inline]
            #[target_feature(enable = $features)]
            fn bit_to(v: __m256i, from: i32, to: i32) -> __m256i {
                if from <= to {
                    _mm256_sll_epi16(v, _mm_cvtsi32_si128(to - from))
                } else {
                    _mm256_srl_epi16(v, _mm_cvtsi32_si128(from - to))
                }
            }

            #[inline]
            #[target_feature(enable = $features)]
            fn store(v: __m256) -> [f32; TILE] {
                let mut out = [0f32; TILE];
                // SAFETY: `out` holds eight f32.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
                out
            }

            /// Byte `o` of each of the eight rows' code section at
            /// `section`, as i32 lanes (see `tiles::interleaved_at`).
            ///
            /// # Safety
            /// `section` starts an interleaved section holding byte `o`.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn code_bytes(section: *const u8, o: usize) -> __m256i {
                // SAFETY: the caller's contract: chunk o / 4 lies inside.
                let chunk = unsafe { load(section.add(32 * (o / 4))) };
                let shifted = _mm256_srl_epi32(chunk, _mm_cvtsi32_si128(8 * (o % 4) as i32));
                _mm256_and_si256(shifted, _mm256_set1_epi32(0xFF))
            }

            /// `acc + Σ x · w[col]` over the activation's outliers, the eight
            /// rows' weights at `col` decoded by `column(tile-block, j)`
            /// (as ggml's block decoder does).
            ///
            /// # Safety
            /// Every outlier's column lies inside the tile's `bytes`-sized
            /// tile-blocks of `len` columns each; `column` reads inside one.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn add_outliers(
                acc: __m256,
                tile: &[u8],
                bytes: usize,
                len: usize,
                outliers: &[(usize, f32)],
                column: impl Fn(*const u8, usize) -> __m256,
            ) -> __m256 {
                let mut acc = acc;
                for &(col, x) in outliers {
                    assert!(
                        (col / len + 1) * bytes <= tile.len(),
                        "an outlier inside the row"
                    );
                    // SAFETY: tile-block col / len lies inside `tile`.
                    let b = unsafe { tile.as_ptr().add(col / len * bytes) };
                    acc = _mm256_fmadd_ps(column(b, col % len), _mm256_set1_ps(x), acc);
                }
                acc
            }

            /// A tile of a 32-element type (`T`: 0 `Q8_0`, 1 `Q4_0`, 2
            /// `Q4_1`, 3 `Q5_0`, 4 `Q5_1`) dotted with `y`.
            ///
            /// # Safety
            /// The CPU has `$features`; `layout` is `TileLayout::of` the
            /// type, whose parts lie inside its `bytes` (tested). (`tile`
            /// must hold `y.d.len()` tile-blocks: checked.)
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn legacy<const T: u8>(
                tile: &[u8],
                layout: &TileLayout,
                y: &Q8Row,
            ) -> [f32; TILE] {
                let (bytes, codes) = (layout.bytes, layout.codes);
                let (min, high) = (layout.min.unwrap_or(0), layout.high.unwrap_or(0));
                let blocks = y.d.len();
                assert!(
                    tile.len() >= blocks * bytes,
                    "a tile-block per activation block"
                );
                assert!(y.q.len() >= blocks * QK8 && y.s.len() >= blocks && y.sum.len() >= blocks);
                let low = _mm256_set1_epi8(0x0F);
                let fifth = _mm256_set1_epi8(0x10);
                let mut acc = _mm256_setzero_ps();
                let mut mins = _mm256_setzero_ps();
                for i in 0..blocks {
                    // SAFETY: tile-block i and activation block i lie
                    // inside `tile` and `y` (checked above); the offsets
                    // are those of the type's layout.
                    unsafe {
                        let b = tile.as_ptr().add(i * bytes);
                        let yq = y.q.as_ptr().add(i * QK8);
                        let mut sumi = _mm256_setzero_si256();
                        if T == 0 {
                            for s in 0..8 {
                                sumi = sdot(sumi, load(b.add(codes + 32 * s)), four(yq.add(4 * s)));
                            }
                        } else {
                            let qh = if T >= 3 { load(b.add(high)) } else { low };
                            for t in 0..4 {
                                let p = load(b.add(codes + 32 * t));
                                let mut lo = _mm256_and_si256(p, low);
                                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(p), low);
                                if T >= 3 {
                                    let f = |s: i32| _mm256_and_si256(bit_to(qh, s, 4), fifth);
                                    lo = _mm256_or_si256(lo, f(t as i32));
                                    hi = _mm256_or_si256(hi, f(t as i32 + 4));
                                }
                                sumi = dot(sumi, lo, four(yq.add(4 * t)));
                                sumi = dot(sumi, hi, four(yq.add(16 + 4 * t)));
                            }
                        }
                        // Σ (q − o)·y: Q4_0's 8, Q5_0's 16, Q8_0's bias.
                        let offset = match T {
                            0 => SIGNED_BIAS,
                            1 => 8,
                            3 => 16,
                            _ => 0,
                        };
                        if offset != 0 {
                            let taken = _mm256_set1_epi32(offset * *y.sum.get_unchecked(i));
                            sumi = _mm256_sub_epi32(sumi, taken);
                        }
                        let dy = _mm256_set1_ps(*y.d.get_unchecked(i));
                        let scale = _mm256_mul_ps(halves(b), dy);
                        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), scale, acc);
                        if T == 2 || T == 4 {
                            let sy = _mm256_set1_ps(*y.s.get_unchecked(i));
                            mins = _mm256_fmadd_ps(halves(b.add(min)), sy, mins);
                        }
                    }
                }
                // The outliers' exact products: `d·(q − o)` or `d·q + m`.
                let column = |b: *const u8, j: usize| {
                    // SAFETY: `b` is a whole tile-block (`add_outliers`).
                    unsafe {
                        let q = if T == 0 {
                            let v = _mm256_slli_epi32::<24>(code_bytes(b.add(codes), j));
                            _mm256_srai_epi32::<24>(v)
                        } else {
                            let nib = code_bytes(b.add(codes), j % 16);
                            let mut q = _mm256_and_si256(
                                _mm256_srl_epi32(nib, _mm_cvtsi32_si128(4 * (j / 16) as i32)),
                                _mm256_set1_epi32(0x0F),
                            );
                            if T >= 3 {
                                let word = code_bytes(b.add(high), j % 4);
                                let bit = _mm256_srl_epi32(word, _mm_cvtsi32_si128((j / 4) as i32));
                                let bit = _mm256_and_si256(bit, _mm256_set1_epi32(1));
                                q = _mm256_or_si256(q, _mm256_slli_epi32::<4>(bit));
                            }
                            q
                        };
                        let q = _mm256_cvtepi32_ps(q);
                        let d = halves(b);
                        match T {
                            1 => _mm256_mul_ps(d, _mm256_sub_ps(q, _mm256_set1_ps(8.0))),
                            3 => _mm256_mul_ps(d, _mm256_sub_ps(q, _mm256_set1_ps(16.0))),
                            2 | 4 => _mm256_add_ps(_mm256_mul_ps(d, q), halves(b.add(min))),
                            _ => _mm256_mul_ps(d, q),
                        }
                    }
                };
                // SAFETY: `tile` holds `blocks` tile-blocks of 32 columns
                // (checked above); `column` reads inside one.
                let acc = unsafe { add_outliers(acc, tile, bytes, QK8, &y.outliers, column) };
                store(_mm256_add_ps(acc, mins))
            }

            /// A tile of `Q4_K` (or `Q5_K`, `FIVE`) dotted with `y`.
            ///
            /// # Safety
            /// As [`legacy`].
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn k4<const FIVE: bool>(
                tile: &[u8],
                layout: &TileLayout,
                y: &Q8Row,
            ) -> [f32; TILE] {
                let (bytes, codes, high) = (layout.bytes, layout.codes, layout.high.unwrap_or(0));
                let dmin = layout.min.unwrap_or(0);
                let (scales, mins) = (layout.sub_scales.unwrap_or(0), layout.sub_mins.unwrap_or(0));
                let per = QK_K / QK8;
                let blocks = y.d.len() / per;
                assert!(
                    tile.len() >= blocks * bytes,
                    "a tile-block per 256 activations"
                );
                assert!(y.q.len() >= blocks * QK_K && y.s.len() >= blocks * per);
                let low = _mm256_set1_epi8(0x0F);
                let fifth = _mm256_set1_epi8(0x10);
                let mut acc = _mm256_setzero_ps();
                for i in 0..blocks {
                    // SAFETY: as in `legacy`.
                    unsafe {
                        let b = tile.as_ptr().add(i * bytes);
                        let yq = y.q.as_ptr().add(i * QK_K);
                        let (dy, sy) = (y.d.as_ptr().add(i * per), y.s.as_ptr().add(i * per));
                        let d = halves(b);
                        // Chunk c: sub-blocks 2c (low nibbles), 2c + 1 (high),
                        // each scaled by its activation block's scale.
                        for c in 0..4 {
                            let (mut s_lo, mut s_hi) =
                                (_mm256_setzero_si256(), _mm256_setzero_si256());
                            for t in 0..8 {
                                let p = load(b.add(codes + 256 * c + 32 * t));
                                let mut lo = _mm256_and_si256(p, low);
                                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(p), low);
                                if FIVE {
                                    let q = load(b.add(high + 32 * t));
                                    let g = 2 * c as i32;
                                    lo = _mm256_or_si256(
                                        lo,
                                        _mm256_and_si256(bit_to(q, g, 4), fifth),
                                    );
                                    hi = _mm256_or_si256(
                                        hi,
                                        _mm256_and_si256(bit_to(q, g + 1, 4), fifth),
                                    );
                                }
                                s_lo = dot(s_lo, lo, four(yq.add(64 * c + 4 * t)));
                                s_hi = dot(s_hi, hi, four(yq.add(64 * c + 32 + 4 * t)));
                            }
                            for (g, sums) in [(2 * c, s_lo), (2 * c + 1, s_hi)] {
                                let scaled = _mm256_mullo_epi32(
                                    sums,
                                    bytes8::<false>(b.add(scales + TILE * g)),
                                );
                                let step = _mm256_mul_ps(d, _mm256_set1_ps(*dy.add(g)));
                                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(scaled), step, acc);
                            }
                        }
                        // dmin · Σ_g m_g · s_g (s_g: sub-block g's scaled sum).
                        let mut msum = _mm256_setzero_ps();
                        for g in 0..8 {
                            let m = _mm256_cvtepi32_ps(bytes8::<false>(b.add(mins + TILE * g)));
                            msum = _mm256_fmadd_ps(m, _mm256_set1_ps(*sy.add(g)), msum);
                        }
                        acc = _mm256_fnmadd_ps(msum, halves(b.add(dmin)), acc);
                    }
                }
                // The outliers' exact products: `d·sc·q − dmin·m`.
                let column = |b: *const u8, j: usize| {
                    // SAFETY: `b` is a whole tile-block (`add_outliers`).
                    unsafe {
                        let g = j / 32;
                        let byte = code_bytes(b.add(codes), (g / 2) * 32 + j % 32);
                        let mut q = _mm256_and_si256(
                            _mm256_srl_epi32(byte, _mm_cvtsi32_si128(4 * (g % 2) as i32)),
                            _mm256_set1_epi32(0x0F),
                        );
                        if FIVE {
                            let bits = code_bytes(b.add(high), j % 32);
                            let bit = _mm256_srl_epi32(bits, _mm_cvtsi32_si128(g as i32));
                            let bit = _mm256_and_si256(bit, _mm256_set1_epi32(1));
                            q = _mm256_or_si256(q, _mm256_slli_epi32::<4>(bit));
                        }
                        let sc = _mm256_cvtepi32_ps(bytes8::<false>(b.add(scales + TILE * g)));
                        let m = _mm256_cvtepi32_ps(bytes8::<false>(b.add(mins + TILE * g)));
                        let w = _mm256_mul_ps(_mm256_mul_ps(halves(b), sc), _mm256_cvtepi32_ps(q));
                        _mm256_sub_ps(w, _mm256_mul_ps(halves(b.add(dmin)), m))
                    }
                };
                // SAFETY: as in `legacy`.
                store(unsafe { add_outliers(acc, tile, bytes, QK_K, &y.outliers, column) })
            }

            /// A tile of `Q6_K` dotted with `y`.
            ///
            /// # Safety
            /// As [`legacy`].
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn q6k(tile: &[u8], layout: &TileLayout, y: &Q8Row) -> [f32; TILE] {
                let (bytes, codes, high) = (layout.bytes, layout.codes, layout.high.unwrap_or(0));
                let scales = layout.sub_scales.unwrap_or(0);
                let per = QK_K / QK8;
                let blocks = y.d.len() / per;
                assert!(
                    tile.len() >= blocks * bytes,
                    "a tile-block per 256 activations"
                );
                assert!(y.q.len() >= blocks * QK_K && y.sums16.len() >= blocks * 2 * per);
                let low = _mm256_set1_epi8(0x0F);
                let two_bits = _mm256_set1_epi8(0x30);
                let mut acc = _mm256_setzero_ps();
                for i in 0..blocks {
                    // SAFETY: as in `legacy`.
                    unsafe {
                        let b = tile.as_ptr().add(i * bytes);
                        let yq = y.q.as_ptr().add(i * QK_K);
                        let sums16 = y.sums16.as_ptr().add(i * 2 * per);
                        let dy = y.d.as_ptr().add(i * per);
                        let d = halves(b);
                        let scale = |g: usize| bytes8::<true>(b.add(scales + TILE * g));
                        // Half h (128 columns), code chunk a: 32-column
                        // blocks a (low nibbles) and a + 2 (high), each two
                        // 16-column sub-blocks with their own scale.
                        for h in 0..2 {
                            for a in 0..2 {
                                let mut s = [_mm256_setzero_si256(); 4];
                                for t in 0..8 {
                                    let p = load(b.add(codes + 512 * h + 256 * a + 32 * t));
                                    let q = load(b.add(high + 256 * h + 32 * t));
                                    let bits = |c: usize| {
                                        _mm256_and_si256(bit_to(q, 2 * c as i32, 4), two_bits)
                                    };
                                    let lo = _mm256_or_si256(_mm256_and_si256(p, low), bits(a));
                                    let hi = _mm256_or_si256(
                                        _mm256_and_si256(_mm256_srli_epi16::<4>(p), low),
                                        bits(a + 2),
                                    );
                                    let y0 = yq.add(128 * h + 32 * a + 4 * t);
                                    s[t / 4] = dot(s[t / 4], lo, four(y0));
                                    s[2 + t / 4] = dot(s[2 + t / 4], hi, four(y0.add(64)));
                                }
                                // Block `blk` (of 8): sub-blocks 2·blk, 2·blk + 1,
                                // less the codes' offset 32 · sc_g · Σ y.
                                for (k, blk) in [(0, 4 * h + a), (2, 4 * h + a + 2)] {
                                    let g = 2 * blk;
                                    let mut isum = _mm256_add_epi32(
                                        _mm256_mullo_epi32(s[k], scale(g)),
                                        _mm256_mullo_epi32(s[k + 1], scale(g + 1)),
                                    );
                                    let offset = pair_products::<true>(
                                        b.add(scales + TILE * g),
                                        b.add(scales + TILE * (g + 1)),
                                        *sums16.add(g),
                                        *sums16.add(g + 1),
                                    );
                                    isum = _mm256_sub_epi32(isum, _mm256_slli_epi32::<5>(offset));
                                    let step = _mm256_mul_ps(d, _mm256_set1_ps(*dy.add(blk)));
                                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), step, acc);
                                }
                            }
                        }
                    }
                }
                // The outliers' exact products: `d·sc·(q − 32)`.
                let column = |b: *const u8, j: usize| {
                    // SAFETY: `b` is a whole tile-block (`add_outliers`).
                    unsafe {
                        let (h, c, l) = (j / 128, (j % 128) / 32, j % 32);
                        let byte = code_bytes(b.add(codes), h * 64 + (c % 2) * 32 + l);
                        let low4 = _mm256_and_si256(
                            _mm256_srl_epi32(byte, _mm_cvtsi32_si128(4 * (c / 2) as i32)),
                            _mm256_set1_epi32(0x0F),
                        );
                        let bits = code_bytes(b.add(high), h * 32 + l);
                        let high2 = _mm256_and_si256(
                            _mm256_srl_epi32(bits, _mm_cvtsi32_si128(2 * c as i32)),
                            _mm256_set1_epi32(3),
                        );
                        let q = _mm256_or_si256(low4, _mm256_slli_epi32::<4>(high2));
                        let q = _mm256_sub_epi32(q, _mm256_set1_epi32(32));
                        let sc =
                            _mm256_cvtepi32_ps(bytes8::<true>(b.add(scales + TILE * (j / 16))));
                        _mm256_mul_ps(_mm256_mul_ps(halves(b), sc), _mm256_cvtepi32_ps(q))
                    }
                };
                // SAFETY: as in `legacy`.
                store(unsafe { add_outliers(acc, tile, bytes, QK_K, &y.outliers, column) })
            }
        }
    };
}

tile_kernels!(
    avx2,
    "avx2,fma,f16c",
    |acc, w, x| _mm256_add_epi32(
        acc,
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
    ),
    |acc, w, x| _mm256_add_epi32(
        acc,
        _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)),
            _mm256_set1_epi16(1)
        )
    ),
    0
);
tile_kernels!(
    avxvnni,
    "avx2,fma,f16c,avxvnni",
    |acc, w, x| _mm256_dpbusd_avx_epi32(acc, w, x),
    |acc, w, x| _mm256_dpbusd_avx_epi32(acc, _mm256_xor_si256(w, _mm256_set1_epi8(-128)), x),
    128
);
tile_kernels!(
    avx512vnni,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    |acc, w, x| _mm256_dpbusd_epi32(acc, w, x),
    |acc, w, x| _mm256_dpbusd_epi32(acc, _mm256_xor_si256(w, _mm256_set1_epi8(-128)), x),
    128
);
