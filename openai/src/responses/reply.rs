//! A Responses answer as it accumulates ([`Reply`]) and its event stream
//! ([`Items`]): output items (`reasoning`, `message`, `function_call`)
//! opened, filled by deltas and closed, each with the id and index the
//! final `response` object gives it.

use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::chat_output::ChatOutput;
use crate::error::ApiError;
use crate::single::{Answer, Dialect};
use crate::tools::parse::{OutputFormat, Piece};

/// What the response object echoes of its request.
#[derive(Debug, Clone)]
pub struct Echo {
    pub instructions: Option<String>,
    pub tools: Vec<Value>,
    pub tool_choice: Value,
    pub parallel_tool_calls: bool,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub max_output_tokens: Option<u32>,
}

/// One request's answer so far.
#[derive(Debug)]
pub struct Reply {
    pub id: String,
    tag: String,
    created_at: u64,
    model: String,
    echo: Echo,
    answer: Answer,
    input_tokens: usize,
}

impl Reply {
    pub fn new(
        id: String,
        created_at: u64,
        model: String,
        echo: Echo,
        format: &OutputFormat,
        input_tokens: usize,
    ) -> Self {
        let tag = id.trim_start_matches("resp_").to_string();
        Self {
            answer: Answer::new(ChatOutput::new(format, format!("call_{tag}_"))),
            id,
            tag,
            created_at,
            model,
            echo,
            input_tokens,
        }
    }

    fn reasoning_id(&self) -> String {
        format!("rs_{}", self.tag)
    }

    fn message_id(&self) -> String {
        format!("msg_{}", self.tag)
    }

    fn call_item_id(&self, index: usize) -> String {
        format!("fc_{}_{index}", self.tag)
    }

    fn reasoning_item(&self, text: &str) -> Value {
        json!({"type": "reasoning", "id": self.reasoning_id(), "summary": [],
               "content": [{"type": "reasoning_text", "text": text}]})
    }

    fn message_item(&self, text: Option<&str>, status: &str) -> Value {
        let content = match text {
            Some(t) => {
                json!([{"type": "output_text", "text": t, "annotations": [], "logprobs": []}])
            }
            None => json!([]),
        };
        json!({"type": "message", "id": self.message_id(), "status": status, "role": "assistant",
               "content": content})
    }

    fn call_item(&self, index: usize, name: &str, arguments: &str, status: &str) -> Value {
        json!({"type": "function_call", "id": self.call_item_id(index),
               "call_id": self.answer.output.call_id(index), "name": name, "arguments": arguments,
               "status": status})
    }

    /// The response object; `done` once the backend finished.
    pub fn response(&self, done: bool) -> Value {
        let mut output = Vec::new();
        if done {
            if !self.answer.output.reasoning.is_empty() {
                output.push(self.reasoning_item(&self.answer.output.reasoning));
            }
            if !self.answer.output.content.is_empty() || self.answer.output.calls.is_empty() {
                output.push(self.message_item(Some(&self.answer.output.content), "completed"));
            }
            for (i, c) in self.answer.output.calls.iter().enumerate() {
                output.push(self.call_item(i, &c.name, &c.arguments, "completed"));
            }
        }
        let incomplete = done && self.answer.finish == Some("length");
        let status = match (done, incomplete) {
            (false, _) => "in_progress",
            (true, true) => "incomplete",
            (true, false) => "completed",
        };
        json!({
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output,
            "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "error": null, "instructions": self.echo.instructions,
            "tools": self.echo.tools, "tool_choice": self.echo.tool_choice,
            "parallel_tool_calls": self.echo.parallel_tool_calls,
            "temperature": self.echo.temperature, "top_p": self.echo.top_p,
            "max_output_tokens": self.echo.max_output_tokens,
            "previous_response_id": null, "store": false, "truncation": "disabled",
            "text": {"format": {"type": "text"}}, "metadata": {},
            "usage": if done { self.usage() } else { Value::Null },
        })
    }

    fn usage(&self) -> Value {
        json!({
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.answer.cached_tokens},
            "output_tokens": self.answer.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens as u64 + u64::from(self.answer.output_tokens),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Open {
    Reasoning,
    Message,
    /// Call `i`, with its name.
    Call(usize, String),
}

/// The stream's items: the open one, its text so far, the next index.
#[derive(Debug, Default)]
pub struct Items {
    open: Option<(usize, Open)>,
    text: String,
    next: usize,
    sequence: u64,
}

impl Items {
    /// An event, numbered.
    pub fn event(&mut self, kind: &str, mut data: Value) -> Event {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        Event::default().event(kind).data(data.to_string())
    }

    /// The opening events: `response.created`, `response.in_progress`.
    pub fn opening(&mut self, reply: &Reply) -> Vec<Event> {
        let r = reply.response(false);
        vec![
            self.event("response.created", json!({"response": r})),
            self.event("response.in_progress", json!({"response": r})),
        ]
    }

    fn close_open(&mut self, reply: &Reply, out: &mut Vec<Event>) {
        let Some((index, open)) = self.open.take() else {
            return;
        };
        let text = std::mem::take(&mut self.text);
        let item = match open {
            Open::Reasoning => {
                let id = reply.reasoning_id();
                out.push(self.event(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                ));
                reply.reasoning_item(&text)
            }
            Open::Message => {
                let id = reply.message_id();
                let part =
                    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                out.push(self.event(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
                ));
                out.push(self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                ));
                reply.message_item(Some(&text), "completed")
            }
            Open::Call(i, name) => {
                out.push(self.event(
                    "response.function_call_arguments.done",
                    json!({"item_id": reply.call_item_id(i), "output_index": index,
                           "name": name, "arguments": text}),
                ));
                reply.call_item(i, &name, &text, "completed")
            }
        };
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        ));
    }

