//! The scheduler: which sequences run in the next step, and how many tokens
//! each.
//!
//! There is one kind of work, "compute the K/V of a sequence's next tokens":
//! a decode is one token, a prefill chunk is many, and a sequence resumed
//! after preemption recomputes its prompt and output as one long prefill. Each
//! step fills a token budget (`max_num_batched_tokens`):
//!
//! 1. running sequences that are decoding (one token each), oldest first;
//! 2. running sequences part-way through a prefill, one chunk each;
//! 3. waiting sequences, first come first served, while `max_num_seqs`, the
//!    budget and the free blocks allow, after a prefix-cache lookup that can
//!    skip most of their prompt.
//!
//! A sequence whose prompt a prefill worker computes is *parked* at
//! admission: its blocks are allocated (after the prefix-cache lookup) but it
//! is not scheduled until the transfer ends; then it runs its last prompt
//! token here and decodes as usual. Parked sequences are never preempted:
//! another worker is writing into their blocks.
//!
//! When a running sequence cannot get a block, the newest running sequence
//! not yet scheduled in this step is preempted: its blocks are freed (full
//! ones stay in the prefix cache, so the recompute is often cheap) and it
//! goes back to the front of the waiting queue. If it is the only one left,
//! it preempts itself. Admission never preempts.
//!
//! A decoding sequence with drafted tokens ([`Sequence::draft`], speculative
//! decoding) runs them with its next token: `1 + drafts` tokens, cut to the
//! budget. After verification the engine rolls the rejected ones back
//! ([`Scheduler::rollback`]), releasing blocks they alone used.
//!
//! **Architecture Invariant:** the scheduler does no arithmetic on K/V and
//! knows nothing of the model; it moves block tables and token counts. A
//! sequence's table always holds exactly `num_computed` tokens between steps.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use tandem_block_hash::{extend_block_hashes_from, BlockHash, ROOT};

use crate::kv_cache::{BlockAllocator, BlockCopy, BlockId, BlockTable, KvError};
use crate::sampling::Sampler;
use crate::speculative::{AdaptiveK, Draft};

use super::output::TextOutput;
use super::request::KvExport;
use crate::lora::LoraAdapter;

/// Internal sequence id (one per choice).
pub(crate) type SeqId = u64;

/// Scheduling limits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SchedulerConfig {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    /// Longest prefill chunk of one sequence in one step.
    pub max_prefill_chunk: usize,
    pub enable_prefix_caching: bool,
}

/// One choice of one request.
#[derive(Debug)]
pub(crate) struct Sequence {
    /// The request it belongs to.
    pub group: u64,
    /// Which choice.
    pub index: u32,
    /// Prompt then output.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose K/V is in the cache.
    pub num_computed: usize,
    /// Chained hashes of every full block of `tokens`.
    pub hashes: Vec<BlockHash>,
    /// `None` while waiting.
    pub table: Option<BlockTable>,
    pub sampler: Sampler,
    /// `None` without a tokenizer.
    pub text: Option<TextOutput>,
    /// Prefill remotely when at least this many prompt tokens are uncached.
    pub remote_min_uncached: Option<usize>,
    /// A prefill-only sequence that exports its blocks.
    pub export: Option<Export>,
    /// (layer, block) pairs a remote prefill has written while parked: the
    /// transfer counts as done only when every one it owes arrived.
    pub remote_written: HashSet<(usize, BlockId)>,
    /// The grammar state of a constrained choice. Taken out while its mask
    /// is computed on a mask thread, and put back before sampling.
    pub constraint: Option<Box<tandem_structured::Constraint>>,
    /// Tokens drafted to verify with the next one (speculative decoding).
    pub draft: Draft,
    /// This choice's draft-length controller.
    pub adaptive: AdaptiveK,
    /// The request scores its prompt: no prefix-cache hits at admission,
    /// logits for every prompt row.
    pub scores_prompt: bool,
    /// The LoRA adapter it runs under; its block hashes chain from the
    /// adapter's root (`hash_root`), so its cached blocks are its own.
    pub lora: Option<Arc<LoraAdapter>>,
    pub hash_root: BlockHash,
    /// Not admitted before this instant unless released sooner: its
    /// prompt's next blocks are being read from the disk tier.
    pub disk_hold: Option<std::time::Instant>,
}

