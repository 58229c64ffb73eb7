//! `tandem gen-model`, and the built-in default model used when no `--model`
//! is given.
//!
//! Until trained default weights ship with the repo, the default is the
//! `small` random preset, generated once into the user's cache directory
//! (`$XDG_CACHE_HOME/tandem` or `~/.cache/tandem`, overridable with
//! `TANDEM_CACHE_DIR`). Generation is deterministic, so every machine gets the
//! same model.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use tandem_engine::synth;
use tandem_engine::DType;

/// Weight dtypes `gen-model` can write.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum DtypeArg {
    F32,
    Bf16,
    F16,
}

impl From<DtypeArg> for DType {
    fn from(d: DtypeArg) -> Self {
        match d {
            DtypeArg::F32 => DType::F32,
            DtypeArg::Bf16 => DType::Bf16,
            DtypeArg::F16 => DType::F16,
        }
    }
}

#[derive(Args, Debug)]
pub struct GenModelArgs {
    /// Preset name (`--list` shows them).
    #[arg(long, default_value = "tiny", required_unless_present = "list")]
    config: String,
    /// Output directory.
    #[arg(long, required_unless_present = "list")]
    out: Option<PathBuf>,
    /// Seed of the weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Weight dtype.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    dtype: DtypeArg,
    /// List the presets and exit.
    #[arg(long)]
    list: bool,
}

pub fn run_gen_model(args: GenModelArgs) -> Result<()> {
    if args.list {
        for (name, desc, cfg) in synth::presets() {
            println!(
                "{name:12} {:>6.1}M params  {desc}",
                cfg.num_params() as f64 / 1e6
            );
        }
        return Ok(());
    }
    let out = args.out.context("--out is required")?;
    let cfg = synth::preset(&args.config)?;
    cfg.write(&out, args.seed, args.dtype.into())?;
    eprintln!(
        "wrote {} ({:.1}M params) to {}",
        args.config,
        cfg.num_params() as f64 / 1e6,
        out.display()
    );
    Ok(())
}

const DEFAULT_PRESET: &str = "small";
const DEFAULT_SEED: u64 = 0;

fn cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("TANDEM_CACHE_DIR") {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(dir).join("tandem"));
    }
    let home =
        std::env::var_os("HOME").context("no HOME to put the default model under; pass --model")?;
    Ok(PathBuf::from(home).join(".cache").join("tandem"))
}

/// The directory of the built-in default model, generating it on first use.
pub fn default_model_dir() -> Result<PathBuf> {
    let dir = cache_dir()?
        .join("models")
        .join(format!("{DEFAULT_PRESET}-seed{DEFAULT_SEED}-bf16"));
    if !is_complete(&dir) {
        eprintln!(
            "generating the built-in default model ({DEFAULT_PRESET}, random weights) in {}",
            dir.display()
        );
        let tmp = dir.with_extension("partial");
        let _ = std::fs::remove_dir_all(&tmp);
        synth::preset(DEFAULT_PRESET)?.write(&tmp, DEFAULT_SEED, DType::Bf16)?;
        // Rename last so an interrupted run never leaves a half model behind.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&tmp, &dir).with_context(|| format!("installing {}", dir.display()))?;
    }
    Ok(dir)
}

fn is_complete(dir: &Path) -> bool {
    [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    .iter()
    .all(|f| dir.join(f).is_file())
}
