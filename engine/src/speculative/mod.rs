//! Speculative decoding: drafters, lossless verification, adaptive draft
//! length.
//!
//! Decode is memory-bound: a step reads every weight to compute one token
//! per sequence, and computing a few more rows costs little more (the CPU
//! row kernel streams each weight row once for all rows of a step). So a
//! cheap [`Drafter`] guesses the next `k` tokens, and the target model scores
//! all of them in one forward pass: the drafted tokens are just more tokens
//! of the sequence in the flattened batch, with logits for every row.
//! [`verify`] then keeps the longest prefix the target agrees with and always
//! adds one token of its own (the correction, or a bonus token when every
//! draft was accepted), so a step emits between 1 and `k + 1` tokens.
//!
//! Verification is lossless: greedy requests accept a draft only where it
//! is the target's argmax, so they get exactly the tokens of plain greedy
//! decoding; sampled requests use rejection sampling (Leviathan et al. 2023,
//! Chen et al. 2023) against the same processed distribution a plain draw
//! follows ([`crate::Sampler::distribution`]), so the output distribution is
//! the target's whatever the drafter proposes.
//!
//! Two drafters sit behind the trait: [`NgramDrafter`] (prompt lookup: no
//! second model) and [`DraftModelDrafter`] (a small model sharing the
//! vocabulary, with its own paged KV cache rolled back on rejection).
//! Medusa/EAGLE-style heads would be a third: they need the target's last
//! hidden state, which a drafter could be handed in the same `propose` call.
//!
//! [`AdaptiveK`] picks each request's draft length from its running
//! acceptance rate, and the engine stops speculating when the batch's rows
//! would push the step past the memory-bound regime
//! ([`SpeculativeConfig::max_batch_rows`]).
//!
//! **Architecture Invariant:** drafters only propose; they never touch the
//! target's KV cache or the scheduler. The engine owns acceptance, block
//! rollback and emission; a drafter learns what was kept through
//! [`Drafter::rollback`].

mod adaptive;
mod draft_model;
mod ngram;
mod verify;

pub use adaptive::AdaptiveK;
pub use draft_model::DraftModelDrafter;
pub use ngram::NgramDrafter;
pub use verify::{verify, Residual, Verified};

use crate::error::{EngineError, Result};
use crate::sampling::Sampler;

/// Speculation settings of an engine.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeculativeConfig {
    /// Most tokens drafted per sequence per step (`k`).
    pub num_speculative_tokens: usize,
    /// Pick each request's `k` from its acceptance rate (else always the
    /// maximum).
    pub adaptive: bool,
    /// Speculate only while the step's decode rows, drafts included, stay
    /// at or below this: past it the step is no longer memory-bound and
    /// extra rows cost about as much as they save. Each sequence's `k` is
    /// cut so the batch fits, down to no speculation. Defaults to the CPU
    /// row kernel's limit ([`crate::kernels::GEMV_MAX_ROWS`]).
    pub max_batch_rows: usize,
    /// Marginal cost of verifying one more row, as a fraction of a decode
    /// step (adaptive `k` weighs it against the expected gain).
    pub verify_row_cost: f64,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            num_speculative_tokens: 4,
            adaptive: true,
            max_batch_rows: crate::kernels::GEMV_MAX_ROWS,
            verify_row_cost: 0.03,
        }
    }
}

impl SpeculativeConfig {
    /// Rejects settings that cannot work.
    pub fn validate(&self) -> Result<()> {
        if self.num_speculative_tokens == 0 || self.num_speculative_tokens > 16 {
            return Err(EngineError::InvalidRequest(format!(
                "num_speculative_tokens must be in 1..=16, got {}",
                self.num_speculative_tokens
            )));
        }
        if !(self.verify_row_cost >= 0.0 && self.verify_row_cost.is_finite()) {
            return Err(EngineError::InvalidRequest(
                "verify_row_cost must be a finite non-negative number".into(),
            ));
        }
        Ok(())
    }
}

/// Drafted tokens of one sequence and, for a stochastic drafter, the
/// distribution each was drawn from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    /// One dense distribution per token, or empty when the drafter is
    /// deterministic (each draft then had probability one).
    pub probs: Vec<Vec<f32>>,
}

impl Draft {
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Keeps the first `n` drafts.
    pub fn truncate(&mut self, n: usize) {
        self.tokens.truncate(n);
        self.probs.truncate(n);
    }

    pub fn clear(&mut self) {
        self.truncate(0);
    }
}

/// One sequence's draft request.
#[derive(Debug)]
pub struct DraftRequest<'a> {
    /// The engine's id of the sequence (stable while it runs).
    pub seq: u64,
    /// Prompt and output so far; the last token is the one the target runs
    /// next.
    pub tokens: &'a [u32],
    /// Most tokens to draft.
    pub k: usize,
    /// The request's sampler: its settings shape a draft model's
    /// distribution, and its random stream draws from it.
    pub sampler: &'a mut Sampler,
    /// Filled by the drafter (at most `k` tokens; none is fine).
    pub draft: Draft,
}

/// Proposes tokens for the target to verify.
pub trait Drafter: Send + std::fmt::Debug {
    /// A short name for logs and stats (`ngram`, `draft-model`).
    fn name(&self) -> &'static str;

    /// Drafts for every request, in one go so a model-based drafter can
    /// batch them.
    fn propose(&mut self, requests: &mut [DraftRequest<'_>]) -> Result<()>;

    /// The sequence's tokens after verification (what was kept, plus the
    /// target's own token): state past their common prefix is stale.
    fn rollback(&mut self, seq: u64, tokens: &[u32]);

    /// The sequence is gone (finished, aborted, preempted): drop its state.
    fn release(&mut self, seq: u64);

    /// Cost of drafting one token as a fraction of a target decode step.
    fn cost_per_token(&self) -> f64;

    /// KV blocks the drafter holds in its own pool (0 for drafters without
    /// one); an idle engine's drafter must hold none.
    fn held_blocks(&self) -> usize {
        0
    }
}

/// Speculation counters (per request, and summed per engine).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecCounts {
    /// Drafted tokens sent for verification.
    pub drafted: u64,
    /// Of those, accepted.
    pub accepted: u64,
    /// Verification steps (a sequence's drafts scored in one forward pass).
    pub verifications: u64,
}

impl SpecCounts {
    /// Accepted per drafted token.
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Drafts accepted per verification step.
    pub fn mean_accepted_len(&self) -> f64 {
        if self.verifications == 0 {
            0.0
        } else {
            self.accepted as f64 / self.verifications as f64
        }
    }

    pub fn add(&mut self, drafted: usize, accepted: usize) {
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        self.verifications += 1;
    }
}