/// Where a prefill-only sequence's blocks go.
#[derive(Debug, Clone)]
pub(crate) struct Export {
    pub sink: std::sync::Arc<dyn KvExport>,
    pub from_block: usize,
    /// Whether blocks computed before this sequence ran (prefix-cache hits
    /// past `from_block`) have been sent.
    pub started: bool,
}

impl Sequence {
    pub fn new(
        group: u64,
        index: u32,
        prompt: Vec<u32>,
        sampler: Sampler,
        text: Option<TextOutput>,
    ) -> Self {
        Self {
            group,
            index,
            prompt_len: prompt.len(),
            tokens: prompt,
            num_computed: 0,
            hashes: Vec::new(),
            table: None,
            sampler,
            text,
            remote_min_uncached: None,
            export: None,
            remote_written: HashSet::new(),
            constraint: None,
            draft: Draft::default(),
            adaptive: AdaptiveK::default(),
            scores_prompt: false,
            lora: None,
            hash_root: ROOT,
            disk_hold: None,
        }
    }

    /// Runs under `adapter`, its blocks hashed apart from everyone else's.
    pub fn with_lora(mut self, adapter: Option<Arc<LoraAdapter>>) -> Self {
        self.hash_root = adapter.as_ref().map_or(ROOT, |a| a.hash_root());
        self.lora = adapter;
        self
    }

    /// Output tokens so far.
    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Appends a sampled token (its K/V is computed next step).
    pub fn push_token(&mut self, token: u32, block_size: usize) {
        self.tokens.push(token);
        extend_block_hashes_from(&mut self.hashes, self.hash_root, &self.tokens, block_size);
    }

    /// Whether computing `num_tokens` more tokens this step leaves it ready
    /// to sample (its pending tokens all computed).
    pub fn samples_after(&self, num_tokens: usize) -> bool {
        self.export.is_none() && self.num_computed + num_tokens >= self.tokens.len()
    }

    pub fn is_decoding(&self) -> bool {
        self.num_computed >= self.prompt_len && self.tokens.len() - self.num_computed == 1
    }
}

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Scheduled {
    pub seq: SeqId,
    /// Tokens from `num_computed` on to run now.
    pub num_tokens: usize,
}

/// The plan for one step.
#[derive(Debug, Default)]
pub(crate) struct StepPlan {
    pub scheduled: Vec<Scheduled>,
    /// Copy-on-write block copies to apply before the forward pass.
    pub copies: Vec<BlockCopy>,
    /// Sequences admitted this step with the prompt tokens found cached.
    pub admitted: Vec<(SeqId, usize)>,
    /// Sequences preempted this step.
    pub preempted: Vec<SeqId>,
    /// Sequences parked for remote prefill this step: their destination
    /// blocks (logical blocks from `cached / block_size` on, one entry per
    /// layer group each).
    pub parked: Vec<(SeqId, Vec<BlockId>)>,
    /// Tokens of `scheduled` that are decodes (with their drafts); the rest
    /// are prefill.
    pub decode_rows: usize,
}

