//! Serving-engine flags shared by every command that runs an engine.

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use tandem_engine::capacity::parse_memory_size;
use tandem_engine::kernels::MatmulPolicy;
use tandem_engine::serving::{EngineConfig, KvPoolSize, StepTimeLimit};
use tandem_engine::weights::Residency;

#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// Memory for the KV cache, e.g. 2GiB (counted in the `--kv-dtype`).
    #[arg(long, default_value = "1GiB", conflicts_with = "num_kv_blocks")]
    kv_cache_memory: String,
    /// KV cache size in blocks instead of bytes.
    #[arg(long)]
    num_kv_blocks: Option<usize>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Most tokens computed per step (decodes plus prefill chunks).
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    /// Most sequences running at once.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Longest prefill chunk of one request per step (default: the budget).
    #[arg(long)]
    max_prefill_chunk: Option<usize>,
    /// Context limit (default: the model's context, `ModelConfig::max_context`).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// How long a step that carries decodes may take, which sizes the
    /// prefill chunks joining it from the measured cost per token: `auto`
    /// (the CPU default: 1.5x the same step without prefill, steps under
    /// 20 ms never cut), a number of milliseconds, or `off` (the token
    /// budget alone; the CUDA default).
    #[arg(long, value_parser = parse_step_time_limit)]
    max_step_ms: Option<tandem_engine::serving::StepTimeLimit>,
    /// Do not reuse the K/V of shared prompt prefixes.
    #[arg(long)]
    no_prefix_caching: bool,
    /// Bit-identical results whatever the batch (slower prefill; CPU only).
    #[arg(long)]
    batch_invariant: bool,
    /// What activations meeting bf16 weights are (CPU): `bf16` rounds them
    /// (AVX512-BF16's `vdpbf16ps`: llama.cpp's and a bf16 PyTorch model's
    /// numerics, batch invariant for bf16 weights; bench/RESULTS.md gives
    /// the quality cost), `f32` keeps them; `auto` is `bf16` where the CPU
    /// has AVX512-BF16 but no AMX (prefill ~1.4x, batches of 8–32 ~1.3x)
    /// and `f32` elsewhere (AMX tiles keep near-f32 activations faster).
    #[arg(long, value_enum, default_value_t = Activations::Auto)]
    activations: Activations,
    /// The same as `--activations bf16`.
    #[arg(long, conflicts_with_all = ["batch_invariant", "activations"])]
    bf16_activations: bool,
    /// Most requests waiting for admission; more are refused with
    /// RESOURCE_EXHAUSTED (HTTP 429) and a retry hint.
    #[arg(long, default_value_t = 1024)]
    max_queued_requests: usize,
    /// Where the model runs. `cuda` needs a build with `--features cuda`
    /// and the CUDA 13 driver and libraries at run time.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// GPU weights and KV cache type (`--device cuda`): f32 matches the CPU
    /// engine's numerics, bf16 is fast.
    #[arg(long, value_enum, default_value_t = GpuDtype::Bf16)]
    gpu_dtype: GpuDtype,
    /// What the KV cache stores (CPU): `auto` (the checkpoint's weight
    /// dtype: bf16 for a bf16 checkpoint, f32 for f32, f16 for a quantized
    /// GGUF); f32;
    /// 16-bit `bf16` / `f16` (half of f32's bytes); or 8-bit `int8` /
    /// `fp8-e4m3` codes with scales (a quarter; `--kv-cache-memory` then
    /// holds four times the blocks). README's engine-flags table gives
    /// each one's measured perplexity cost.
    #[arg(long, default_value = "auto", value_parser = parse_kv_dtype_choice)]
    kv_dtype: KvDtypeChoice,
    /// Keep every KV block of sliding-window layers (Gemma 2/3, Mistral)
    /// instead of freeing those that left the window: more memory, the same
    /// tokens.
    #[arg(long)]
    keep_windowed_blocks: bool,
    /// Quantize the linear layers' and the output head's weights at load:
    /// `int4` = 4-bit codes with a scale and zero point per group of input
    /// columns, run by integer kernels (CPU only). Pre-quantized AWQ/GPTQ
    /// checkpoints need no flag.
    #[arg(long, value_enum)]
    quantize: Option<Quantize>,
    /// Input columns per INT4 scale (`--quantize int4`): 32, 64 or 128 (a
    /// matrix it does not divide uses the largest smaller one that does).
    #[arg(long, default_value_t = tandem_engine::quant::DEFAULT_GROUP_SIZE)]
    quantize_group_size: usize,
    /// How INT4 decode kernels code activations (`--quantize int4`):
    /// `two-pass` (about 15 bits, as GPU W4A16 kernels) or `int8` (W4A8:
    /// 12–30% faster decode, three times the perplexity cost; bench/RESULTS.md).
    #[arg(long, default_value = "two-pass")]
    int4_activations: tandem_engine::quant::ActivationCodes,
    /// Keep the CPU engine's weights memory-mapped from the checkpoint's
    /// files (the page cache, shared by every process on the host serving
    /// them) instead of the default private copy on huge pages (batch-1
    /// decode 13–30% faster; bench/RESULTS.md "Weights on huge pages").
    /// Weights quantized at load, a GPU's and a `--tp`/`--pp` leader's are
    /// always mapped: those read the files once.
    #[arg(long)]
    mmap_weights: bool,
    /// Which GPU (`--device cuda`).
    #[arg(long, default_value_t = 0)]
    gpu_index: usize,
    #[command(flatten)]
    speculative: crate::speculative_args::SpeculativeArgs,
    #[command(flatten)]
    parallel: crate::parallel_args::ParallelArgs,
    #[command(flatten)]
    lora: crate::lora_args::LoraArgs,
    #[command(flatten)]
    kv_disk: crate::kv_disk_args::KvDiskArgs,
}

