//! The tensor types llama.cpp writes and how their blocks decode.
//!
//! A quantized row is a run of fixed-size blocks; each decodes to
//! [`GgmlType::block_len`] weights on its own, so a row (whose length the
//! parser checks is a multiple of it) decodes without its neighbours. The
//! layouts follow ggml's `ggml-common.h`; `tests/dequantize.rs` checks every
//! type against the `gguf` Python package's own dequantizer.
//!
//! The 4-bit types (`Q4_0`, `Q4_1`, `Q4_K`) also decode to groups of 32
//! codes with a scale and an offset ([`four_bit_groups`]): the shape of the
//! engine's INT4 matrices, so those tensors load without going through
//! floats.

use half::{bf16, f16};

/// A tensor type this crate reads, named as ggml names it.
#[allow(non_camel_case_types)] // Q4_K and Q4K would read as different types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
}

/// Weights per K-quant super-block.
const QK_K: usize = 256;

/// The names of ggml's other type codes, so an error can say which one a
/// file used.
const OTHER_TYPES: [(u32, &str); 19] = [
    (9, "Q8_1"),
    (10, "Q2_K"),
    (11, "Q3_K"),
    (15, "Q8_K"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (39, "MXFP4"),
];

impl GgmlType {
    /// Every type this crate reads.
    pub const ALL: [GgmlType; 11] = [
        Self::F32,
        Self::F16,
        Self::Bf16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
    ];

    /// The type with ggml's code `code`, or `Err` with the name of a type
    /// ggml has and this crate does not read (`None` when ggml has no such
    /// code either).
    pub fn from_code(code: u32) -> Result<Self, Option<&'static str>> {
        match code {
            0 => Ok(Self::F32),
            1 => Ok(Self::F16),
            2 => Ok(Self::Q4_0),
            3 => Ok(Self::Q4_1),
            6 => Ok(Self::Q5_0),
            7 => Ok(Self::Q5_1),
            8 => Ok(Self::Q8_0),
            12 => Ok(Self::Q4_K),
            13 => Ok(Self::Q5_K),
            14 => Ok(Self::Q6_K),
            30 => Ok(Self::Bf16),
            _ => Err(OTHER_TYPES
                .iter()
                .find(|(c, _)| *c == code)
                .map(|(_, n)| *n)),
        }
    }

    /// ggml's code for the type.
    pub fn code(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q4_K => 12,
            Self::Q5_K => 13,
            Self::Q6_K => 14,
            Self::Bf16 => 30,
        }
    }

    /// ggml's name for the type.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Bf16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q4_K => "Q4_K",
            Self::Q5_K => "Q5_K",
            Self::Q6_K => "Q6_K",
        }
    }

    /// Weights per block.
    pub fn block_len(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::Bf16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            Self::Q4_K | Self::Q5_K | Self::Q6_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Q4_0 => 2 + 16,
            Self::Q4_1 => 2 + 2 + 16,
            Self::Q5_0 => 2 + 4 + 16,
            Self::Q5_1 => 2 + 2 + 4 + 16,
            Self::Q8_0 => 2 + 32,
            Self::Q4_K => 2 + 2 + 12 + QK_K / 2,
            Self::Q5_K => 2 + 2 + 12 + QK_K / 8 + QK_K / 2,
            Self::Q6_K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
        }
    }

    /// Bytes of `n` weights (`n` a multiple of the block length).
    pub fn bytes_for(self, n: usize) -> usize {
        n / self.block_len() * self.block_bytes()
    }

    /// Whether the type is a float format (read in place, not decoded).
    pub fn is_float(self) -> bool {
        matches!(self, Self::F32 | Self::F16 | Self::Bf16)
    }

    /// Whether [`four_bit_groups`] reads the type.
    pub fn is_four_bit(self) -> bool {
        matches!(self, Self::Q4_0 | Self::Q4_1 | Self::Q4_K)
    }
}

fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Decodes `out.len()` weights from `bytes` (exactly their blocks).
///
/// # Panics
/// When `bytes` is not `ty.bytes_for(out.len())` long or `out.len()` is not
/// a multiple of the block length: the parser checks both for every tensor.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    assert_eq!(out.len() % ty.block_len(), 0, "partial block");
    assert_eq!(bytes.len(), ty.bytes_for(out.len()), "block bytes");
    let blocks = bytes
        .chunks_exact(ty.block_bytes())
        .zip(out.chunks_exact_mut(ty.block_len()));
    match ty {
        GgmlType::F32 => {
            for (b, o) in blocks {
                o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => blocks.for_each(|(b, o)| o[0] = half_at(b, 0)),
        GgmlType::Bf16 => {
            blocks.for_each(|(b, o)| o[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32())
        }
        GgmlType::Q8_0 => {
            for (b, o) in blocks {
                let d = half_at(b, 0);
                for (w, &q) in o.iter_mut().zip(&b[2..]) {
                    *w = d * f32::from(q as i8);
                }
            }
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4_K => {
            let groups_per_block = ty.block_len() / 32;
            for (b, o) in blocks {
                for (g, group) in o.chunks_exact_mut(32).enumerate().take(groups_per_block) {
                    let FourBitGroup { codes, scale, min } = four_bit_group(ty, b, g);
                    for (w, &q) in group.iter_mut().zip(&codes) {
                        *w = scale * f32::from(q) + min;
                    }
                }
            }
        }
        GgmlType::Q5_0 => blocks.for_each(|(b, o)| dequantize_q5(b, o, false)),
        GgmlType::Q5_1 => blocks.for_each(|(b, o)| dequantize_q5(b, o, true)),
        GgmlType::Q5_K => blocks.for_each(|(b, o)| dequantize_q5_k(b, o)),
        GgmlType::Q6_K => blocks.for_each(|(b, o)| dequantize_q6_k(b, o)),
    }
}

/// 32 consecutive weights as 4-bit codes: `w = scale · q + min`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FourBitGroup {
    /// Codes `0..=15`, in weight order.
    pub codes: [u8; 32],
    pub scale: f32,
    pub min: f32,
}

/// The 32-weight groups of a row of a 4-bit type, in order (`Q4_0`: `min =
/// −8 · scale`; `Q4_1`: its stored min; `Q4_K`: the 6-bit sub-block scale and
/// min times the super-block's).
///
/// # Panics
/// When `ty` is not 4-bit or `bytes` is not whole blocks.
pub fn four_bit_groups(ty: GgmlType, bytes: &[u8]) -> impl Iterator<Item = FourBitGroup> + '_ {
    assert!(ty.is_four_bit(), "{} is not a 4-bit type", ty.name());
    assert_eq!(bytes.len() % ty.block_bytes(), 0, "partial block");
    let per_block = ty.block_len() / 32;
    bytes
        .chunks_exact(ty.block_bytes())
        .flat_map(move |b| (0..per_block).map(move |g| four_bit_group(ty, b, g)))
}

/// Group `g` (of 32 weights) of one block of a 4-bit type.
fn four_bit_group(ty: GgmlType, b: &[u8], g: usize) -> FourBitGroup {
    let mut codes = [0u8; 32];
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            // Byte j: weight j in the low nibble, weight j + 16 in the high.
            let (qs, scale, min) = match ty {
                GgmlType::Q4_0 => {
                    let d = half_at(b, 0);
                    (&b[2..18], d, -8.0 * d)
                }
                _ => (&b[4..20], half_at(b, 0), half_at(b, 2)),
            };
            for j in 0..16 {
                codes[j] = qs[j] & 0x0F;
                codes[j + 16] = qs[j] >> 4;
            }
            FourBitGroup { codes, scale, min }
        }
        GgmlType::Q4_K => {
            let (d, dmin) = (half_at(b, 0), half_at(b, 2));
            let (sc, m) = k_scale_min(&b[4..16], g);
            // 32 bytes per pair of groups: the even group in the low
            // nibbles, the odd one in the high.
            let qs = &b[16 + (g / 2) * 32..16 + (g / 2) * 32 + 32];
            let shift = 4 * (g % 2);
            for (c, &q) in codes.iter_mut().zip(qs) {
                *c = (q >> shift) & 0x0F;
            }
            FourBitGroup {
                codes,
                scale: d * f32::from(sc),
                min: -dmin * f32::from(m),
            }
        }
        _ => unreachable!("four_bit_group on {}", ty.name()),
    }
}

