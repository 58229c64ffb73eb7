//! 16-bit KV storage: bf16 or IEEE f16 elements, no scales.
//!
//! Half the bytes of f32 with one rounding per element: bf16 keeps f32's
//! exponent range (nothing a model produces overflows it) with 8 bits of
//! mantissa; f16 has 11 bits of mantissa but saturates at ±65504, which a
//! key or value of an ordinary checkpoint never reaches (the conversion
//! saturates rather than producing infinities, so an outlier is clipped,
//! not poisonous). On AVX-512 attention reads the rows as stored
//! ([`super::LayerView::half_rows`]) and widens them as its key transpose
//! and weighted sums load them; elsewhere they are decoded into the task's
//! f32 buffer, as 8-bit codes are (`q8.rs`).

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};

/// A 16-bit float format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Half {
    /// bfloat16: f32's exponent, 8-bit mantissa.
    Bf16,
    /// IEEE binary16: 5-bit exponent, 11-bit mantissa.
    F16,
}

impl Half {
    /// The bits of `x` in this format (round to nearest even; f16 saturates
    /// at its largest finite value).
    #[inline]
    pub fn encode(self, x: f32) -> u16 {
        match self {
            Self::Bf16 => bf16::from_f32(x).to_bits(),
            Self::F16 => {
                let max = f16::MAX.to_f32();
                f16::from_f32(x.clamp(-max, max)).to_bits()
            }
        }
    }

    /// Encodes `src` into `dst` element by element.
    pub fn encode_into(self, src: &[f32], dst: &mut [u16]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = self.encode(x);
        }
    }

    /// Decodes a run of elements into `out`.
    #[inline]
    pub fn decode_into(self, bits: &[u16], out: &mut [f32]) {
        match self {
            // bf16 is the top half of an f32: a shift.
            Self::Bf16 => widen_bf16(bits, &mut out[..bits.len()]),
            // F16C where the CPU has it (detected once by `half`), eight
            // elements an instruction.
            Self::F16 => bits
                .reinterpret_cast::<f16>()
                .convert_to_f32_slice(&mut out[..bits.len()]),
        }
    }

    /// `bits` decoded into a new vector.
    pub fn decode(self, bits: &[u16]) -> Vec<f32> {
        let mut out = vec![0f32; bits.len()];
        self.decode_into(bits, &mut out);
        out
    }
}

/// bf16 bits widened to f32, eight or sixteen an instruction where the CPU
/// has AVX2 or AVX-512 ([`crate::kernels::simd`]).
fn widen_bf16(bits: &[u16], out: &mut [f32]) {
    crate::kernels::simd::widen_bf16(bits.reinterpret_cast::<bf16>(), out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_within_half_an_ulp() {
        let xs: Vec<f32> = (0..2000)
            .map(|i| ((i as f32) * 0.37).sin() * 50.0)
            .collect();
        for (kind, rel) in [(Half::Bf16, 1.0 / 256.0), (Half::F16, 1.0 / 2048.0)] {
            let mut bits = vec![0u16; xs.len()];
            kind.encode_into(&xs, &mut bits);
            let back = kind.decode(&bits);
            for (a, b) in xs.iter().zip(&back) {
                assert!(
                    (a - b).abs() <= a.abs() * rel + 1e-6,
                    "{kind:?}: {a} -> {b}"
                );
            }
        }
    }

    #[test]
    fn f16_saturates_instead_of_overflowing() {
        let back = Half::F16.decode(&[Half::F16.encode(1e6), Half::F16.encode(-1e6)]);
        assert_eq!(back, vec![65504.0, -65504.0]);
        // bf16 has f32's range.
        assert_eq!(Half::Bf16.decode(&[Half::Bf16.encode(1e6)])[0], 999424.0);
    }

    /// The vector widening is the scalar one bit for bit, tails included
    /// (every bit pattern of the high byte, NaNs and infinities among them).
    #[test]
    fn bf16_widens_exactly_at_every_length() {
        let bits: Vec<u16> = (0..300u32).map(|i| (i * 0x0101 + 7) as u16).collect();
        for len in [0, 1, 15, 16, 17, 33, 300] {
            let got = Half::Bf16.decode(&bits[..len]);
            for (g, &b) in got.iter().zip(&bits[..len]) {
                assert_eq!(g.to_bits(), u32::from(b) << 16, "len {len}");
            }
        }
    }
}
