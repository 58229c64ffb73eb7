//! The engine core: one step = schedule, run the model once over the whole
//! batch, sample, and stream each request its events.
//!
//! [`EngineCore`] is synchronous and single-threaded; the serving thread
//! ([`super::EngineHandle`]) drives it, and tests drive it directly so they
//! can check the block books after every step.

mod beams;
mod config;
mod disk;
mod emit;
mod forward;
mod lora;
mod prompt_scores;
mod remote;
mod resume;
mod speculation;
mod stats;
mod step_budget;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc::{Sender, UnboundedSender};

use crate::backend::{ComputeBackend, CpuBackend};
use crate::error::{EngineError, Result};
use crate::generate::FinishReason;
use crate::kv_cache::{BlockAllocator, KvGroups, SlidingLayers};
use crate::lora::LoraRegistry;
use crate::model::Model;
use crate::speculative::SpecCounts;
use crate::tokenizer::Tokenizer;

use super::constrained::{Grammars, MaskJob, MaskWorkers};
use super::kv_feed::{KvFeed, KvFeedPublisher};
use super::request::{
    ChoiceSummary, Limits, PrefillMode, RemotePrefill, RequestEvent, RequestFailure, ValidRequest,
};
use super::scheduler::{Export, Scheduler, SchedulerConfig, SeqId, StepPlan};
use speculation::Speculation;

pub use config::{EngineConfig, KvPoolSize};
pub use disk::{DiskTierStats, LOAD_HOLD};
pub use stats::EngineStats;
pub use step_budget::{BadStepTimeLimit, StepTimeLimit};

/// Tokens from which a step counts as prefill when timing it.
const PREFILL_SIZED_STEP: usize = 64;

/// One request: its choices' shared bookkeeping.
#[derive(Debug)]
struct Group {
    request_id: String,
    sink: UnboundedSender<RequestEvent>,
    n: usize,
    max_tokens: usize,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    prompt_len: usize,
    /// Sampling settings, for forked choices.
    sampling: crate::sampling::SamplingParams,
    forked: bool,
    arrival: Instant,
    first_scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Output tokens of choice 0 (for TPOT).
    tokens_of_first: usize,
    cached_tokens: usize,
    choices: Vec<ChoiceSummary>,
    /// Sequence ids of unfinished choices.
    live: Vec<SeqId>,
    /// Speculative decoding over all its choices.
    speculation: SpecCounts,
    /// Prompt scores, when asked for (`prompt_scores`).
    score: Option<prompt_scores::PromptScore>,
    /// Beam search, when asked for (`beams`): then `live` are its beams.
    beam: Option<beams::BeamState>,
    /// The caller's span for the request ...
    span: tracing::Span,
    /// ... and the child span of its current phase: `queue` until
    /// admission, then `prefill` until the first token (or the end of an
    /// export), then `decode`. Replacing it ends the previous phase.
    phase: tracing::Span,
}

/// A child span of `parent`, or none when `parent` records nothing (so an
/// engine driven without spans never starts stray root spans).
fn child_span(parent: &tracing::Span, make: impl FnOnce() -> tracing::Span) -> tracing::Span {
    if parent.is_none() {
        tracing::Span::none()
    } else {
        make()
    }
}

/// The synchronous engine: a model, its KV cache, the scheduler and the
/// requests in flight.
#[derive(Debug)]
pub struct EngineCore {
    backend: Box<dyn ComputeBackend>,
    /// Set when the backend failed for good: every request has been failed
    /// and new ones are refused.
    failure: Option<String>,
    tokenizer: Option<Arc<Tokenizer>>,
    eos: Vec<u32>,
    scheduler: Scheduler,
    limits: Limits,
    groups: HashMap<u64, Group>,
    next_seq: SeqId,
    kv_feed: KvFeedPublisher,
    stats: EngineStats,
    /// Compiles response formats; `None` without a tokenizer.
    grammars: Option<Arc<Grammars>>,
    masks: MaskWorkers,
    /// The drafter, when speculative decoding is on.
    spec: Option<Speculation>,
    max_queued: Option<usize>,
    /// LoRA adapters requests may name (backends that run them only).
    lora: Option<Arc<LoraRegistry>>,
    /// The disk tier under the KV pool, when enabled (`disk`).
    disk: Option<disk::DiskState>,
    /// Sizes prefill chunks beside decodes from measured step times.
    step_budget: step_budget::StepBudget,
}

