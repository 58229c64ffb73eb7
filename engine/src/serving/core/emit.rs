//! A step's output: sampling, streaming each choice its tokens, and ending
//! choices and requests.

use std::time::Instant;

use crate::generate::FinishReason;
use crate::sampling::{Sampled, Sampler};

use super::super::request::{
    ChoiceSummary, RequestEvent, RequestFailure, RequestSummary, Timings, TokenDelta, Usage,
};
use super::super::scheduler::{SeqId, Sequence, StepPlan};
use super::{child_span, EngineCore};

/// When a choice ends other than at a stop string.
pub(super) struct EndRule<'a> {
    pub stop_token_ids: &'a [u32],
    pub ignore_eos: bool,
    pub eos: &'a [u32],
    pub max_tokens: usize,
    pub max_model_len: usize,
}

impl EndRule<'_> {
    /// Why `seq` ends at its newest token `token`, if it does
    /// (`grammar_done`: its grammar is complete and nothing may follow).
    pub fn ends_at(
        &self,
        seq: &Sequence,
        token: u32,
        grammar_done: bool,
    ) -> Option<(FinishReason, Option<String>)> {
        let produced = seq.tokens.len() - seq.prompt_len;
        // A constrained choice samples end-of-sequence only where its
        // grammar is complete, so it ends there even with `ignore_eos`.
        let constrained = seq.constraint.is_some();
        if self.stop_token_ids.contains(&token) {
            Some((FinishReason::Stop, Some(token.to_string())))
        } else if grammar_done || ((!self.ignore_eos || constrained) && self.eos.contains(&token)) {
            Some((FinishReason::Stop, None))
        } else if produced >= self.max_tokens || seq.tokens.len() >= self.max_model_len {
            Some((FinishReason::Length, None))
        } else {
            None
        }
    }
}

impl EngineCore {
    /// Samples every sequence of the step whose pending tokens are all
    /// computed (beams hand their rows to the search; drafts are verified;
    /// choice 0 of `n > 1` forks the others), and streams the tokens.
    pub(super) fn sample_and_emit(&mut self, plan: &StepPlan, logits: &crate::model::Logits) {
        self.score_prompts(plan, logits);
        let bs = self.scheduler.block_size();
        for (i, s) in plan.scheduled.iter().enumerate() {
            let Some(seq) = self.scheduler.seq(s.seq) else {
                continue;
            };
            if seq.num_computed < seq.tokens.len() {
                continue; // mid-prefill: nothing to sample yet
            }
            if seq.export.is_some() {
                // Prefill-only: its blocks are all sent; nothing to sample.
                let group = seq.group;
                self.finish_seq(s.seq, FinishReason::Length, None);
                self.maybe_close(group);
                continue;
            }
            if !seq.draft.is_empty() {
                self.emit_verified(s.seq, logits.seq(i), logits.vocab());
                continue;
            }
            let group_id = seq.group;
            let row = logits.last(i);
            if self.groups.get(&group_id).is_some_and(|g| g.beam.is_some()) {
                self.beam_row(s.seq, row);
                continue;
            }
            // Parallel sampling: the other choices fork off choice 0 once its
            // prompt is computed, sharing every block.
            let mut choices = vec![s.seq];
            if let Some(g) = self.groups.get_mut(&group_id) {
                if !g.forked {
                    g.forked = true;
                    for index in 1..g.n as u32 {
                        let mut params = g.sampling.clone();
                        params.seed = params.seed.map(|x| x.wrapping_add(u64::from(index)));
                        let Some(parent) = self.scheduler.seq(s.seq) else {
                            break;
                        };
                        let Ok(sampler) = Sampler::new(params, &parent.tokens[..parent.prompt_len])
                        else {
                            break;
                        };
                        let id = self.next_seq;
                        self.next_seq += 1;
                        if self.scheduler.fork(s.seq, id, index, sampler) {
                            g.live.push(id);
                            choices.push(id);
                        }
                    }
                }
            }
            for seq_id in choices {
                let Some(seq) = self.scheduler.seq_mut(seq_id) else {
                    continue;
                };
                let (sampled, grammar_done) = match seq.constraint.as_deref_mut() {
                    None => (seq.sampler.sample(row), false),
                    Some(c) => {
                        // Normally computed during the forward pass; a
                        // sequence that skipped it (a fresh fork) does it now.
                        let step = c.compute_mask().and_then(|_| {
                            let sampled = seq.sampler.sample_masked(row, c.mask());
                            c.commit(sampled.token).map(|k| (sampled, k.stopped))
                        });
                        match step {
                            Ok(v) => v,
                            Err(e) => {
                                let group = seq.group;
                                self.fail_group(
                                    group,
                                    RequestFailure::request(format!("response_format: {e}")),
                                );
                                continue;
                            }
                        }
                    }
                };
                seq.push_token(sampled.token, bs);
                self.emit_token(seq_id, sampled, grammar_done);
            }
        }
    }

