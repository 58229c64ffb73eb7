//! `tandem.v1.Chat`: the chat API over gRPC, for clients that speak
//! `tandem.v1` rather than HTTP.
//!
//! A call is translated into the HTTP chat request's own types and goes
//! down the same path: the messages, tools and `tool_choice` are checked by
//! [`ChatRequest::messages`] and [`ChatRequest::tool_set`], the
//! conversation is rendered and constrained by `chat_prompt`, and each
//! choice's text is parsed by a [`ChatOutput`]. So a gRPC reply carries the
//! same content, reasoning and tool calls as `/v1/chat/completions` does,
//! and its deltas concatenate into them. Generation settings travel as a
//! `GenerateRequest` without a prompt; prompt logprobs, `n`, beam search
//! and the rest behave as on `Generate`, and so does the call's deadline
//! (`grpc-timeout`, handed to the backend).

use std::pin::Pin;

use futures_util::{Stream, StreamExt};
use serde_json::{json, Value};
use tandem_proto::v1;
use tonic::{Code, Request, Response, Status};

use crate::chat_output::ChatOutput;
use crate::error::ApiError;
use crate::params::{ChatMessageIn, ChatRequest, CommonParams, Content, Plan};
use crate::tools::parse::{OutputFormat, Piece};
use crate::{Inner, OpenAi};

/// The `Chat` service over an [`OpenAi`] translator (its backend,
/// tokenizer, template and tool syntax).
#[derive(Debug, Clone)]
pub struct ChatService {
    api: OpenAi,
}

impl OpenAi {
    /// The `tandem.v1.Chat` service over the same backend and template.
    pub fn chat_service(&self) -> ChatService {
        ChatService { api: self.clone() }
    }
}

type ChatStream = Pin<Box<dyn Stream<Item = Result<v1::ChatResponse, Status>> + Send>>;

#[tonic::async_trait]
impl v1::chat_server::Chat for ChatService {
    type ChatStream = ChatStream;