/// Where the model runs.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda,
}

fn parse_step_time_limit(s: &str) -> Result<tandem_engine::serving::StepTimeLimit, String> {
    s.parse()
        .map_err(|e: tandem_engine::serving::BadStepTimeLimit| e.to_string())
}

/// `--kv-dtype`: a dtype, or the checkpoint's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtypeChoice {
    Auto,
    Is(tandem_engine::KvCacheDtype),
}

pub(crate) fn parse_kv_dtype_choice(s: &str) -> Result<KvDtypeChoice, String> {
    match s {
        "auto" => Ok(KvDtypeChoice::Auto),
        s => s
            .parse()
            .map(KvDtypeChoice::Is)
            .map_err(|e| format!("{e}, or auto (the checkpoint's dtype)")),
    }
}

/// What the activations meeting bf16 weights are (`--activations`).
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activations {
    /// bf16 where the CPU has AVX512-BF16 and no AMX, f32 elsewhere.
    Auto,
    F32,
    Bf16,
}

/// Weight quantization applied at load.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantize {
    Int4,
}

/// Storage type of weights and KV on a GPU.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuDtype {
    F32,
    Bf16,
}

impl EngineArgs {
    /// The matmul policy: `--batch-invariant`, else `--activations`.
    fn matmul_policy(&self) -> Result<MatmulPolicy> {
        let activations = match self.bf16_activations {
            true => Activations::Bf16,
            false => self.activations,
        };
        Ok(match (activations, self.batch_invariant, self.device) {
            (Activations::Bf16, true, _) => {
                bail!("--activations bf16 and --batch-invariant: choose one")
            }
            (_, true, _) => MatmulPolicy::BatchInvariant,
            (Activations::Bf16, false, _) => MatmulPolicy::Bf16Activations,
            (Activations::F32, false, _) | (Activations::Auto, false, Device::Cuda) => {
                MatmulPolicy::Fastest
            }
            (Activations::Auto, false, Device::Cpu) => MatmulPolicy::serving_default(),
        })
    }

