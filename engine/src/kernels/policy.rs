//! [`MatmulPolicy`]: which kernels a linear may take, and what a server
//! runs with unless told otherwise.

use super::GEMV_MAX_ROWS;
#[cfg(target_arch = "x86_64")]
use super::{amx, dpbf16};
use crate::weights::Matrix;

/// From this many token rows, bf16 weights run on AMX tiles where the CPU
/// has them ([`amx`](super::amx)) under [`MatmulPolicy::Fastest`].
pub const AMX_MIN_ROWS: usize = 12;

/// How [`linear`](super::linear) may trade bit-exactness for speed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MatmulPolicy {
    /// The row kernel for small batches, the GEMM above
    /// [`GEMV_MAX_ROWS`]. A token's result can differ in the last bits
    /// with the size of the batch it ran in (the two kernels sum in
    /// different orders).
    /// bf16 weights run on AMX tiles from [`AMX_MIN_ROWS`] rows where the
    /// CPU has them ([`amx`](super::amx)).
    #[default]
    Fastest,
    /// As `Fastest` without AMX tiles: the vector kernels only, as every
    /// CPU ran before them (to measure the tiles against).
    VectorOnly,
    /// The row kernel at every size: each output element is summed in the
    /// same order whatever else is in the batch, so a request's tokens do not
    /// depend on its batch-mates (SGLang's deterministic mode, vLLM's
    /// `VLLM_BATCH_INVARIANT`). Prefill is slower.
    BatchInvariant,
    /// bf16 weights against activations rounded to bf16, on `vdpbf16ps`
    /// at every batch size where the CPU has AVX512-BF16 ([`dpbf16`](super::dpbf16)):
    /// llama.cpp's and a bf16 PyTorch model's numerics, about twice the
    /// arithmetic rate of the f32-activation kernels where there is no AMX.
    /// With AVX2 and FMA only, the same chains run on FMAs
    /// ([`dpbf16::fma`](super::dpbf16::fma)). Batch invariant for those
    /// weights; other weights, and CPUs without AVX2, run as
    /// [`Self::Fastest`].
    Bf16Activations,
}

impl MatmulPolicy {
    /// Whether `m` token rows take the row kernel (every weight type's
    /// kernels split so) rather than the GEMM.
    pub fn uses_row_kernel(self, m: usize) -> bool {
        m <= GEMV_MAX_ROWS || self == Self::BatchInvariant
    }

    /// The policy's one-byte code (a tensor-parallel leader tells its
    /// followers with it).
    pub fn code(self) -> u8 {
        match self {
            Self::Fastest => 0,
            Self::VectorOnly => 1,
            Self::BatchInvariant => 2,
            Self::Bf16Activations => 3,
        }
    }

    /// The policy a server runs with unless told otherwise: bf16
    /// activations where this CPU runs them but has no AMX tiles: with
    /// AVX512-BF16 (AMD Zen 4 and 5, Intel before Sapphire Rapids)
    /// `vdpbf16ps` runs a prefill ~1.4x and a batch of 8–32 ~1.3x faster
    /// than f32 activations, and with AVX2 alone the FMA panel kernel runs
    /// decode 1.1–1.3x faster at the same prefill speed, at +0.002–0.05%
    /// perplexity (bench/RESULTS.md); [`Self::Fastest`] elsewhere, AMX
    /// tiles keeping near-f32 activations at a higher rate.
    /// Only bf16 weights are affected either way.
    pub fn serving_default() -> Self {
        #[cfg(target_arch = "x86_64")]
        if Self::Bf16Activations.runs_here() && !amx::available() {
            return Self::Bf16Activations;
        }
        Self::Fastest
    }

    /// The policy of a [`Self::code`].
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => Self::Fastest,
            1 => Self::VectorOnly,
            2 => Self::BatchInvariant,
            3 => Self::Bf16Activations,
            _ => return None,
        })
    }

    /// Whether a model packs its bf16 linear weights into panels
    /// ([`Panels`](super::Panels)) under this policy: bf16 activations
    /// where the CPU runs them (AVX512-BF16, or AVX2 and FMA).
    pub fn packs_weights(self) -> bool {
        self == Self::Bf16Activations && self.runs_here()
    }

    /// Whether `w` takes its activations rounded to bf16 and then the row
    /// kernel at every size: bf16 weights not packed in panels, under
    /// `Bf16Activations` on a CPU with AVX2 and FMA but not AVX512-BF16
    /// ([`dpbf16::fma`]), so the policy rounds and stays batch invariant
    /// there too.
    pub(crate) fn rounds_for_rows(self, w: &Matrix) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self == Self::Bf16Activations
                && matches!(w.data, crate::weights::WeightData::Bf16(_))
                && !dpbf16::available()
                && dpbf16::fma::available()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = w;
            false
        }
    }

    /// Whether this CPU runs the policy as documented rather than falling
    /// back to [`Self::Fastest`] (only `Bf16Activations` needs a feature:
    /// AVX512-BF16, or AVX2 and FMA for [`dpbf16::fma`]'s kernels).
    pub fn runs_here(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Bf16Activations => dpbf16::available() || dpbf16::fma::available(),
            #[cfg(not(target_arch = "x86_64"))]
            Self::Bf16Activations => false,
            _ => true,
        }
    }
}
