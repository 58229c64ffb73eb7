//! What a client asks for, how it is checked, and what it gets back.
//!
//! Validation happens on the caller's thread, before a request reaches the
//! engine loop, so a bad request costs the loop nothing and its error names
//! the offending field (the gRPC layer turns it into `INVALID_ARGUMENT`).

use std::sync::Arc;
use std::time::Duration;

use crate::error::{EngineError, Result};
use crate::generate::FinishReason;
use crate::lora::{LoraAdapter, LoraRegistry};
use crate::sampling::{SamplingParams, TokenLogprob};
use crate::tokenizer::Tokenizer;

use super::constrained::Grammars;
use super::resume::{Resume, ResumeBounds};
use super::stop::{StopStrings, MAX_STOP_TOKEN_IDS};
use tandem_structured::{CompiledGrammar, ResponseFormat};

/// Most alternatives a request may ask logprobs for (vLLM's default cap).
pub const MAX_LOGPROBS: usize = 20;

/// The prompt, as text or as token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Tokenized by the server, with the tokenizer's special tokens.
    Text(String),
    /// Used as given.
    Tokens(Vec<u32>),
}

/// Receives a prefill's K/V layer by layer, as soon as each layer is
/// computed (the prefill worker forwards it to the decode worker). Called on
/// the engine thread: implementations copy what they need and return fast.
pub trait KvExport: Send + Sync + std::fmt::Debug {
    /// Layer `layer` of these blocks is final.
    fn layer_ready(&self, layer: usize, blocks: &[ExportedBlock<'_>]);
}

/// One block of one layer, by its logical index in the sequence.
#[derive(Debug, Clone, Copy)]
pub struct ExportedBlock<'a> {
    /// Block `i` holds positions `i * block_size ..`.
    pub logical: usize,
    /// `[kv_head][slot][head_dim]`.
    pub k: &'a [f32],
    pub v: &'a [f32],
}

/// One exported block-layer, owned: (layer, logical block, K, V).
pub type OwnedBlock = (usize, usize, Vec<f32>, Vec<f32>);

/// A [`KvExport`] that keeps every block in memory, in order: a prefill
/// handed over in process, where no transport is wanted (tests, the GPU
/// engine's parity checks).
#[derive(Debug, Default)]
pub struct CollectedExport(std::sync::Mutex<Vec<OwnedBlock>>);

impl CollectedExport {
    /// The blocks exported so far, leaving none.
    pub fn take(&self) -> Vec<OwnedBlock> {
        std::mem::take(
            &mut *self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

impl KvExport for CollectedExport {
    fn layer_ready(&self, layer: usize, blocks: &[ExportedBlock<'_>]) {
        let mut all = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for b in blocks {
            all.push((layer, b.logical, b.k.to_vec(), b.v.to_vec()));
        }
    }
}

/// Where a request's prompt K/V is computed.
#[derive(Debug, Clone, Default)]
pub enum PrefillMode {
    /// Here: the colocated default.
    #[default]
    Local,
    /// By another worker, as placed, when at least `min_uncached` prompt
    /// tokens are not in this engine's prefix cache (shorter ones run
    /// here). The engine allocates the blocks, hands a [`RemotePrefill`] to
    /// the handle's [`RemotePrefiller`](super::RemotePrefiller) (or emits it
    /// as [`RequestEvent::RemotePrefill`] from an [`EngineCore`](super::EngineCore)
    /// driven directly), accepts the blocks through `write_kv` and resumes
    /// the request at `finish_remote_prefill`; it computes the last prompt
    /// token itself, so sampling stays here. A failed transfer falls back
    /// to local prefill.
    Remote(PrefillPlacement),
    /// Compute the prompt's K/V, hand every block from logical index
    /// `from_block` on to `sink` layer by layer, and stop: nothing is
    /// sampled, and the stream ends with a `Finished` without choices.
    Export {
        sink: Arc<dyn KvExport>,
        from_block: usize,
    },
}

/// A generation request as a client states it.
#[derive(Debug, Clone)]
pub struct Request {
    /// The client's name for it, echoed back; need not be unique.
    pub request_id: String,
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    /// Most new tokens per choice; `None` means up to `max_model_len`.
    pub max_tokens: Option<usize>,
    /// Independent choices sampled from one prompt (sharing its blocks).
    pub n: usize,
    /// Strings that end a choice; they are cut from its text.
    pub stop: Vec<String>,
    /// Tokens that end a choice (they are kept in its output).
    pub stop_token_ids: Vec<u32>,
    /// Keep going past the model's end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Where the prompt is computed.
    pub prefill: PrefillMode,
    /// Constrains the output to a JSON schema, regex, choice or grammar
    /// (compiled at validation; see [`tandem_structured`]).
    pub response_format: Option<ResponseFormat>,
    /// Score the prompt: the logprob of each prompt token after the first
    /// (see [`PromptLogprobs`]), sent as [`RequestEvent::PromptLogprobs`]
    /// before the first token.
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// Beam search instead of sampling: the `n` best of `width` beams come
    /// back, each as one delta when the search ends (see [`BeamSearch`]).
    pub beam: Option<BeamSearch>,
    /// The LoRA adapter to run under, by name (`None`: the base model).
    pub lora: Option<String>,
    /// A request begun on another worker: each choice's tokens so far,
    /// replayed before sampling goes on (see [`Resume`]).
    pub resume: Option<Resume>,
    /// The caller's span for this request: the engine's spans for its
    /// phases (`queue`, `prefill` with one `prefill_chunk` per step,
    /// `decode`) are its children. `Span::none()` (the default) records
    /// none.
    pub span: tracing::Span,
}

impl Request {
    /// A greedy request for `max_tokens` tokens of `prompt`.
    pub fn new(prompt: Prompt, max_tokens: usize) -> Self {
        Self {
            request_id: String::new(),
            prompt,
            sampling: SamplingParams::default(),
            max_tokens: Some(max_tokens),
            n: 1,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            prefill: PrefillMode::Local,
            response_format: None,
            prompt_logprobs: None,
            beam: None,
            lora: None,
            resume: None,
            span: tracing::Span::none(),
        }
    }
}

/// Beam search, as transformers' `generate(num_beams=width,
/// do_sample=False)` does it: every step keeps the `width` best
/// continuations by summed raw logprob; a continuation ending in a stop
/// token (end-of-sequence or `stop_token_ids`) joins the finished
/// hypotheses, scored `sum / generated_len ^ length_penalty`. The beams
/// share their common prefix's KV blocks (copy-on-write).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BeamSearch {
    /// Beams kept per step (vLLM's `best_of` / `beam_width`); at least `n`.
    pub width: usize,
    /// Exponent of the generated length that divides a finished
    /// hypothesis' summed logprob (> 0 favours longer ones).
    pub length_penalty: f32,
    pub early_stopping: EarlyStopping,
}

impl BeamSearch {
    /// `width` beams, transformers' defaults otherwise.
    pub fn new(width: usize) -> Self {
        Self {
            width,
            length_penalty: 1.0,
            early_stopping: EarlyStopping::Heuristic,
        }
    }
}

/// When beam search stops before `max_tokens` (transformers'
/// `early_stopping`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EarlyStopping {
    /// `False`: when the best running beam, scored at its current length,
    /// can no longer beat the worst of `width` finished hypotheses.
    #[default]
    Heuristic,
    /// `True`: as soon as `width` hypotheses have finished.
    WhenFull,
    /// `"never"`: only when no running beam could beat them at any length
    /// up to `max_tokens` (canonical beam search).
    Never,
}

/// What prompt scoring asks for. The prompt is then computed whole, never
/// from the prefix cache (cached positions have no logits), with logits
/// for every position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLogprobs {
    /// Top alternatives per prompt token (at most [`MAX_LOGPROBS`]).
    pub top: usize,
    /// The token that follows the prompt, scored by its last position: a
    /// prefill worker's prompt lacks the last token, which the decode side
    /// computes, but its logprob comes from the prefill worker's last row.
    pub next_token: Option<u32>,
}

impl PromptLogprobs {
    /// Scores of a whole prompt with `top` alternatives each.
    pub fn top(top: usize) -> Self {
        Self {
            top,
            next_token: None,
        }
    }
}

/// What the engine can accept, for validation.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub vocab_size: usize,
    pub max_model_len: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_num_seqs: usize,
    /// How many of those blocks a sequence takes (layer groups, windows).
    pub footprint: crate::kv_cache::KvFootprint,
    /// Longest prompt chunk one step runs.
    pub max_prefill_chunk: usize,
}

/// A request that passed validation, tokenized.
#[derive(Debug, Clone)]
pub(crate) struct ValidRequest {
    pub request_id: String,
    pub prompt_ids: Vec<u32>,
    pub sampling: SamplingParams,
    /// Effective: never past `max_model_len`.
    pub max_tokens: usize,
    pub n: usize,
    /// Compiled here, on the caller's thread.
    pub stop: Arc<StopStrings>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub prefill: PrefillMode,
    /// The compiled `response_format`.
    pub grammar: Option<Arc<CompiledGrammar>>,
    pub prompt_logprobs: Option<PromptLogprobs>,
    pub beam: Option<BeamSearch>,
    pub lora: Option<Arc<LoraAdapter>>,
    pub resume: Option<Resume>,
    pub span: tracing::Span,
}

fn invalid(msg: String) -> EngineError {
    EngineError::InvalidRequest(msg)
}

/// Checks and tokenizes a request and compiles its response format; every
/// error names the field at fault.
pub(crate) fn validate(
    req: Request,
    tokenizer: Option<&Tokenizer>,
    grammars: Option<&Grammars>,
    adapters: Option<&LoraRegistry>,
    limits: &Limits,
) -> Result<ValidRequest> {
    check_choices(&req, limits)?;
    if !req.stop.is_empty() && tokenizer.is_none() {
        return Err(invalid(
            "stop: stop strings need a tokenizer and the model has none".into(),
        ));
    }
    let stop = StopStrings::new(req.stop)?;
    let prompt_ids = prompt_ids(req.prompt, tokenizer, limits)?;
    if let Some(&bad) = req
        .stop_token_ids
        .iter()
        .find(|&&t| t as usize >= limits.vocab_size)
    {
        return Err(invalid(format!(
            "stop_token_ids: token id {bad} is outside the vocabulary (size {})",
            limits.vocab_size
        )));
    }
    let max_tokens = token_budget(prompt_ids.len(), req.max_tokens, limits)?;
    if let Some(r) = &req.resume {
        let refused_by = if req.beam.is_some() {
            Some("beam search")
        } else if req.prompt_logprobs.is_some() {
            Some("prompt_logprobs")
        } else if matches!(req.prefill, PrefillMode::Export { .. }) {
            Some("a prefill-only export")
        } else {
            None
        };
        let bounds = ResumeBounds {
            n: req.n,
            max_tokens,
            vocab_size: limits.vocab_size,
            refused_by,
        };
        super::resume::check(r, &bounds)?;
    }
    // Last: compiling is the most expensive check (cached by format).
    let grammar = match (&req.response_format, &req.prefill) {
        (None, _) | (Some(_), PrefillMode::Export { .. }) => None,
        (Some(format), _) => {
            let g = grammars.ok_or_else(|| {
                invalid(format!(
                    "response_format.{}: constrained decoding needs a tokenizer and the model has none",
                    format.kind()
                ))
            })?;
            Some(g.compile(format)?)
        }
    };
    let lora = match (req.lora.as_deref(), adapters) {
        (None, _) => None,
        (Some(name), Some(reg)) => Some(reg.resolve(name)?),
        (Some(name), None) => {
            return Err(invalid(format!(
                "lora: adapter `{name}` asked for, but this engine serves no LoRA adapters"
            )))
        }
    };
    Ok(ValidRequest {
        request_id: req.request_id,
        prompt_ids,
        sampling: req.sampling,
        max_tokens,
        n: req.n,
        stop,
        stop_token_ids: req.stop_token_ids,
        ignore_eos: req.ignore_eos,
        prefill: req.prefill,
        grammar,
        prompt_logprobs: req.prompt_logprobs,
        beam: req.beam,
        lora,
        resume: req.resume,
        span: req.span,
    })
}

/// The sampling settings, logprob counts, `n`, beams, `max_tokens` and
/// stop ids, before anything is tokenized.
fn check_choices(req: &Request, limits: &Limits) -> Result<()> {
    req.sampling.validate()?;
    if let Some(n) = req.sampling.logprobs {
        if n > MAX_LOGPROBS {
            return Err(invalid(format!(
                "logprobs must be at most {MAX_LOGPROBS}, got {n}"
            )));
        }
    }
    if let Some(p) = &req.prompt_logprobs {
        if p.top > MAX_LOGPROBS {
            return Err(invalid(format!(
                "prompt_logprobs must be at most {MAX_LOGPROBS}, got {}",
                p.top
            )));
        }
        if p.next_token
            .is_some_and(|t| t as usize >= limits.vocab_size)
        {
            return Err(invalid(
                "prompt_logprobs: the next token is outside the vocabulary".into(),
            ));
        }
    }
    if req.n == 0 || req.n > limits.max_num_seqs {
        return Err(invalid(format!(
            "n must be between 1 and {} (max_num_seqs), got {}",
            limits.max_num_seqs, req.n
        )));
    }
    // A remotely prefilled request may fork choices (after its last prompt
    // token is computed here); an export computes the prompt only.
    if matches!(req.prefill, PrefillMode::Export { .. }) && req.n != 1 {
        return Err(invalid(format!(
            "n must be 1 for a prefill-only request, got {}",
            req.n
        )));
    }
    if let Some(beam) = &req.beam {
        check_beam(beam, req, limits)?;
    }
    if req.max_tokens == Some(0) {
        return Err(invalid("max_tokens must be at least 1, got 0".into()));
    }
    if req.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(invalid(format!(
            "stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids, got {}",
            req.stop_token_ids.len()
        )));
    }
    Ok(())
}