    /// The engine configuration these flags describe, for a checkpoint
    /// whose weights are `weights` (what `--kv-dtype auto` follows).
    pub fn config(&self, weights: tandem_engine::DType) -> Result<EngineConfig> {
        if self.block_size == 0 {
            bail!("--block-size must be positive");
        }
        let kv_pool = match self.num_kv_blocks {
            Some(0) => bail!("--num-kv-blocks must be positive"),
            Some(n) => KvPoolSize::Blocks(n),
            None => KvPoolSize::Bytes(usize::try_from(parse_memory_size(&self.kv_cache_memory)?)?),
        };
        let weight_quantization = match self.quantize {
            Some(Quantize::Int4) => Some(
                tandem_engine::quant::Int4Config::new(self.quantize_group_size)
                    .map_err(|e| anyhow::anyhow!("--quantize-group-size: {e}"))?
                    .with_activations(self.int4_activations),
            ),
            None => None,
        };
        if weight_quantization.is_some() && self.device == Device::Cuda {
            bail!("--quantize int4 runs on the CPU only (the CUDA backend has no INT4 kernels)");
        }
        let kv_cache_dtype = match (self.kv_dtype, self.device) {
            (KvDtypeChoice::Is(d), Device::Cuda) if d != tandem_engine::KvCacheDtype::F32 => {
                bail!("--kv-dtype {d} runs on the CPU only (use --gpu-dtype on a GPU)")
            }
            (KvDtypeChoice::Is(d), _) => d,
            // The GPU's cache follows --gpu-dtype, not this setting.
            (KvDtypeChoice::Auto, Device::Cuda) => tandem_engine::KvCacheDtype::F32,
            (KvDtypeChoice::Auto, Device::Cpu) => tandem_engine::KvCacheDtype::for_weights(weights),
        };
        Ok(EngineConfig {
            block_size: self.block_size,
            kv_pool,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_prefill_chunk: self.max_prefill_chunk,
            max_model_len: self.max_model_len,
            enable_prefix_caching: !self.no_prefix_caching,
            matmul: self.matmul_policy()?,
            max_queued_requests: Some(self.max_queued_requests),
            weight_quantization,
            kv_cache_dtype,
            keep_windowed_blocks: self.keep_windowed_blocks,
            max_step_time: self.max_step_ms.unwrap_or(match self.device {
                Device::Cpu => StepTimeLimit::AUTO,
                Device::Cuda => StepTimeLimit::Off,
            }),
        })
    }
}

impl EngineArgs {
    /// How this engine holds the checkpoint's weights: a private huge-page
    /// copy only where the CPU engine streams them at every step as
    /// loaded; mapped where they are read once (quantized at load, copied
    /// to a GPU, split over rank processes that map their own parts,
    /// `packed` into panels for bf16 activations: the packed copies replace
    /// the file's bytes) or `--mmap-weights` asks.
    fn weight_residency(&self, parallel: bool, packed: bool) -> Residency {
        let streamed_as_loaded =
            self.device == Device::Cpu && self.quantize.is_none() && !parallel && !packed;
        match streamed_as_loaded && !self.mmap_weights {
            true => Residency::HugePages,
            false => Residency::Mapped,
        }
    }

    /// What the KV pool's values depend on beside the model: where they
    /// are computed, their storage type and the weights' quantization.
    fn kv_values(&self, config: &EngineConfig) -> String {
        let int4 = config.weight_quantization.map(|q| q.group_size);
        match self.device {
            Device::Cpu => format!("cpu-{} int4={int4:?}", config.kv_cache_dtype),
            Device::Cuda => format!("cuda-{:?}", self.gpu_dtype),
        }
    }
}

/// A started engine thread and what workers need to describe it.
pub struct StartedEngine {
    pub handle: tandem_engine::serving::EngineHandle,
    pub kv_layout: tandem_engine::KvLayout,
    /// The model's name for membership checks (its directory name).
    pub model_name: String,
    /// The checkpoint directory.
    pub model_dir: std::path::PathBuf,
    /// Its LoRA adapters (CPU, unsharded engines).
    pub lora: Option<std::sync::Arc<tandem_engine::lora::LoraRegistry>>,
    /// The other ranks of a `--tp`/`--pp` worker, when this process started
    /// them: held for its `Drop`, which stops them with this process.
    pub _ranks: Option<crate::parallel_args::RankProcesses>,
}

impl StartedEngine {
    /// Its adapters for the HTTP API (listed, loaded, unloaded).
    pub fn adapters(&self) -> Option<std::sync::Arc<dyn tandem_openai::Adapters>> {
        let reg = self.lora.clone()?;
        Some(std::sync::Arc::new(crate::lora_args::EngineAdapters(reg)))
    }
}

