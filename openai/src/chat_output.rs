//! One chat choice's output as it streams: the text deltas go through the
//! request's [`OutputParser`], and what it yields is kept (for the final
//! message) and turned into OpenAI delta objects (for the stream). Both the
//! OpenAI and the Anthropic endpoints build their answers from these
//! pieces, so a stream and an unstreamed answer always agree.

use serde_json::{json, Map, Value};

use crate::tools::parse::{OutputFormat, OutputParser, Piece};

/// A tool call as the answer reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub id: String,
    pub name: String,
    /// The arguments exactly as the model wrote them (JSON text).
    pub arguments: String,
}

/// What some pieces add (see [`ChatOutput::gather`]).
#[derive(Debug, Default)]
pub struct Gathered {
    pub content: String,
    pub reasoning: String,
    pub calls: Vec<CallDelta>,
}

/// One call's part of a delta.
#[derive(Debug)]
pub struct CallDelta {
    pub index: usize,
    /// `(id, name)` when the call starts here.
    pub start: Option<(String, String)>,
    /// Argument fragments, joined.
    pub arguments: String,
}

/// One choice's parsed output.
#[derive(Debug)]
pub struct ChatOutput {
    parser: OutputParser,
    pub content: String,
    pub reasoning: String,
    pub calls: Vec<Call>,
    /// Call ids are this plus the call's index.
    id_prefix: String,
    /// The choice's last text went in (the parser is flushed).
    ended: bool,
}

impl ChatOutput {
    pub fn new(format: &OutputFormat, id_prefix: String) -> Self {
        Self {
            parser: OutputParser::new(format),
            content: String::new(),
            reasoning: String::new(),
            calls: Vec::new(),
            id_prefix,
            ended: false,
        }
    }

    /// Parses a text delta (and, at the choice's end, what was held back);
    /// the pieces are also folded into the totals.
    pub fn push(&mut self, text: &str, end: bool) -> Vec<Piece> {
        let mut pieces = self.parser.push(text);
        if end {
            pieces.extend(self.parser.finish());
            self.ended = true;
        }
        for p in &pieces {
            match p {
                Piece::Content(t) => self.content.push_str(t),
                Piece::Reasoning(t) => self.reasoning.push_str(t),
                Piece::CallStart { index, name } => self.calls.push(Call {
                    id: self.call_id(*index),
                    name: name.clone(),
                    arguments: String::new(),
                }),
                Piece::CallArguments { index, fragment } => {
                    if let Some(c) = self.calls.get_mut(*index) {
                        c.arguments.push_str(fragment);
                    }
                }
            }
        }
        pieces
    }

    /// What was held back, when the backend ended without marking the
    /// choice's last delta (nothing once it has).
    pub fn close(&mut self) -> Vec<Piece> {
        if self.ended {
            return Vec::new();
        }
        self.push("", true)
    }

    /// The id of call `index`.
    pub fn call_id(&self, index: usize) -> String {
        format!("{}{index}", self.id_prefix)
    }

    /// Calls whose object was written out whole.
    pub fn completed_calls(&self) -> usize {
        self.parser.completed_calls()
    }

    /// OpenAI's finish reason: `tool_calls` when the model stopped after
    /// calling.
    pub fn finish_reason(&self, engine: Option<&'static str>) -> Option<&'static str> {
        match engine {
            Some("stop") if self.completed_calls() > 0 => Some("tool_calls"),
            other => other,
        }
    }

    /// What `pieces` add, gathered: their text, their reasoning, and one
    /// entry per call they touch (a call's start carries its id and name;
    /// consecutive argument fragments of one call are joined). The OpenAI
    /// delta and gRPC's `ChatDelta` are both written from it.
    pub fn gather(&self, pieces: &[Piece]) -> Gathered {
        let mut g = Gathered::default();
        for p in pieces {
            match p {
                Piece::Content(t) => g.content.push_str(t),
                Piece::Reasoning(t) => g.reasoning.push_str(t),
                Piece::CallStart { index, name } => g.calls.push(CallDelta {
                    index: *index,
                    start: Some((self.call_id(*index), name.clone())),
                    arguments: String::new(),
                }),
                Piece::CallArguments { index, fragment } => {
                    match g.calls.last_mut().filter(|c| c.index == *index) {
                        Some(c) => c.arguments.push_str(fragment),
                        None => g.calls.push(CallDelta {
                            index: *index,
                            start: None,
                            arguments: fragment.clone(),
                        }),
                    }
                }
            }
        }
        g
    }

    /// The fields of an OpenAI chat delta for `pieces` (`content`,
    /// `reasoning_content`, `tool_calls`); `None` when they say nothing.
    pub fn delta(&self, pieces: &[Piece]) -> Option<Map<String, Value>> {
        let g = self.gather(pieces);
        let mut delta = Map::new();
        if !g.reasoning.is_empty() {
            delta.insert("reasoning_content".into(), Value::String(g.reasoning));
        }
        if !g.content.is_empty() {
            delta.insert("content".into(), Value::String(g.content));
        }
        if !g.calls.is_empty() {
            let calls = g
                .calls
                .into_iter()
                .map(|c| match c.start {
                    Some((id, name)) => json!({
                        "index": c.index,
                        "id": id,
                        "type": "function",
                        "function": {"name": name, "arguments": c.arguments},
                    }),
                    None => json!({"index": c.index, "function": {"arguments": c.arguments}}),
                })
                .collect();
            delta.insert("tool_calls".into(), Value::Array(calls));
        }
        (!delta.is_empty()).then_some(delta)
    }

    /// The final assistant message: `content` is null when the model only
    /// called tools.
    pub fn message(&self) -> Value {
        let mut m = json!({"role": "assistant"});
        m["content"] = if self.content.is_empty() && !self.calls.is_empty() {
            Value::Null
        } else {
            Value::String(self.content.clone())
        };
        if !self.reasoning.is_empty() {
            m["reasoning_content"] = Value::String(self.reasoning.clone());
        }
        if !self.calls.is_empty() {
            m["tool_calls"] = self
                .calls
                .iter()
                .map(|c| {
                    json!({"id": c.id, "type": "function",
                           "function": {"name": c.name, "arguments": c.arguments}})
                })
                .collect();
        }
        m
    }
}
