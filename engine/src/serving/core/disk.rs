//! The disk tier under the KV pool ([`tandem_kv_disk`]).
//!
//! - **Write-through.** Every block the prefix cache names is copied out of
//!   the pool after the step that completed it and offered to the tier's
//!   writer thread, so the pool can evict it, or the worker restart, and
//!   the block is still one read away. A block is read from the pool only
//!   if it still carries its name (speculation may have rolled it back)
//!   and the tier does not know it already.
//! - **Prefetch on arrival.** When a request arrives, the blocks of its
//!   prompt after the pool's cached prefix that the tier holds are handed
//!   to the loader thread, and the request waits (at most [`LOAD_HOLD`],
//!   first come first served) while the steps of running requests go on.
//!   Loads in flight hold at most a pool's worth of blocks in memory; a
//!   burst of arrivals past that computes the rest.
//! - **Promote, then admit.** A finished load is written into fresh pool
//!   blocks and registered in the prefix cache, chained after the pool's
//!   prefix; admission then finds the prompt cached as usual. A load that
//!   came back short (a corrupt file), a pool that lost the prefix it
//!   chains to, or a pool without room all fall back to computing.
//!
//! One layer group only: a sliding-window layout names a block per group,
//! and the tier does not store those yet (`--keep-windowed-blocks` makes
//! one group).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tandem_block_hash::SetDigest;
use tandem_kv_disk::{DiskStats, DiskTier, Loaded};

use super::EngineCore;
use crate::error::{EngineError, Result};
use crate::kv_cache::{BlockTable, CacheEvent};
use crate::serving::scheduler::SeqId;

/// Longest a request waits for its blocks to come off disk; after that it
/// is admitted and computes what has not arrived.
pub const LOAD_HOLD: Duration = Duration::from_secs(1);

/// With nothing running, the engine waits this long per step for a load
/// instead of spinning.
const IDLE_WAIT: Duration = Duration::from_millis(5);

/// What the engine did with its disk tier, beside the tier's own counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DiskTierStats {
    pub tier: DiskStats,
    /// Blocks read from disk into the pool (prefix hits served by the
    /// disk tier), and the restores that brought them.
    pub restored_blocks: u64,
    pub restores: u64,
    /// Blocks read from the pool and offered to the writer.
    pub offered_blocks: u64,
    /// Seconds a block took from the request's arrival (the load asked
    /// for) to its place in the pool, a moving average (0 until measured).
    pub seconds_per_block: f64,
}

/// The engine's side of the tier.
#[derive(Debug)]
pub(super) struct DiskState {
    tier: DiskTier,
    /// Loads in flight, by sequence: the pool blocks their run follows,
    /// the run's length, and when the load was asked for.
    pending: HashMap<SeqId, (usize, usize, Instant)>,
    restored_blocks: u64,
    seconds_per_block: f64,
    restores: u64,
    offered_blocks: u64,
    /// The blocks routers were told are on disk (hash → parent), their
    /// digest (salted members, [`CacheEvent::digest_member`]) and the
    /// changes not yet published.
    announced: HashMap<u64, u64>,
    digest: SetDigest,
    events: Vec<CacheEvent>,
}

impl DiskState {
    fn new(tier: DiskTier) -> Self {
        let announced: HashMap<u64, u64> = tier.stored_blocks().into_iter().collect();
        let digest = SetDigest::of(
            announced
                .keys()
                .map(|&hash| CacheEvent::DiskRemoved { hash }.digest_member()),
        );
        Self {
            tier,
            pending: HashMap::new(),
            restored_blocks: 0,
            seconds_per_block: 0.0,
            restores: 0,
            offered_blocks: 0,
            announced,
            digest,
            events: Vec::new(),
        }
    }

    fn announce(&mut self, e: CacheEvent) {
        let fresh = match e {
            CacheEvent::DiskStored { parent, hash } => {
                self.announced.insert(hash, parent).is_none()
            }
            CacheEvent::DiskRemoved { hash } => self.announced.remove(&hash).is_some(),
            _ => false,
        };
        if fresh {
            match e {
                CacheEvent::DiskStored { .. } => self.digest.insert(e.digest_member()),
                _ => self.digest.remove(e.digest_member()),
            }
            self.events.push(e);
        }
    }