/// Sub-block `j`'s 6-bit scale and min from a K-quant's 12 packed bytes
/// (ggml's `get_scale_min_k4`).
pub fn k_scale_min(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

/// One `Q5_0` block (`w = d·(q − 16)`) or `Q5_1` block (`w = d·q + m`):
/// the scale (and min), 32 fifth bits, and 4-bit codes laid out as
/// `Q4_0`'s.
fn dequantize_q5(b: &[u8], out: &mut [f32], with_min: bool) {
    let d = half_at(b, 0);
    let (min, at) = match with_min {
        true => (half_at(b, 2), 4),
        false => (-16.0 * d, 2),
    };
    let high = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let qs = &b[at + 4..at + 20];
    for (j, w) in out.iter_mut().enumerate() {
        let low = (qs[j % 16] >> (4 * (j / 16))) & 0x0F;
        let q = low | (((high >> j) & 1) as u8) << 4;
        *w = d * f32::from(q) + min;
    }
}

/// One `Q5_K` block: `Q4_K`'s layout plus a 32-byte plane of fifth bits.
fn dequantize_q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (g, group) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = k_scale_min(&b[4..16], g);
        let (scale, min) = (d * f32::from(sc), dmin * f32::from(m));
        let low = &qs[(g / 2) * 32..(g / 2) * 32 + 32];
        let shift = 4 * (g % 2);
        for (l, w) in group.iter_mut().enumerate() {
            let q = ((low[l] >> shift) & 0x0F) | (((qh[l] >> g) & 1) << 4);
            *w = scale * f32::from(q) - min;
        }
    }
}

/// One `Q6_K` block: low nibbles (128 bytes), high bit pairs (64), sixteen
/// int8 scales of 16 weights each, and the f16 super-scale.
fn dequantize_q6_k(b: &[u8], out: &mut [f32]) {
    let (ql, qh) = (&b[0..128], &b[128..192]);
    let scales = &b[192..208];
    let d = half_at(b, 208);
    for (v, w) in out.iter_mut().enumerate() {
        // Each half of 128 weights: four runs of 32; run c takes the low
        // (c < 2) or high nibbles of 64 bytes and bits 2c..2c+1 of 32.
        let (half, c, l) = (v / 128, (v % 128) / 32, v % 32);
        let low = (ql[half * 64 + (c % 2) * 32 + l] >> (4 * (c / 2))) & 0x0F;
        let high = (qh[half * 32 + l] >> (2 * c)) & 0x03;
        let q = i32::from(low | (high << 4)) - 32;
        *w = d * f32::from(scales[v / 16] as i8) * q as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for ty in GgmlType::ALL {
            assert_eq!(GgmlType::from_code(ty.code()), Ok(ty));
        }
        assert_eq!(GgmlType::from_code(16), Err(Some("IQ2_XXS")));
        assert_eq!(GgmlType::from_code(9999), Err(None));
    }

    #[test]
    fn q4_0_block_decodes_with_its_offset_of_eight() {
        let mut b = vec![0u8; 18];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2] = 0xF0; // weight 0 = code 0, weight 16 = code 15
        let mut out = [0.0f32; 32];
        dequantize(GgmlType::Q4_0, &b, &mut out);
        assert_eq!(out[0], -4.0);
        assert_eq!(out[16], 3.5);
        assert_eq!(out[1], -4.0);
    }

    #[test]
    fn k_scales_unpack_the_high_bits() {
        // Sub-block 5: low nibble of byte 9, top bits of byte 1 (scale) and
        // byte 5 (min).
        let mut s = [0u8; 12];
        s[9] = 0x7A;
        s[1] = 0b1100_0000;
        s[5] = 0b0100_0000;
        assert_eq!(k_scale_min(&s, 5), (0x0A | (3 << 4), 0x07 | (1 << 4)));
    }
}
