//! Turning the backend's event streams into OpenAI responses: one JSON body
//! ([`Collector`]) or a sequence of chunks ([`Chunker`]).
//!
//! A request with several prompts (completions) or `n` choices becomes one
//! backend call per prompt; choice `i` of prompt `p` is OpenAI choice
//! `p * n + i`, as in OpenAI's own batching.

use std::sync::Arc;

use serde_json::{json, Value};
use tandem_engine::tokenizer::Tokenizer;
use tandem_proto::v1;

use crate::chat_output::ChatOutput;
use crate::error::ApiError;
use crate::tools::parse::OutputFormat;

/// Which endpoint a response is for: the JSON shapes differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// What every response object repeats.
#[derive(Debug, Clone)]
pub struct Header {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
    pub tokenizer: Arc<Tokenizer>,
    /// What chat output is parsed for (reasoning, tool calls).
    pub output: OutputFormat,
}

pub(crate) fn finish_reason(code: i32) -> Option<&'static str> {
    match v1::FinishReason::try_from(code) {
        Ok(v1::FinishReason::Stop) => Some("stop"),
        Ok(v1::FinishReason::Length) => Some("length"),
        Ok(v1::FinishReason::Abort) => Some("abort"),
        _ => None,
    }
}

/// Usage summed over a request's backend calls.
#[derive(Debug, Clone, Copy, Default)]
pub struct UsageSum {
    prompt: u64,
    cached: u64,
    completion: u64,
}

impl UsageSum {
    fn add(&mut self, u: &v1::Usage) {
        self.prompt += u64::from(u.prompt_tokens);
        self.cached += u64::from(u.cached_tokens);
        self.completion += u64::from(u.completion_tokens);
    }

    pub fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        })
    }
}

impl Header {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    fn wrap(&self, chunk: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// The parser of chat choice `index`'s output (`None` for completions).
    fn chat_output(&self, index: usize) -> Option<ChatOutput> {
        (self.endpoint == Endpoint::Chat).then(|| {
            let tag = self.id.rsplit('-').next().unwrap_or_default();
            ChatOutput::new(&self.output, format!("call_{tag}_{index}_"))
        })
    }

    fn token(&self, id: u32) -> String {
        self.tokenizer
            .token_text(id)
            .unwrap_or_else(|_| format!("<token {id}>"))
    }

    /// Logprobs of some tokens, in the endpoint's shape. `offset` is the
    /// text offset of the first token (completions report one per token).
    fn logprobs(&self, lps: &[v1::TokenLogprob], offset: &mut usize) -> Value {
        match self.endpoint {
            Endpoint::Chat => {
                let content: Vec<Value> = lps
                    .iter()
                    .map(|lp| {
                        let token = self.token(lp.token_id);
                        let top: Vec<Value> = lp
                            .top
                            .iter()
                            .map(|t| {
                                let s = self.token(t.token_id);
                                json!({"token": s, "logprob": t.logprob, "bytes": s.as_bytes()})
                            })
                            .collect();
                        json!({
                            "token": token,
                            "logprob": lp.logprob,
                            "bytes": token.as_bytes(),
                            "top_logprobs": top,
                        })
                    })
                    .collect();
                json!({ "content": content })
            }
            Endpoint::Completions => {
                let (mut tokens, mut token_lps, mut tops, mut offsets) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for lp in lps {
                    let token = self.token(lp.token_id);
                    offsets.push(*offset);
                    *offset += token.len();
                    let top: serde_json::Map<String, Value> = lp
                        .top
                        .iter()
                        .map(|t| (self.token(t.token_id), json!(t.logprob)))
                        .collect();
                    tokens.push(token);
                    token_lps.push(lp.logprob);
                    tops.push(Value::Object(top));
                }
                json!({
                    "tokens": tokens,
                    "token_logprobs": token_lps,
                    "top_logprobs": tops,
                    "text_offset": offsets,
                })
            }
        }
    }
}

/// One choice of a non-streamed response, as it accumulates.
#[derive(Debug, Default)]
struct Choice {
    text: String,
    /// Chat: the parsed output.
    chat: Option<ChatOutput>,
    ended: bool,
    logprobs: Vec<v1::TokenLogprob>,
    finish_reason: Option<&'static str>,
}

/// Builds a non-streamed response from all of a request's events.
#[derive(Debug)]
pub struct Collector {
    header: Header,
    n: usize,
    want_logprobs: bool,
    choices: Vec<Choice>,
    usage: UsageSum,
}

impl Collector {
    pub fn new(header: Header, prompts: usize, n: u32, want_logprobs: bool) -> Self {
        let n = n as usize;
        Self {
            n,
            want_logprobs,
            choices: (0..prompts * n)
                .map(|i| Choice {
                    chat: header.chat_output(i),
                    ..Choice::default()
                })
                .collect(),
            header,
            usage: UsageSum::default(),
        }
    }