/// Loads the model (default: the built-in one) and starts its engine thread.
pub fn start_engine(model: Option<&std::path::Path>, args: &EngineArgs) -> Result<StartedEngine> {
    use anyhow::Context;
    use tandem_engine::serving::{EngineCore, EngineHandle};

    let dir = match model {
        Some(d) => d.to_path_buf(),
        None => crate::default_model::default_model_dir()?,
    };
    let parallel = args.parallel.parallelism()?;
    let open = |residency| {
        tandem_engine::Checkpoint::open_with(&dir, residency)
            .with_context(|| format!("loading model from {}", dir.display()))
    };
    let packed = args.matmul_policy()?.packs_weights();
    let residency = args.weight_residency(parallel.is_some(), packed);
    let mut ckpt = open(residency)?;
    let unpacked = args.weight_residency(parallel.is_some(), false);
    if residency != unpacked && ckpt.model.weight_dtype() != tandem_engine::DType::Bf16 {
        // Only bf16 weights are packed: the others stream from their copy.
        ckpt = open(unpacked)?;
    }
    let config = args.config(ckpt.model.weight_dtype())?;
    let tokenizer = ckpt.tokenizer.map(std::sync::Arc::new);
    let mut ranks = None;
    let mut core = match (args.device, parallel) {
        (Device::Cpu, None) => EngineCore::new(ckpt.model, tokenizer, ckpt.eos_token_ids, &config)?,
        (Device::Cpu, Some(par)) => {
            drop(ckpt.model);
            let (backend, children) =
                crate::parallel_args::start_leader(&dir, &args.parallel, par, &config)?;
            ranks = Some(children);
            EngineCore::with_backend(Box::new(backend), tokenizer, ckpt.eos_token_ids, &config)?
        }
        (Device::Cuda, Some(_)) => {
            bail!("--tp/--pp run on the CPU backend (the CUDA backend is one GPU per worker)")
        }
        (Device::Cuda, None) => {
            let config_json = ckpt.model.config().clone();
            drop(ckpt.model);
            let backend = cuda_backend(&dir, &config_json, args, &config)?;
            EngineCore::with_backend(backend, tokenizer, ckpt.eos_token_ids, &config)?
        }
    };
    // The backend's layout (a GPU or pipeline-split cache groups no layers).
    let kv_layout = core.kv_layout();
    let builtin = crate::default_model::is_default_model(&dir);
    args.speculative
        .apply(&mut core, &dir, builtin, config.matmul)?;
    let lora = args.lora.apply(&mut core)?;
    args.kv_disk
        .apply(&mut core, &dir, &args.kv_values(&config))?;
    tracing::info!(
        model = %dir.display(),
        device = ?args.device,
        matmul = ?config.matmul,
        "model loaded"
    );
    let model_name = tandem_engine::checkpoint::model_name(&dir);
    Ok(StartedEngine {
        handle: EngineHandle::spawn(core)?,
        kv_layout,
        model_name,
        model_dir: dir,
        lora,
        _ranks: ranks,
    })
}