    /// Streams one new token of one choice and ends the choice if a stop
    /// condition holds (`grammar_done`: its grammar is complete and nothing
    /// may follow).
    pub(super) fn emit_token(&mut self, seq_id: SeqId, sampled: Sampled, grammar_done: bool) {
        let tokenizer = self.tokenizer.clone();
        let Some(seq) = self.scheduler.seq_mut(seq_id) else {
            return;
        };
        let (group_id, index) = (seq.group, seq.index);
        let Some(g) = self.groups.get_mut(&group_id) else {
            return;
        };
        let now = Instant::now();
        if g.first_token.is_none() {
            g.first_token = Some(now);
            let span = &g.span;
            g.phase = child_span(span, || tracing::info_span!(parent: span, "decode"));
        }
        if index == 0 {
            g.last_token = Some(now);
            g.tokens_of_first += 1;
        }
        let token = sampled.token;
        let mut text = String::new();
        let mut finish = None;
        if let (Some(out), Some(tok)) = (seq.text.as_mut(), tokenizer.as_deref()) {
            match out.push(tok, token) {
                Ok(u) => {
                    text = u.delta;
                    if let Some(stop) = u.matched_stop {
                        finish = Some((FinishReason::Stop, Some(stop)));
                    }
                }
                Err(e) => {
                    self.fail_group(group_id, RequestFailure::request(e.to_string()));
                    return;
                }
            }
        }
        if finish.is_none() {
            let rule = EndRule {
                stop_token_ids: &g.stop_token_ids,
                ignore_eos: g.ignore_eos,
                eos: &self.eos,
                max_tokens: g.max_tokens,
                max_model_len: self.limits.max_model_len,
            };
            finish = rule.ends_at(seq, token, grammar_done);
            if finish.is_some() {
                if let Some(out) = seq.text.as_mut() {
                    text.push_str(&out.flush());
                }
            }
        }
        let delta = TokenDelta {
            index,
            token_ids: vec![token],
            text,
            logprobs: sampled.logprob.into_iter().collect(),
            finish_reason: None,
        };
        match finish {
            Some((reason, stop)) => {
                // The finishing delta carries the reason.
                self.finish_seq(seq_id, reason, stop);
                if let Some(g) = self.groups.get(&group_id) {
                    let _ = g.sink.send(RequestEvent::Delta(TokenDelta {
                        finish_reason: Some(reason),
                        ..delta
                    }));
                }
                self.maybe_close(group_id);
            }
            None => {
                if g.sink.send(RequestEvent::Delta(delta)).is_err() {
                    // The client went away: stop spending compute on it.
                    self.abort(group_id);
                }
            }
        }
    }

    /// Ends one choice: frees its blocks and records its summary. An
    /// aborted choice gets its finishing delta here (others carry the reason
    /// on their last token's delta).
    pub(super) fn finish_seq(
        &mut self,
        seq_id: SeqId,
        reason: FinishReason,
        matched_stop: Option<String>,
    ) {
        // An aborted remote prefill frees its blocks at once: a late write
        // names a transfer that no longer exists and is refused.
        let Some(seq) = self.scheduler.remove(seq_id) else {
            return;
        };
        self.release_draft_state(seq_id);
        let Some(g) = self.groups.get_mut(&seq.group) else {
            return;
        };
        g.live.retain(|&s| s != seq_id);
        if seq.export.is_some() {
            return; // a prefill-only request has no choices
        }
        g.choices.push(ChoiceSummary {
            index: seq.index,
            finish_reason: reason,
            matched_stop,
            completion_tokens: seq.output().len(),
        });
        if reason == FinishReason::Abort {
            let _ = g.sink.send(RequestEvent::Delta(TokenDelta {
                index: seq.index,
                token_ids: Vec::new(),
                text: String::new(),
                logprobs: Vec::new(),
                finish_reason: Some(reason),
            }));
        }
    }

    /// Sends the summary once every choice is done.
    pub(super) fn maybe_close(&mut self, group_id: u64) {
        let done = self
            .groups
            .get(&group_id)
            .is_some_and(|g| g.live.is_empty() && g.forked);
        if !done {
            return;
        }
        let Some(mut g) = self.groups.remove(&group_id) else {
            return;
        };
        g.choices.sort_by_key(|c| c.index);
        let span = g.span.clone();
        let end = Instant::now();
        let tpot = match (g.first_token, g.last_token) {
            (Some(a), Some(b)) if g.tokens_of_first > 1 => {
                Some((b - a) / (g.tokens_of_first as u32 - 1))
            }
            _ => None,
        };
        let summary = RequestSummary {
            usage: Usage {
                prompt_tokens: g.prompt_len,
                cached_tokens: g.cached_tokens,
                completion_tokens: g.choices.iter().map(|c| c.completion_tokens).sum(),
            },
            choices: g.choices,
            speculation: g.speculation,
            timings: Timings {
                queue: g.first_scheduled.map_or(end - g.arrival, |t| t - g.arrival),
                ttft: g.first_token.map(|t| t - g.arrival),
                tpot,
                e2e: end - g.arrival,
            },
        };
        tracing::debug!(
            parent: &span,
            request_id = %g.request_id,
            prompt_tokens = summary.usage.prompt_tokens,
            cached_tokens = summary.usage.cached_tokens,
            completion_tokens = summary.usage.completion_tokens,
            "request finished"
        );
        let _ = g.sink.send(RequestEvent::Finished(summary));
    }
}
