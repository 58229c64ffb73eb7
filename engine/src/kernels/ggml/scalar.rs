//! The portable dot products of one GGUF-quantized weight row with one
//! int8 activation row: ggml's reference arithmetic, one element at a
//! time. Every SIMD kernel computes the same integer sums (only the float
//! accumulation order differs) and is tested against these.
//!
//! Codes are kept unsigned; a type's offset (`Q4_0`'s 8, `Q5_0`'s 16,
//! `Q6_K`'s 32) is taken out once per block against the activations'
//! integer sums, which is the same integer as ggml's `Σ (q − o)·y`. The
//! K-quants' sums are scaled per 32 columns, the activations' block
//! ([`super::act`]).

use tandem_gguf::{k_scale_min, GgmlType};

use super::act::{Q8Row, QK8, QK_K};

#[inline]
pub(super) fn half(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// `Σ w·x` over one row (`w`: the row's blocks), the activations'
/// outliers aside.
pub(super) fn dot(ty: GgmlType, w: &[u8], y: &Q8Row) -> f32 {
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => dot_k(ty, w, y),
        _ => dot_q8(ty, w, y),
    }
}

/// [`dot`] for the 32-element types.
fn dot_q8(ty: GgmlType, w: &[u8], y: &Q8Row) -> f32 {
    let mut acc = 0f32;
    for (i, b) in w.chunks_exact(ty.block_bytes()).enumerate() {
        let yq = &y.q[i * QK8..(i + 1) * QK8];
        let (dy, sy, sum) = (y.d[i], y.s[i], y.sum[i]);
        acc += match ty {
            GgmlType::Q8_0 => {
                let isum: i32 = b[2..34]
                    .iter()
                    .zip(yq)
                    .map(|(&q, &v)| i32::from(q as i8) * i32::from(v))
                    .sum();
                half(b, 0) * dy * isum as f32
            }
            GgmlType::Q4_0 => {
                let isum = nibble_dot(&b[2..18], yq);
                half(b, 0) * dy * (isum - 8 * sum) as f32
            }
            GgmlType::Q4_1 => half(b, 0) * dy * nibble_dot(&b[4..20], yq) as f32 + half(b, 2) * sy,
            GgmlType::Q5_0 => {
                let isum = q5_dot(&b[2..6], &b[6..22], yq);
                half(b, 0) * dy * (isum - 16 * sum) as f32
            }
            GgmlType::Q5_1 => {
                half(b, 0) * dy * q5_dot(&b[4..8], &b[8..24], yq) as f32 + half(b, 2) * sy
            }
            _ => unreachable!("dot_q8 on {}", ty.name()),
        };
    }
    acc
}

/// `Σ q·y` of 32 codes packed as `Q4_0`'s nibbles (low: 0..16, high: 16..32).
fn nibble_dot(qs: &[u8], y: &[i8]) -> i32 {
    (0..16)
        .map(|j| {
            i32::from(qs[j] & 0x0F) * i32::from(y[j]) + i32::from(qs[j] >> 4) * i32::from(y[j + 16])
        })
        .sum()
}

/// `Σ q·y` of 32 five-bit codes: `Q4_0`'s nibbles plus bit `j` of `qh`.
fn q5_dot(qh: &[u8], qs: &[u8], y: &[i8]) -> i32 {
    let high = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    (0..32)
        .map(|j| {
            let low = (qs[j % 16] >> (4 * (j / 16))) & 0x0F;
            let q = low | ((((high >> j) & 1) as u8) << 4);
            i32::from(q) * i32::from(y[j])
        })
        .sum()
}

/// [`dot`] for the K-quants: integer sums per sub-block, each 32 columns
/// scaled by their activation block's scale.
fn dot_k(ty: GgmlType, w: &[u8], y: &Q8Row) -> f32 {
    let mut acc = 0f32;
    for (i, b) in w.chunks_exact(ty.block_bytes()).enumerate() {
        let at = i * QK_K / QK8;
        let dy = &y.d[at..at + QK_K / QK8];
        let yq = &y.q[i * QK_K..(i + 1) * QK_K];
        acc += match ty {
            GgmlType::Q6_K => q6k_block(b, yq, &y.sums16[2 * at..2 * at + 16], dy),
            _ => k4_block(ty, b, yq, dy, &y.s[at..at + QK_K / QK8]),
        };
    }
    acc
}