/// The prompt's token ids (text tokenized), none outside the vocabulary.
fn prompt_ids(prompt: Prompt, tokenizer: Option<&Tokenizer>, limits: &Limits) -> Result<Vec<u32>> {
    let ids = match prompt {
        Prompt::Text(text) => {
            if text.is_empty() {
                return Err(invalid("prompt: the prompt text is empty".into()));
            }
            let tok = tokenizer.ok_or_else(|| {
                invalid("prompt.text: the model has no tokenizer; send token ids".into())
            })?;
            tok.encode(&text)?
        }
        Prompt::Tokens(ids) => ids,
    };
    if ids.is_empty() {
        return Err(invalid("prompt: the prompt has no tokens".into()));
    }
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= limits.vocab_size) {
        return Err(invalid(format!(
            "prompt.token_ids: token id {bad} is outside the vocabulary (size {})",
            limits.vocab_size
        )));
    }
    Ok(ids)
}

/// `max_tokens` (the room left in the context when not given), checked
/// against the context and against the whole pool: one sequence must fit
/// it, or it could never finish.
fn token_budget(len: usize, asked: Option<usize>, limits: &Limits) -> Result<usize> {
    if len >= limits.max_model_len {
        return Err(invalid(format!(
            "prompt: {len} tokens leave no room to generate within max_model_len {}",
            limits.max_model_len
        )));
    }
    let room = limits.max_model_len - len;
    let max_tokens = match asked {
        Some(t) if t > room => {
            return Err(invalid(format!(
                "max_tokens: prompt ({len} tokens) + max_tokens ({t}) exceeds max_model_len {}",
                limits.max_model_len
            )))
        }
        Some(t) => t,
        None => room,
    };
    let peak = |tokens: usize| {
        let chunk = limits.max_prefill_chunk;
        limits
            .footprint
            .peak(len, len + tokens, chunk, limits.block_size)
    };
    let need = peak(max_tokens);
    if need <= limits.num_blocks {
        return Ok(max_tokens);
    }
    // The most tokens that fit beside the prompt (the peak grows with them).
    let (mut fits, mut over) = (0, max_tokens);
    while fits + 1 < over {
        let mid = fits + (over - fits) / 2;
        match peak(mid) <= limits.num_blocks {
            true => fits = mid,
            false => over = mid,
        }
    }
    let blocks = limits.num_blocks;
    match (fits, asked) {
        (0, _) => Err(invalid(format!(
            "prompt: {len} tokens and one more need {} KV blocks but the whole cache holds \
             {blocks}; shorten the prompt",
            peak(1)
        ))),
        // Unasked, the budget is whatever room there is: the pool's.
        (fits, None) => Ok(fits),
        (fits, Some(_)) => Err(invalid(format!(
            "max_tokens: prompt ({len}) + max_tokens ({max_tokens}) needs {need} KV blocks \
             but the whole cache holds {blocks}; at most {fits} fit"
        ))),
    }
}

