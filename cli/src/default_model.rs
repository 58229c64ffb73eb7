//! `tandem gen-model`, and the built-in models used when no `--model` is
//! given.
//!
//! The default model is `models/shakespeare-target` (a 5.5M-parameter Llama
//! trained on Shakespeare, `models/README.md`) and its draft
//! `models/shakespeare-draft`, compiled into the binary and written once into
//! the user's cache directory (`$XDG_CACHE_HOME/tandem` or
//! `~/.cache/tandem`, overridable with `TANDEM_CACHE_DIR`), so an installed
//! binary needs no checkout and no download.

use std::path::PathBuf;

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

/// A checkpoint compiled into the binary: its files, written out to the
/// cache on first use.
struct Builtin {
    /// The cache directory's name (bump the suffix when the weights change).
    name: &'static str,
    files: &'static [(&'static str, &'static [u8])],
}

macro_rules! builtin_files {
    ($dir:literal) => {
        &[
            (
                "config.json",
                include_bytes!(concat!("../../models/", $dir, "/config.json")),
            ),
            (
                "generation_config.json",
                include_bytes!(concat!("../../models/", $dir, "/generation_config.json")),
            ),
            (
                "model.safetensors",
                include_bytes!(concat!("../../models/", $dir, "/model.safetensors")),
            ),
            (
                "tokenizer.json",
                include_bytes!(concat!("../../models/", $dir, "/tokenizer.json")),
            ),
            (
                "tokenizer_config.json",
                include_bytes!(concat!("../../models/", $dir, "/tokenizer_config.json")),
            ),
        ]
    };
}

/// The built-in target: trained on Shakespeare (`models/README.md`).
const TARGET: Builtin = Builtin {
    name: "shakespeare-target-v1",
    files: builtin_files!("shakespeare-target"),
};

/// Its draft model for speculative decoding.
const DRAFT: Builtin = Builtin {
    name: "shakespeare-draft-v1",
    files: builtin_files!("shakespeare-draft"),
};

/// The user's tandem cache directory (also where `chat` keeps its history).
pub(crate) fn cache_dir() -> Result<PathBuf> {
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

/// The directory of the built-in default model, written out on first use.
pub fn default_model_dir() -> Result<PathBuf> {
    install(&TARGET)
}

/// The built-in draft model of the default model (speculative decoding).
pub fn default_draft_model_dir() -> Result<PathBuf> {
    install(&DRAFT)
}

/// Whether `dir` is the built-in default model's directory (as `tandem up`
/// passes it to its workers).
pub fn is_default_model(dir: &std::path::Path) -> bool {
    cache_dir().is_ok_and(|c| {
        let builtin = c.join("models").join(TARGET.name);
        match (builtin.canonicalize(), dir.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        }
    })
}

fn install(model: &Builtin) -> Result<PathBuf> {
    let dir = cache_dir()?.join("models").join(model.name);
    let complete = |dir: &std::path::Path| {
        model.files.iter().all(|(name, bytes)| {
            std::fs::metadata(dir.join(name)).is_ok_and(|m| m.len() == bytes.len() as u64)
        })
    };
    if !complete(&dir) {
        eprintln!(
            "installing the built-in model {} in {}",
            model.name,
            dir.display()
        );
        // A directory of our own: several processes (a worker's ranks, a
        // cluster's workers) may install at once.
        let tmp = dir.with_extension(format!("partial-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        for (name, bytes) in model.files {
            std::fs::write(tmp.join(name), bytes)
                .with_context(|| format!("writing {}", tmp.join(name).display()))?;
        }
        // Rename last so an interrupted run never leaves a half model
        // behind; if another process finished first, keep its copy.
        if !complete(&dir) {
            let _ = std::fs::remove_dir_all(&dir);
            if let Err(e) = std::fs::rename(&tmp, &dir) {
                if !complete(&dir) {
                    let _ = std::fs::remove_dir_all(&tmp);
                    return Err(e).with_context(|| format!("installing {}", dir.display()));
                }
            }
        }
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(dir)
}
