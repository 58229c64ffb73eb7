//! Generation for one request: prefill, then decode until a stop condition.
//!
//! This is the single-request driver behind `tandem generate`; the serving
//! scheduler will batch many such sequences through the same
//! [`Model::forward`]. Prefill runs in chunks of at most `prefill_chunk`
//! tokens, the same path the scheduler's chunked prefill takes.

use std::time::{Duration, Instant};

use crate::error::{EngineError, Result};
use crate::kv_cache::{BlockTable, KvCache, KvCacheDtype, KvGroups};
use crate::model::{Model, SeqInput};
use crate::sampling::{Sampled, Sampler, SamplingParams, TokenLogprob};

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence or stop token was produced.
    Stop,
    /// `max_tokens` or the model's context limit was reached.
    Length,
    /// The request was cancelled.
    Abort,
}

impl FinishReason {
    /// The OpenAI-style name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
        }
    }
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Tokens that end generation besides the model's eos ids.
    pub stop_token_ids: Vec<u32>,
    /// Keep going past eos ids.
    pub ignore_eos: bool,
}

/// Engine-side knobs for a generation.
#[derive(Debug, Clone, Copy)]
pub struct GenerateOptions {
    pub block_size: usize,
    pub prefill_chunk: usize,
    /// What the generation's KV cache stores.
    pub kv_dtype: KvCacheDtype,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            block_size: 16,
            prefill_chunk: 2048,
            kv_dtype: KvCacheDtype::F32,
        }
    }
}

/// The result of a generation.
#[derive(Debug, Clone)]
pub struct GenerateOutput {
    pub output_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    pub finish_reason: FinishReason,
    /// Time to first token.
    pub ttft: Duration,
    /// Mean time per output token after the first.
    pub tpot: Option<Duration>,
}

/// The prompt fits the vocabulary and leaves room in the context; the chunk
/// is positive.
fn check(model: &Model, prompt: &[u32], opts: &GenerateOptions) -> Result<()> {
    let cfg = model.config();
    if prompt.is_empty() {
        return Err(EngineError::InvalidRequest("the prompt is empty".into()));
    }
    if prompt.len() >= cfg.max_context() {
        return Err(EngineError::InvalidRequest(format!(
            "prompt of {} tokens leaves no room to generate within the model's context of {} tokens (max_position_embeddings, with any rope_scaling)",
            prompt.len(),
            cfg.max_context()
        )));
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        return Err(EngineError::InvalidRequest(format!(
            "token id {bad} is outside the vocabulary (size {})",
            cfg.vocab_size
        )));
    }
    if opts.prefill_chunk == 0 {
        return Err(EngineError::InvalidRequest(
            "prefill chunk must be positive".into(),
        ));
    }
    Ok(())
}

/// Runs one request to completion, calling `on_token` for each new token.
pub fn generate(
    model: &Model,
    eos_token_ids: &[u32],
    req: &GenerateRequest,
    opts: GenerateOptions,
    mut on_token: impl FnMut(&Sampled) -> Result<()>,
) -> Result<GenerateOutput> {
    let start = Instant::now();
    let cfg = model.config();
    let prompt = &req.prompt_ids;
    check(model, prompt, &opts)?;
    let mut sampler = Sampler::new(req.sampling.clone(), prompt)?;
    // The context limit caps the output; hitting it is a `length` finish.
    let max_new = req.max_tokens.min(cfg.max_context() - prompt.len());
    let total = prompt.len() + max_new;
    let layout = model.kv_layout(opts.block_size);
    let blocks = total.div_ceil(opts.block_size).max(1) * KvGroups::of(&layout).num_groups();
    let mut kv = KvCache::with_dtype(layout, blocks, opts.kv_dtype);
    let allocator = kv.allocator()?;
    let mut table = BlockTable::new(&allocator);

    let mut output = Vec::new();
    let mut logprobs = Vec::new();
    let mut ttft = Duration::ZERO;
    let mut finish = FinishReason::Length;
    let mut pending: Vec<u32> = Vec::new();
    let mut pos = 0;
    // Prefill in chunks; the last chunk's logits give the first token.
    let mut logits = None;
    for chunk in prompt.chunks(opts.prefill_chunk) {
        // A fresh table shares no block, so no copy-on-write can arise.
        table.release_outside_window(pos);
        for copy in table.append(chunk.len())? {
            kv.copy_block(copy);
        }
        let out = model.forward(
            &[SeqInput {
                tokens: chunk,
                start_pos: pos,
                blocks: table.blocks(),
                all_logits: false,
                lora: None,
            }],
            &mut kv,
        )?;
        pos += chunk.len();
        logits = Some(out);
    }
    let mut first_decode_at = None;
    while output.len() < max_new {
        let row = match &logits {
            Some(l) => l.last(0),
            None => break,
        };
        let s = sampler.sample(row);
        if output.is_empty() {
            ttft = start.elapsed();
            first_decode_at = Some(Instant::now());
        }
        output.push(s.token);
        if let Some(lp) = &s.logprob {
            logprobs.push(lp.clone());
        }
        on_token(&s)?;
        let is_eos = !req.ignore_eos && eos_token_ids.contains(&s.token);
        if is_eos || req.stop_token_ids.contains(&s.token) {
            finish = FinishReason::Stop;
            break;
        }
        if output.len() == max_new {
            break;
        }
        pending.clear();
        pending.push(s.token);
        table.release_outside_window(pos);
        for copy in table.append(1)? {
            kv.copy_block(copy);
        }
        logits = Some(model.forward(
            &[SeqInput {
                tokens: &pending,
                start_pos: pos,
                blocks: table.blocks(),
                all_logits: false,
                lora: None,
            }],
            &mut kv,
        )?);
        pos += 1;
    }
    let tpot = match (first_decode_at, output.len()) {
        (Some(t0), n) if n > 1 => Some(t0.elapsed() / (n as u32 - 1)),
        _ => None,
    };
    Ok(GenerateOutput {
        output_ids: output,
        logprobs,
        finish_reason: finish,
        ttft,
        tpot,
    })
}
