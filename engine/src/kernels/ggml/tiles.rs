//! The layout GGUF blocks are repacked into at load: eight rows a tile, so
//! one 32-byte load holds four codes of each of eight rows and one integer
//! dot-product instruction (`vpdpbusd`, or `vpmaddubsw` + `vpmaddwd`)
//! leaves each row's sum in its own 32-bit lane (llama.cpp's `Q4_0_8x8`
//! idea, for every type). A tile-block is the eight rows' blocks at one
//! block column:
//!
//! - the scales as planes: eight f16 `d` (one load and `vcvtph2ps` give all
//!   eight), eight f16 mins / `dmin`, and the K-quants' sub-block scales and
//!   mins unpacked from their 6-bit packing to one byte each, sub-block
//!   major (`[g][row]`), so eight rows' scales of a sub-block are one 8-byte
//!   load;
//! - the code bytes **interleaved in 4-byte chunks**: byte `o` of a row's
//!   code section lies at `32·(o/4) + 4·row + o%4`. Every type's code
//!   bytes (nibbles, `Q5_K`'s fifth-bit bytes, `Q6_K`'s two-bit bytes,
//!   `Q8_0`'s bytes) keep their meaning, only their place changes, so each
//!   32-byte load is one chunk of eight rows and unpacks with the same
//!   masks and shifts as one row's would;
//! - `Q5_0`/`Q5_1`'s 32-bit fifth-bit word transposed: bit `s` of byte
//!   `4·row + j` is the fifth bit of column `4s + j`, so step `s` takes its
//!   bits with one shift and mask.
//!
//! Sizes equal the file's blocks (the K-quants' 12 scale bytes become 16:
//! 3% more for `Q4_K`). Rows past the matrix's end are zero blocks. A
//! row's original blocks are rebuilt on demand ([`TileLayout::unpack`]: the
//! prefill decoding and the portable kernel) and single weights read in
//! place ([`weight_at`]).

use tandem_gguf::{k_scale_min, GgmlType};

/// Rows per tile.
pub const TILE: usize = 8;

/// Where the parts of one tile-block lie (byte offsets inside it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileLayout {
    pub ty: GgmlType,
    /// Bytes of one tile-block.
    pub bytes: usize,
    /// Eight f16 scales (`d`).
    pub d: usize,
    /// Eight f16 mins (`Q4_1`, `Q5_1`) or `dmin` (`Q4_K`, `Q5_K`).
    pub min: Option<usize>,
    /// Sub-block scales, one byte each, `[g][row]` (K-quants).
    pub sub_scales: Option<usize>,
    /// Sub-block mins, one byte each, `[g][row]` (`Q4_K`, `Q5_K`).
    pub sub_mins: Option<usize>,
    /// High code bits: the transposed word (`Q5_0`, `Q5_1`) or an
    /// interleaved section (`Q5_K`, `Q6_K`).
    pub high: Option<usize>,
    /// The interleaved code bytes (low nibbles, or `Q8_0`'s bytes).
    pub codes: usize,
}

/// A run of a GGUF block's bytes stored interleaved: `(offset in the
/// block, length, offset in the tile-block)`.
type Interleaved = (usize, usize, usize);

impl TileLayout {
    /// The layout of `ty`'s tile-blocks (a block-quantized type).
    pub fn of(ty: GgmlType) -> Self {
        let base = Self {
            ty,
            bytes: TILE * ty.block_bytes(),
            d: 0,
            min: None,
            sub_scales: None,
            sub_mins: None,
            high: None,
            codes: 16,
        };
        match ty {
            GgmlType::Q4_1 => Self {
                min: Some(16),
                codes: 32,
                ..base
            },
            GgmlType::Q5_0 => Self {
                high: Some(16),
                codes: 48,
                ..base
            },
            GgmlType::Q5_1 => Self {
                min: Some(16),
                high: Some(32),
                codes: 64,
                ..base
            },
            GgmlType::Q4_K | GgmlType::Q5_K => {
                let five = ty == GgmlType::Q5_K;
                Self {
                    bytes: 32 + 128 + if five { 256 } else { 0 } + 1024,
                    min: Some(16),
                    sub_scales: Some(32),
                    sub_mins: Some(96),
                    high: five.then_some(160),
                    codes: if five { 416 } else { 160 },
                    ..base
                }
            }
            GgmlType::Q6_K => Self {
                sub_scales: Some(16),
                codes: 144,
                high: Some(1168),
                ..base
            },
            _ => base,
        }
    }