/// Queues, budget and preemption over one block pool.
#[derive(Debug)]
pub(crate) struct Scheduler {
    cfg: SchedulerConfig,
    allocator: BlockAllocator,
    seqs: HashMap<SeqId, Sequence>,
    waiting: VecDeque<SeqId>,
    running: Vec<SeqId>,
    /// Admitted, blocks allocated, waiting for a remote prefill.
    parked: Vec<SeqId>,
    preemptions: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, allocator: BlockAllocator) -> Self {
        Self {
            cfg,
            allocator,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            parked: Vec::new(),
            preemptions: 0,
        }
    }

    pub fn allocator(&self) -> &BlockAllocator {
        &self.allocator
    }

    pub fn block_size(&self) -> usize {
        self.allocator.block_size()
    }

    /// Whether full computed blocks are kept under their hashes.
    pub fn prefix_caching(&self) -> bool {
        self.cfg.enable_prefix_caching
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    pub fn num_parked(&self) -> usize {
        self.parked.len()
    }

    /// Whether a step could do anything (parked sequences wait on others).
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn is_parked(&self, id: SeqId) -> bool {
        self.parked.contains(&id)
    }

    /// Ends a remote prefill: on success the blocks hold the prompt but its
    /// last token, which runs here next; on failure the transferred part is
    /// dropped and the prompt is computed here.
    pub fn unpark(&mut self, id: SeqId, ok: bool) {
        if !self.parked.contains(&id) {
            return;
        }
        self.parked.retain(|&s| s != id);
        let caching = self.cfg.enable_prefix_caching;
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.remote_written = HashSet::new();
            if let Some(t) = seq.table.as_mut() {
                if ok {
                    seq.num_computed = t.num_tokens();
                    if caching {
                        t.register_computed(&seq.hashes, seq.num_computed);
                    }
                } else {
                    t.truncate(t.num_tokens() - seq.num_computed);
                }
            }
        }
        self.running.push(id);
    }

    /// Notes that a remote prefill wrote `layer` of `block` (a destination
    /// of parked sequence `id`, checked by the caller).
    pub fn record_remote_write(&mut self, id: SeqId, layer: usize, block: BlockId) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.remote_written.insert((layer, block));
        }
    }

    /// How many of the (layer, block) pairs parked sequence `id` is owed
    /// are still missing: every layer of every block holding a position in
    /// `num_computed .. prompt - 1` (the last token runs here). A transfer
    /// that ends with any missing must not be taken as the prompt's K/V
    /// (nor enter the prefix cache).
    ///
    /// A windowed layer is owed only the blocks the last token's window
    /// reads: the sender may have freed the others.
    pub fn missing_remote_writes(&self, id: SeqId, num_layers: usize) -> usize {
        let (Some(seq), Some(blocks)) = (self.seqs.get(&id), self.parked_blocks(id)) else {
            return 0;
        };
        let bs = self.block_size();
        let groups = self.allocator.groups();
        let g = groups.num_groups();
        let from_block = seq.num_computed / bs;
        let remote_end = seq.tokens.len().saturating_sub(1);
        let owed_blocks =
            (blocks.len() / g).min(remote_end.div_ceil(bs).saturating_sub(from_block));
        let window_start = groups.window_start(remote_end, bs);
        (0..num_layers)
            .flat_map(|layer| {
                let group = groups.group(layer);
                let windowed = groups.is_windowed(group);
                (0..owed_blocks)
                    .filter(move |&j| !windowed || from_block + j >= window_start)
                    .map(move |j| (layer, blocks[j * g + group]))
            })
            .filter(|pair| !seq.remote_written.contains(pair))
            .count()
    }

    /// Destination blocks of a parked sequence (those a transfer may write).
    pub fn parked_blocks(&self, id: SeqId) -> Option<&[BlockId]> {
        if !self.parked.contains(&id) {
            return None;
        }
        let seq = self.seqs.get(&id)?;
        let table = seq.table.as_ref()?;
        let groups = self.allocator.groups().num_groups();
        Some(&table.blocks()[seq.num_computed / self.block_size() * groups..])
    }

    pub fn seq(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    pub fn seq_mut(&mut self, id: SeqId) -> Option<&mut Sequence> {
        self.seqs.get_mut(&id)
    }

    /// Queues a new sequence behind the waiting ones.
    pub fn add(&mut self, id: SeqId, mut seq: Sequence) {
        let bs = self.block_size();
        extend_block_hashes_from(&mut seq.hashes, seq.hash_root, &seq.tokens, bs);
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
    }

    /// Adds a copy of `parent` (parallel sampling, beam search): beside a
    /// running parent it runs at once, sharing the parent's blocks
    /// copy-on-write; a preempted parent's copy waits behind the queue and
    /// is computed again. Returns false if the parent is neither (parked
    /// for a remote prefill, or unknown).
    pub fn fork(&mut self, parent: SeqId, id: SeqId, index: u32, sampler: Sampler) -> bool {
        let Some(p) = self.seqs.get(&parent) else {
            return false;
        };
        let resident = p.table.is_some() && self.running.contains(&parent);
        if !resident && !self.waiting.contains(&parent) {
            return false;
        }
        let child = Sequence {
            group: p.group,
            index,
            tokens: p.tokens.clone(),
            prompt_len: p.prompt_len,
            num_computed: if resident { p.num_computed } else { 0 },
            hashes: p.hashes.clone(),
            table: p.table.as_ref().filter(|_| resident).map(BlockTable::fork),
            sampler,
            text: p
                .text
                .as_ref()
                .map(|_| TextOutput::new(&p.tokens[..p.prompt_len], &p.text_stops())),
            remote_min_uncached: None,
            export: None,
            remote_written: HashSet::new(),
            // Same place in the grammar, its own parser.
            constraint: p.constraint.as_ref().map(|c| Box::new(c.fork())),
            draft: Draft::default(),
            adaptive: AdaptiveK::default(),
            // Forks come after the prompt: nothing left to score.
            scores_prompt: false,
            lora: p.lora.clone(),
            hash_root: p.hash_root,
            // Its parent waits for any restore; the blocks are shared.
            disk_hold: None,
        };
        self.seqs.insert(id, child);
        if resident {
            self.running.push(id);
        } else {
            self.waiting.push_back(id);
        }
        true
    }

    /// Removes a sequence wherever it is; dropping it frees its blocks.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        self.running.retain(|&s| s != id);
        self.parked.retain(|&s| s != id);
        self.waiting.retain(|&s| s != id);
        self.seqs.remove(&id)
    }

    fn preempt(&mut self, id: SeqId, plan: &mut StepPlan) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.table = None;
            seq.num_computed = 0;
            seq.draft.clear();
            seq.remote_min_uncached = None;
        }
        self.running.retain(|&s| s != id);
        self.waiting.push_front(id);
        self.preemptions += 1;
        plan.preempted.push(id);
    }

    /// Preempts the newest idle running sequence (a beam waiting for its
    /// siblings' rows: all its tokens computed, nothing to run) to the back
    /// of the queue, so that idle sequences never keep the queue's front
    /// out; returns false if none is idle.
    fn preempt_idle(&mut self, plan: &mut StepPlan) -> bool {
        let idle = self.running.iter().rposition(|id| {
            self.seqs
                .get(id)
                .is_some_and(|s| s.export.is_none() && s.num_computed == s.tokens.len())
        });
        let Some(pos) = idle else {
            return false;
        };
        let id = self.running[pos];
        self.preempt(id, plan);
        // Behind the others: its row is kept, it is in no hurry.
        self.waiting.retain(|&s| s != id);
        self.waiting.push_back(id);
        true
    }

    /// Plans the next step. `prefill_cap(decode_rows)` bounds the prefill
    /// tokens that may join a step carrying that many decode rows (the
    /// step-time budget; `None`: the token budget alone).
    pub fn schedule(&mut self, prefill_cap: impl FnOnce(usize) -> Option<usize>) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut done: HashSet<SeqId> = HashSet::new();
        let mut prefill_cap = Some(prefill_cap);
        for decodes in [true, false] {
            if !decodes {
                plan.decode_rows = self.cfg.max_num_batched_tokens - budget;
                if let Some(cap) = prefill_cap.take().and_then(|f| f(plan.decode_rows)) {
                    budget = budget.min(cap);
                }
            }
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let id = self.running[i];
                let Some(seq) = self.seqs.get_mut(&id) else {
                    i += 1;
                    continue;
                };
                if seq.is_decoding() != decodes || done.contains(&id) {
                    i += 1;
                    continue;
                }
                let n = (seq.tokens.len() - seq.num_computed + seq.draft.len())
                    .min(budget)
                    .min(self.cfg.max_prefill_chunk);
                // Drafts that do not fit this step are dropped.
                seq.draft.truncate(n.saturating_sub(1));
                if n == 0 {
                    i += 1;
                    continue;
                }
                match self.grow(id, n) {
                    Ok(copy) => {
                        plan.copies.extend(copy);
                        plan.scheduled.push(Scheduled {
                            seq: id,
                            num_tokens: n,
                        });
                        done.insert(id);
                        budget -= n;
                        i += 1;
                    }
                    Err(_) => {
                        let victim = self
                            .running
                            .iter()
                            .rposition(|v| *v != id && !done.contains(v));
                        match victim {
                            // Retry the same sequence with more free blocks.
                            Some(pos) => {
                                let v = self.running[pos];
                                self.preempt(v, &mut plan);
                                if pos < i {
                                    i -= 1;
                                }
                            }
                            // Nobody left to preempt: step aside.
                            None => self.preempt(id, &mut plan),
                        }
                    }
                }
            }
        }
        self.admit(&mut plan, budget);
        plan
    }

    /// Frees what left the window of windowed layers, then makes room for
    /// `n` more tokens.
    fn grow(&mut self, id: SeqId, n: usize) -> Result<Vec<BlockCopy>, KvError> {
        let allocator = self.allocator.clone();
        let seq = self.seqs.get_mut(&id).ok_or(KvError::EmptyPool)?;
        let table = seq.table.get_or_insert_with(|| BlockTable::new(&allocator));
        table.release_outside_window(seq.num_computed);
        table.append(n)
    }

    fn admit(&mut self, plan: &mut StepPlan, mut budget: usize) {
        let bs = self.block_size();
        let groups = self.allocator.groups().num_groups();
        while budget > 0 {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            if self.running.len() + self.parked.len() >= self.cfg.max_num_seqs {
                if self.preempt_idle(plan) {
                    continue;
                }
                break;
            }
            let Some(seq) = self.seqs.get(&id) else {
                self.waiting.pop_front();
                continue;
            };
            // First come, first served: a restore from disk takes
            // milliseconds, and admitting behind it would skip the queue.
            if seq
                .disk_hold
                .is_some_and(|until| std::time::Instant::now() < until)
            {
                break;
            }
            // At least the last token is always computed: its logits are
            // the point.
            let cacheable = if self.cfg.enable_prefix_caching && !seq.scores_prompt {
                &seq.hashes[..seq.hashes.len().min((seq.tokens.len() - 1) / bs)]
            } else {
                &[]
            };
            let (hits, hits_free) = self.allocator.probe(cacheable);
            let cached = hits * bs;
            // Remote prefill computes all but the last prompt token.
            let remote_end = seq.tokens.len() - 1;
            // A resumed sequence's replayed tokens go with its prompt (a
            // draining worker's KV moves); a preempted one recomputes here.
            if seq
                .remote_min_uncached
                .is_some_and(|m| remote_end > cached && remote_end - cached >= m)
            {
                let need = (remote_end.div_ceil(bs) - hits) * groups;
                if need + hits_free > self.allocator.num_free() {
                    if self.preempt_idle(plan) {
                        continue;
                    }
                    break;
                }
                let hashes = cacheable[..hits].to_vec();
                let mut table = BlockTable::from_cached_prefix(&self.allocator, &hashes);
                if table.append(remote_end - cached).is_err() {
                    break; // unreachable after the check above; wait
                }
                let blocks = table.blocks()[hits * groups..].to_vec();
                let Some(seq) = self.seqs.get_mut(&id) else {
                    break;
                };
                seq.num_computed = cached;
                seq.table = Some(table);
                self.waiting.pop_front();
                self.parked.push(id);
                plan.admitted.push((id, cached));
                plan.parked.push((id, blocks));
                continue;
            }
            let n = (seq.tokens.len() - cached)
                .min(budget)
                .min(self.cfg.max_prefill_chunk);
            let need = ((cached + n).div_ceil(bs) - hits) * groups;
            if need + hits_free > self.allocator.num_free() {
                if self.preempt_idle(plan) {
                    continue;
                }
                break; // first come, first served: wait for blocks
            }
            let mut table = BlockTable::from_cached_prefix(&self.allocator, &cacheable[..hits]);
            let appended = table.append(n);
            let Some(seq) = self.seqs.get_mut(&id) else {
                break;
            };
            match appended {
                // A fresh table shares no partial block: no copy can arise.
                Ok(_) => {
                    seq.num_computed = table.num_tokens() - n;
                    seq.table = Some(table);
                }
                Err(_) => break, // unreachable after the check above; wait
            }
            self.waiting.pop_front();
            self.running.push(id);
            plan.admitted.push((id, cached));
            plan.scheduled.push(Scheduled {
                seq: id,
                num_tokens: n,
            });
            budget -= n;
        }
    }

    /// The sequences with these ids, mutably (unknown ids are skipped).
    pub fn seqs_mut(&mut self, ids: &[SeqId]) -> Vec<(SeqId, &mut Sequence)> {
        let wanted: HashSet<SeqId> = ids.iter().copied().collect();
        self.seqs
            .iter_mut()
            .filter(|(id, _)| wanted.contains(id))
            .map(|(&id, s)| (id, s))
            .collect()
    }

    /// Running sequences that decode next step (one pending token each).
    pub fn running_decodes(&self) -> Vec<SeqId> {
        self.running
            .iter()
            .copied()
            .filter(|id| self.seqs.get(id).is_some_and(Sequence::is_decoding))
            .collect()
    }

    /// Forgets the last `n` computed tokens of a sequence (rejected drafts):
    /// blocks they alone filled go back to the pool.
    pub fn rollback(&mut self, id: SeqId, n: usize) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            let n = n.min(seq.num_computed);
            seq.num_computed -= n;
            if let Some(t) = seq.table.as_mut() {
                t.truncate(n);
            }
        }
    }

    /// Records that the planned tokens were computed, and caches the blocks
    /// they completed.
    pub fn complete(&mut self, plan: &StepPlan) {
        for s in &plan.scheduled {
            if let Some(seq) = self.seqs.get_mut(&s.seq) {
                seq.num_computed += s.num_tokens;
                if self.cfg.enable_prefix_caching {
                    if let Some(t) = seq.table.as_mut() {
                        t.register_computed(&seq.hashes, seq.num_computed);
                    }
                }
            }
        }
    }

    /// Tokens held and slots allocated over all live tables (in tokens of
    /// every layer: a windowed layer's freed blocks do not count), and how
    /// many sequences hold a table.
    pub fn kv_usage(&self) -> (usize, usize, usize) {
        let bs = self.block_size();
        let groups = self.allocator.groups().num_groups();
        let mut tokens = 0;
        let mut slots = 0;
        let mut seqs = 0;
        for t in self.seqs.values().filter_map(|s| s.table.as_ref()) {
            tokens += t.num_tokens();
            slots += t.num_held() * bs / groups;
            seqs += 1;
        }
        (tokens, slots, seqs)
    }

    /// Checks the block books against the live tables, and that every
    /// table holds exactly its sequence's computed tokens.
    pub fn check_accounting(&self) -> Result<(), String> {
        let mut refs = 0;
        for (id, s) in &self.seqs {
            match &s.table {
                Some(t) => {
                    refs += t.num_held();
                    let parked = self.parked.contains(id);
                    if !parked && t.num_tokens() != s.num_computed {
                        return Err(format!(
                            "sequence {id}: table holds {} tokens, {} computed",
                            t.num_tokens(),
                            s.num_computed
                        ));
                    }
                }
                None if s.num_computed != 0 => {
                    return Err(format!("sequence {id} has computed tokens but no blocks"));
                }
                None => {}
            }
        }
        self.allocator.check_accounting(refs)
    }
}

impl Sequence {
    fn text_stops(&self) -> std::sync::Arc<super::stop::StopStrings> {
        self.text
            .as_ref()
            .map_or_else(super::stop::StopStrings::none, TextOutput::stops)
    }
}