impl EngineCore {
    /// Builds the KV pool and the scheduler for `model` on the CPU.
    pub fn new(
        mut model: Model,
        tokenizer: Option<Arc<Tokenizer>>,
        eos: Vec<u32>,
        config: &EngineConfig,
    ) -> Result<Self> {
        if config.block_size == 0 {
            return Err(EngineError::InvalidRequest(
                "block_size must be positive".into(),
            ));
        }
        if let Some(q) = config.weight_quantization {
            model.quantize_int4(q)?;
            tracing::info!(
                group_size = q.group_size,
                activations = q.activations.name(),
                measured = q.measured_cost(),
                "INT4 weights"
            );
        }
        let dtype = config.kv_cache_dtype;
        tracing::info!(kv_dtype = %dtype, measured = dtype.measured_cost(), "KV cache dtype");
        let mut layout = model.kv_layout(config.block_size);
        if config.keep_windowed_blocks {
            layout.sliding = SlidingLayers::NONE;
        }
        let num_blocks = match config.kv_pool {
            KvPoolSize::Blocks(n) => n,
            KvPoolSize::Bytes(b) => b / config.kv_cache_dtype.block_bytes(&layout).max(1),
        };
        let backend = CpuBackend::with_kv_layout(model, layout, num_blocks, config.kv_cache_dtype);
        Self::with_backend(Box::new(backend), tokenizer, eos, config)
    }

    /// Builds the scheduler over a backend that already holds its KV pool
    /// (its block count wins over `config.kv_pool`; the block sizes must
    /// agree).
    pub fn with_backend(
        mut backend: Box<dyn ComputeBackend>,
        tokenizer: Option<Arc<Tokenizer>>,
        eos: Vec<u32>,
        config: &EngineConfig,
    ) -> Result<Self> {
        let mc = backend.config().clone();
        let max_model_len = config.max_model_len.unwrap_or(mc.max_context());
        if max_model_len == 0 || max_model_len > mc.max_context() {
            return Err(EngineError::InvalidRequest(format!(
                "max_model_len {max_model_len} must be in 1..={} (the model's context)",
                mc.max_context()
            )));
        }
        if config.max_num_batched_tokens == 0
            || config.max_num_seqs == 0
            || config.max_queued_requests == Some(0)
        {
            return Err(EngineError::InvalidRequest(
                "max_num_batched_tokens, max_num_seqs and max_queued_requests must be positive"
                    .into(),
            ));
        }
        let layout = backend.kv_layout();
        if layout.block_size != config.block_size {
            return Err(EngineError::InvalidRequest(format!(
                "the {} backend's KV blocks hold {} tokens, the engine is configured for {}",
                backend.device(),
                layout.block_size,
                config.block_size
            )));
        }
        let num_blocks = backend.num_blocks();
        let groups = KvGroups::of(&layout);
        let footprint = groups.footprint();
        let allocator = BlockAllocator::with_groups(num_blocks, config.block_size, groups)?;
        backend.set_matmul_policy(config.matmul)?;
        let block_bytes = backend.block_bytes();
        let chunk = config
            .max_prefill_chunk
            .unwrap_or(config.max_num_batched_tokens)
            .clamp(1, config.max_num_batched_tokens);
        let scheduler = Scheduler::new(
            SchedulerConfig {
                max_num_batched_tokens: config.max_num_batched_tokens,
                max_num_seqs: config.max_num_seqs,
                max_prefill_chunk: chunk,
                enable_prefix_caching: config.enable_prefix_caching,
            },
            allocator,
        );
        let limits = Limits {
            vocab_size: mc.vocab_size,
            max_model_len,
            block_size: config.block_size,
            num_blocks,
            max_num_seqs: config.max_num_seqs,
            footprint,
            max_prefill_chunk: chunk,
        };
        let per_seq = footprint.held(max_model_len, config.block_size);
        let max_concurrency = num_blocks / per_seq.max(1);
        if footprint.windowed_groups > 0 {
            tracing::info!(
                layer_groups = footprint.groups,
                windowed_groups = footprint.windowed_groups,
                window = footprint.window,
                blocks_per_seq = per_seq,
                blocks_per_seq_without_freeing =
                    max_model_len.div_ceil(config.block_size) * footprint.groups,
                "sliding-window layers keep only their window's blocks"
            );
        }
        tracing::info!(
            kv_blocks = num_blocks,
            kv_tokens = num_blocks * config.block_size / footprint.groups,
            kv_bytes = %crate::capacity::format_bytes((num_blocks * block_bytes) as u64),
            device = backend.device(),
            block_size = config.block_size,
            max_model_len,
            max_concurrency_at_max_model_len = max_concurrency,
            "KV cache pool"
        );
        if max_concurrency == 0 {
            tracing::warn!(
                "the KV pool cannot hold one sequence of max_model_len tokens; \
                 requests that could outgrow it are refused"
            );
        }
        if config.max_step_time != StepTimeLimit::Off {
            tracing::info!(
                max_step_time = %config.max_step_time,
                "prefill chunks beside decodes sized to a step time"
            );
        }
        let stats = EngineStats {
            num_blocks,
            block_size: config.block_size,
            max_model_len,
            free_blocks: num_blocks,
            ..EngineStats::default()
        };
        let grammars = tokenizer
            .as_ref()
            .map(|t| Arc::new(Grammars::new(t.clone(), mc.vocab_size, eos.clone())));
        Ok(Self {
            backend,
            failure: None,
            tokenizer,
            grammars,
            masks: MaskWorkers::default(),
            eos,
            scheduler,
            limits,
            groups: HashMap::new(),
            next_seq: 0,
            kv_feed: KvFeedPublisher::default(),
            stats,
            spec: None,
            max_queued: config.max_queued_requests,
            lora: None,
            disk: None,
            step_budget: step_budget::StepBudget::new(config.max_step_time),
        })
    }