/// A `Q4_K`/`Q5_K` block: `Σ_g d·sc_g·dy_g·Σ q·y − dmin·m_g·s_g` over its
/// eight 32-column sub-blocks (`s_g`: the activations' scaled sum).
fn k4_block(ty: GgmlType, b: &[u8], y: &[i8], dy: &[f32], sy: &[f32]) -> f32 {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let scales = &b[4..16];
    let (qh, qs) = match ty {
        GgmlType::Q5_K => (Some(&b[16..48]), &b[48..176]),
        _ => (None, &b[16..144]),
    };
    let (mut dots, mut mins) = (0f32, 0f32);
    for g in 0..8 {
        let (sc, m) = k_scale_min(scales, g);
        let low = &qs[(g / 2) * 32..(g / 2) * 32 + 32];
        let isum: i32 = (0..32)
            .map(|l| {
                let mut q = (low[l] >> (4 * (g % 2))) & 0x0F;
                if let Some(qh) = qh {
                    q |= ((qh[l] >> g) & 1) << 4;
                }
                i32::from(q) * i32::from(y[g * 32 + l])
            })
            .sum();
        dots += (i32::from(sc) * isum) as f32 * (d * dy[g]);
        mins += f32::from(m) * sy[g];
    }
    dots - dmin * mins
}

/// A `Q6_K` block: `Σ_b d·dy_b·Σ_{g∈b} sc_g·(Σ q·y − 32·Σ y)` over its
/// 32-column blocks `b`, each two 16-column sub-blocks `g`.
fn q6k_block(b: &[u8], y: &[i8], sums16: &[i16], dy: &[f32]) -> f32 {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let mut sums = [0i32; 16];
    for (v, &yv) in y.iter().enumerate() {
        let (half, c, l) = (v / 128, (v % 128) / 32, v % 32);
        let low = (ql[half * 64 + (c % 2) * 32 + l] >> (4 * (c / 2))) & 0x0F;
        let high = (qh[half * 32 + l] >> (2 * c)) & 0x03;
        sums[v / 16] += i32::from(low | (high << 4)) * i32::from(yv);
    }
    let d = half(b, 208);
    (0..8)
        .map(|blk| {
            let isum: i32 = (2 * blk..2 * blk + 2)
                .map(|g| i32::from(scales[g] as i8) * (sums[g] - 32 * i32::from(sums16[g])))
                .sum();
            isum as f32 * (d * dy[blk])
        })
        .sum()
}

/// The weight at column `col` of a row of `ty` blocks, decoded alone: the
/// reference the tiles' [`super::tiles::weight_at`] is tested against.
#[cfg(test)]
pub(super) fn weight_at(ty: GgmlType, row: &[u8], col: usize) -> f32 {
    let n = ty.block_len();
    let b = &row[col / n * ty.block_bytes()..(col / n + 1) * ty.block_bytes()];
    let j = col % n;
    // The nibble of element j of a 32-element legacy block.
    let nib = |qs: &[u8]| (qs[j % 16] >> (4 * (j / 16))) & 0x0F;
    let fifth = |qh: &[u8]| ((qh[j / 8] >> (j % 8)) & 1) << 4;
    match ty {
        GgmlType::Q8_0 => half(b, 0) * f32::from(b[2 + j] as i8),
        GgmlType::Q4_0 => half(b, 0) * (f32::from(nib(&b[2..18])) - 8.0),
        GgmlType::Q4_1 => half(b, 0) * f32::from(nib(&b[4..20])) + half(b, 2),
        GgmlType::Q5_0 => half(b, 0) * (f32::from(nib(&b[6..22]) | fifth(&b[2..6])) - 16.0),
        GgmlType::Q5_1 => half(b, 0) * f32::from(nib(&b[8..24]) | fifth(&b[4..8])) + half(b, 2),
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let g = j / 32;
            let (sc, m) = k_scale_min(&b[4..16], g);
            let at = if ty == GgmlType::Q5_K { 48 } else { 16 };
            let mut q = (b[at + (g / 2) * 32 + j % 32] >> (4 * (g % 2))) & 0x0F;
            if ty == GgmlType::Q5_K {
                q |= ((b[16 + j % 32] >> g) & 1) << 4;
            }
            half(b, 0) * f32::from(sc) * f32::from(q) - half(b, 2) * f32::from(m)
        }
        GgmlType::Q6_K => {
            let (h, c, l) = (j / 128, (j % 128) / 32, j % 32);
            let low = (b[h * 64 + (c % 2) * 32 + l] >> (4 * (c / 2))) & 0x0F;
            let high = (b[128 + h * 32 + l] >> (2 * c)) & 0x03;
            let q = i32::from(low | (high << 4)) - 32;
            half(b, 208) * f32::from(b[192 + j / 16] as i8) * q as f32
        }
        _ => unreachable!("weight_at on {}", ty.name()),
    }
}