    async fn chat(
        &self,
        request: Request<v1::ChatRequest>,
    ) -> Result<Response<Self::ChatStream>, Status> {
        let api = self.api.inner.clone();
        // The caller's deadline goes on to the backend, which honours it.
        let timeout = tandem_proto::deadline::grpc_timeout(request.metadata());
        let req = request.into_inner();
        // Rendering and tokenizing a long conversation take milliseconds of
        // CPU: on the blocking pool.
        let inner = api.clone();
        let (id, plan, ids, format) = tokio::task::spawn_blocking(move || prepare(&inner, req))
            .await
            .map_err(|e| Status::internal(format!("preparing the chat prompt failed: {e}")))?
            .map_err(status_of)?;
        let prompt = v1::generate_request::Prompt::TokenIds(v1::TokenIds { ids });
        let events = api
            .start(&id, &plan, vec![prompt], timeout)
            .await
            .map_err(status_of)?;
        let mut replies = Replies {
            id: id.clone(),
            format,
            outputs: Vec::new(),
        };
        let stream = events.flat_map(move |(_, item)| {
            let out = match item {
                Ok(msg) => replies.translate(msg).into_iter().map(Ok).collect(),
                Err(status) => vec![Err(status)],
            };
            futures_util::stream::iter(out)
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// Checks and renders a call: its id, plan, prompt ids and output format.
fn prepare(
    api: &Inner,
    req: v1::ChatRequest,
) -> Result<(String, Plan, Vec<u32>, OutputFormat), ApiError> {
    if api.chat.is_none() {
        return Err(ApiError {
            status: axum::http::StatusCode::PRECONDITION_FAILED,
            ..ApiError::bad_request("this model has no chat template; use Generate")
        });
    }
    let mut template = req.generation.unwrap_or_default();
    if template.prompt.is_some() {
        return Err(ApiError::bad_param(
            "generation.prompt",
            "must be empty: the prompt is the rendered conversation",
        ));
    }
    let id = if template.request_id.is_empty() {
        api.next_request_id("chatcmpl")
    } else {
        std::mem::take(&mut template.request_id)
    };
    let chat = ChatRequest {
        messages: req.messages.into_iter().map(message_in).collect(),
        logprobs: None,
        top_logprobs: None,
        tools: tools_in(req.tools)?,
        tool_choice: req.tool_choice.and_then(tool_choice_in),
        parallel_tool_calls: req.parallel_tool_calls,
        add_generation_prompt: req.add_generation_prompt,
        common: CommonParams::default(),
    };
    let messages = chat.messages()?;
    let tools = chat.tool_set()?;
    let mut plan = Plan {
        n: template.n.max(1),
        template,
        stream: true,
        include_usage: false,
        echo: false,
        report_prompt_logprobs: false,
        max_tokens_param: "max_tokens",
    };
    let (ids, format) = api.chat_prompt(
        &messages,
        tools.as_ref(),
        chat.add_generation_prompt.unwrap_or(true),
        &mut plan,
    )?;
    Ok((id, plan, ids, format))
}

/// A message in the HTTP request's shape.
fn message_in(m: v1::ChatMessage) -> ChatMessageIn {
    let calls: Vec<Value> = m
        .tool_calls
        .into_iter()
        .map(|c| {
            json!({"id": c.id, "type": "function",
                   "function": {"name": c.name, "arguments": c.arguments}})
        })
        .collect();
    let some = |s: String| (!s.is_empty()).then_some(s);
    ChatMessageIn {
        content: (!m.content.is_empty() || calls.is_empty()).then_some(Content::Text(m.content)),
        role: m.role,
        tool_calls: (!calls.is_empty()).then_some(calls),
        tool_call_id: some(m.tool_call_id),
        name: some(m.name),
        reasoning_content: some(m.reasoning_content),
    }
}

/// Tools in OpenAI's shape (`{"type": "function", "function": {...}}`).
fn tools_in(tools: Vec<v1::Tool>) -> Result<Option<Vec<Value>>, ApiError> {
    if tools.is_empty() {
        return Ok(None);
    }
    tools
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let mut function = json!({"name": t.name});
            if !t.description.is_empty() {
                function["description"] = Value::String(t.description);
            }
            if !t.parameters.is_empty() {
                function["parameters"] = serde_json::from_str(&t.parameters).map_err(|e| {
                    ApiError::bad_param(
                        format!("tools[{i}].parameters"),
                        format!("the schema is not JSON: {e}"),
                    )
                })?;
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// `tool_choice` in OpenAI's shape.
fn tool_choice_in(c: v1::ToolChoice) -> Option<Value> {
    use v1::tool_choice::{Choice, Mode};
    Some(match c.choice? {
        Choice::Mode(m) => Value::String(
            match Mode::try_from(m).unwrap_or(Mode::Auto) {
                Mode::Auto => "auto",
                Mode::None => "none",
                Mode::Required => "required",
            }
            .into(),
        ),
        Choice::Function(name) => json!({"type": "function", "function": {"name": name}}),
    })
}

/// The gRPC status for an API error: its code by the HTTP status, its
/// message led by the field at fault.
fn status_of(e: ApiError) -> Status {
    use axum::http::StatusCode;
    let code = match e.status {
        StatusCode::BAD_REQUEST => Code::InvalidArgument,
        StatusCode::PRECONDITION_FAILED => Code::FailedPrecondition,
        StatusCode::NOT_FOUND => Code::NotFound,
        StatusCode::PAYLOAD_TOO_LARGE => Code::OutOfRange,
        StatusCode::TOO_MANY_REQUESTS => Code::ResourceExhausted,
        StatusCode::SERVICE_UNAVAILABLE => Code::Unavailable,
        StatusCode::GATEWAY_TIMEOUT => Code::DeadlineExceeded,
        StatusCode::NOT_IMPLEMENTED => Code::Unimplemented,
        _ => Code::Internal,
    };
    let message = match &e.param {
        Some(p) if !e.message.starts_with(p.as_ref()) => format!("{p}: {}", e.message),
        _ => e.message,
    };
    Status::new(code, message)
}

/// One call's choices, parsed as their text arrives.
struct Replies {
    id: String,
    format: OutputFormat,
    outputs: Vec<ChatOutput>,
}

impl Replies {
    fn output(&mut self, index: usize) -> &mut ChatOutput {
        while self.outputs.len() <= index {
            let tag = self.id.rsplit('-').next().unwrap_or_default();
            let i = self.outputs.len();
            self.outputs
                .push(ChatOutput::new(&self.format, format!("call_{tag}_{i}_")));
        }
        &mut self.outputs[index]
    }

    /// The replies for one backend event: a parsed delta, the prompt's
    /// scores, or (after whatever the parsers held back) the end.
    fn translate(&mut self, msg: v1::GenerateResponse) -> Vec<v1::ChatResponse> {
        use v1::chat_response::Event;
        let id = self.id.clone();
        let reply = |event| v1::ChatResponse {
            request_id: id.clone(),
            event: Some(event),
        };
        match msg.event {
            Some(v1::generate_response::Event::Delta(d)) => {
                let ended = d.finish_reason != v1::FinishReason::Unspecified as i32;
                let out = self.output(d.index as usize);
                let pieces = out.push(&d.text, ended);
                let mut delta = chat_delta(out, d.index, &pieces);
                delta.token_ids = d.token_ids;
                delta.logprobs = d.logprobs;
                delta.finish_reason = d.finish_reason;
                delta.tool_calls_finish = ended
                    && out.finish_reason(crate::response::finish_reason(d.finish_reason))
                        == Some("tool_calls");
                vec![reply(Event::Delta(delta))]
            }
            Some(v1::generate_response::Event::Finished(f)) => {
                let mut replies = Vec::new();
                for (index, out) in self.outputs.iter_mut().enumerate() {
                    let pieces = out.close();
                    if !pieces.is_empty() {
                        replies.push(Event::Delta(chat_delta(out, index as u32, &pieces)));
                    }
                }
                replies.push(Event::Finished(f));
                replies.into_iter().map(reply).collect()
            }
            Some(v1::generate_response::Event::PromptLogprobs(p)) => {
                vec![reply(Event::PromptLogprobs(p))]
            }
            None => Vec::new(),
        }
    }
}

/// A delta with `pieces`' content, reasoning and call pieces.
fn chat_delta(out: &ChatOutput, index: u32, pieces: &[Piece]) -> v1::ChatDelta {
    let g = out.gather(pieces);
    v1::ChatDelta {
        index,
        content: g.content,
        reasoning_content: g.reasoning,
        tool_calls: g
            .calls
            .into_iter()
            .map(|c| {
                let (id, name) = c.start.unwrap_or_default();
                v1::ToolCallDelta {
                    index: c.index as u32,
                    id,
                    name,
                    arguments: c.arguments,
                }
            })
            .collect(),
        ..Default::default()
    }
}
