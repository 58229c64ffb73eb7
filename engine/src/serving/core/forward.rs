//! One forward pass of a step: the batch's inputs from the plan, and the
//! blocks prefill-only sequences export after each layer.
//!
//! An export sends, per layer, each of its logical blocks' entry for that
//! layer's group ([`KvGroups`]). A sliding-window layer sends only the
//! blocks the receiver's next token reads (the last prompt token, which the
//! decode side computes), so a long Gemma prompt moves its global layers'
//! KV and the windowed layers' last window, not every layer's whole prompt.

use std::collections::HashMap;
use std::sync::Arc;

use crate::backend::KvBlocks;
use crate::error::{EngineError, Result};
use crate::kv_cache::{BlockId, BlockTable, KvGroups, FREED, RECENT_TOKENS};
use crate::model::SeqInput;

use super::super::request::{ExportedBlock, KvExport};
use super::super::scheduler::{Export, SeqId, Sequence, StepPlan};
use super::{child_span, EngineCore};

/// What one prefill-only sequence exports after each layer of this step.
struct LayerExport<'a> {
    sink: Arc<dyn KvExport>,
    /// Logical blocks and their table entries, one per layer group.
    blocks: Vec<(usize, &'a [BlockId])>,
    /// First logical block a windowed layer sends.
    windowed_from: usize,
    /// First logical block of the prompt's tail (sent from 16-bit copies).
    recent_from: usize,
}

impl<'a> LayerExport<'a> {
    /// The blocks `seq` completes this step (`num_tokens` more), and on its
    /// first step those cached here from `from_block` on.
    fn plan(
        ex: &Export,
        seq: &Sequence,
        num_tokens: usize,
        table: &'a BlockTable,
        groups: &KvGroups,
        bs: usize,
    ) -> Self {
        let g = groups.num_groups();
        let lo = (ex.from_block * bs).max(if ex.started { seq.num_computed } else { 0 });
        let hi = seq.num_computed + num_tokens;
        let blocks = (lo / bs..hi.div_ceil(bs))
            .filter_map(|l| table.blocks().get(l * g..(l + 1) * g).map(|e| (l, e)))
            .collect();
        // The prompt's last blocks, which the receiver keeps at 16 bits
        // where its cache has a recent window (`EngineCore::write_kv`).
        let window_blocks = RECENT_TOKENS.div_ceil(bs) + 1;
        Self {
            sink: ex.sink.clone(),
            blocks,
            windowed_from: groups.window_start(seq.tokens.len(), bs),
            recent_from: seq.tokens.len().div_ceil(bs).saturating_sub(window_blocks),
        }
    }

    /// Hands `layer`'s blocks to the sink; a block the backend cannot read
    /// is an error (the rest are still sent, and the step fails).
    fn send_layer(&self, layer: usize, groups: &KvGroups, kv: &dyn KvBlocks) -> Result<()> {
        let group = groups.group(layer);
        let windowed = groups.is_windowed(group);
        let held = self
            .blocks
            .iter()
            .filter(|&&(l, _)| !windowed || l >= self.windowed_from)
            .map(|&(l, e)| (l, e[group]))
            .filter(|&(_, b)| b != FREED);
        let mut read = Vec::with_capacity(self.blocks.len());
        let mut error = None;
        for (logical, b) in held {
            let rows = if logical >= self.recent_from {
                kv.read_recent_block(layer, b)
            } else {
                kv.read_block(layer, b)
            };
            match rows {
                Ok((k, v)) => read.push((logical, k, v)),
                Err(e) => {
                    tracing::error!(error = %e, layer, block = b, "KV export read failed");
                    error.get_or_insert(e);
                }
            }
        }
        let data: Vec<ExportedBlock<'_>> = read
            .iter()
            .map(|(logical, k, v)| ExportedBlock {
                logical: *logical,
                k,
                v,
            })
            .collect();
        if !data.is_empty() {
            self.sink.layer_ready(layer, &data);
        }
        error.map_or(Ok(()), Err)
    }
}

