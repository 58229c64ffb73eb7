//! OpenAI's Responses API, stateless: `POST /v1/responses`.
//!
//! The request ([`request`]) becomes the same chat messages, tools and plan
//! as a chat completion and is rendered with the same template; the answer
//! is built from the same output pieces ([`crate::chat_output`]) as output
//! items: `reasoning`, a `message` with `output_text`, `function_call`s.
//! Streamed ([`reply`]), it is the Responses event sequence:
//! `response.created`, `response.in_progress`, per item
//! `response.output_item.added`, its deltas (`response.output_text.delta`,
//! `response.reasoning_text.delta`, `response.function_call_arguments.delta`)
//! and `…done` events, then `response.completed` (or
//! `response.incomplete` at `max_output_tokens`) carrying the whole
//! response, every event numbered. Nothing is stored: there is no
//! `previous_response_id` and no `GET /v1/responses/{id}`.

mod reply;
pub mod request;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use serde_json::json;

use crate::error::ApiError;
use crate::params::Plan;
use crate::tools::ToolChoice;
use crate::{body_bytes, parse, unix_now, Inner};
use reply::{Echo, Reply, ResponsesAnswer};
use request::ResponsesRequest;

fn prepare(
    api: &Inner,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Plan, Vec<u32>, ResponsesAnswer), ApiError> {
    let body = body_bytes(api, body)?;
    let req: ResponsesRequest = parse(&body)?;
    let lora = api.check_model(req.model.as_deref())?;
    let mut plan = req.plan()?;
    plan.template.lora = lora;
    let messages = req.messages()?;
    let tools = req.tool_set()?;
    let (ids, output) = api.chat_prompt(&messages, tools.as_ref(), true, &mut plan)?;
    let echo = Echo {
        instructions: req.instructions.clone(),
        tools: req.tools.clone().unwrap_or_default(),
        tool_choice: match tools.as_ref().map(|t| &t.choice) {
            None | Some(ToolChoice::Auto) => json!("auto"),
            Some(ToolChoice::None) => json!("none"),
            Some(ToolChoice::Required) => json!("required"),
            Some(ToolChoice::Named(name)) => json!({"type": "function", "name": name}),
        },
        parallel_tool_calls: tools.as_ref().is_none_or(|t| t.parallel),
        temperature: req.temperature,
        top_p: req.top_p,
        max_output_tokens: plan.template.max_tokens,
    };
    let reply = Reply::new(
        api.next_request_id("resp"),
        unix_now(),
        api.served_name(&plan.template.lora).to_string(),
        echo,
        &output,
        ids.len(),
    );
    Ok((plan, ids, ResponsesAnswer::new(reply)))
}

/// `POST /v1/responses`.
pub(crate) async fn create(
    State(api): State<Arc<Inner>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    crate::single::prepare_and_respond(api, move |api| prepare(api, body)).await
}