    /// Requests waiting for admission.
    pub fn num_waiting(&self) -> usize {
        self.scheduler.num_waiting()
    }

    /// The admission queue's bound, if any.
    pub fn max_queued_requests(&self) -> Option<usize> {
        self.max_queued
    }

    /// What requests must fit.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The backend's KV layout: what workers advertise and transfers check.
    pub fn kv_layout(&self) -> crate::KvLayout {
        self.backend.kv_layout()
    }

    /// The served model's configuration.
    pub fn model_config(&self) -> &crate::ModelConfig {
        self.backend.config()
    }

    /// The tokenizer, if the checkpoint has one.
    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// Bytes of the KV pool.
    pub fn kv_pool_bytes(&self) -> usize {
        self.limits.num_blocks * self.backend.block_bytes()
    }

    /// The format compiler shared with the handle.
    pub(crate) fn grammars(&self) -> Option<Arc<Grammars>> {
        self.grammars.clone()
    }

    /// Whether token masks are computed on mask threads during the forward
    /// pass (the default) or on the engine thread before it (to measure
    /// what the overlap saves).
    pub fn set_mask_overlap(&mut self, overlap: bool) {
        self.masks.inline = !overlap;
    }

    /// Validates and queues a request under the caller's `id`; its events go
    /// to `sink`.
    pub fn add_request(
        &mut self,
        id: u64,
        req: super::Request,
        sink: UnboundedSender<RequestEvent>,
    ) -> Result<()> {
        let valid = super::request::validate(
            req,
            self.tokenizer.as_deref(),
            self.grammars.as_deref(),
            self.lora.as_deref(),
            &self.limits,
        )?;
        self.add_valid(id, valid, sink);
        Ok(())
    }