    /// Blocks asked of the loader and not yet promoted.
    fn pending_blocks(&self) -> usize {
        self.pending.values().map(|p| p.1).sum()
    }

    /// Changes since the last call, and the disk set's digest after them.
    pub(super) fn take_events(&mut self) -> (Vec<CacheEvent>, SetDigest) {
        (std::mem::take(&mut self.events), self.digest)
    }

    /// Every announced block, as `DiskStored` events (a new subscriber's
    /// snapshot).
    pub(super) fn snapshot(&self) -> Vec<CacheEvent> {
        self.announced
            .iter()
            .map(|(&hash, &parent)| CacheEvent::DiskStored { parent, hash })
            .collect()
    }

    pub(super) fn stats(&self) -> DiskTierStats {
        DiskTierStats {
            tier: self.tier.stats(),
            restored_blocks: self.restored_blocks,
            restores: self.restores,
            offered_blocks: self.offered_blocks,
            seconds_per_block: self.seconds_per_block,
        }
    }
}

impl EngineCore {
    /// Puts `tier` under the KV pool. Refused without the prefix cache,
    /// with more than one layer group, or on a backend whose pool cannot
    /// be read between steps.
    pub fn enable_disk_tier(&mut self, tier: DiskTier) -> Result<()> {
        let why = if !self.scheduler.prefix_caching() {
            Some("the prefix cache is off".to_string())
        } else if self.scheduler.allocator().groups().num_groups() != 1 {
            Some(
                "the model's sliding-window layers keep blocks per layer group \
                 (pass --keep-windowed-blocks for one group)"
                    .to_string(),
            )
        } else if self.backend.kv_blocks().is_none() {
            Some(format!(
                "the {} backend cannot read its KV pool between steps",
                self.backend.device()
            ))
        } else {
            None
        };
        if let Some(why) = why {
            return Err(EngineError::Unsupported(format!(
                "a KV disk tier needs blocks it can name and read: {why}"
            )));
        }
        self.scheduler.allocator().log_registrations();
        self.disk = Some(DiskState::new(tier));
        self.stats.disk = self.disk.as_ref().map(DiskState::stats);
        Ok(())
    }

    /// f32 values of one block in the disk tier: every layer's K then V
    /// (a latent layout's rows alone).
    pub fn disk_block_values(&self) -> usize {
        self.backend.kv_layout().block_values()
    }

    /// Asks the tier for the blocks of `seq`'s prompt after the pool's
    /// cached prefix, and holds the sequence back while they load.
    pub(super) fn prefetch_from_disk(&mut self, seq: SeqId) {
        let (Some(disk), Some(s)) = (self.disk.as_mut(), self.scheduler.seq(seq)) else {
            return;
        };
        if s.scores_prompt {
            return; // it computes every prompt row anyway
        }
        let bs = self.scheduler.block_size();
        let cacheable = &s.hashes[..s.hashes.len().min((s.tokens.len() - 1) / bs)];
        let (hits, _) = self.scheduler.allocator().probe(cacheable);
        // Loaded blocks wait in memory until promoted: at most a pool's
        // worth at once, so a burst of arrivals cannot load without bound.
        let room = self
            .scheduler
            .allocator()
            .num_blocks()
            .saturating_sub(disk.pending_blocks());
        let run = disk.tier.stored_run(&cacheable[hits..]).min(room);
        if run == 0 {
            return;
        }
        disk.tier.load(seq, cacheable[hits..hits + run].to_vec());
        disk.pending.insert(seq, (hits, run, Instant::now()));
        if let Some(s) = self.scheduler.seq_mut(seq) {
            s.disk_hold = Some(Instant::now() + LOAD_HOLD);
        }
    }