    /// Opens `open` unless it is the open item; returns its output index.
    fn enter(&mut self, reply: &Reply, open: Open, out: &mut Vec<Event>) -> usize {
        if let Some((index, current)) = &self.open {
            if *current == open {
                return *index;
            }
        }
        self.close_open(reply, out);
        let index = self.next;
        self.next += 1;
        let item = match &open {
            Open::Reasoning => {
                json!({"type": "reasoning", "id": reply.reasoning_id(), "summary": [], "content": []})
            }
            Open::Message => reply.message_item(None, "in_progress"),
            Open::Call(i, name) => reply.call_item(*i, name, "", "in_progress"),
        };
        out.push(self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        ));
        if open == Open::Message {
            out.push(self.event(
                "response.content_part.added",
                json!({"item_id": reply.message_id(), "output_index": index, "content_index": 0,
                       "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
            ));
        }
        self.open = Some((index, open));
        index
    }

    /// The events for `pieces`.
    pub fn events(&mut self, reply: &Reply, pieces: &[Piece]) -> Vec<Event> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Reasoning(t) => {
                    let index = self.enter(reply, Open::Reasoning, &mut out);
                    self.text.push_str(t);
                    let data = json!({"item_id": reply.reasoning_id(), "output_index": index,
                                      "content_index": 0, "delta": t});
                    out.push(self.event("response.reasoning_text.delta", data));
                }
                Piece::Content(t) => {
                    let index = self.enter(reply, Open::Message, &mut out);
                    self.text.push_str(t);
                    let data = json!({"item_id": reply.message_id(), "output_index": index,
                                      "content_index": 0, "delta": t, "logprobs": []});
                    out.push(self.event("response.output_text.delta", data));
                }
                Piece::CallStart { index, name } => {
                    self.enter(reply, Open::Call(*index, name.clone()), &mut out);
                }
                Piece::CallArguments { index, fragment } => {
                    let Some((output_index, Open::Call(open, _))) = &self.open else {
                        continue;
                    };
                    if open != index {
                        continue;
                    }
                    let data = json!({"item_id": reply.call_item_id(*index),
                                      "output_index": output_index, "delta": fragment});
                    self.text.push_str(fragment);
                    out.push(self.event("response.function_call_arguments.delta", data));
                }
            }
        }
        out
    }

    /// The open item's closing events, then `response.completed` (or
    /// `response.incomplete`) with the whole response.
    pub fn finish(&mut self, reply: &Reply) -> Vec<Event> {
        let mut out = Vec::new();
        if self.next == 0 && self.open.is_none() {
            // Nothing was said: the response still has its (empty) message.
            self.enter(reply, Open::Message, &mut out);
        }
        self.close_open(reply, &mut out);
        let response = reply.response(true);
        let kind = if response["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        out.push(self.event(kind, json!({"response": response})));
        out
    }
}

/// A response with its stream's item state: the Responses [`Dialect`].
#[derive(Debug)]
pub struct ResponsesAnswer {
    pub reply: Reply,
    items: Items,
}

impl ResponsesAnswer {
    pub fn new(reply: Reply) -> Self {
        Self {
            reply,
            items: Items::default(),
        }
    }
}

impl Dialect for ResponsesAnswer {
    fn id(&self) -> &str {
        &self.reply.id
    }

    fn answer(&mut self) -> &mut Answer {
        &mut self.reply.answer
    }

    fn body(&self) -> Value {
        self.reply.response(true)
    }

    fn opening(&mut self) -> Vec<Event> {
        self.items.opening(&self.reply)
    }

    fn events(&mut self, pieces: &[Piece]) -> Vec<Event> {
        self.items.events(&self.reply, pieces)
    }

    fn finish(&mut self) -> Vec<Event> {
        self.items.finish(&self.reply)
    }

    fn error_event(&mut self, e: &ApiError) -> Event {
        self.items.event("error", e.body()["error"].clone())
    }

    fn error_response(e: ApiError) -> Response {
        e.into_response()
    }

    const FIELDS: &'static [(&'static str, &'static str)] = &[
        ("prompt", "input"),
        ("max_tokens", "max_output_tokens"),
        ("lora", "model"),
    ];
}