/// Beam search scores raw logprobs and ends beams at tokens: what would
/// change that (or cannot follow several beams) is refused, by field.
fn check_beam(beam: &BeamSearch, req: &Request, limits: &Limits) -> Result<()> {
    if beam.width < req.n || beam.width > limits.max_num_seqs {
        return Err(invalid(format!(
            "best_of: beam search needs n ({}) <= best_of <= {} (max_num_seqs), got {}",
            req.n, limits.max_num_seqs, beam.width
        )));
    }
    if !beam.length_penalty.is_finite() {
        return Err(invalid("length_penalty must be finite".into()));
    }
    let s = &req.sampling;
    let refused = [
        (s.temperature != 0.0, "temperature"),
        (s.top_k != 0, "top_k"),
        (s.top_p != 1.0, "top_p"),
        (s.min_p != 0.0, "min_p"),
        (s.repetition_penalty != 1.0, "repetition_penalty"),
        (s.presence_penalty != 0.0, "presence_penalty"),
        (s.frequency_penalty != 0.0, "frequency_penalty"),
        (!req.stop.is_empty(), "stop"),
        (req.response_format.is_some(), "response_format"),
        (matches!(req.prefill, PrefillMode::Export { .. }), "prefill"),
    ];
    if let Some((_, field)) = refused.iter().find(|(bad, _)| *bad) {
        return Err(invalid(format!(
            "{field}: not supported with beam search, which ranks beams by the model's raw \
             logprobs and ends them at stop tokens (use stop_token_ids)"
        )));
    }
    Ok(())
}

