//! Turning the backend's event streams into OpenAI responses: one JSON body
//! ([`Collector`]) or a sequence of chunks ([`Chunker`]).
//!
//! A request with several prompts (completions) or `n` choices becomes one
//! backend call per prompt; choice `i` of prompt `p` is OpenAI choice
//! `p * n + i`, as in OpenAI's own batching.

use std::sync::Arc;

use serde_json::{json, Value};
use tandem_proto::v1;
use tandem_tokenizer::Tokenizer;

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
    /// Completions' `echo`: each prompt's text and token ids.
    pub echo: Option<Vec<EchoPrompt>>,
    /// Choices report `prompt_logprobs` (vLLM's field).
    pub report_prompt_logprobs: bool,
}

/// A prompt as `echo` repeats it.
#[derive(Debug, Clone)]
pub struct EchoPrompt {
    pub text: String,
    pub ids: Vec<u32>,
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

    /// vLLM's `prompt_logprobs`: `null` for the first prompt token, then
    /// per token `{"<id>": {"logprob", "rank", "decoded_token"}}` for the
    /// token and its top alternatives (`rank` is 1-based among them, `null`
    /// for a token outside them).
    fn prompt_logprobs(&self, scores: &[v1::TokenLogprob]) -> Value {
        let mut out = vec![Value::Null];
        for s in scores {
            let mut entry = serde_json::Map::new();
            let rank = |id: u32| s.top.iter().position(|t| t.token_id == id).map(|r| r + 1);
            entry.insert(
                s.token_id.to_string(),
                json!({"logprob": s.logprob, "rank": rank(s.token_id), "decoded_token": self.token(s.token_id)}),
            );
            for t in &s.top {
                entry.entry(t.token_id.to_string()).or_insert_with(|| {
                    json!({"logprob": t.logprob, "rank": rank(t.token_id), "decoded_token": self.token(t.token_id)})
                });
            }
            out.push(Value::Object(entry));
        }
        Value::Array(out)
    }

    /// Completions' logprobs of an echoed prompt: its first token has
    /// none. `offset` advances past the prompt's text.
    fn echo_logprobs(
        &self,
        prompt: &EchoPrompt,
        scores: &[v1::TokenLogprob],
        offset: &mut usize,
    ) -> Value {
        let mut body = self.logprobs(scores, &mut 0);
        let first = prompt
            .ids
            .first()
            .map(|&t| self.token(t))
            .unwrap_or_default();
        let shift = first.len();
        let arrays = ["tokens", "token_logprobs", "top_logprobs", "text_offset"];
        let firsts = [json!(first), Value::Null, Value::Null, json!(*offset)];
        for (key, head) in arrays.iter().zip(firsts) {
            if let Some(Value::Array(items)) = body.get_mut(*key) {
                if *key == "text_offset" {
                    for v in items.iter_mut() {
                        *v = json!(v.as_u64().unwrap_or(0) as usize + *offset + shift);
                    }
                }
                items.insert(0, head);
            }
        }
        *offset += prompt.text.len();
        body
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
    /// Each prompt's scores, once they arrive.
    prompt_scores: Vec<Vec<v1::TokenLogprob>>,
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
            prompt_scores: vec![Vec::new(); prompts],
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
                    }
                    None => choice.text.push_str(&d.text),
                }
                choice.logprobs.extend(d.logprobs);
                if let Some(r) = finish {
                    choice.finish_reason = Some(r);
                }
            }
            Some(v1::generate_response::Event::PromptLogprobs(p)) => {
                if let Some(slot) = self.prompt_scores.get_mut(prompt) {
                    *slot = p.logprobs;
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
        for chat in self.choices.iter_mut().filter_map(|c| c.chat.as_mut()) {
            chat.close();
        }
        let choices = self
            .choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let scores = &self.prompt_scores[index / self.n.max(1)];
                let echo = self.header.echo.as_ref().map(|e| &e[index / self.n.max(1)]);
                let mut offset = 0;
                let echoed = match (echo, self.want_logprobs) {
                    (Some(e), true) => Some(self.header.echo_logprobs(e, scores, &mut offset)),
                    _ => None,
                };
                let logprobs = if self.want_logprobs {
                    let own = self.header.logprobs(&c.logprobs, &mut offset);
                    match echoed {
                        Some(e) => concat_logprobs(e, own),
                        None => own,
                    }
                } else {
                    Value::Null
                };
                let mut choice = match self.header.endpoint {
                    Endpoint::Completions => json!({
                        "index": index,
                        "text": echo.map_or(String::new(), |e| e.text.clone()) + &c.text,
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
                };
                if self.header.report_prompt_logprobs {
                    choice["prompt_logprobs"] = self.header.prompt_logprobs(scores);
                }
                choice
            })
            .collect();
        let mut body = self.header.wrap(false, choices);
        body["usage"] = self.usage.json();
        body
    }
}

/// Completions logprobs `a` then `b` (each `tokens`, `token_logprobs`,
/// `top_logprobs`, `text_offset` arrays).
fn concat_logprobs(mut a: Value, b: Value) -> Value {
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(Value::Array(x)), Value::Array(y)) = (a.get_mut(key), &b[key]) {
            x.extend(y.iter().cloned());
        }
    }
    a
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
            // An echo without logprobs needs no scores: it goes first.
            let Some(echo) = self.header.echo.as_ref().filter(|_| !self.want_logprobs) else {
                return Vec::new();
            };
            return (0..self.offsets.len())
                .map(|index| {
                    let text = &echo[index / self.n.max(1)].text;
                    let choice = json!({"index": index, "text": text, "logprobs": null, "finish_reason": null});
                    self.header.wrap(true, vec![choice])
                })
                .collect();
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
            v1::generate_response::Event::PromptLogprobs(p) => {
                self.scores_chunk(prompt, &p.logprobs)
            }
            v1::generate_response::Event::Finished(f) => {
                if let Some(u) = &f.usage {
                    self.usage.add(u);
                }
                None
            }
        }
    }

    /// The chunk for prompt `prompt`'s scores: every one of its choices
    /// with `prompt_logprobs`, and an echo that waited for its logprobs.
    fn scores_chunk(&mut self, prompt: usize, scores: &[v1::TokenLogprob]) -> Option<Value> {
        let echo = self
            .header
            .echo
            .as_ref()
            .filter(|_| self.want_logprobs)
            .and_then(|e| e.get(prompt));
        if echo.is_none() && !self.header.report_prompt_logprobs {
            return None;
        }
        let mut choices = Vec::new();
        for index in prompt * self.n..(prompt + 1) * self.n {
            let mut choice = match (self.header.endpoint, echo) {
                (Endpoint::Completions, Some(e)) => {
                    let offset = self.offsets.get_mut(index)?;
                    let logprobs = self.header.echo_logprobs(e, scores, offset);
                    json!({"index": index, "text": e.text, "logprobs": logprobs, "finish_reason": null})
                }
                (Endpoint::Completions, None) => {
                    json!({"index": index, "text": "", "logprobs": null, "finish_reason": null})
                }
                (Endpoint::Chat, _) => {
                    json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": null})
                }
            };
            if self.header.report_prompt_logprobs {
                choice["prompt_logprobs"] = self.header.prompt_logprobs(scores);
            }
            choices.push(choice);
        }
        Some(self.header.wrap(true, choices))
    }

    /// The usage chunk sent last when `stream_options.include_usage` is set.
    pub fn usage_chunk(&self) -> Value {
        let mut chunk = self.header.wrap(true, Vec::new());
        chunk["usage"] = self.usage.json();
        chunk
    }
}
