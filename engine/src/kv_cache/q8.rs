//! 8-bit KV storage: int8 or fp8 (e4m3) codes with one f32 scale per
//! (layer, block, KV head), for K and for V separately.
//!
//! A block-head's scale is `amax / code_max` of what it holds (127 for
//! int8, 448 for e4m3; e4m3's rounded up to a power of two, see
//! [`Code::scale_for`]), so `x ≈ scale · decode(code)`. Tokens arrive one at
//! a time during decode: the first token of a block (slot 0) sets the scale;
//! a later token whose magnitude exceeds it raises the scale and re-encodes
//! the slots already written (one rounding more for them, only when the
//! range grows). A whole-block write (a transferred block) quantizes the
//! block at once. Everything a block-layer needs to be read back, codes and
//! scales, belongs to that block, so copy-on-write and block transfer never
//! look at another block.
//!
//! Per token and head this stores `head_dim` bytes plus `4 / block_size`
//! bytes of scale: half of a 16-bit cache, to within the scales.

use std::sync::OnceLock;

/// An 8-bit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// Signed integers −127..=127.
    Int8,
    /// OCP FP8 E4M3 (the `fn` variant: no infinities, max 448).
    Fp8E4m3,
}

/// E4M3's largest finite magnitude.
const E4M3_MAX: f32 = 448.0;

/// The 256 values of E4M3 codes (NaN codes decode to 0: never produced).
fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: OnceLock<[f32; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = [0f32; 256];
        for (c, v) in t.iter_mut().enumerate() {
            let (sign, exp, man) = ((c >> 7) & 1, (c >> 3) & 0xf, c & 7);
            let mag = if exp == 0xf && man == 7 {
                0.0
            } else if exp == 0 {
                man as f32 * 2f32.powi(-9)
            } else {
                (1.0 + man as f32 / 8.0) * 2f32.powi(exp as i32 - 7)
            };
            *v = if sign == 1 { -mag } else { mag };
        }
        t
    })
}

/// Nearest E4M3 code of `x` (saturating at ±448).
fn e4m3_encode(x: f32) -> u8 {
    let table = e4m3_table();
    let mag = x.abs().min(E4M3_MAX);
    // Codes 0..=0x7e are the finite non-negative values in increasing order.
    let positive = &table[..0x7f];
    let hi = positive.partition_point(|&v| v < mag).min(0x7e);
    let code = if hi > 0 && (mag - positive[hi - 1]) <= (positive[hi] - mag) {
        hi - 1
    } else {
        hi
    } as u8;
    if x.is_sign_negative() && code != 0 {
        code | 0x80
    } else {
        code
    }
}

impl Code {
    /// The largest magnitude a code represents (before scaling).
    pub fn max(self) -> f32 {
        match self {
            Self::Int8 => 127.0,
            Self::Fp8E4m3 => E4M3_MAX,
        }
    }

    /// The scale that fits magnitudes up to `amax`. Int8 uses its whole
    /// range (`amax / 127`). E4M3 is a float: its relative precision is the
    /// same across its range, so its scale is rounded up to a power of two,
    /// which costs no precision and makes raising a block's scale later an
    /// exact exponent shift of the codes already written (no second
    /// rounding).
    #[inline]
    pub fn scale_for(self, amax: f32) -> f32 {
        let s = amax / self.max();
        match self {
            Self::Int8 => s,
            Self::Fp8E4m3 if s > 0.0 && s.is_finite() => 2f32.powi(s.log2().ceil() as i32),
            Self::Fp8E4m3 => s,
        }
    }

    /// The code of `x / scale`'s nearest representable value.
    #[inline]
    pub fn encode(self, x: f32) -> u8 {
        match self {
            Self::Int8 => x.round().clamp(-127.0, 127.0) as i8 as u8,
            Self::Fp8E4m3 => e4m3_encode(x),
        }
    }

    /// Decodes a run of codes into `out` (unscaled).
    #[inline]
    pub fn decode_into(self, codes: &[u8], out: &mut [f32]) {
        match self {
            Self::Int8 => {
                for (o, &c) in out.iter_mut().zip(codes) {
                    *o = f32::from(c as i8);
                }
            }
            Self::Fp8E4m3 => {
                let t = e4m3_table();
                for (o, &c) in out.iter_mut().zip(codes) {
                    *o = t[c as usize];
                }
            }
        }
    }
}

/// One layer's 8-bit K (or V) pool: `[block][kv_head][slot][head_dim]`
/// codes and `[block][kv_head]` scales.
#[derive(Debug, Clone)]
pub(super) struct Q8Pool {
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
}

impl Q8Pool {
    pub fn new(num_blocks: usize, heads: usize, block_size: usize, head_dim: usize) -> Self {
        Self {
            codes: vec![0; num_blocks * heads * block_size * head_dim],
            scales: vec![0.0; num_blocks * heads],
        }
    }

    /// Writes one head's row at `slot` of block-head `bh` (each block-head
    /// holds `block_size` rows of `d`).
    pub fn write_row(
        &mut self,
        code: Code,
        bh: usize,
        slot: usize,
        block_size: usize,
        row: &[f32],
    ) {
        let d = row.len();
        let amax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
        let base = bh * block_size * d;
        let old = self.scales[bh];
        let scale = if slot == 0 {
            code.scale_for(amax)
        } else if amax > old * code.max() {
            // Raise the block-head's scale and re-encode the rows before.
            let new = code.scale_for(amax);
            let mut buf = vec![0f32; slot * d];
            code.decode_into(&self.codes[base..base + slot * d], &mut buf);
            let ratio = old / new;
            for (c, v) in self.codes[base..base + slot * d].iter_mut().zip(&buf) {
                *c = code.encode(v * ratio);
            }
            new
        } else {
            old
        };
        self.scales[bh] = scale;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        let dst = &mut self.codes[base + slot * d..base + (slot + 1) * d];
        for (c, &v) in dst.iter_mut().zip(row) {
            *c = code.encode(v * inv);
        }
    }