/// One event on a request's stream.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestEvent {
    /// New tokens of one choice.
    Delta(TokenDelta),
    /// The prompt's K/V is to be computed elsewhere (see
    /// [`PrefillMode::Remote`]).
    RemotePrefill(RemotePrefill),
    /// The logprobs of the prompt's tokens after the first, in order (a
    /// request with [`Request::prompt_logprobs`]); sent once, before the
    /// first token.
    PromptLogprobs(Vec<TokenLogprob>),
    /// The last event: every choice is done.
    Finished(RequestSummary),
    /// The engine failed the request; nothing follows.
    Error(RequestFailure),
}

/// Why the engine failed a request, and whose fault it was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RequestFailure {
    pub scope: FailureScope,
    pub message: String,
}

/// Whether a failure is the request's own or the engine's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureScope {
    /// This request could not go on (its grammar, its sampler, its text):
    /// the engine serves others as before.
    Request,
    /// A step or the backend failed (a device fault, a lost rank): every
    /// request in it failed, and the engine may be broken.
    Engine,
    /// The worker is draining: the request stopped here to go on on
    /// another worker, and its computed blocks stay in the prefix cache
    /// for that worker to pull ([`super::EngineHandle::hand_over`]).
    HandedOver,
}

impl RequestFailure {
    /// The request's own failure.
    pub fn request(message: impl Into<String>) -> Self {
        Self {
            scope: FailureScope::Request,
            message: message.into(),
        }
    }

