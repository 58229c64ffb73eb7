//! Remote prefill's receiving end: blocks a prefill worker writes into a
//! parked sequence's destination blocks, and the transfer's end.

use crate::kv_cache::{BlockId, RECENT_TOKENS};
use crate::serving::{KvWriteError, RemotePrefillError};

use super::EngineCore;

impl EngineCore {
    /// Writes one block of one layer received for remote prefill
    /// `transfer`. Only the transfer's own destination blocks are writable.
    pub fn write_kv(
        &mut self,
        transfer: u64,
        layer: usize,
        block: BlockId,
        k: &[f32],
        v: &[f32],
    ) -> std::result::Result<(), KvWriteError> {
        let Some(blocks) = self.scheduler.parked_blocks(transfer) else {
            return Err(KvWriteError::NotParked(transfer));
        };
        // A block holds one layer group's layers: layer `layer` may land
        // only in its own group's entries.
        let groups = self.scheduler.allocator().groups();
        let mut own = blocks
            .iter()
            .skip(groups.group(layer))
            .step_by(groups.num_groups());
        if !own.any(|&b| b == block) {
            return Err(KvWriteError::NotADestination {
                transfer,
                layer,
                block,
            });
        }
        // The prompt's last positions: the first steps here read them at
        // 16 bits where the cache keeps a recent window, as the sender did.
        let tail =
            (RECENT_TOKENS.div_ceil(self.backend.kv_layout().block_size) + 1) * groups.num_groups();
        if blocks.iter().rev().take(tail).any(|&b| b == block) {
            self.backend.hold_recent(&[block]);
        }
        self.backend
            .write_block(layer, block, k, v)
            .map_err(KvWriteError::Backend)?;
        self.scheduler.record_remote_write(transfer, layer, block);
        Ok(())
    }

    /// Ends remote prefill `transfer`: on success (and every block-layer
    /// it owed written) the request goes on here from its last prompt
    /// token; otherwise it is prefilled here.
    pub fn finish_remote_prefill(
        &mut self,
        transfer: u64,
        outcome: std::result::Result<(), RemotePrefillError>,
    ) {
        if !self.scheduler.is_parked(transfer) {
            return; // aborted, or already finished
        }
        // A sender that says "done" without having written everything it
        // owed (a bug, a forged peer, a refused write) leaves blocks holding
        // someone else's K/V: compute the prompt here instead.
        let missing = self
            .scheduler
            .missing_remote_writes(transfer, self.backend.kv_layout().num_layers);
        let outcome = match outcome {
            Ok(()) if missing > 0 => Err(RemotePrefillError::Incomplete(missing)),
            other => other,
        };
        if outcome.is_ok() {
            // A scoring request waits for the prefill worker's scores too
            // (`remote_prompt_logprobs`), so they precede its first token.
            let group = self.scheduler.seq(transfer).map(|s| s.group);
            let score = group
                .and_then(|g| self.groups.get_mut(&g))
                .and_then(|g| g.score.as_mut())
                .filter(|s| s.pending());
            if let Some(score) = score {
                score.transfer_done = true;
                return;
            }
        }
        if let Err(e) = &outcome {
            // Logged in the request's span, so the line names its id.
            let span = self
                .scheduler
                .seq(transfer)
                .and_then(|s| self.groups.get(&s.group))
                .map_or_else(tracing::Span::none, |g| g.phase.clone());
            tracing::warn!(parent: &span, transfer, error = %e, "remote prefill failed; prefilling locally");
        }
        self.scheduler.unpark(transfer, outcome.is_ok());
        self.refresh_gauges();
    }
}