    /// Where a GGUF block keeps its f16 `d` and its f16 min / `dmin`.
    fn block_halves(&self) -> (usize, Option<usize>) {
        match self.ty {
            GgmlType::Q6_K => (208, None),
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => (0, Some(2)),
            _ => (0, None),
        }
    }

    /// The byte runs stored interleaved (their tile offsets are those
    /// [`of`](Self::of) gives `codes` and `high`).
    pub(super) fn interleaved(&self) -> &'static [Interleaved] {
        match self.ty {
            GgmlType::Q8_0 => &[(2, 32, 16)],
            GgmlType::Q4_0 => &[(2, 16, 16)],
            GgmlType::Q4_1 => &[(4, 16, 32)],
            GgmlType::Q5_0 => &[(6, 16, 48)],
            GgmlType::Q5_1 => &[(8, 16, 64)],
            GgmlType::Q4_K => &[(16, 128, 160)],
            GgmlType::Q5_K => &[(16, 32, 160), (48, 128, 416)],
            GgmlType::Q6_K => &[(0, 128, 144), (128, 64, 1168)],
            _ => unreachable!("{} has no tile layout", self.ty.name()),
        }
    }

    /// Where the legacy five-bit types keep their 32-bit fifth-bit word.
    fn block_fifth_word(&self) -> Option<usize> {
        match self.ty {
            GgmlType::Q5_0 => Some(2),
            GgmlType::Q5_1 => Some(4),
            _ => None,
        }
    }

    /// Writes one row's GGUF block (`src`) as lane `row` of tile-block
    /// `dst` (which starts zeroed).
    pub fn pack(&self, src: &[u8], row: usize, dst: &mut [u8]) {
        let (d, min) = self.block_halves();
        dst[self.d + 2 * row..self.d + 2 * row + 2].copy_from_slice(&src[d..d + 2]);
        if let (Some(from), Some(to)) = (min, self.min) {
            dst[to + 2 * row..to + 2 * row + 2].copy_from_slice(&src[from..from + 2]);
        }
        for &(from, len, to) in self.interleaved() {
            for o in 0..len {
                dst[to + interleaved_at(row, o)] = src[from + o];
            }
        }
        if let (Some(at), Some(to)) = (self.block_fifth_word(), self.high) {
            let word = u32::from_le_bytes([src[at], src[at + 1], src[at + 2], src[at + 3]]);
            for col in 0..32 {
                let bit = ((word >> col) & 1) as u8;
                dst[to + 4 * row + col % 4] |= bit << (col / 4);
            }
        }
        match self.ty {
            GgmlType::Q4_K | GgmlType::Q5_K => {
                let (sc, mins) = (self.sub_scales.unwrap_or(0), self.sub_mins.unwrap_or(0));
                for g in 0..8 {
                    let (s, m) = k_scale_min(&src[4..16], g);
                    dst[sc + TILE * g + row] = s;
                    dst[mins + TILE * g + row] = m;
                }
            }
            GgmlType::Q6_K => {
                let sc = self.sub_scales.unwrap_or(0);
                for g in 0..16 {
                    dst[sc + TILE * g + row] = src[192 + g];
                }
            }
            _ => {}
        }
    }

    /// Rebuilds lane `row`'s GGUF block from tile-block `src`: the inverse
    /// of [`pack`](Self::pack).
    pub fn unpack(&self, src: &[u8], row: usize, dst: &mut [u8]) {
        let (d, min) = self.block_halves();
        dst[d..d + 2].copy_from_slice(&src[self.d + 2 * row..self.d + 2 * row + 2]);
        if let (Some(to), Some(from)) = (min, self.min) {
            dst[to..to + 2].copy_from_slice(&src[from + 2 * row..from + 2 * row + 2]);
        }
        for &(to, len, from) in self.interleaved() {
            for o in 0..len {
                dst[to + o] = src[from + interleaved_at(row, o)];
            }
        }
        if let (Some(at), Some(from)) = (self.block_fifth_word(), self.high) {
            let word = (0..32).fold(0u32, |w, col| {
                let bit = (src[from + 4 * row + col % 4] >> (col / 4)) & 1;
                w | (u32::from(bit) << col)
            });
            dst[at..at + 4].copy_from_slice(&word.to_le_bytes());
        }
        match self.ty {
            GgmlType::Q4_K | GgmlType::Q5_K => {
                let (sc, mins) = (self.sub_scales.unwrap_or(0), self.sub_mins.unwrap_or(0));
                let s = |g: usize| src[sc + TILE * g + row];
                let m = |g: usize| src[mins + TILE * g + row];
                // ggml's 6-bit packing (the inverse of `k_scale_min`).
                for j in 0..4 {
                    dst[4 + j] = s(j) | ((s(j + 4) >> 4) << 6);
                    dst[8 + j] = m(j) | ((m(j + 4) >> 4) << 6);
                    dst[12 + j] = (s(j + 4) & 0x0F) | ((m(j + 4) & 0x0F) << 4);
                }
            }
            GgmlType::Q6_K => {
                let sc = self.sub_scales.unwrap_or(0);
                for g in 0..16 {
                    dst[192 + g] = src[sc + TILE * g + row];
                }
            }
            _ => {}
        }
    }
}

