//! What a running engine reports: counters summed over steps and gauges
//! refreshed after each.

use std::time::Duration;

use crate::kv_cache::PrefixCacheStats;
use crate::speculative::SpecCounts;

/// Counters and gauges of a running engine.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_model_len: usize,
    pub free_blocks: usize,
    pub cached_blocks: usize,
    pub running: usize,
    pub waiting: usize,
    /// Waiting for a remote prefill.
    pub parked: usize,
    pub steps: u64,
    pub preemptions: u64,
    /// Tokens run through the model (prefill and decode).
    pub computed_tokens: u64,
    pub prefix: PrefixCacheStats,
    /// Summed over steps: tokens held by live block tables ...
    pub kv_token_steps: u64,
    /// ... slots of the blocks they hold ...
    pub kv_slot_steps: u64,
    /// ... and sequences holding blocks.
    pub kv_seq_steps: u64,
    /// Constrained decoding: steps that computed token masks ...
    pub mask_steps: u64,
    /// ... the masks computed ...
    pub masks_computed: u64,
    /// ... their summed wall time per step (from the first mask's start to
    /// the last one's end) ...
    pub mask_time: Duration,
    /// ... the part the engine waited for after the forward pass (the rest
    /// was hidden behind it) ...
    pub mask_exposed: Duration,
    /// ... and the wall time of the latest step's masks (`None` when that
    /// step computed none).
    pub last_step_mask_time: Option<Duration>,
    /// Speculative decoding: drafted and accepted tokens, verifications ...
    pub speculation: SpecCounts,
    /// ... and the KV blocks the drafter holds in its own pool.
    pub draft_blocks: usize,
    /// Mixture of experts: tokens routed to each expert since start, per
    /// sparse layer (`(layer, per expert)`), so hot experts show.
    pub routed_tokens: Vec<(usize, Vec<u64>)>,
    /// The disk tier under the pool, when there is one.
    pub disk: Option<super::DiskTierStats>,
    /// Seconds one KV block of prompt takes to compute, a moving average
    /// over prefill-sized steps (0 until one ran).
    pub prefill_seconds_per_block: f64,
}

/// Weight of the newest sample in the engine's moving averages.
pub(super) const EWMA_WEIGHT: f64 = 0.2;

/// `avg` moved toward `sample` (the sample itself when `avg` is unset).
pub(super) fn ewma(avg: f64, sample: f64) -> f64 {
    if avg <= 0.0 {
        sample
    } else {
        avg + EWMA_WEIGHT * (sample - avg)
    }
}

impl EngineStats {
    /// Share of allocated KV slots holding no token, averaged over steps.
    pub fn paged_fragmentation(&self) -> f64 {
        if self.kv_slot_steps == 0 {
            return 0.0;
        }
        1.0 - self.kv_token_steps as f64 / self.kv_slot_steps as f64
    }

    /// The same for a cache that gives every sequence `max_model_len` slots
    /// up front.
    pub fn contiguous_waste(&self) -> f64 {
        let slots = self.kv_seq_steps as f64 * self.max_model_len as f64;
        if slots == 0.0 {
            return 0.0;
        }
        1.0 - self.kv_token_steps as f64 / slots
    }
}
