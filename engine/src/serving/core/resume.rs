//! A resumed request's choices, each replayed to where it stood on the
//! worker it began on (see [`crate::serving::Resume`]), and the hand-over
//! that ends a draining worker's requests so they can be resumed elsewhere.

use crate::error::EngineError;
use crate::generate::FinishReason;
use crate::sampling::Sampler;

use super::super::output::TextOutput;
use super::super::request::{ChoiceSummary, RequestEvent, RequestFailure, ValidRequest};
use super::super::resume::ReplayError;
use super::super::scheduler::Sequence;
use super::super::Resume;
use super::emit::EndRule;
use super::EngineCore;

/// A choice after its replay.
pub(super) enum Replayed {
    /// It goes on: its tokens are to be computed (like a preempted
    /// sequence's) before it samples again.
    Live(Box<Sequence>),
    /// Its last replayed token ended it.
    Ended(ChoiceSummary),
}

impl EngineCore {
    /// Choice `index` of request `group`, with `tokens` replayed into its
    /// sampler, text, stop strings and grammar. A token the grammar refuses,
    /// or an end before the last token, is an error naming the choice.
    pub(super) fn replay_choice(
        &self,
        group: u64,
        req: &ValidRequest,
        index: u32,
        tokens: &[u32],
    ) -> Result<Replayed, ReplayError> {
        let mut params = req.sampling.clone();
        // Choice `i` of `n` samples with seed + i, as when it forks.
        params.seed = params.seed.map(|x| x.wrapping_add(u64::from(index)));
        let mut sampler = Sampler::new(params, &req.prompt_ids).map_err(ReplayError::Sampler)?;
        sampler.replay(tokens);
        let tokenizer = self.tokenizer.as_deref();
        let mut text = tokenizer.map(|_| TextOutput::new(&req.prompt_ids, &req.stop));
        let mut seq = Sequence::new(group, index, req.prompt_ids.clone(), sampler, None);
        seq.constraint = req.grammar.as_ref().map(|g| Box::new(g.start()));
        let rule = EndRule {
            stop_token_ids: &req.stop_token_ids,
            ignore_eos: req.ignore_eos,
            eos: &self.eos,
            max_tokens: req.max_tokens,
            max_model_len: self.limits.max_model_len,
        };
        let at = |at: usize| {
            move |e: EngineError| ReplayError::Token {
                index,
                at,
                source: Box::new(e),
            }
        };
        for (k, &token) in tokens.iter().enumerate() {
            let grammar_done = match seq.constraint.as_deref_mut() {
                Some(c) => {
                    c.commit(token)
                        .map_err(|e| ReplayError::Token {
                            index,
                            at: k,
                            source: Box::new(e),
                        })?
                        .stopped
                }
                None => false,
            };
            seq.tokens.push(token);
            let mut end = None;
            if let (Some(out), Some(tok)) = (text.as_mut(), tokenizer) {
                let update = out.push(tok, token).map_err(at(k))?;
                end = update
                    .matched_stop
                    .map(|stop| (FinishReason::Stop, Some(stop)));
            }
            let Some((reason, matched_stop)) =
                end.or_else(|| rule.ends_at(&seq, token, grammar_done))
            else {
                continue;
            };
            if k + 1 < tokens.len() {
                return Err(ReplayError::EndedEarly { index, at: k });
            }
            return Ok(Replayed::Ended(ChoiceSummary {
                index,
                finish_reason: reason,
                matched_stop,
                completion_tokens: tokens.len(),
            }));
        }
        seq.text = text;
        Ok(Replayed::Live(Box::new(seq)))
    }

    /// A fresh request's choice 0 (the others fork off it once its prompt
    /// is computed), or every choice of a resumed one, replayed: those
    /// still going, and the summaries of those their replay ended.
    pub(super) fn first_choices(
        &self,
        id: u64,
        req: &ValidRequest,
        resume: Option<&Resume>,
    ) -> std::result::Result<(Vec<Sequence>, Vec<ChoiceSummary>), ReplayError> {
        let Some(resume) = resume else {
            let sampler = Sampler::new(req.sampling.clone(), &req.prompt_ids)
                .map_err(ReplayError::Sampler)?;
            // Beams are decoded when the search ends.
            let text = self
                .tokenizer
                .as_ref()
                .filter(|_| req.beam.is_none())
                .map(|_| TextOutput::new(&req.prompt_ids, &req.stop));
            let mut seq = Sequence::new(id, 0, req.prompt_ids.clone(), sampler, text);
            seq.constraint = req.grammar.as_ref().map(|g| Box::new(g.start()));
            return Ok((vec![seq], Vec::new()));
        };
        let (mut live, mut ended) = (Vec::new(), Vec::new());
        for index in 0..req.n as u32 {
            match self.replay_choice(id, req, index, resume.tokens_of(index))? {
                Replayed::Live(seq) => live.push(*seq),
                Replayed::Ended(summary) => ended.push(summary),
            }
        }
        Ok((live, ended))
    }

    /// Ends every request but prefill-only exports with a handed-over
    /// failure and frees its sequences without streaming anything more;
    /// their computed full blocks stay in the prefix cache (see
    /// [`super::EngineHandle::hand_over`]).
    pub fn hand_over(&mut self) {
        let ids: Vec<u64> = self
            .groups
            .iter()
            .filter(|(_, g)| {
                g.live
                    .iter()
                    .all(|&s| self.scheduler.seq(s).is_none_or(|q| q.export.is_none()))
            })
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            let Some(g) = self.groups.remove(&id) else {
                continue;
            };
            let _ = g.sink.send(RequestEvent::Error(RequestFailure::handed_over(
                "this decode worker is draining; the request goes on elsewhere",
            )));
            // The group is gone: freeing its choices streams nothing.
            for seq in g.live {
                self.finish_seq(seq, FinishReason::Abort, None);
            }
        }
        self.refresh_gauges();
    }
}