    /// Writes finished loads into the pool (before admission). With nothing
    /// running and loads in flight, waits a little for one.
    pub(super) fn restore_from_disk(&mut self) {
        let Some(disk) = self.disk.as_mut() else {
            return;
        };
        let mut done = disk.tier.poll();
        if done.is_empty() && !disk.pending.is_empty() && self.scheduler.num_running() == 0 {
            done.extend(disk.tier.wait(IDLE_WAIT));
        }
        for loaded in done {
            let restored = self.promote(&loaded);
            if let Some(disk) = self.disk.as_mut() {
                let asked = disk.pending.remove(&loaded.ticket).map(|p| p.2);
                if restored > 0 {
                    disk.restored_blocks += restored as u64;
                    disk.restores += 1;
                    if let Some(asked) = asked {
                        let per_block = asked.elapsed().as_secs_f64() / restored as f64;
                        disk.seconds_per_block =
                            super::stats::ewma(disk.seconds_per_block, per_block);
                    }
                }
            }
            if let Some(s) = self.scheduler.seq_mut(loaded.ticket) {
                s.disk_hold = None;
            }
        }
    }

    /// Puts one load's blocks into the pool under their names; returns how
    /// many. Nothing when the sequence is gone or admitted, or the pool no
    /// longer holds the prefix they follow, or has no room.
    fn promote(&mut self, loaded: &Loaded) -> usize {
        let from = self
            .disk
            .as_ref()
            .and_then(|d| d.pending.get(&loaded.ticket));
        let (Some(&(from, _, _)), Some(seq)) = (from, self.scheduler.seq(loaded.ticket)) else {
            return 0;
        };
        let n = loaded.blocks.len();
        let names = seq.hashes.get(from..from + n);
        if n == 0 || seq.table.is_some() || names != Some(&loaded.hashes[..n]) {
            return 0;
        }
        let bs = self.scheduler.block_size();
        let hashes = seq.hashes[..from + n].to_vec();
        let allocator = self.scheduler.allocator().clone();
        let mut table = BlockTable::from_cached_prefix(&allocator, &hashes[..from]);
        if table.num_tokens() != from * bs || table.append(n * bs).is_err() {
            return 0; // dropping the table returns its blocks
        }
        let layout = self.backend.kv_layout();
        let (per_layer, keys) = (
            layout.block_elems() + layout.value_elems(),
            layout.block_elems(),
        );
        for (&block, values) in table.blocks()[from..].iter().zip(&loaded.blocks) {
            for (layer, kv) in values.chunks_exact(per_layer).enumerate() {
                let (k, v) = kv.split_at(keys);
                if let Err(e) = self.backend.write_block(layer, block, k, v) {
                    tracing::warn!(error = %e, block, layer, "restoring a KV block from disk failed");
                    return 0;
                }
            }
        }
        table.register_computed(&hashes, (from + n) * bs);
        n
    }

    /// Offers the blocks the prefix cache named since the last call to the
    /// tier's writer (after a step).
    pub(super) fn spill_to_disk(&mut self) {
        let Some(disk) = self.disk.as_mut() else {
            return;
        };
        // Departures first: a block forgotten and offered again ends up
        // announced, as it is.
        for hash in disk.tier.drain_forgotten() {
            disk.announce(CacheEvent::DiskRemoved { hash });
        }
        let allocator = self.scheduler.allocator();
        let named = allocator.drain_registered();
        let Some(kv) = self.backend.kv_blocks().filter(|_| !named.is_empty()) else {
            return;
        };
        let layout = self.backend.kv_layout();
        'blocks: for r in named {
            if disk.tier.knows(r.hash) || !allocator.holds(r.block, r.hash) {
                continue;
            }
            let mut values = Vec::with_capacity(layout.block_values());
            for layer in 0..layout.num_layers {
                match kv.read_block(layer, r.block) {
                    Ok((k, v)) => {
                        values.extend_from_slice(&k);
                        values.extend_from_slice(&v);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, block = r.block, "reading a KV block for the disk tier failed");
                        continue 'blocks;
                    }
                }
            }
            if disk.tier.offer(r.hash, r.parent, values) {
                disk.offered_blocks += 1;
                disk.announce(CacheEvent::DiskStored {
                    parent: r.parent,
                    hash: r.hash,
                });
            }
        }
    }

    /// Reads the disk tier's own counters from another thread (they move
    /// between steps, as its writer and loader work).
    pub fn disk_stats_reader(&self) -> Option<tandem_kv_disk::DiskStatsReader> {
        self.disk.as_ref().map(|d| d.tier.stats_reader())
    }

    /// Blocks until every block offered to the disk tier is written.
    pub fn flush_disk_tier(&self) {
        if let Some(d) = &self.disk {
            d.tier.flush();
        }
    }
}