    /// Folds in one event of prompt `prompt`'s call.
    pub fn add(&mut self, prompt: usize, msg: v1::GenerateResponse) -> Result<(), ApiError> {
        match msg.event {
            Some(v1::generate_response::Event::Delta(d)) => {
                let i = prompt * self.n + d.index as usize;
                let choice = self.choices.get_mut(i).ok_or_else(|| {
                    ApiError::from(tonic::Status::internal(format!(
                        "backend sent choice {} of {}",
                        d.index, self.n
                    )))
                })?;
                let finish = finish_reason(d.finish_reason);
                match &mut choice.chat {
                    Some(chat) => {
                        chat.push(&d.text, finish.is_some());
                        choice.ended |= finish.is_some();
                    }
                    None => choice.text.push_str(&d.text),
                }
                choice.logprobs.extend(d.logprobs);
                if let Some(r) = finish {
                    choice.finish_reason = Some(r);
                }
            }
            Some(v1::generate_response::Event::Finished(f)) => {
                if let Some(u) = &f.usage {
                    self.usage.add(u);
                }
                for c in &f.choices {
                    if let Some(choice) = self.choices.get_mut(prompt * self.n + c.index as usize) {
                        if let Some(r) = finish_reason(c.finish_reason) {
                            choice.finish_reason = Some(r);
                        }
                    }
                }
            }
            None => {}
        }
        Ok(())
    }

    /// The response body.
    pub fn finish(mut self) -> Value {
        for c in &mut self.choices {
            if let (Some(chat), false) = (&mut c.chat, c.ended) {
                chat.push("", true);
            }
        }
        let choices = self
            .choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let logprobs = if self.want_logprobs {
                    self.header.logprobs(&c.logprobs, &mut 0)
                } else {
                    Value::Null
                };
                match self.header.endpoint {
                    Endpoint::Completions => json!({
                        "index": index,
                        "text": c.text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                    }),
                    Endpoint::Chat => {
                        let (message, finish) = match &c.chat {
                            Some(chat) => (chat.message(), chat.finish_reason(c.finish_reason)),
                            None => (
                                json!({"role": "assistant", "content": c.text}),
                                c.finish_reason,
                            ),
                        };
                        json!({
                            "index": index,
                            "message": message,
                            "logprobs": logprobs,
                            "finish_reason": finish,
                        })
                    }
                }
            })
            .collect();
        let mut body = self.header.wrap(false, choices);
        body["usage"] = self.usage.json();
        body
    }
}

/// Turns events into stream chunks as they arrive.
#[derive(Debug)]
pub struct Chunker {
    header: Header,
    n: usize,
    want_logprobs: bool,
    /// Text offset per choice (completions' logprobs).
    offsets: Vec<usize>,
    /// Chat: each choice's parsed output.
    chat: Vec<ChatOutput>,
    usage: UsageSum,
}

impl Chunker {
    pub fn new(header: Header, prompts: usize, n: u32, want_logprobs: bool) -> Self {
        let choices = prompts * n as usize;
        Self {
            chat: (0..choices).filter_map(|i| header.chat_output(i)).collect(),
            header,
            n: n as usize,
            want_logprobs,
            offsets: vec![0; choices],
            usage: UsageSum::default(),
        }
    }

    /// The chunks that open the stream: chat announces the assistant role
    /// of every choice.
    pub fn opening(&self) -> Vec<Value> {
        if self.header.endpoint != Endpoint::Chat {
            return Vec::new();
        }
        (0..self.offsets.len())
            .map(|index| {
                self.header.wrap(
                    true,
                    vec![json!({
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": null,
                        "finish_reason": null,
                    })],
                )
            })
            .collect()
    }

    /// The chunk (if any) for one event of prompt `prompt`'s call.
    pub fn chunk(&mut self, prompt: usize, msg: v1::GenerateResponse) -> Option<Value> {
        match msg.event? {
            v1::generate_response::Event::Delta(d) => {
                let index = prompt * self.n + d.index as usize;
                let mut finish = finish_reason(d.finish_reason);
                let mut delta = None;
                if let Some(chat) = self.chat.get_mut(index) {
                    let pieces = chat.push(&d.text, finish.is_some());
                    delta = chat.delta(&pieces);
                    finish = chat.finish_reason(finish);
                    if delta.is_none() && finish.is_none() && !self.want_logprobs {
                        return None; // held back: maybe a marker
                    }
                }
                if d.text.is_empty() && finish.is_none() && !self.want_logprobs {
                    return None; // a held-back partial character or stop string
                }
                let logprobs = match self.offsets.get_mut(index) {
                    Some(offset) if self.want_logprobs => self.header.logprobs(&d.logprobs, offset),
                    _ => Value::Null,
                };
                let choice = match self.header.endpoint {
                    Endpoint::Completions => json!({
                        "index": index,
                        "text": d.text,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    }),
                    Endpoint::Chat => json!({
                        "index": index,
                        "delta": delta.map_or_else(|| json!({}), Value::Object),
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    }),
                };
                Some(self.header.wrap(true, vec![choice]))
            }
            v1::generate_response::Event::Finished(f) => {
                if let Some(u) = &f.usage {
                    self.usage.add(u);
                }
                None
            }
        }
    }

    /// The usage chunk sent last when `stream_options.include_usage` is set.
    pub fn usage_chunk(&self) -> Value {
        let mut chunk = self.header.wrap(true, Vec::new());
        chunk["usage"] = self.usage.json();
        chunk
    }
}