impl EngineCore {
    /// Runs the step's forward pass; on a CPU backend it runs on a thread
    /// of rayon's pool with the other threads kept awake for its length
    /// ([`crate::pool::run_step`]): one hand-off per step instead of one
    /// per parallel region (about a hundred and fifty in a decode step).
    /// Measured with `engine-bench` on SmolLM2-135M, 2 threads: from the
    /// pool rather than this thread, batch-1 decode 1.5–1.6x, batch 32
    /// 1.05–1.08x; the workers kept awake on top of that: see
    /// `bench/RESULTS.md`.
    pub(super) fn forward_placed(&mut self, plan: &StepPlan) -> Result<crate::model::Logits> {
        if self.backend.uses_cpu_pool() {
            return crate::pool::run_step(|| self.forward(plan));
        }
        self.forward(plan)
    }

    fn forward(&mut self, plan: &StepPlan) -> Result<crate::model::Logits> {
        let bs = self.scheduler.block_size();
        let layer_groups = self.scheduler.allocator().groups();
        let mut inputs = Vec::with_capacity(plan.scheduled.len());
        // Prefill-only sequences: which blocks each exports after every layer.
        let mut exports: Vec<LayerExport<'_>> = Vec::new();
        // One span per prompt chunk in this forward pass, ended after it.
        let mut chunks: Vec<tracing::Span> = Vec::new();
        // Speculating sequences run their pending token and their drafts,
        // with logits for every row.
        let speculating: HashMap<SeqId, Vec<u32>> = plan
            .scheduled
            .iter()
            .filter_map(|s| {
                let seq = self.scheduler.seq(s.seq)?;
                if seq.draft.is_empty() {
                    return None;
                }
                let mut tokens = seq.tokens[seq.num_computed..].to_vec();
                tokens.extend(&seq.draft.tokens);
                Some((s.seq, tokens))
            })
            .collect();
        for s in &plan.scheduled {
            let seq = self
                .scheduler
                .seq(s.seq)
                .ok_or_else(|| EngineError::InvalidRequest("scheduled sequence vanished".into()))?;
            if seq.num_computed < seq.prompt_len {
                if let Some(g) = self.groups.get(&seq.group) {
                    let (phase, start) = (&g.phase, seq.num_computed);
                    chunks.push(child_span(phase, || {
                        tracing::info_span!(
                            parent: phase,
                            "prefill_chunk",
                            tokens = s.num_tokens,
                            start,
                            batch_tokens = plan.scheduled.iter().map(|x| x.num_tokens).sum::<usize>()
                        )
                    }));
                }
            }
            let table = seq.table.as_ref().ok_or_else(|| {
                EngineError::InvalidRequest("scheduled sequence has no blocks".into())
            })?;
            let (tokens, all_logits) = match speculating.get(&s.seq) {
                Some(t) => (t.as_slice(), true),
                None => (
                    seq.tokens
                        .get(seq.num_computed..seq.num_computed + s.num_tokens)
                        .unwrap_or_default(),
                    // Prompt scoring wants every prompt row.
                    seq.scores_prompt && seq.num_computed < seq.prompt_len,
                ),
            };
            // The scheduler cuts drafts to the tokens it planned; anything
            // else is a bug, refused rather than run on the wrong tokens.
            if tokens.len() != s.num_tokens {
                return Err(EngineError::InvalidRequest(format!(
                    "planned {} tokens for a sequence with {} to run",
                    s.num_tokens,
                    tokens.len()
                )));
            }
            inputs.push(SeqInput {
                tokens,
                start_pos: seq.num_computed,
                blocks: table.blocks(),
                all_logits,
                lora: seq.lora.as_deref(),
            });
            if let Some(ex) = &seq.export {
                exports.push(LayerExport::plan(
                    ex,
                    seq,
                    s.num_tokens,
                    table,
                    layer_groups,
                    bs,
                ));
            }
        }
        // A block the backend cannot read fails the step (below), so an
        // export never completes with a hole in it: the prefill call fails
        // and the decode side prefills locally.
        let mut read_error: Option<EngineError> = None;
        let mut after_layer = |layer: usize, kv: &dyn KvBlocks| {
            for export in &exports {
                if let Err(e) = export.send_layer(layer, layer_groups, kv) {
                    read_error.get_or_insert(e);
                }
            }
        };
        let mut out = self.backend.forward(&inputs, &mut after_layer);
        if let Some(e) = read_error {
            out = Err(e);
        }
        drop(inputs);
        drop(chunks);
        for s in &plan.scheduled {
            if let Some(ex) = self
                .scheduler
                .seq_mut(s.seq)
                .and_then(|q| q.export.as_mut())
            {
                ex.started = true;
            }
        }
        out
    }
}