    /// The engine's failure.
    pub fn engine(message: impl Into<String>) -> Self {
        Self {
            scope: FailureScope::Engine,
            message: message.into(),
        }
    }

    /// A draining worker's hand-over.
    pub fn handed_over(message: impl Into<String>) -> Self {
        Self {
            scope: FailureScope::HandedOver,
            message: message.into(),
        }
    }
}

/// Where a request's prompt comes from when another worker computes it
/// (the router's placement).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillPlacement {
    /// The worker (`host:port`) that computes the prompt (a prefill worker)
    /// or holds its blocks (a draining or peer decode worker).
    pub worker: String,
    /// Remote only when at least this many prompt tokens are not cached
    /// here.
    pub min_uncached: usize,
}

/// What a prefill worker must compute and where the blocks go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemotePrefill {
    /// Names the transfer in `write_kv` and `finish_remote_prefill`.
    pub transfer: u64,
    /// The prompt without its last token (computed here).
    pub tokens: Vec<u32>,
    /// Leading tokens already cached here (a whole number of blocks).
    pub cached_tokens: usize,
    /// Destination block ids for logical blocks `cached_tokens / block_size ..`,
    /// one per layer group per logical block (see [`crate::BlockTable`]).
    pub blocks: Vec<u32>,
    /// The request scores its prompt: the prefill worker computes the
    /// prompt logprobs (`next_token` is the prompt's last token) and they
    /// come back through `remote_prompt_logprobs`.
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// The adapter the prompt runs under: the prefill worker must run the
    /// same one (same name, same hash root).
    pub lora: Option<LoraRef>,
}