    /// Overwrites block `block` (`heads` block-heads) from f32 values
    /// `[kv_head][slot][head_dim]`.
    pub fn write_block(&mut self, code: Code, block: usize, heads: usize, values: &[f32]) {
        let per_head = values.len() / heads;
        for (h, src) in values.chunks_exact(per_head).enumerate() {
            let bh = block * heads + h;
            let amax = src.iter().fold(0f32, |a, v| a.max(v.abs()));
            let scale = code.scale_for(amax);
            self.scales[bh] = scale;
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            let dst = &mut self.codes[bh * per_head..(bh + 1) * per_head];
            for (c, &v) in dst.iter_mut().zip(src) {
                *c = code.encode(v * inv);
            }
        }
    }

    /// Block `block` dequantized to f32 `[kv_head][slot][head_dim]`.
    pub fn read_block(&self, code: Code, block: usize, heads: usize, per_head: usize) -> Vec<f32> {
        let mut out = vec![0f32; heads * per_head];
        for (h, dst) in out.chunks_exact_mut(per_head).enumerate() {
            let bh = block * heads + h;
            code.decode_into(&self.codes[bh * per_head..(bh + 1) * per_head], dst);
            let s = self.scales[bh];
            for v in dst.iter_mut() {
                *v *= s;
            }
        }
        out
    }

    /// Copies block `src` onto block `dst` (codes and scales).
    pub fn copy_block(&mut self, src: usize, dst: usize, heads: usize, per_head: usize) {
        let n = heads * per_head;
        self.codes.copy_within(src * n..(src + 1) * n, dst * n);
        self.scales
            .copy_within(src * heads..(src + 1) * heads, dst * heads);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_round_trips_its_own_values_and_rounds_to_nearest() {
        let t = e4m3_table();
        for c in 0..=0x7eu8 {
            assert_eq!(e4m3_encode(t[c as usize]), c, "code {c:#x}");
            if c > 0 {
                assert_eq!(e4m3_encode(-t[c as usize]), c | 0x80);
            }
        }
        assert_eq!(t[0x7e], 448.0);
        assert_eq!(e4m3_encode(1e6), 0x7e);
        assert_eq!(t[e4m3_encode(1.06) as usize], 1.0); // 1.0 and 1.125 neighbours
        assert_eq!(t[e4m3_encode(1.1) as usize], 1.125);
    }

    #[test]
    fn raising_an_e4m3_scale_keeps_the_earlier_rows_exactly() {
        let (bs, d) = (4, 8);
        let mut pool = Q8Pool::new(1, 1, bs, d);
        let small: Vec<f32> = (0..d).map(|i| (i as f32 - 3.3) * 0.013).collect();
        pool.write_row(Code::Fp8E4m3, 0, 0, bs, &small);
        let before = pool.read_block(Code::Fp8E4m3, 0, 1, bs * d)[..d].to_vec();
        let big: Vec<f32> = small.iter().map(|v| v * 37.0).collect();
        pool.write_row(Code::Fp8E4m3, 0, 1, bs, &big);
        assert!(
            pool.scales[0] > 16.0 * Code::Fp8E4m3.scale_for(0.05),
            "the scale grew"
        );
        let after = pool.read_block(Code::Fp8E4m3, 0, 1, bs * d)[..d].to_vec();
        assert_eq!(before, after, "a power-of-two rescale is exact");
        assert_eq!(Code::Fp8E4m3.scale_for(448.0), 1.0);
        assert_eq!(Code::Fp8E4m3.scale_for(449.0), 2.0);
        assert_eq!(Code::Fp8E4m3.scale_for(0.0), 0.0);
    }

    #[test]
    fn rows_written_one_by_one_stay_within_a_step_after_the_scale_grows() {
        for code in [Code::Int8, Code::Fp8E4m3] {
            let (bs, d) = (4, 8);
            let mut pool = Q8Pool::new(2, 1, bs, d);
            let rows: Vec<Vec<f32>> = (0..bs)
                .map(|s| {
                    (0..d)
                        .map(|i| (i as f32 - 3.5) * (s + 1) as f32 * 0.1)
                        .collect()
                })
                .collect();
            for (s, r) in rows.iter().enumerate() {
                pool.write_row(code, 1, s, bs, r);
            }
            let back = pool.read_block(code, 1, 1, bs * d);
            let amax = rows.iter().flatten().fold(0f32, |a, v| a.max(v.abs()));
            // Relative precision: int8 is 1/127 of the range; e4m3 carries
            // 3 mantissa bits (1/16 relative) plus one re-encoding.
            let tol = match code {
                Code::Int8 => 2.0 * amax / 127.0,
                Code::Fp8E4m3 => amax / 8.0,
            };
            for (a, b) in rows.iter().flatten().zip(&back) {
                assert!((a - b).abs() <= tol, "{code:?}: {a} vs {b}");
            }
        }
    }
}
