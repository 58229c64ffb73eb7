//! Prompt scoring (`prompt_logprobs`): the logprob of every prompt token
//! after the first, with top alternatives.
//!
//! A scoring sequence skips the prefix cache at admission (a cached
//! position has no logits) and asks the forward pass for every row of its
//! prompt chunks; row `p` scores target `p + 1`, the targets being the
//! prompt plus, for a prefill worker's export, the prompt's last token
//! (which only the decode side computes). Rows are folded in position
//! order, so a recompute after preemption adds nothing twice. The scores
//! are sent as one [`RequestEvent::PromptLogprobs`] as soon as the prompt
//! is complete, before the first token is sampled.
//!
//! Remotely prefilled, the prefill worker scores the prompt and the decode
//! worker hands the scores over with [`EngineCore::remote_prompt_logprobs`];
//! the sequence stays parked until both they and its blocks have arrived,
//! so the scores still come before the first token. If they never come
//! (the transfer fails), the prompt is computed and scored here.

use crate::model::Logits;
use crate::sampling::{score_token, TokenLogprob};

use super::super::request::{PromptLogprobs, RequestEvent};
use super::super::scheduler::StepPlan;
use super::EngineCore;

/// One request's prompt scores as they accumulate.
#[derive(Debug)]
pub(super) struct PromptScore {
    top: usize,
    /// Row `p` scores `targets[p + 1]`.
    targets: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    sent: bool,
    /// A remote prefill's blocks all arrived; its scores had not yet.
    pub(super) transfer_done: bool,
}

impl PromptScore {
    pub(super) fn new(asked: PromptLogprobs, prompt: &[u32]) -> Self {
        let mut targets = prompt.to_vec();
        targets.extend(asked.next_token);
        Self {
            top: asked.top,
            targets,
            logprobs: Vec::new(),
            sent: false,
            transfer_done: false,
        }
    }

    /// Top alternatives per score.
    pub(super) fn top(&self) -> usize {
        self.top
    }

    /// Scores owed: one per target after the first.
    fn owed(&self) -> usize {
        self.targets.len().saturating_sub(1)
    }

    /// Whether the scores are still to be sent.
    pub(super) fn pending(&self) -> bool {
        !self.sent
    }

    /// Folds in the logits rows of positions `start ..` (`vocab` floats
    /// each).
    fn add_rows(&mut self, start: usize, rows: &[f32], vocab: usize) {
        for (j, row) in rows.chunks_exact(vocab).enumerate() {
            let position = start + j;
            if position != self.logprobs.len() || position >= self.owed() {
                continue; // already scored (a recompute), or past the targets
            }
            self.logprobs
                .push(score_token(row, self.targets[position + 1], self.top));
        }
    }
}

impl EngineCore {
    /// After a forward pass: folds in the prompt rows of scoring sequences
    /// and sends each request's scores once its prompt is complete.
    pub(super) fn score_prompts(&mut self, plan: &StepPlan, logits: &Logits) {
        for (i, s) in plan.scheduled.iter().enumerate() {
            let Some(seq) = self.scheduler.seq(s.seq) else {
                continue;
            };
            if !seq.scores_prompt {
                continue;
            }
            // `complete` already counted this chunk.
            let start = seq.num_computed - s.num_tokens;
            let done = seq.num_computed >= seq.prompt_len;
            let group = seq.group;
            let Some(score) = self.groups.get_mut(&group).and_then(|g| g.score.as_mut()) else {
                continue;
            };
            if start < seq.prompt_len {
                score.add_rows(start, logits.seq(i), logits.vocab());
            }
            if done {
                self.send_scores(group);
            }
        }
    }

    /// Sends a request's scores (once).
    fn send_scores(&mut self, group: u64) {
        let Some(g) = self.groups.get_mut(&group) else {
            return;
        };
        let Some(score) = g.score.as_mut().filter(|s| !s.sent) else {
            return;
        };
        score.sent = true;
        let event = RequestEvent::PromptLogprobs(score.logprobs.clone());
        if g.sink.send(event).is_err() {
            self.abort(group);
        }
    }

    /// A prefill worker's scores for the prompt of parked transfer
    /// `transfer`. Scores of the wrong length are ignored, and the prompt
    /// is then computed and scored here.
    pub fn remote_prompt_logprobs(&mut self, transfer: u64, logprobs: Vec<TokenLogprob>) {
        let Some(group) = self.scheduler.seq(transfer).map(|s| s.group) else {
            return;
        };
        let Some(score) = self.groups.get_mut(&group).and_then(|g| g.score.as_mut()) else {
            return;
        };
        if score.sent || logprobs.len() != score.owed() {
            tracing::warn!(
                transfer,
                got = logprobs.len(),
                want = score.owed(),
                "prompt scores from the prefill worker refused; scoring here"
            );
            if self.scheduler.is_parked(transfer) {
                self.scheduler.unpark(transfer, false);
            }
            return;
        }
        score.logprobs = logprobs;
        let transfer_done = score.transfer_done;
        self.send_scores(group);
        if transfer_done && self.scheduler.is_parked(transfer) {
            self.scheduler.unpark(transfer, true);
            self.refresh_gauges();
        }
    }
}