    pub(crate) fn add_valid(
        &mut self,
        id: u64,
        mut req: ValidRequest,
        sink: UnboundedSender<RequestEvent>,
    ) {
        if let Some(why) = &self.failure {
            let _ = sink.send(RequestEvent::Error(RequestFailure::engine(format!(
                "the engine has stopped: {why}"
            ))));
            return;
        }
        let resume = req.resume.take();
        let (seqs, ended) = match self.first_choices(id, &req, resume.as_ref()) {
            Ok(v) => v,
            Err(e) => {
                let _ = sink.send(RequestEvent::Error(RequestFailure::request(e.to_string())));
                return;
            }
        };
        let first_id = self.next_seq;
        let beam = self.beam_state(&req, first_id);
        let prompt_len = req.prompt_ids.len();
        let span = req.span;
        let phase = child_span(&span, || tracing::info_span!(parent: &span, "queue"));
        let score = req
            .prompt_logprobs
            .map(|p| prompt_scores::PromptScore::new(p, &req.prompt_ids));
        let mut live = Vec::with_capacity(seqs.len());
        for seq in seqs {
            let mut seq = seq.with_lora(req.lora.clone());
            seq.scores_prompt = score.is_some();
            match &req.prefill {
                PrefillMode::Local => {}
                PrefillMode::Remote(placement) => {
                    seq.remote_min_uncached = Some(placement.min_uncached)
                }
                PrefillMode::Export { sink, from_block } => {
                    seq.export = Some(Export {
                        sink: sink.clone(),
                        from_block: *from_block,
                        started: false,
                    })
                }
            }
            let seq_id = self.next_seq;
            self.next_seq += 1;
            self.scheduler.add(seq_id, seq);
            self.prefetch_from_disk(seq_id);
            live.push(seq_id);
        }
        let now = Instant::now();
        // A resumed request's timings count from its first arrival.
        let arrival = resume
            .as_ref()
            .and_then(|r| now.checked_sub(r.elapsed))
            .unwrap_or(now);
        let first_token = resume
            .as_ref()
            .and_then(|r| r.first_token_after)
            .map(|d| arrival + d);
        let tokens_of_first = resume.as_ref().map_or(0, |r| r.tokens_of(0).len());
        self.groups.insert(
            id,
            Group {
                request_id: req.request_id,
                sink,
                n: req.n,
                max_tokens: req.max_tokens,
                stop_token_ids: req.stop_token_ids,
                ignore_eos: req.ignore_eos,
                prompt_len,
                sampling: req.sampling,
                // Beams fork by their own rule; resumed choices exist.
                forked: req.n == 1 || beam.is_some() || resume.is_some(),
                arrival,
                first_scheduled: None,
                first_token,
                last_token: (tokens_of_first > 0).then_some(now),
                tokens_of_first,
                cached_tokens: 0,
                choices: ended,
                live,
                speculation: SpecCounts::default(),
                score,
                beam,
                span,
                phase,
            },
        );
        // Every resumed choice may have ended in its replay.
        self.maybe_close(id);
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    /// Cancels a request: its blocks are freed now and its stream ends with
    /// `abort` finishes. Unknown ids are ignored (it may have just finished).
    pub fn abort(&mut self, id: u64) {
        let Some(group) = self.groups.get_mut(&id) else {
            return;
        };
        group.forked = true; // no choice will fork off an aborted request
        if group.beam.is_some() {
            self.beam_abort(id);
            self.refresh_gauges();
            return;
        }
        for seq in group.live.clone() {
            self.finish_seq(seq, FinishReason::Abort, None);
        }
        self.maybe_close(id);
        self.refresh_gauges();
    }

    /// Counters and gauges (the disk tier's own read now, the rest as of
    /// the last step).
    pub fn stats(&self) -> EngineStats {
        let mut s = self.stats.clone();
        if let (Some(d), Some(reader)) = (s.disk.as_mut(), self.disk_stats_reader()) {
            d.tier = reader.stats();
        }
        s
    }

    /// Checks the block books (tests run it after every step).
    pub fn check_accounting(&self) -> std::result::Result<(), String> {
        self.scheduler.check_accounting()
    }

    /// Follows the prefix cache: `sink` gets a snapshot now, then every
    /// change after each step, for as long as it keeps up (`kv_feed`).
    pub fn subscribe_kv_events(&mut self, sink: Sender<KvFeed>) {
        self.publish_kv_events();
        let (mut snapshot, pool_closed) = self.scheduler.allocator().snapshot_and_closure();
        if let Some(d) = &self.disk {
            snapshot.extend(d.snapshot());
        }
        self.kv_feed.subscribe(sink, snapshot, pool_closed);
    }

    /// Publishes the pool's and the disk tier's changes, with the digest
    /// of both sets.
    fn publish_kv_events(&mut self) {
        let mut changes = self.scheduler.allocator().drain_announced();
        if let Some(d) = self.disk.as_mut() {
            let (disk_events, disk_digest) = d.take_events();
            changes.events.extend(disk_events);
            changes.digest = changes.digest.combined(disk_digest);
        }
        self.kv_feed.publish(changes);
    }

    /// Runs one step. Does nothing when there is no work.
    pub fn step(&mut self) {
        self.restore_from_disk();
        self.run_step();
        self.spill_to_disk();
        self.refresh_stats();
    }

    fn run_step(&mut self) {
        self.stats.last_step_mask_time = None;
        self.propose_drafts();
        let budget = &self.step_budget;
        let plan = self.scheduler.schedule(|rows| budget.prefill_cap(rows));
        for &seq in &plan.preempted {
            self.release_draft_state(seq);
        }
        let now = Instant::now();
        for &(seq, cached) in &plan.admitted {
            let Some(s) = self.scheduler.seq(seq) else {
                continue;
            };
            let (group, index) = (s.group, s.index);
            let remote = plan.parked.iter().any(|p| p.0 == seq);
            if let Some(g) = self.groups.get_mut(&group) {
                if g.first_scheduled.is_none() && index == 0 {
                    g.first_scheduled = Some(now);
                    g.cached_tokens = cached;
                    let (prompt_tokens, span) = (g.prompt_len, &g.span);
                    g.phase = child_span(span, || {
                        tracing::info_span!(
                            parent: span,
                            "prefill",
                            prompt_tokens,
                            cached_tokens = cached,
                            remote
                        )
                    });
                }
            }
        }
        for (seq, blocks) in &plan.parked {
            let Some(s) = self.scheduler.seq(*seq) else {
                continue;
            };
            let prompt_logprobs = self
                .groups
                .get(&s.group)
                .and_then(|g| g.score.as_ref())
                .map(|score| super::request::PromptLogprobs {
                    top: score.top(),
                    next_token: s.tokens.last().copied(),
                });
            let ev = RequestEvent::RemotePrefill(RemotePrefill {
                transfer: *seq,
                tokens: s.tokens[..s.tokens.len() - 1].to_vec(),
                cached_tokens: s.num_computed,
                blocks: blocks.clone(),
                prompt_logprobs,
                lora: s.lora.as_ref().map(|a| super::request::LoraRef {
                    name: a.name().to_string(),
                    hash_root: a.hash_root(),
                }),
            });
            let group = s.group;
            let gone = self
                .groups
                .get(&group)
                .is_none_or(|g| g.sink.send(ev).is_err());
            if gone {
                self.abort(group);
            }
        }
        if plan.scheduled.is_empty() {
            return;
        }
        for &copy in &plan.copies {
            if let Err(e) = self.backend.copy_block(copy) {
                // The allocator made the copy; a backend refusing it is a
                // bug or a device fault. Fail the step's requests rather
                // than compute on a stale block.
                tracing::error!(error = %e, ?copy, "KV block copy failed");
                self.fail_scheduled(&plan, &format!("KV block copy failed: {e}"));
                self.check_backend();
                return;
            }
        }
        // Constrained sequences that sample after this forward pass get
        // their masks computed while it runs.
        let mut jobs = self.take_mask_jobs(&plan);
        let started = Instant::now();
        let result = if jobs.is_empty() {
            self.forward_placed(&plan)
        } else {
            let mut masks = std::mem::take(&mut self.masks);
            let (result, timing) = masks.overlap(&mut jobs, || self.forward_placed(&plan));
            self.masks = masks;
            let s = &mut self.stats;
            s.mask_steps += 1;
            s.masks_computed += jobs.len() as u64;
            s.mask_time += timing.wall;
            s.mask_exposed += timing.exposed;
            s.last_step_mask_time = Some(timing.wall);
            self.return_mask_jobs(jobs);
            result
        };
        let tokens: usize = plan.scheduled.iter().map(|s| s.num_tokens).sum();
        self.time_prefill(&plan, tokens, started.elapsed());
        match result {
            Ok(logits) => {
                self.scheduler.complete(&plan);
                self.stats.computed_tokens += tokens as u64;
                self.sample_and_emit(&plan, &logits);
                // Forward and sampling: what a decode waits for.
                self.step_budget.observe(
                    plan.decode_rows,
                    tokens - plan.decode_rows,
                    started.elapsed(),
                );
            }
            Err(e) => {
                // Validation makes this unreachable in practice; if it
                // happens, fail the step's requests rather than the engine
                // (unless the backend is gone for good).
                self.fail_scheduled(&plan, &e.to_string());
                self.check_backend();
            }
        }
        self.stats.steps += 1;
    }

    /// Folds a step's forward time into the prefill cost per block when
    /// the step was mostly prefill (chunks of more than one token, at least
    /// [`PREFILL_SIZED_STEP`] of them and most of the step's rows: a few
    /// decode rows beside them change little; a big decode batch is not a
    /// prefill).
    fn time_prefill(&mut self, plan: &StepPlan, tokens: usize, took: std::time::Duration) {
        let chunked: usize = plan
            .scheduled
            .iter()
            .map(|s| s.num_tokens)
            .filter(|&n| n > 1)
            .sum();
        if chunked >= PREFILL_SIZED_STEP && 2 * chunked >= tokens {
            let per_block = took.as_secs_f64() * self.scheduler.block_size() as f64 / tokens as f64;
            let s = &mut self.stats;
            s.prefill_seconds_per_block = stats::ewma(s.prefill_seconds_per_block, per_block);
        }
    }

    /// Takes the constraints of the step's sequences that will sample and
    /// still need a mask.
    fn take_mask_jobs(&mut self, plan: &StepPlan) -> Vec<MaskJob> {
        let mut jobs = Vec::new();
        for s in &plan.scheduled {
            let Some(seq) = self.scheduler.seq_mut(s.seq) else {
                continue;
            };
            if !seq.samples_after(s.num_tokens)
                || !seq.constraint.as_ref().is_some_and(|c| c.needs_mask())
            {
                continue;
            }
            if let Some(c) = seq.constraint.take() {
                jobs.push(MaskJob::new(s.seq, c));
            }
        }
        jobs
    }

    /// Puts the constraints back; a failed mask fails its request.
    fn return_mask_jobs(&mut self, jobs: Vec<MaskJob>) {
        let mut failed = Vec::new();
        for job in jobs {
            let Some(seq) = self.scheduler.seq_mut(job.seq) else {
                continue;
            };
            seq.constraint = Some(job.constraint);
            if let Err(e) = job.result {
                failed.push((seq.group, e.to_string()));
            }
        }
        for (group, msg) in failed {
            self.fail_group(
                group,
                RequestFailure::request(format!("response_format: {msg}")),
            );
        }
    }

    /// Fails every request with a sequence in this step.
    fn fail_scheduled(&mut self, plan: &StepPlan, msg: &str) {
        let groups: Vec<u64> = plan
            .scheduled
            .iter()
            .filter_map(|s| self.scheduler.seq(s.seq).map(|q| q.group))
            .collect();
        for g in groups {
            self.fail_group(g, RequestFailure::engine(msg));
        }
    }

    /// After a failed step: if the backend can never run again, fails every
    /// request (their blocks go back) and stops taking new ones.
    fn check_backend(&mut self) {
        let Some(why) = self.backend.failure() else {
            return;
        };
        tracing::error!(reason = %why, "the compute backend failed for good; failing every request");
        let msg = format!("the engine has stopped: {why}");
        let groups: Vec<u64> = self.groups.keys().copied().collect();
        for g in groups {
            self.fail_group(g, RequestFailure::engine(msg.clone()));
        }
        self.failure = Some(why);
    }

    /// Why the engine stopped, once it has (see [`ComputeBackend::failure`]).
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    fn fail_group(&mut self, group_id: u64, failure: RequestFailure) {
        let Some(g) = self.groups.remove(&group_id) else {
            return;
        };
        for &seq in &g.live {
            self.scheduler.remove(seq);
            self.release_draft_state(seq);
        }
        let _ = g.sink.send(RequestEvent::Error(failure));
    }

    /// Updates the gauges (and, after a step, the per-step sums).
    fn refresh_stats(&mut self) {
        self.refresh_gauges();
        let (tokens, slots, seqs) = self.scheduler.kv_usage();
        let s = &mut self.stats;
        s.kv_token_steps += tokens as u64;
        s.kv_slot_steps += slots as u64;
        s.kv_seq_steps += seqs as u64;
    }

    fn refresh_gauges(&mut self) {
        self.publish_kv_events();
        let draft_blocks = self.spec_held_blocks();
        let a = self.scheduler.allocator();
        let s = &mut self.stats;
        s.free_blocks = a.num_free();
        s.cached_blocks = a.num_cached();
        s.prefix = a.prefix_stats();
        s.running = self.scheduler.num_running();
        s.waiting = self.scheduler.num_waiting();
        s.parked = self.scheduler.num_parked();
        s.preemptions = self.scheduler.preemptions();
        s.draft_blocks = draft_blocks;
        s.routed_tokens = self.backend.routed_tokens();
        s.disk = self.disk.as_ref().map(disk::DiskState::stats);
    }
}
