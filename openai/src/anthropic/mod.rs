//! Anthropic's Messages API on the same server: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens`.
//!
//! A request is translated ([`request`]) into the chat messages, tools and
//! plan of the OpenAI side and rendered with the same chat template, so a
//! conversation costs the same tokens either way. The answer is built from
//! the same output pieces ([`crate::chat_output`]): text, `thinking` and
//! `tool_use` content blocks, `stop_reason` (`end_turn`, `max_tokens`,
//! `stop_sequence` with the sequence that matched, `tool_use`), usage.
//! Streamed, it is Anthropic's event sequence ([`reply`]): `message_start`,
//! per block `content_block_start` / `content_block_delta` (`text_delta`,
//! `thinking_delta`, `input_json_delta`) / `content_block_stop`, then
//! `message_delta` and `message_stop`. Errors have Anthropic's shape with
//! the field at fault named. Clients authenticate with `x-api-key` (or a
//! bearer token), checked against the same keys.

mod reply;
pub mod request;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::ApiError;
use crate::params::Plan;
use crate::{body_bytes, parse, Inner};
use reply::{Messages, Reply};
use request::MessagesRequest;

fn prepare(
    api: &Inner,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Plan, Vec<u32>, Messages), ApiError> {
    let body = body_bytes(api, body)?;
    let req: MessagesRequest = parse(&body)?;
    let lora = api.check_model(req.model.as_deref())?;
    let mut plan = req.plan()?;
    plan.template.lora = lora;
    let messages = req.messages()?;
    let tools = req.tool_set()?;
    let (ids, output) = api.chat_prompt(&messages, tools.as_ref(), true, &mut plan)?;
    let reply = Reply::new(
        api.next_request_id("msg"),
        api.served_name(&plan.template.lora).to_string(),
        &output,
        ids.len(),
        req.stop_sequences.unwrap_or_default(),
    );
    Ok((plan, ids, Messages::new(reply)))
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(api): State<Arc<Inner>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    crate::single::prepare_and_respond(api, move |api| prepare(api, body)).await
}

/// One server-sent event of the Messages stream.
fn sse(name: &str, data: serde_json::Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as rendered for
/// `/v1/messages`.
pub(crate) async fn count_tokens(
    State(api): State<Arc<Inner>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let inner = api.clone();
    let counted = tokio::task::spawn_blocking(move || {
        let body = body_bytes(&inner, body)?;
        let mut req: MessagesRequest = parse(&body)?;
        inner.check_model(req.model.as_deref())?;
        // count_tokens takes no max_tokens; the plan wants one.
        req.max_tokens.get_or_insert(1);
        let mut plan = req.plan()?;
        let messages = req.messages()?;
        let tools = req.tool_set()?;
        let (ids, _) = inner.chat_prompt(&messages, tools.as_ref(), true, &mut plan)?;
        Ok::<_, ApiError>(ids.len())
    })
    .await
    .unwrap_or_else(|e| Err(ApiError::internal(format!("counting failed: {e}"))));
    match counted {
        Ok(n) => Json(json!({"input_tokens": n})).into_response(),
        Err(e) => e.into_anthropic_response(),
    }
}
