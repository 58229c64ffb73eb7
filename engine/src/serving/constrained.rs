//! Constrained decoding inside the engine: compiling formats at admission,
//! and computing each step's token masks while the forward pass runs.
//!
//! * [`Grammars`] belongs to an engine with a tokenizer and is shared with
//!   its handle, so `submit` compiles (and caches) a request's format on the
//!   caller's thread; an invalid format never reaches the engine thread. The
//!   grammar compiler itself (token trie and llguidance's parser factory) is
//!   built on the first constrained request, so engines that never see one
//!   pay nothing.
//! * Each constrained sequence owns a [`Constraint`]. The mask for its next
//!   token depends only on the tokens already committed, so at the start of
//!   step t every sequence that will sample in step t can have its mask
//!   computed *during* step t's forward pass: [`MaskWorkers::overlap`] takes
//!   those constraints out of their sequences, spawns the mask jobs into
//!   rayon's global pool, runs the forward pass on the engine thread, and
//!   puts them back before sampling. What the step waited for after the forward
//!   pass is recorded as exposed mask time.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use tandem_structured::{
    CompiledGrammar, Constraint, GrammarCompiler, ResponseFormat, StructuredError, Vocabulary,
    DEFAULT_CACHE_CAPACITY,
};

use crate::error::{EngineError, Result};
use crate::tokenizer::Tokenizer;

use super::scheduler::SeqId;

/// Format compilation for one engine's vocabulary.
#[derive(Debug)]
pub(crate) struct Grammars {
    tokenizer: Arc<Tokenizer>,
    logits: usize,
    eos: Vec<u32>,
    compiler: OnceLock<std::result::Result<GrammarCompiler, StructuredError>>,
}

impl Grammars {
    pub fn new(tokenizer: Arc<Tokenizer>, logits: usize, eos: Vec<u32>) -> Self {
        Self {
            tokenizer,
            logits,
            eos,
            compiler: OnceLock::new(),
        }
    }

    /// Compiles `format` (or finds it in the cache). Errors are
    /// `InvalidRequest`s naming `response_format.<kind>` with the grammar
    /// engine's message.
    pub fn compile(&self, format: &ResponseFormat) -> Result<Arc<CompiledGrammar>> {
        let compiler = self
            .compiler
            .get_or_init(|| {
                let vocab =
                    Vocabulary::from_tokenizer(self.tokenizer.hf(), self.logits, &self.eos)?;
                GrammarCompiler::new(&vocab, DEFAULT_CACHE_CAPACITY)
            })
            .as_ref()
            .map_err(|e| EngineError::InvalidRequest(format!("response_format: {e}")))?;
        compiler.compile(format).map_err(|e| {
            EngineError::InvalidRequest(match e {
                StructuredError::InvalidFormat { .. } => format!("response_format.{e}"),
                other => format!("response_format.{}: {other}", format.kind()),
            })
        })
    }
}

/// One sequence's mask to compute this step.
#[derive(Debug)]
pub(crate) struct MaskJob {
    pub seq: SeqId,
    pub constraint: Box<Constraint>,
    pub result: std::result::Result<Duration, StructuredError>,
}

impl MaskJob {
    pub fn new(seq: SeqId, constraint: Box<Constraint>) -> Self {
        Self {
            seq,
            constraint,
            result: Ok(Duration::ZERO),
        }
    }
}

/// Timings of one step's masks.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct MaskTiming {
    /// From the first mask's start to the last one's end.
    pub wall: Duration,
    /// How long the engine thread waited for them after its forward pass.
    pub exposed: Duration,
}

/// Where masks are computed.
#[derive(Debug, Default)]
pub(crate) struct MaskWorkers {
    /// Compute masks on the engine thread before the forward pass instead
    /// of beside it (for measuring what the overlap saves).
    pub inline: bool,
}

fn compute(jobs: &mut [MaskJob]) {
    jobs.par_iter_mut()
        .for_each(|j| j.result = j.constraint.compute_mask());
}

fn compute_sequential(jobs: &mut [MaskJob]) {
    for j in jobs {
        j.result = j.constraint.compute_mask();
    }
}

impl MaskWorkers {
    /// Computes `jobs`' masks while `forward` runs; returns its result.
    ///
    /// The forward pass runs here, on the engine thread, exactly as without
    /// constraints (its layer hooks too); the mask jobs are spawned into
    /// rayon's global pool, whose workers the forward pass's parallel loops
    /// also use, so masks take a core when the forward pass leaves one free
    /// and nothing is oversubscribed. (A separate mask pool would add
    /// threads that the forward pass's fork-join loops compete with on a
    /// CPU-only machine, where one descheduled worker stalls the step.)
    pub fn overlap<R>(
        &mut self,
        jobs: &mut [MaskJob],
        forward: impl FnOnce() -> R,
    ) -> (R, MaskTiming) {
        if self.inline {
            let t0 = Instant::now();
            compute_sequential(jobs);
            let wall = t0.elapsed();
            let timing = MaskTiming {
                wall,
                exposed: wall,
            };
            return (forward(), timing);
        }
        let mut wall = Duration::ZERO;
        let mut masks_end = None;
        let (out, forward_end) = {
            let (wall, masks_end) = (&mut wall, &mut masks_end);
            rayon::in_place_scope(move |s| {
                s.spawn(move |_| {
                    let t0 = Instant::now();
                    compute(jobs);
                    let end = Instant::now();
                    *wall = end - t0;
                    *masks_end = Some(end);
                });
                let out = forward();
                (out, Instant::now())
            })
        };
        let masks_end = masks_end.unwrap_or(forward_end);
        let exposed = masks_end.saturating_duration_since(forward_end);
        (out, MaskTiming { wall, exposed })
    }
}
