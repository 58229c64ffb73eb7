//! 8-bit KV storage: int8 or fp8 (e4m3) codes, one f16 scale per row (a
//! token's K or V in one KV head), rows rotated by a Hadamard transform.
//!
//! Measured on a real checkpoint (`quality-bench`, bench/RESULTS.md), two
//! things decide an 8-bit cache's error:
//!
//! - **Scale granularity.** One scale per (block, head) let one loud token
//!   (the attention sink every model grows at its first position) set the
//!   step for the fifteen tokens beside it. A scale per row costs 2 bytes per
//!   `head_dim` codes and never re-encodes anything: a row is quantized once,
//!   when written.
//! - **Outlier channels.** Keys carry a few channels far louder than the
//!   rest, and a query meets them on exactly those channels (that is how a
//!   head attends to its sink). Each row is multiplied by an orthonormal
//!   Hadamard matrix `H` (after fixed sign flips `D`) before it is quantized
//!   ([`rotate`]): `H` spreads an outlier's energy evenly over every
//!   channel, so the step a row's `amax` sets is small for all of them, and
//!   a float code's relative error no longer lands on the channels that
//!   carry the score. Attention never un-rotates a key:
//!   `q·k = (HDq)·(HDk)`, so it rotates the query once; it sums rotated
//!   values and rotates the output back once ([`unrotate`]). A block read
//!   out for a transfer is rotated back.
//!
//! Per token and head this stores `head_dim` bytes plus a 2-byte (f16)
//! scale: with `head_dim` 64, 0.52 of a 16-bit cache's bytes. FP8 adds its
//! recent window's 16-bit copies (`recent.rs`), an eighth of the blocks:
//! 0.64 in all.

use std::sync::OnceLock;

use half::f16;

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

/// `H·D·x` in place: `D` flips the signs of a fixed pseudo-random half of
/// the channels, `H` is the orthonormal Hadamard matrix of the largest power
/// of two dividing the length (block-diagonal: a `head_dim` of 96 is three
/// blocks of 32). The signs keep a channel pattern that happens to match a
/// Hadamard row from passing through unspread. [`unrotate`] inverts it.
pub fn rotate(x: &mut [f32]) {
    flip_signs(x);
    hadamard(x);
}

/// Each `d`-long row of `x`, [`rotate`]d, as a new buffer.
pub(super) fn rotate_rows(x: &[f32], d: usize) -> Vec<f32> {
    let mut out = x.to_vec();
    for row in out.chunks_exact_mut(d.max(1)) {
        rotate(row);
    }
    out
}

/// `D·H·x` in place, the inverse of [`rotate`] (`H` and `D` are their own
/// inverses).
pub fn unrotate(x: &mut [f32]) {
    hadamard(x);
    flip_signs(x);
}

fn flip_signs(x: &mut [f32]) {
    for (i, v) in x.iter_mut().enumerate() {
        // A fixed hash of the channel: the same on every worker and run.
        if (i as u32).wrapping_mul(0x9e37_79b9).rotate_left(7) & 0x100 != 0 {
            *v = -*v;
        }
    }
}

fn hadamard(x: &mut [f32]) {
    let n = x.len();
    if n == 0 {
        return;
    }
    let block = 1usize << n.trailing_zeros();
    let norm = 1.0 / (block as f32).sqrt();
    for part in x.chunks_exact_mut(block) {
        let mut h = 1;
        while h < block {
            for i in (0..block).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (part[j], part[j + h]);
                    part[j] = a + b;
                    part[j + h] = a - b;
                }
            }
            h *= 2;
        }
        for v in part.iter_mut() {
            *v *= norm;
        }
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
    /// which costs no precision and is exact in the f16 it is stored as.
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
/// codes and one scale per row, `[block][kv_head][slot]`.
#[derive(Debug, Clone)]
pub(super) struct Q8Pool {
    pub codes: Vec<u8>,
    /// f16: a scale only sets a row's step, and the codes are made against
    /// the rounded value, so its rounding costs nothing.
    pub scales: Vec<f16>,
    /// Rows of one block: `kv_heads × block_size`.
    block_rows: usize,
}

impl Q8Pool {
    pub fn new(num_blocks: usize, heads: usize, block_size: usize, head_dim: usize) -> Self {
        Self {
            codes: vec![0; num_blocks * heads * block_size * head_dim],
            scales: vec![f16::ZERO; num_blocks * heads * block_size],
            block_rows: heads * block_size,
        }
    }

    /// Encodes an already rotated row `src` into `dst` and returns its scale.
    fn encode_rotated(code: Code, src: &[f32], dst: &mut [u8]) -> f16 {
        let amax = src.iter().fold(0f32, |a, v| a.max(v.abs()));
        // Rounded up to the next f16, so no code overflows its range.
        let mut scale16 = f16::from_f32(code.scale_for(amax));
        if scale16.is_finite() && scale16.to_f32() * code.max() < amax {
            scale16 = f16::from_bits(scale16.to_bits() + 1);
        }
        let scale = scale16.to_f32();
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        for (c, &v) in dst.iter_mut().zip(src) {
            *c = code.encode(v * inv);
        }
        scale16
    }

    /// Writes one head's row, already rotated ([`rotate`]), at `slot` of
    /// block-head `bh` (each block-head holds `block_size` rows of `d`).
    pub fn write_rotated_row(
        &mut self,
        code: Code,
        bh: usize,
        slot: usize,
        block_size: usize,
        row: &[f32],
    ) {
        let d = row.len();
        let r = bh * block_size + slot;
        self.scales[r] = Self::encode_rotated(code, row, &mut self.codes[r * d..(r + 1) * d]);
    }