/// The model on a GPU, its KV pool sized by the same flags as the CPU's
/// (bytes are counted in the GPU's KV type).
#[cfg(feature = "cuda")]
fn cuda_backend(
    dir: &std::path::Path,
    model: &tandem_engine::ModelConfig,
    args: &EngineArgs,
    config: &tandem_engine::serving::EngineConfig,
) -> Result<Box<dyn tandem_engine::ComputeBackend>> {
    use tandem_cuda::{kv_block_bytes, CudaModel, CudaOptions, DeviceDType};
    use tandem_engine::serving::KvPoolSize;

    let dtype = match args.gpu_dtype {
        GpuDtype::F32 => DeviceDType::F32,
        GpuDtype::Bf16 => DeviceDType::Bf16,
    };
    let block_bytes = kv_block_bytes(model, config.block_size, dtype);
    let num_blocks = match config.kv_pool {
        KvPoolSize::Blocks(n) => n,
        KvPoolSize::Bytes(b) => b / block_bytes.max(1),
    };
    let mut opts = CudaOptions::new(model, num_blocks);
    opts.device = args.gpu_index;
    opts.weights = dtype;
    opts.kv = dtype;
    opts.block_size = config.block_size;
    opts.max_tokens = config.max_num_batched_tokens;
    opts.max_seqs = config.max_num_seqs;
    opts.max_logit_rows = config.max_num_seqs;
    opts.max_model_len = config.max_model_len.unwrap_or(model.max_context());
    opts.graph_max_batch = config.max_num_seqs.min(256);
    let gpu = CudaModel::load(dir, opts)
        .map_err(|e| anyhow::anyhow!("loading {} onto the GPU: {e}", dir.display()))?;
    Ok(Box::new(gpu))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(
    _dir: &std::path::Path,
    _model: &tandem_engine::ModelConfig,
    _args: &EngineArgs,
    _config: &tandem_engine::serving::EngineConfig,
) -> Result<Box<dyn tandem_engine::ComputeBackend>> {
    bail!(
        "--device cuda: this tandem was built without CUDA support \
         (rebuild with `cargo build --release -p tandem --features cuda`)"
    )
}

/// A multi-threaded tokio runtime for servers.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    use anyhow::Context;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Resolves once the engine has stopped for good (a lost rank), with why.
pub async fn engine_stopped(handle: tandem_engine::serving::EngineHandle) -> String {
    loop {
        if let Some(why) = handle.failure() {
            return why;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// Ends this process after its engine stopped for good: every request has
/// already failed, so there is nothing to drain (and a drain would wait on
/// the router's long-lived streams). Exits non-zero, so a supervisor
/// restarts the worker; the other ranks exit when this one's links close.
pub fn exit_after_engine_failure(why: &str) -> ! {
    tracing::error!(reason = %why, "exiting: the engine stopped");
    tandem_telemetry::flush();
    eprintln!("error: the engine stopped: {why}");
    std::process::exit(1)
}

/// Resolves on Ctrl-C or SIGTERM (a worker drains on either).
///
/// Listens from the moment it is called, not from its first poll: call it
/// before printing `listening on`, so a signal sent by whoever read that
/// line (a test, `tandem up`, Kubernetes) is handled rather than taking the
/// default action and killing the process mid-start. Needs a tokio runtime.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{signal, SignalKind};
    let interrupt = signal(SignalKind::interrupt());
    let terminate = signal(SignalKind::terminate());
    async move {
        let (mut interrupt, mut terminate) = match (interrupt, terminate) {
            (Ok(i), Ok(t)) => (i, t),
            // Without handlers the signals keep their default action
            // (exit), so there is nothing to wait for.
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(error = %e, "no signal handlers; Ctrl-C and SIGTERM kill at once");
                return std::future::pending().await;
            }
        };
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn residency(argv: &[&str], parallel: bool) -> Residency {
        let cmd = Cmd::try_parse_from(std::iter::once("tandem").chain(argv.iter().copied()))
            .expect("flags parse");
        cmd.engine.weight_residency(parallel, false)
    }

    fn policy(argv: &[&str]) -> Result<MatmulPolicy> {
        let cmd = Cmd::try_parse_from(std::iter::once("tandem").chain(argv.iter().copied()))
            .expect("flags parse");
        cmd.engine.matmul_policy()
    }

    #[test]
    fn activations_follow_the_flags_and_auto_follows_the_cpu() {
        let ok = |argv: &[&str]| policy(argv).expect("a policy");
        assert_eq!(ok(&[]), MatmulPolicy::serving_default());
        assert_eq!(ok(&["--device", "cuda"]), MatmulPolicy::Fastest);
        assert_eq!(ok(&["--activations", "f32"]), MatmulPolicy::Fastest);
        assert_eq!(
            ok(&["--activations", "bf16"]),
            MatmulPolicy::Bf16Activations
        );
        assert_eq!(ok(&["--bf16-activations"]), MatmulPolicy::Bf16Activations);
        assert_eq!(ok(&["--batch-invariant"]), MatmulPolicy::BatchInvariant);
        assert!(policy(&["--batch-invariant", "--activations", "bf16"]).is_err());
    }

    #[test]
    fn only_weights_streamed_as_loaded_get_a_private_huge_page_copy() {
        assert_eq!(residency(&[], false), Residency::HugePages);
        assert_eq!(residency(&["--mmap-weights"], false), Residency::Mapped);
        assert_eq!(residency(&["--quantize", "int4"], false), Residency::Mapped);
        assert_eq!(residency(&["--device", "cuda"], false), Residency::Mapped);
        assert_eq!(residency(&[], true), Residency::Mapped);
        let packed = Cmd::try_parse_from(["tandem"]).expect("flags parse");
        assert_eq!(
            packed.engine.weight_residency(false, true),
            Residency::Mapped
        );
    }
}