/// Where byte `o` of lane `row`'s code section lies within the section.
#[inline]
pub fn interleaved_at(row: usize, o: usize) -> usize {
    32 * (o / 4) + 4 * row + o % 4
}

/// The weight at column `j` of lane `row`'s block in tile-block `b`,
/// decoded alone as ggml's block decoder does (for the activations'
/// outliers).
pub fn weight_at(layout: &TileLayout, b: &[u8], row: usize, j: usize) -> f32 {
    let half = |at: usize| super::scalar::half(b, at + 2 * row);
    let code = |section: usize, o: usize| b[section + interleaved_at(row, o)];
    let d = half(layout.d);
    let min = || half(layout.min.unwrap_or(0));
    // Legacy blocks: element j's nibble (low: 0..16, high: 16..32) and
    // fifth bit (bit j/4 of byte 4·row + j%4 of the transposed word).
    let nib = || (code(layout.codes, j % 16) >> (4 * (j / 16))) & 0x0F;
    let fifth = || ((b[layout.high.unwrap_or(0) + 4 * row + j % 4] >> (j / 4)) & 1) << 4;
    match layout.ty {
        GgmlType::Q8_0 => d * f32::from(code(layout.codes, j) as i8),
        GgmlType::Q4_0 => d * (f32::from(nib()) - 8.0),
        GgmlType::Q4_1 => d * f32::from(nib()) + min(),
        GgmlType::Q5_0 => d * (f32::from(nib() | fifth()) - 16.0),
        GgmlType::Q5_1 => d * f32::from(nib() | fifth()) + min(),
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let g = j / 32;
            let sc = b[layout.sub_scales.unwrap_or(0) + TILE * g + row];
            let m = b[layout.sub_mins.unwrap_or(0) + TILE * g + row];
            let mut q = (code(layout.codes, (g / 2) * 32 + j % 32) >> (4 * (g % 2))) & 0x0F;
            if let Some(high) = layout.high {
                q |= ((code(high, j % 32) >> g) & 1) << 4;
            }
            d * f32::from(sc) * f32::from(q) - min() * f32::from(m)
        }
        GgmlType::Q6_K => {
            let (h, c, l) = (j / 128, (j % 128) / 32, j % 32);
            let low = (code(layout.codes, h * 64 + (c % 2) * 32 + l) >> (4 * (c / 2))) & 0x0F;
            let high = (code(layout.high.unwrap_or(0), h * 32 + l) >> (2 * c)) & 0x03;
            let q = i32::from(low | (high << 4)) - 32;
            let sc = b[layout.sub_scales.unwrap_or(0) + TILE * (j / 16) + row] as i8;
            d * f32::from(sc) * q as f32
        }
        _ => unreachable!("weight_at on {}", layout.ty.name()),
    }
}
