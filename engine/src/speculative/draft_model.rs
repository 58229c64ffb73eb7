//! A separate small model as the drafter.
//!
//! The draft model shares the target's vocabulary and runs on its own
//! [`ComputeBackend`] with its own paged KV pool and [`BlockAllocator`]. Each
//! sequence keeps a block table and the tokens whose K/V it holds; a
//! proposal first catches up on tokens the draft has not seen (the whole
//! prompt the first time, then the target's corrected token), then drafts
//! `k` tokens one forward pass at a time, batched over every sequence.
//! After verification [`Drafter::rollback`] cuts the table back to the
//! prefix the target kept, releasing blocks of rejected drafts.
//!
//! Sampled requests draw drafts from the draft model's distribution under
//! the request's own temperature / top-k / top-p / min-p
//! ([`crate::Sampler::distribution`]) and hand it to verification, which
//! needs `q(x)` for the acceptance ratio.

use std::collections::HashMap;

use crate::backend::ComputeBackend;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kv_cache::{BlockAllocator, BlockTable, KvGroups};
use crate::model::SeqInput;
use crate::sampling::argmax;

use super::{DraftRequest, Drafter};

/// One sequence's state in the draft model's cache.
#[derive(Debug)]
struct DraftSeq {
    table: BlockTable,
    /// Tokens whose K/V the draft cache holds (the table's contents).
    cached: Vec<u32>,
}

/// Draft-model drafter.
#[derive(Debug)]
pub struct DraftModelDrafter {
    backend: Box<dyn ComputeBackend>,
    allocator: BlockAllocator,
    seqs: HashMap<u64, DraftSeq>,
    cost: f64,
}

/// Weights a decode step reads, roughly: every layer's projections and the
/// output head (an embedding lookup reads one row).
fn decode_params(c: &ModelConfig) -> f64 {
    let (h, i) = (c.hidden_size as f64, c.intermediate_size as f64);
    let q = (c.num_heads * c.head_dim) as f64;
    let kv = (c.num_kv_heads * c.head_dim) as f64;
    let layer = h * q * 2.0 + h * kv * 2.0 + 3.0 * h * i;
    c.num_layers as f64 * layer + c.vocab_size as f64 * h
}

impl DraftModelDrafter {
    /// A drafter running `backend` (which holds the draft model and its KV
    /// pool) for a target with config `target`. The vocabularies must be
    /// the same size: drafts are target token ids.
    pub fn new(backend: Box<dyn ComputeBackend>, target: &ModelConfig) -> Result<Self> {
        let draft = backend.config();
        if draft.vocab_size != target.vocab_size {
            return Err(EngineError::InvalidRequest(format!(
                "the draft model's vocabulary ({}) differs from the target's ({})",
                draft.vocab_size, target.vocab_size
            )));
        }
        let cost = decode_params(draft) / decode_params(target).max(1.0);
        let layout = backend.kv_layout();
        let allocator = BlockAllocator::with_groups(
            backend.num_blocks(),
            layout.block_size,
            KvGroups::of(&layout),
        )?;
        Ok(Self {
            backend,
            allocator,
            seqs: HashMap::new(),
            cost,
        })
    }
}

impl Drafter for DraftModelDrafter {
    fn name(&self) -> &'static str {
        "draft-model"
    }

    fn propose(&mut self, requests: &mut [DraftRequest<'_>]) -> Result<()> {
        // Inputs each request still has to run: the part of its tokens the
        // draft cache lacks (at least the last token, whose logits draft).
        let mut pending: Vec<Option<Vec<u32>>> = Vec::with_capacity(requests.len());
        for r in requests.iter_mut() {
            r.draft.clear();
            if r.k == 0 || r.tokens.is_empty() {
                pending.push(None);
                continue;
            }
            let st = self.seqs.entry(r.seq).or_insert_with(|| DraftSeq {
                table: BlockTable::new(&self.allocator),
                cached: Vec::new(),
            });
            let common = st
                .cached
                .iter()
                .zip(r.tokens)
                .take_while(|(a, b)| a == b)
                .count()
                .min(r.tokens.len() - 1);
            st.table.truncate(st.cached.len() - common);
            st.cached.truncate(common);
            pending.push(Some(r.tokens[common..].to_vec()));
        }
        let rounds = requests.iter().map(|r| r.k).max().unwrap_or(0);
        for _ in 0..rounds {
            // Grow each table for this round's inputs; a full pool ends that
            // request's draft where it is.
            let mut batch: Vec<usize> = Vec::new();
            for (i, r) in requests.iter().enumerate() {
                let Some(input) = pending[i].as_ref() else {
                    continue;
                };
                if r.draft.len() >= r.k {
                    continue;
                }
                let Some(st) = self.seqs.get_mut(&r.seq) else {
                    continue;
                };
                if st.table.append(input.len()).is_err() {
                    pending[i] = None;
                    continue;
                }
                batch.push(i);
            }
            if batch.is_empty() {
                break;
            }
            let logits = {
                let mut inputs = Vec::with_capacity(batch.len());
                for &i in &batch {
                    let (Some(st), Some(input)) = (self.seqs.get(&requests[i].seq), &pending[i])
                    else {
                        // Checked just above: rows would no longer line up.
                        return Err(EngineError::InvalidRequest(
                            "draft state vanished mid-proposal".into(),
                        ));
                    };
                    inputs.push(SeqInput {
                        tokens: input,
                        start_pos: st.cached.len(),
                        blocks: st.table.blocks(),
                        all_logits: false,
                        lora: None,
                    });
                }
                self.backend.forward(&inputs, &mut |_, _| {})?
            };
            for (row, &i) in batch.iter().enumerate() {
                let r = &mut requests[i];
                let Some(st) = self.seqs.get_mut(&r.seq) else {
                    continue;
                };
                if let Some(input) = pending[i].take() {
                    st.cached.extend(input);
                }
                let z = logits.last(row);
                let token = if r.sampler.params().temperature == 0.0 {
                    argmax(z)
                } else {
                    let q = r.sampler.distribution(z);
                    let t = r.sampler.draw_from(&q);
                    r.draft.probs.push(q);
                    t
                };
                r.draft.tokens.push(token);
                pending[i] = Some(vec![token]);
            }
        }
        Ok(())
    }

    fn rollback(&mut self, seq: u64, tokens: &[u32]) {
        if let Some(st) = self.seqs.get_mut(&seq) {
            let common = st
                .cached
                .iter()
                .zip(tokens)
                .take_while(|(a, b)| a == b)
                .count();
            st.table.truncate(st.cached.len() - common);
            st.cached.truncate(common);
        }
    }

    fn release(&mut self, seq: u64) {
        self.seqs.remove(&seq);
    }

    fn cost_per_token(&self) -> f64 {
        self.cost
    }

    fn held_blocks(&self) -> usize {
        self.allocator.num_blocks() - self.allocator.num_free()
    }
}
