//! Speculative-decoding flags (decode workers and `serve`; prefill-only
//! requests never speculate).

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use tandem_engine::kernels::MatmulPolicy;
use tandem_engine::serving::EngineCore;
use tandem_engine::speculative::{DraftModelDrafter, Drafter, NgramDrafter, SpeculativeConfig};
use tandem_engine::{ComputeBackend, CpuBackend, Model};

#[derive(Args, Debug, Clone)]
pub struct SpeculativeArgs {
    /// Speculative decoding: `ngram` (prompt lookup) or `draft-model`
    /// (`--draft-model`, or the target's first `--draft-layers` layers).
    #[arg(long, value_enum)]
    speculative: Option<SpeculativeMethod>,
    /// Draft model checkpoint (same vocabulary as the target); default: the
    /// built-in draft when serving the built-in model, else the target
    /// itself cut by `--draft-layers`. Runs on the CPU.
    #[arg(long, requires = "speculative")]
    draft_model: Option<std::path::PathBuf>,
    /// Keep only the draft model's first N layers (self-speculation when
    /// the draft is the target).
    #[arg(long, requires = "speculative")]
    draft_layers: Option<usize>,
    /// Most tokens drafted per sequence per step.
    #[arg(long, default_value_t = 4)]
    num_speculative_tokens: usize,
    /// Always draft `--num-speculative-tokens` (no per-request adaptation).
    #[arg(long)]
    no_adaptive_speculation: bool,
    /// Speculate only while a step's decode rows, drafts included, stay at
    /// or below this (default: where the CPU step stops being memory-bound).
    #[arg(long)]
    speculative_max_batch_rows: Option<usize>,
}

/// Which drafter.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpeculativeMethod {
    Ngram,
    DraftModel,
}

impl SpeculativeArgs {
    /// Turns speculation on in `core` (serving `target_dir`, the built-in
    /// model when `builtin`) if asked; a draft model runs the target's
    /// matmul policy (its drafts are checked by the target, so bf16
    /// activations cost them nothing but speed).
    pub fn apply(
        &self,
        core: &mut EngineCore,
        target_dir: &std::path::Path,
        builtin: bool,
        matmul: MatmulPolicy,
    ) -> Result<()> {
        let Some(method) = self.speculative else {
            return Ok(());
        };
        let mut config = SpeculativeConfig {
            num_speculative_tokens: self.num_speculative_tokens,
            adaptive: !self.no_adaptive_speculation,
            ..SpeculativeConfig::default()
        };
        if let Some(rows) = self.speculative_max_batch_rows {
            config.max_batch_rows = rows;
        }
        let drafter: Box<dyn Drafter> = match method {
            SpeculativeMethod::Ngram => {
                if self.draft_model.is_some() || self.draft_layers.is_some() {
                    bail!("--draft-model and --draft-layers need --speculative draft-model");
                }
                Box::new(NgramDrafter::default())
            }
            SpeculativeMethod::DraftModel => {
                let dir = match (&self.draft_model, self.draft_layers) {
                    (Some(d), _) => d.clone(),
                    (None, Some(_)) => target_dir.to_path_buf(),
                    (None, None) if builtin => crate::default_model::default_draft_model_dir()?,
                    (None, None) => bail!(
                        "--speculative draft-model needs --draft-model DIR or --draft-layers N \
                         (the target's first N layers)"
                    ),
                };
                let dir = dir.as_path();
                let mut draft = Model::load(dir)
                    .with_context(|| format!("loading the draft model from {}", dir.display()))?;
                if let Some(n) = self.draft_layers {
                    draft.truncate_layers(n)?;
                }
                let limits = core.limits();
                let mut backend = CpuBackend::new(draft, limits.block_size, limits.num_blocks);
                backend.set_matmul_policy(matmul)?;
                Box::new(DraftModelDrafter::new(
                    Box::new(backend),
                    core.model_config(),
                )?)
            }
        };
        core.enable_speculation(drafter, config)?;
        Ok(())
    }
}
