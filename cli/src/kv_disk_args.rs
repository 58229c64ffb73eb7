//! The KV disk tier's flags: where its block files live and how many
//! bytes they may take.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use tandem_engine::capacity::parse_memory_size;
use tandem_engine::serving::{DiskTier, DiskTierConfig, EngineCore};

#[derive(Args, Debug, Clone)]
pub struct KvDiskArgs {
    /// Keep the KV blocks the prefix cache names in files under DIR too
    /// (one per block, checksummed), so prefixes the pool evicted, or a
    /// restart lost, are read back instead of recomputed. A worker
    /// restarted on the same DIR starts warm.
    #[arg(long, value_name = "DIR")]
    kv_disk: Option<PathBuf>,
    /// Most bytes the disk tier's files take (least recently used go first).
    #[arg(long, default_value = "64GiB", requires = "kv_disk")]
    kv_disk_size: String,
}

impl KvDiskArgs {
    /// Opens the tier and puts it under the engine's pool (nothing without
    /// `--kv-disk`). `kv_values` names what the pool stores beside the
    /// model (its KV dtype, weight quantization): blocks written under
    /// other settings live in another directory and are never read.
    pub fn apply(&self, core: &mut EngineCore, model_dir: &Path, kv_values: &str) -> Result<()> {
        let Some(dir) = &self.kv_disk else {
            return Ok(());
        };
        let budget = parse_memory_size(&self.kv_disk_size).context("--kv-disk-size")?;
        let layout = core.kv_layout();
        let layout = format!(
            "layers={} kv_heads={} head_dim={} block={} values={kv_values}",
            layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size
        );
        let model = model_fingerprint(model_dir)
            .with_context(|| format!("--kv-disk: reading {}", model_dir.display()))?;
        let fingerprint =
            tandem_engine::serving::disk_fingerprint(&[&model.to_le_bytes(), layout.as_bytes()]);
        let config = DiskTierConfig::new(dir, budget, fingerprint, core.disk_block_values());
        let tier = DiskTier::open(config).context("--kv-disk")?;
        core.enable_disk_tier(tier).context("--kv-disk")?;
        Ok(())
    }
}

/// Names a checkpoint's contents cheaply: `config.json`, and every weight
/// file's name, length, first and last 64 KiB. Two fine-tunes of one
/// architecture differ in their tensors' bytes, so in the tails. (Not a
/// content hash: hashing every byte of a 10 GB model at each start costs
/// seconds.)
fn model_fingerprint(dir: &Path) -> std::io::Result<u64> {
    use std::io::{Read, Seek, SeekFrom};
    const EDGE: u64 = 64 << 10;
    let mut parts: Vec<Vec<u8>> = Vec::new();
    let config = dir.join("config.json");
    if config.exists() {
        parts.push(std::fs::read(config)?);
    }
    let mut files: Vec<PathBuf> = if dir.is_file() {
        vec![dir.to_path_buf()]
    } else {
        std::fs::read_dir(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.extension()
                    .is_some_and(|x| x == "safetensors" || x == "gguf" || x == "bin")
            })
            .collect()
    };
    files.sort();
    for path in files {
        let mut f = std::fs::File::open(&path)?;
        let len = f.metadata()?.len();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        parts.push(name.unwrap_or_default().into_bytes());
        parts.push(len.to_le_bytes().to_vec());
        let mut head = vec![0u8; EDGE.min(len) as usize];
        f.read_exact(&mut head)?;
        parts.push(head);
        let mut tail = vec![0u8; EDGE.min(len) as usize];
        f.seek(SeekFrom::Start(len - tail.len() as u64))?;
        f.read_exact(&mut tail)?;
        parts.push(tail);
    }
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    Ok(tandem_engine::serving::disk_fingerprint(&refs))
}