/// An adapter named on the wire: its name and the root of its hash chains
/// (a digest of its weights, so two workers' copies can be compared).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraRef {
    pub name: String,
    pub hash_root: u64,
}

/// New tokens of one choice.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenDelta {
    /// Which choice (0 .. n).
    pub index: u32,
    pub token_ids: Vec<u32>,
    /// Text these tokens completed; may be empty while a UTF-8 character or
    /// a possible stop string is incomplete.
    pub text: String,
    /// One per token when logprobs were asked for.
    pub logprobs: Vec<TokenLogprob>,
    /// Set on the choice's last delta.
    pub finish_reason: Option<FinishReason>,
}

/// How one choice ended.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceSummary {
    pub index: u32,
    pub finish_reason: FinishReason,
    /// The stop string, or the stop token id in decimal, that ended it.
    pub matched_stop: Option<String>,
    pub completion_tokens: usize,
}

/// Token counts of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix cache.
    pub cached_tokens: usize,
    /// Summed over choices.
    pub completion_tokens: usize,
}

/// Latencies of a request, measured inside the engine.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Timings {
    /// Arrival to first scheduling.
    pub queue: Duration,
    /// Arrival to first token.
    pub ttft: Option<Duration>,
    /// Mean gap between tokens after the first (choice 0).
    pub tpot: Option<Duration>,
    /// Arrival to the end.
    pub e2e: Duration,
}

/// The final event of a request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSummary {
    pub choices: Vec<ChoiceSummary>,
    pub usage: Usage,
    /// Speculative decoding over all choices (zeros when it was off).
    pub speculation: crate::speculative::SpecCounts,
    pub timings: Timings,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(num_blocks: usize) -> Limits {
        Limits {
            vocab_size: 100,
            max_model_len: 1024,
            block_size: 16,
            num_blocks,
            max_num_seqs: 8,
            footprint: crate::kv_cache::KvFootprint::PLAIN,
            max_prefill_chunk: 2048,
        }
    }

    fn message(r: Result<usize>) -> String {
        match r {
            Err(EngineError::InvalidRequest(m)) => m,
            other => panic!("expected an invalid request, got {other:?}"),
        }
    }

    #[test]
    fn a_budget_the_pool_cannot_hold_names_the_field_at_fault() {
        // 12 blocks = 192 tokens.
        let l = limits(12);
        assert_eq!(token_budget(100, Some(92), &l).ok(), Some(92));
        let m = message(token_budget(100, Some(93), &l));
        assert!(
            m.starts_with("max_tokens:") && m.ends_with("at most 92 fit"),
            "{m}"
        );
        // Unasked, the budget is the pool's room, not the context's.
        assert_eq!(token_budget(100, None, &l).ok(), Some(92));
        // A prompt the pool cannot hold with one more token is the prompt's fault.
        let m = message(token_budget(192, Some(1), &l));
        assert!(m.starts_with("prompt: 192 tokens"), "{m}");
        assert_eq!(token_budget(191, None, &l).ok(), Some(1));
        assert!(message(token_budget(2000, None, &l)).starts_with("prompt:"));
    }
}