    /// Block `block` decoded into `out` (`[kv_head][slot][head_dim]`) as
    /// attention scores it: scaled, still rotated.
    pub fn decode_block_rotated(&self, code: Code, block: usize, out: &mut [f32]) {
        let d = out.len() / self.block_rows;
        for (i, dst) in out.chunks_exact_mut(d).enumerate() {
            let r = block * self.block_rows + i;
            code.decode_into(&self.codes[r * d..(r + 1) * d], dst);
            let s = self.scales[r].to_f32();
            for v in dst.iter_mut() {
                *v *= s;
            }
        }
    }

    /// Overwrites block `block` (`heads` block-heads) from f32 rows
    /// `[kv_head][slot][head_dim]`, each already rotated ([`rotate_rows`]).
    pub fn write_rotated_block(&mut self, code: Code, block: usize, rotated: &[f32]) {
        let rows = self.block_rows;
        let d = rotated.len() / rows;
        for (i, src) in rotated.chunks_exact(d).enumerate() {
            let r = block * rows + i;
            self.scales[r] = Self::encode_rotated(code, src, &mut self.codes[r * d..(r + 1) * d]);
        }
    }

    /// Block `block` dequantized to f32 `[kv_head][slot][head_dim]`, rotated
    /// back.
    pub fn read_block(&self, code: Code, block: usize, block_elems: usize) -> Vec<f32> {
        let mut out = vec![0f32; block_elems];
        self.decode_block_rotated(code, block, &mut out);
        for row in out.chunks_exact_mut(block_elems / self.block_rows) {
            unrotate(row);
        }
        out
    }

    /// Copies block `src` onto block `dst` (codes and scales).
    pub fn copy_block(&mut self, src: usize, dst: usize, block_elems: usize) {
        let n = block_elems;
        let rows = self.block_rows;
        self.codes.copy_within(src * n..(src + 1) * n, dst * n);
        self.scales
            .copy_within(src * rows..(src + 1) * rows, dst * rows);
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

    fn lcg(seed: u32) -> impl FnMut() -> f32 {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
        move || {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        }
    }

    #[test]
    fn rotation_is_orthonormal_and_inverted_exactly_enough() {
        for d in [64, 96, 128, 80] {
            let mut r = lcg(d as u32);
            let a: Vec<f32> = (0..d).map(|_| r()).collect();
            let b: Vec<f32> = (0..d).map(|_| r()).collect();
            let (mut ra, mut rb) = (a.clone(), b.clone());
            rotate(&mut ra);
            rotate(&mut rb);
            let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| p * q).sum::<f32>();
            assert!(
                (dot(&a, &b) - dot(&ra, &rb)).abs() < 1e-5,
                "d {d}: dot kept"
            );
            assert_ne!(a, ra, "d {d}: rotated");
            unrotate(&mut ra);
            for (x, y) in a.iter().zip(&ra) {
                assert!((x - y).abs() < 1e-6, "d {d}: {x} vs {y}");
            }
        }
    }

    #[test]
    fn an_outlier_channel_is_spread_before_it_sets_the_int8_step() {
        // One channel 100x the others: unrotated, int8 would step by
        // 10/127 = 0.079 on every channel, giving the quiet ones about one
        // level; rotated, the outlier's energy is spread first.
        let d = 64;
        let mut r = lcg(7);
        let mut row: Vec<f32> = (0..d).map(|_| r() * 0.1).collect();
        row[5] = 10.0;
        let mut pool = Q8Pool::new(1, 1, 4, d);
        let mut rotated = row.clone();
        rotate(&mut rotated);
        pool.write_rotated_row(Code::Int8, 0, 2, 4, &rotated);
        let back = &pool.read_block(Code::Int8, 0, 4 * d)[2 * d..3 * d];
        let err = row
            .iter()
            .zip(back)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < 0.02, "{err}");
    }

    #[test]
    fn each_row_has_its_own_scale_and_blocks_round_trip() {
        let (bs, d, heads) = (4, 32, 2);
        for code in [Code::Int8, Code::Fp8E4m3] {
            let mut pool = Q8Pool::new(3, heads, bs, d);
            let mut r = lcg(3);
            // A loud row beside quiet ones must not coarsen them.
            let block: Vec<f32> = (0..heads * bs * d)
                .map(|i| r() * if i / d == 1 { 1000.0 } else { 0.01 })
                .collect();
            pool.write_rotated_block(code, 2, &rotate_rows(&block, d));
            let back = pool.read_block(code, 2, block.len());
            for (row, (a, b)) in block.chunks(d).zip(back.chunks(d)).enumerate() {
                let amax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
                let err = a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                assert!(
                    err <= amax / 10.0,
                    "{code:?} row {row}: {err} vs amax {amax}"
                );
            }
            // Row by row gives the same codes as a whole-block write.
            let mut rows = Q8Pool::new(3, heads, bs, d);
            for (i, src) in block.chunks(d).enumerate() {
                let mut row = src.to_vec();
                rotate(&mut row);
                rows.write_rotated_row(code, 2 * heads + i / bs, i % bs, bs, &row);
            }
            assert_eq!(rows.codes, pool.codes);
            assert_eq!(rows.scales, pool.scales);
            pool.copy_block(2, 0, block.len());
            assert_eq!(pool.read_block(code, 0, block.len()), back);
        }
    }
}
