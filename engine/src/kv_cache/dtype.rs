//! [`KvCacheDtype`]: what the cache stores per element, its sizes and its
//! command-line spelling.

use super::half::Half;
use super::q8::Code;
use super::KvLayout;

/// What the KV cache stores per element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum KvCacheDtype {
    #[default]
    F32,
    /// bfloat16 elements: half of f32's bytes, one rounding each.
    Bf16,
    /// IEEE f16 elements (saturating at ±65504).
    F16,
    /// int8 codes of Hadamard-rotated rows, one f16 scale per row
    /// (layer, token, KV head).
    Int8,
    /// FP8 E4M3 codes of Hadamard-rotated rows, one f16 scale per row.
    Fp8E4m3,
}

impl KvCacheDtype {
    /// Every dtype, in the order the command line lists them.
    pub const ALL: [KvCacheDtype; 5] =
        [Self::F32, Self::Bf16, Self::F16, Self::Int8, Self::Fp8E4m3];

    /// The command-line spelling (`f32`, `bf16`, `f16`, `int8`, `fp8-e4m3`).
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::Int8 => "int8",
            Self::Fp8E4m3 => "fp8-e4m3",
        }
    }

    /// The cache that stores what a checkpoint of `weights` computes in
    /// (`--kv-dtype auto`): a bf16 or f16 checkpoint gets a 16-bit cache,
    /// an f32 one an f32 cache.
    pub fn for_weights(weights: crate::DType) -> Self {
        match weights {
            crate::DType::F32 => Self::F32,
            crate::DType::Bf16 => Self::Bf16,
            crate::DType::F16 => Self::F16,
        }
    }

    /// What this dtype cost in perplexity where it was measured
    /// (`quality-bench` on SmolLM2-135M-Instruct against its f32 cache,
    /// bench/RESULTS.md), for the start-up log.
    pub fn measured_cost(self) -> &'static str {
        match self {
            Self::F32 => "the reference",
            Self::Bf16 => "+0.004% perplexity, 13/13 answers kept",
            Self::F16 => "-0.001% perplexity, 13/13 answers kept",
            Self::Int8 => "+0.05% perplexity, 13/13 answers kept",
            Self::Fp8E4m3 => {
                "+0.01% perplexity, 13/13 answers kept (the last 32 positions read at bf16)"
            }
        }
    }

    /// Bytes per stored element.
    pub fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 | Self::F16 => 2,
            Self::Int8 | Self::Fp8E4m3 => 1,
        }
    }

    /// Bytes of scale per stored row (an 8-bit dtype's f16 scale).
    pub fn scale_bytes(self) -> usize {
        match self {
            Self::F32 | Self::Bf16 | Self::F16 => 0,
            Self::Int8 | Self::Fp8E4m3 => 2,
        }
    }

    /// Bytes of K and V, all layers, for one block of `layout` (codes and
    /// scales), and for FP8 its share of the recent window's 16-bit copies
    /// (one per [`RECENT_SHARE`](super::RECENT_SHARE) blocks): what a pool
    /// of `n` blocks costs is `n` times this.
    pub fn block_bytes(self, layout: &KvLayout) -> usize {
        let pools = layout.pools_per_layer() * layout.layers_per_block();
        match self {
            Self::F32 => layout.block_bytes(),
            Self::Bf16 | Self::F16 => layout.block_bytes() / 2,
            Self::Int8 | Self::Fp8E4m3 => {
                let scales = layout.num_kv_heads * layout.block_size * 2;
                let codes = pools * (layout.block_elems() + scales);
                let copies = match self {
                    Self::Fp8E4m3 => pools * layout.block_elems() * 2 / super::RECENT_SHARE,
                    _ => 0,
                };
                codes + copies
            }
        }
    }

    pub(super) fn code(self) -> Option<Code> {
        match self {
            Self::F32 | Self::Bf16 | Self::F16 => None,
            Self::Int8 => Some(Code::Int8),
            Self::Fp8E4m3 => Some(Code::Fp8E4m3),
        }
    }

    pub(super) fn half(self) -> Option<Half> {
        match self {
            Self::Bf16 => Some(Half::Bf16),
            Self::F16 => Some(Half::F16),
            Self::F32 | Self::Int8 | Self::Fp8E4m3 => None,
        }
    }
}

impl std::str::FromStr for KvCacheDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" | "float" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "f16" | "fp16" | "float16" | "half" => Ok(Self::F16),
            "int8" | "i8" => Ok(Self::Int8),
            "fp8-e4m3" | "fp8_e4m3" | "fp8" | "f8" | "e4m3" | "float8_e4m3fn" => Ok(Self::Fp8E4m3),
            other => Err(format!(
                "unknown KV cache dtype `{other}` (expected f32, bf16, f16, int8 or fp8-e4m3)"
            )),
        }
    }
}

impl std::fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
