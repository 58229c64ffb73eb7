//! The engine's LoRA adapters: its registry, where the backend runs them.

use std::sync::Arc;

use super::EngineCore;
use crate::error::{EngineError, Result};
use crate::lora::{LoraRegistry, LoraSettings};

impl EngineCore {
    /// Serves LoRA adapters: a registry for this model with `settings`'
    /// limits, its start-up adapters loaded. Refused when the backend cannot
    /// run them (a GPU, a sharded model).
    pub fn enable_lora(&mut self, settings: &LoraSettings) -> Result<Arc<LoraRegistry>> {
        if !self.backend.runs_lora() {
            return Err(EngineError::Unsupported(format!(
                "LoRA adapters need the CPU backend with the whole model in one process \
                 (not --tp/--pp, not a GPU); this engine's backend is {} and runs none",
                self.backend.device()
            )));
        }
        let registry = Arc::new(LoraRegistry::new(self.backend.config().clone(), settings)?);
        self.lora = Some(Arc::clone(&registry));
        Ok(registry)
    }

    /// Whether the backend runs LoRA adapters.
    pub fn runs_lora(&self) -> bool {
        self.backend.runs_lora()
    }

    /// The adapters requests may name.
    pub(crate) fn lora(&self) -> Option<&Arc<LoraRegistry>> {
        self.lora.as_ref()
    }
}
