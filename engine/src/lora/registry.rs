//! The adapters an engine knows, and the few it keeps in memory.
//!
//! Known adapters are names with a directory. At most `max_loras` are
//! resident (their weights loaded); a request for a known adapter that is
//! not resident loads it again from its directory, evicting the least
//! recently used resident adapter no request holds. A request holds its
//! adapter (an `Arc`) until it ends, so eviction or unloading never pulls
//! weights from under a running sequence. Loading happens on the caller's
//! thread (request validation, the admin API), never on the engine thread.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use tandem_block_hash::BlockHash;

use super::{LoraAdapter, DEFAULT_MAX_LORA_RANK, MAX_LORA_RANK};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};

/// Limits of an engine's adapters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraSettings {
    /// Adapters to know from the start: `(name, directory)`.
    pub adapters: Vec<(String, PathBuf)>,
    /// Most adapters resident at once.
    pub max_loras: usize,
    /// Largest rank accepted.
    pub max_rank: usize,
}

impl Default for LoraSettings {
    fn default() -> Self {
        Self {
            adapters: Vec::new(),
            max_loras: 8,
            max_rank: DEFAULT_MAX_LORA_RANK,
        }
    }
}

/// One known adapter, for listings and membership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterInfo {
    pub name: String,
    /// Where its requests' block-hash chains start (routers hash prompts
    /// from it).
    pub hash_root: BlockHash,
    pub rank: usize,
    pub resident: bool,
}

#[derive(Debug)]
struct Known {
    dir: PathBuf,
    hash_root: BlockHash,
    rank: usize,
    resident: Option<Arc<LoraAdapter>>,
    last_used: u64,
}

/// The adapters of one engine (shared by its handle and its API servers).
#[derive(Debug)]
pub struct LoraRegistry {
    config: ModelConfig,
    max_loras: usize,
    max_rank: usize,
    known: Mutex<(HashMap<String, Known>, u64)>,
}

impl LoraRegistry {
    /// A registry for a base model of `config`, loading `settings.adapters`
    /// now (the first error is returned).
    pub fn new(config: ModelConfig, settings: &LoraSettings) -> Result<Self> {
        if settings.max_loras == 0 {
            return Err(EngineError::InvalidRequest(
                "max_loras must be at least 1".into(),
            ));
        }
        if !(1..=MAX_LORA_RANK).contains(&settings.max_rank) {
            return Err(EngineError::InvalidRequest(format!(
                "max_lora_rank must be between 1 and {MAX_LORA_RANK}, got {}",
                settings.max_rank
            )));
        }
        let reg = Self {
            config,
            max_loras: settings.max_loras,
            max_rank: settings.max_rank,
            known: Mutex::new((HashMap::new(), 0)),
        };
        for (name, dir) in &settings.adapters {
            reg.load(name, dir)?;
        }
        Ok(reg)
    }

    fn lock(&self) -> MutexGuard<'_, (HashMap<String, Known>, u64)> {
        // A panic while holding it cannot leave the map half-updated: every
        // update is one insert or remove.
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Loads an adapter under `name` (replacing one of that name) and
    /// makes it resident.
    pub fn load(&self, name: &str, dir: &Path) -> Result<AdapterInfo> {
        check_name(name)?;
        let adapter = Arc::new(LoraAdapter::load(name, dir, &self.config, self.max_rank)?);
        let mut guard = self.lock();
        let (known, clock) = &mut *guard;
        *clock += 1;
        // The adapter it replaces stays if there is no room for this one.
        let replaced = known.remove(name);
        if let Err(e) = make_room(known, self.max_loras) {
            if let Some(old) = replaced {
                known.insert(name.to_string(), old);
            }
            return Err(e);
        }
        let info = AdapterInfo {
            name: name.to_string(),
            hash_root: adapter.hash_root(),
            rank: adapter.rank(),
            resident: true,
        };
        known.insert(
            name.to_string(),
            Known {
                dir: dir.to_path_buf(),
                hash_root: info.hash_root,
                rank: info.rank,
                resident: Some(adapter),
                last_used: *clock,
            },
        );
        tracing::info!(adapter = name, rank = info.rank, dir = %dir.display(), "LoRA adapter loaded");
        Ok(info)
    }

    /// Forgets an adapter; running requests keep theirs until they end.
    pub fn unload(&self, name: &str) -> Result<()> {
        match self.lock().0.remove(name) {
            Some(_) => Ok(()),
            None => Err(unknown(name)),
        }
    }

    /// The adapter a request names, loading it again if it was evicted.
    pub fn resolve(&self, name: &str) -> Result<Arc<LoraAdapter>> {
        let dir = {
            let mut guard = self.lock();
            let (known, clock) = &mut *guard;
            *clock += 1;
            let entry = known.get_mut(name).ok_or_else(|| unknown(name))?;
            entry.last_used = *clock;
            if let Some(a) = &entry.resident {
                return Ok(Arc::clone(a));
            }
            entry.dir.clone()
        };
        let adapter = Arc::new(LoraAdapter::load(name, &dir, &self.config, self.max_rank)?);
        let mut guard = self.lock();
        let (known, _) = &mut *guard;
        // Unloaded (or reloaded elsewhere) meanwhile: serve this request
        // with what it resolved, keep nothing.
        if known.get(name).is_none_or(|k| k.dir != dir) {
            return Ok(adapter);
        }
        make_room(known, self.max_loras)?;
        if let Some(entry) = known.get_mut(name) {
            entry.resident = Some(Arc::clone(&adapter));
        }
        Ok(adapter)
    }

    /// Every known adapter, by name.
    pub fn list(&self) -> Vec<AdapterInfo> {
        let mut out: Vec<AdapterInfo> = self
            .lock()
            .0
            .iter()
            .map(|(name, k)| AdapterInfo {
                name: name.clone(),
                hash_root: k.hash_root,
                rank: k.rank,
                resident: k.resident.is_some(),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Most adapters resident at once.
    pub fn max_loras(&self) -> usize {
        self.max_loras
    }
}

/// Evicts least recently used idle adapters until one more fits.
fn make_room(known: &mut HashMap<String, Known>, max: usize) -> Result<()> {
    loop {
        let resident = known.values().filter(|k| k.resident.is_some()).count();
        if resident < max {
            return Ok(());
        }
        let idle = known
            .iter_mut()
            .filter(|(_, k)| {
                k.resident
                    .as_ref()
                    .is_some_and(|a| Arc::strong_count(a) == 1)
            })
            .min_by_key(|(_, k)| k.last_used);
        match idle {
            Some((name, k)) => {
                tracing::info!(adapter = %name, "LoRA adapter evicted (least recently used)");
                k.resident = None;
            }
            None => {
                return Err(EngineError::Overloaded {
                    queued: resident,
                    limit: max,
                    retry_after: std::time::Duration::from_secs(1),
                })
            }
        }
    }
}

fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:".contains(c));
    match ok {
        true => Ok(()),
        false => Err(EngineError::InvalidRequest(format!(
            "adapter name `{name}` must be 1-128 characters of letters, digits and -_./:"
        ))),
    }
}

fn unknown(name: &str) -> EngineError {
    EngineError::InvalidRequest(format!("lora: no adapter named `{name}` is loaded"))
}
