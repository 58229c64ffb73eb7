//! LoRA flags shared by every command that runs an engine.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Result};
use clap::Args;
use tandem_engine::lora::{LoraRegistry, LoraSettings, DEFAULT_MAX_LORA_RANK};
use tandem_engine::serving::EngineCore;

#[derive(Args, Debug, Clone)]
pub struct LoraArgs {
    /// Serve a PEFT LoRA adapter as NAME (requests name it in `model` on
    /// the OpenAI API, in `lora` on gRPC): `--lora NAME=DIR`, repeatable.
    /// More load at run time (`POST /v1/load_lora_adapter`). CPU backend,
    /// unsharded models.
    #[arg(long = "lora", value_name = "NAME=DIR", value_parser = parse_adapter)]
    adapters: Vec<(String, PathBuf)>,
    /// Most adapters resident at once; a request for an evicted one loads
    /// it again, evicting the least recently used idle one.
    #[arg(long, default_value_t = 8)]
    max_loras: usize,
    /// Largest adapter rank accepted.
    #[arg(long, default_value_t = DEFAULT_MAX_LORA_RANK)]
    max_lora_rank: usize,
}

fn parse_adapter(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((name, dir)) if !name.is_empty() && !dir.is_empty() => {
            Ok((name.to_string(), PathBuf::from(dir)))
        }
        _ => Err(format!("expected NAME=DIR, got `{s}`")),
    }
}

impl LoraArgs {
    /// Gives the engine its adapter registry where its backend runs
    /// adapters (CPU, unsharded); elsewhere `--lora` is an error.
    pub fn apply(&self, core: &mut EngineCore) -> Result<Option<Arc<LoraRegistry>>> {
        let settings = LoraSettings {
            adapters: self.adapters.clone(),
            max_loras: self.max_loras,
            max_rank: self.max_lora_rank,
        };
        match core.enable_lora(&settings) {
            Ok(reg) => Ok(Some(reg)),
            Err(e) if self.adapters.is_empty() && !core.runs_lora() => {
                tracing::debug!(error = %e, "no LoRA adapters on this backend");
                Ok(None)
            }
            Err(e) => bail!("--lora: {e}"),
        }
    }
}

/// The colocated engine's adapters over the HTTP API: listed, loaded and
/// unloaded in its registry (loading reads the files on the blocking pool).
pub struct EngineAdapters(pub Arc<LoraRegistry>);

#[async_trait::async_trait]
impl tandem_openai::Adapters for EngineAdapters {
    fn names(&self) -> Vec<String> {
        self.0.list().into_iter().map(|a| a.name).collect()
    }

    async fn load(&self, name: &str, path: &str) -> Result<(), tandem_openai::ApiError> {
        let (reg, name, path) = (self.0.clone(), name.to_string(), PathBuf::from(path));
        let loaded = tokio::task::spawn_blocking(move || reg.load(&name, &path)).await;
        match loaded {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(adapter_error(&e)),
            Err(e) => Err(tandem_openai::ApiError::internal(format!(
                "loading the adapter failed: {e}"
            ))),
        }
    }

    async fn unload(&self, name: &str) -> Result<(), tandem_openai::ApiError> {
        self.0.unload(name).map_err(|e| adapter_error(&e))
    }
}

fn adapter_error(e: &tandem_engine::EngineError) -> tandem_openai::ApiError {
    use tandem_engine::EngineError as E;
    let param = match e {
        E::MissingFile { .. } | E::Io { .. } | E::Json { .. } => "lora_path",
        _ => "lora_name",
    };
    match e {
        E::Overloaded { .. } => tandem_openai::ApiError::busy(format!(
            "every adapter slot holds an adapter in use; {e}"
        )),
        _ => tandem_openai::ApiError::bad_param(param, e.to_string()),
    }
}

/// The router's view: every adapter some healthy decode worker serves;
/// loading and unloading go to every worker of the cluster
/// ([`tandem_router::adapters`]).
pub struct ClusterAdapters(pub Arc<tandem_router::Cluster>);

#[async_trait::async_trait]
impl tandem_openai::Adapters for ClusterAdapters {
    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .0
            .healthy(tandem_router::Role::Decode)
            .iter()
            .flat_map(|w| w.adapter_names())
            .collect();
        names.sort();
        names.dedup();
        names
    }

    async fn load(&self, name: &str, path: &str) -> Result<(), tandem_openai::ApiError> {
        let loaded = tandem_router::adapters::load_adapter(&self.0, name, path).await;
        loaded.map_err(|e| cluster_error(&e, "lora_path"))
    }

    async fn unload(&self, name: &str) -> Result<(), tandem_openai::ApiError> {
        let unloaded = tandem_router::adapters::unload_adapter(&self.0, name).await;
        unloaded.map_err(|e| cluster_error(&e, "lora_name"))
    }
}

fn cluster_error(
    e: &tandem_router::adapters::AdapterAdminError,
    param: &'static str,
) -> tandem_openai::ApiError {
    match e.is_callers() {
        true => tandem_openai::ApiError::bad_param(param, e.to_string()),
        false => tandem_openai::ApiError::internal(e.to_string()),
    }
}
