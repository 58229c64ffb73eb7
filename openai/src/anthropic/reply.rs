//! A Messages answer as it accumulates ([`Reply`]) and its stream of
//! content-block events ([`Blocks`]).

use axum::response::sse::Event;
use axum::response::Response;
use serde_json::{json, Value};

use super::sse;
use crate::chat_output::ChatOutput;
use crate::error::ApiError;
use crate::single::{Answer, Dialect};
use crate::tools::parse::{OutputFormat, Piece};

/// One request's answer so far.
#[derive(Debug)]
pub struct Reply {
    pub id: String,
    model: String,
    answer: Answer,
    input_tokens: usize,
    stop_sequences: Vec<String>,
}

impl Reply {
    pub fn new(
        id: String,
        model: String,
        format: &OutputFormat,
        input_tokens: usize,
        stop_sequences: Vec<String>,
    ) -> Self {
        let tag = id.trim_start_matches("msg_").to_string();
        Self {
            id,
            model,
            answer: Answer::new(ChatOutput::new(format, format!("toolu_{tag}_"))),
            input_tokens,
            stop_sequences,
        }
    }

    /// `stop_reason` and `stop_sequence`.
    fn stop(&self) -> (&'static str, Option<&str>) {
        let a = &self.answer;
        match a.finish {
            Some("length") => ("max_tokens", None),
            _ if a.output.completed_calls() > 0 => ("tool_use", None),
            _ => match a
                .matched_stop
                .as_deref()
                .filter(|m| self.stop_sequences.iter().any(|s| s == m))
            {
                Some(seq) => ("stop_sequence", Some(seq)),
                None => ("end_turn", None),
            },
        }
    }

    fn usage(&self) -> Value {
        json!({
            "input_tokens": self.input_tokens,
            "output_tokens": self.answer.output_tokens,
            "cache_read_input_tokens": self.answer.cached_tokens,
        })
    }

    /// The message as `message_start` announces it: no content yet.
    pub fn skeleton(&self) -> Value {
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        })
    }

    /// The whole message (the unstreamed answer).
    pub fn message(&self) -> Value {
        let mut content = Vec::new();
        if !self.answer.output.reasoning.is_empty() {
            content.push(
                json!({"type": "thinking", "thinking": self.answer.output.reasoning, "signature": ""}),
            );
        }
        if !self.answer.output.content.is_empty() {
            content.push(json!({"type": "text", "text": self.answer.output.content}));
        }
        for c in &self.answer.output.calls {
            content.push(json!({"type": "tool_use", "id": c.id, "name": c.name,
                                "input": tool_input(&c.arguments)}));
        }
        let (reason, sequence) = self.stop();
        let mut m = self.skeleton();
        m["content"] = Value::Array(content);
        m["stop_reason"] = json!(reason);
        m["stop_sequence"] = json!(sequence);
        m["usage"] = self.usage();
        m
    }
}

/// A call's input object; a call cut off mid-arguments (max_tokens) has
/// whatever parsed, else `{}`.
fn tool_input(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({}),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Text,
    Thinking,
    /// Tool call `i` of the output.
    ToolUse(usize),
}

/// The content blocks of a stream: which one is open, and its index.
#[derive(Debug, Default)]
pub struct Blocks {
    open: Option<(usize, Block)>,
    next: usize,
}

impl Blocks {
    /// Opens `block` unless it is the open one (closing that first).
    fn enter(&mut self, block: Block, start: Value, out: &mut Vec<Event>) -> usize {
        if let Some((index, open)) = self.open {
            if open == block {
                return index;
            }
            out.push(stop_event(index));
        }
        let index = self.next;
        self.next += 1;
        self.open = Some((index, block));
        out.push(sse(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": start}),
        ));
        index
    }

    /// The events for `pieces`.
    pub fn events(&mut self, reply: &Reply, pieces: &[Piece]) -> Vec<Event> {
        let mut out = Vec::new();
        for p in pieces {
            let (index, delta) = match p {
                Piece::Content(t) => {
                    let i = self.enter(Block::Text, json!({"type": "text", "text": ""}), &mut out);
                    (i, json!({"type": "text_delta", "text": t}))
                }
                Piece::Reasoning(t) => {
                    let start = json!({"type": "thinking", "thinking": "", "signature": ""});
                    let i = self.enter(Block::Thinking, start, &mut out);
                    (i, json!({"type": "thinking_delta", "thinking": t}))
                }
                Piece::CallStart { index, name } => {
                    let start = json!({"type": "tool_use", "id": reply.answer.output.call_id(*index),
                                       "name": name, "input": {}});
                    self.enter(Block::ToolUse(*index), start, &mut out);
                    continue;
                }
                Piece::CallArguments { index, fragment } => {
                    let Some((i, Block::ToolUse(open))) = self.open else {
                        continue;
                    };
                    if open != *index {
                        continue;
                    }
                    (
                        i,
                        json!({"type": "input_json_delta", "partial_json": fragment}),
                    )
                }
            };
            out.push(sse(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index, "delta": delta}),
            ));
        }
        out
    }

    /// The closing events: the open block's stop, `message_delta` with the
    /// stop reason and usage, `message_stop`.
    pub fn finish(&mut self, reply: &Reply) -> Vec<Event> {
        let mut out = Vec::new();
        if let Some((index, _)) = self.open.take() {
            out.push(stop_event(index));
        }
        let (reason, sequence) = reply.stop();
        out.push(sse(
            "message_delta",
            json!({"type": "message_delta",
                   "delta": {"stop_reason": reason, "stop_sequence": sequence},
                   "usage": {"output_tokens": reply.answer.output_tokens}}),
        ));
        out.push(sse("message_stop", json!({"type": "message_stop"})));
        out
    }
}

fn stop_event(index: usize) -> Event {
    sse(
        "content_block_stop",
        json!({"type": "content_block_stop", "index": index}),
    )
}

/// A Messages answer with its stream's block state: the Messages
/// [`Dialect`].
#[derive(Debug)]
pub struct Messages {
    pub reply: Reply,
    blocks: Blocks,
}

impl Messages {
    pub fn new(reply: Reply) -> Self {
        Self {
            reply,
            blocks: Blocks::default(),
        }
    }
}

impl Dialect for Messages {
    fn id(&self) -> &str {
        &self.reply.id
    }

    fn answer(&mut self) -> &mut Answer {
        &mut self.reply.answer
    }

    fn body(&self) -> Value {
        self.reply.message()
    }

    fn opening(&mut self) -> Vec<Event> {
        let start = json!({"type": "message_start", "message": self.reply.skeleton()});
        vec![sse("message_start", start)]
    }

    fn events(&mut self, pieces: &[Piece]) -> Vec<Event> {
        self.blocks.events(&self.reply, pieces)
    }

    fn finish(&mut self) -> Vec<Event> {
        self.blocks.finish(&self.reply)
    }

    fn error_event(&mut self, e: &ApiError) -> Event {
        sse("error", e.anthropic_body())
    }

    fn error_response(e: ApiError) -> Response {
        e.into_anthropic_response()
    }

    const FIELDS: &'static [(&'static str, &'static str)] = &[
        ("prompt", "messages"),
        ("stop", "stop_sequences"),
        ("lora", "model"),
    ];
}
