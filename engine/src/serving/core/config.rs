//! How an engine is set up: its KV pool and its scheduling limits.

/// How big the KV pool is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvPoolSize {
    /// This many blocks.
    Blocks(usize),
    /// As many blocks as fit in this many bytes.
    Bytes(usize),
}

/// Serving-engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    pub kv_pool: KvPoolSize,
    /// Most tokens computed in one step (decodes plus prefill chunks).
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Longest prefill chunk of one sequence per step; defaults to the budget.
    pub max_prefill_chunk: Option<usize>,
    /// Context limit; defaults to the model's context
    /// ([`crate::ModelConfig::max_context`]).
    pub max_model_len: Option<usize>,
    pub enable_prefix_caching: bool,
    /// How the CPU's linears trade exactness for speed: bit-identical
    /// tokens whatever the batch (slower prefill), or bf16 activations
    /// (faster where the CPU has AVX512-BF16).
    pub matmul: crate::kernels::MatmulPolicy,
    /// Most requests waiting for admission; more are refused with
    /// [`EngineError::Overloaded`] (`None`: unbounded). Enforced by
    /// [`super::EngineHandle::submit`].
    pub max_queued_requests: Option<usize>,
    /// Quantize the linear layers' weights to INT4 at start-up (CPU
    /// backend; see [`crate::quant`]).
    pub weight_quantization: Option<crate::quant::Int4Config>,
    /// What the KV pool stores (CPU backend): f32, 16-bit floats (twice
    /// the blocks in the same bytes), or 8-bit codes with per-row scales
    /// (nearly four times).
    pub kv_cache_dtype: crate::kv_cache::KvCacheDtype,
    /// Keep every block of sliding-window layers (CPU backend): one layer
    /// group, nothing freed out of the window (vLLM's
    /// `--disable-hybrid-kv-cache-manager`). Costs memory on Gemma-style
    /// models; tokens are the same either way.
    pub keep_windowed_blocks: bool,
    /// How long a step carrying decodes may take: prefill chunks joining it
    /// are sized from the measured cost per token
    /// ([`super::StepTimeLimit`]; the CLI's CPU default is
    /// [`super::StepTimeLimit::AUTO`]).
    pub max_step_time: super::StepTimeLimit,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_pool: KvPoolSize::Bytes(1 << 30),
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            max_prefill_chunk: None,
            max_model_len: None,
            enable_prefix_caching: true,
            matmul: crate::kernels::MatmulPolicy::Fastest,
            max_queued_requests: Some(1024),
            weight_quantization: None,
            kv_cache_dtype: crate::kv_cache::KvCacheDtype::F32,
            keep_windowed_blocks: false,
            max_step_time: super::StepTimeLimit::Off,
        }
    }
}
