//! tandem's CUDA backend.
//!
//! The CPU engine (`tandem-engine`) defines the semantics; this crate runs
//! the same flattened-batch forward pass on an NVIDIA GPU. The model takes
//! the engine's [`SeqInput`](tandem_engine::SeqInput)s (tokens, start
//! position, block table) and keeps weights and the paged KV pool in device
//! memory; the host keeps scheduling, block allocation and prefix caching.
//!
//! - [`arch`]: which architecture descriptions the kernels run (others are
//!   refused by the name of the missing feature) and the tensors the loader
//!   fuses: host code, tested without a GPU.
//! - [`layout`]: the per-step arrays the kernels read (token ids, positions,
//!   KV slots, query tiles, padded block tables) and the attention split
//!   heuristics: host code, tested without a GPU.
//! - [`graphs`]: the decode batch sizes that get a captured CUDA graph.
//! - [`ptx`]: the kernel source and the PTX cache key.
//! - `device`, `model` (feature `cuda`): the CUDA context, cuBLAS, the
//!   NVRTC-compiled kernels, and [`CudaModel`].
//! - `nccl` (feature `cuda`): `NcclComm`, the `tandem_comm::Communicator`
//!   seam on NCCL (one rank per GPU, bootstrapped over the CPU communicator).
//!
//! GEMMs are cuBLAS (`GemmEx`, f32 or bf16 inputs, f32 accumulation);
//! decode steps of at most 8 rows use our own bf16 GEMV (weight streaming is
//! all that matters there). Everything else is one NVRTC module
//! (`kernels.cu`): embedding, RMSNorm, RoPE fused with the KV-cache write,
//! SiLU-and-multiply, paged attention (query tiles
//! with online softmax, split over KV blocks with a reduction when a step has
//! few tiles) and argmax (greedy on the device).
//!
//! **Architecture Invariant:** this crate knows the engine's data types and
//! nothing of serving: no scheduler, no networking. Block ids come from the
//! engine's allocator; the GPU pool only stores what it is told to.
//!
//! **Architecture Invariant:** without the `cuda` feature nothing here links
//! CUDA; with it, CUDA libraries are loaded at run time (cudarc's dynamic
//! loading), so the feature compiles on machines without CUDA.

pub mod arch;
pub mod error;
pub mod graphs;
pub mod layout;
pub mod ptx;

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod model;
#[cfg(feature = "cuda")]
pub mod nccl;

#[cfg(feature = "cuda")]
pub use device::{gpu_count, Gpu};
pub use error::CudaError;
#[cfg(feature = "cuda")]
pub use model::{kv_block_bytes, CudaModel, CudaOptions, DeviceDType, StepOutput};
#[cfg(feature = "cuda")]
pub use nccl::NcclComm;

/// Warps per attention CTA (`ATTN_WARPS` in `kernels.cu`).
pub const ATTN_WARPS: usize = 8;

/// Every kernel the backend loads from the module.
pub const KERNEL_NAMES: &[&str] = &[
    "embed_f32",
    "embed_bf16",
    "rms_norm_f32",
    "rms_norm_bf16",
    "bias_add",
    "silu_mul_f32",
    "silu_mul_bf16",
    "rope_kv_write_f32",
    "rope_kv_write_bf16",
    "qk_head_norm",
    "gemv_bf16",
    "attention_f32_16",
    "attention_f32_16_decode",
    "attention_f32_32",
    "attention_f32_32_decode",
    "attention_f32_64",
    "attention_f32_64_decode",
    "attention_f32_128",
    "attention_f32_128_decode",
    "attention_f32_256",
    "attention_f32_256_decode",
    "attention_bf16_16",
    "attention_bf16_16_decode",
    "attention_bf16_32",
    "attention_bf16_32_decode",
    "attention_bf16_64",
    "attention_bf16_64_decode",
    "attention_bf16_128",
    "attention_bf16_128_decode",
    "attention_bf16_256",
    "attention_bf16_256_decode",
    "attn_reduce",
    "argmax_rows",
    "fill_uniform_bf16",
    "fill_f32",
];
