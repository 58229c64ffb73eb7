//! What a client asks about the served model without generating: the model
//! list and one model (`/v1/models`, `/v1/models/{id}`: OpenAI's API), and
//! the tokens a prompt or a conversation costs and the text of token ids
//! (`/tokenize`, `/detokenize`: vLLM's extension, the same request shapes).
//!
//! A conversation is tokenized exactly as `/v1/chat/completions` would
//! tokenize the same body (its template, tools and `add_generation_prompt`),
//! so a client can count what a chat request will cost before sending it.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::params::ChatRequest;
use crate::{body_bytes, parse, ApiError, Inner};

/// Every model this server answers to: the base model and its loaded
/// adapters.
pub(crate) async fn models(State(api): State<Arc<Inner>>) -> Json<Value> {
    let adapters = api.adapters.as_ref().map(|a| a.names()).unwrap_or_default();
    let data: Vec<Value> = std::iter::once(api.model_object(&api.model))
        .chain(adapters.iter().map(|name| api.model_object(name)))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// One model by id (ids may hold `/`, as Hugging Face names do).
pub(crate) async fn model(State(api): State<Arc<Inner>>, Path(id): Path<String>) -> Response {
    match api.check_model(Some(&id)) {
        Ok(_) => Json(api.model_object(&id)).into_response(),
        Err(e) => e.into_response(),
    }
}

impl Inner {
    /// OpenAI's model object for the base model or one of its adapters.
    fn model_object(&self, id: &str) -> Value {
        let mut object = json!({
            "id": id,
            "object": "model",
            "created": self.created,
            "owned_by": "tandem",
        });
        if id != self.model {
            object["parent"] = json!(self.model);
        }
        object
    }
}

/// `/tokenize`'s options beside the prompt or the conversation.
#[derive(Debug, Deserialize)]
struct TokenizeOptions {
    model: Option<String>,
    prompt: Option<String>,
    /// A conversation (read whole by [`chat_ids`]; here only whether it is
    /// there).
    messages: Option<IgnoredAny>,
    /// Default: true for a prompt (as `/v1/completions` encodes it), false
    /// for a conversation (its template spells its special tokens).
    add_special_tokens: Option<bool>,
    #[serde(default)]
    return_token_strs: bool,
}

/// The token ids of `prompt`, or of `messages` rendered as a chat request
/// with the same body would render them.
pub(crate) async fn tokenize(
    State(api): State<Arc<Inner>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let inner = api.clone();
    let run = move || {
        let body = body_bytes(&inner, body)?;
        let options: TokenizeOptions = parse(&body)?;
        inner.check_model(options.model.as_deref())?;
        let ids = match (options.messages.is_some(), &options.prompt) {
            (true, Some(_)) => {
                return Err(ApiError::bad_param(
                    "prompt",
                    "give prompt or messages, not both",
                ))
            }
            (true, None) => chat_ids(&inner, &body, options.add_special_tokens)?,
            (false, Some(text)) => {
                let encoded = match options.add_special_tokens.unwrap_or(true) {
                    true => inner.tokenizer.encode(text),
                    false => inner.tokenizer.encode_plain(text),
                };
                encoded.map_err(|e| ApiError::bad_param("prompt", e.to_string()))?
            }
            (false, None) => return Err(ApiError::bad_param("prompt", "give prompt or messages")),
        };
        let strs = match options.return_token_strs {
            true => Some(token_strs(&inner, &ids)?),
            false => None,
        };
        Ok::<_, ApiError>(json!({"count": ids.len(), "tokens": ids, "token_strs": strs}))
    };
    match tokio::task::spawn_blocking(run).await {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(e) => ApiError::internal(format!("tokenizing failed: {e}")).into_response(),
    }
}

/// A conversation's ids as `/v1/chat/completions` computes them, the
/// tokenizer's special tokens added in front only when asked.
fn chat_ids(api: &Inner, body: &Bytes, add_special: Option<bool>) -> Result<Vec<u32>, ApiError> {
    let req: ChatRequest = parse(body)?;
    let mut plan = req.plan()?;
    let messages = req.messages()?;
    let tools = req.tool_set()?;
    let generation_prompt = req.add_generation_prompt.unwrap_or(true);
    let (ids, _) = api.chat_prompt(&messages, tools.as_ref(), generation_prompt, &mut plan)?;
    if !add_special.unwrap_or(false) {
        return Ok(ids);
    }
    // The tokenizer's added tokens are what it puts around empty text.
    let mut added = api
        .tokenizer
        .encode("")
        .map_err(|e| ApiError::internal(e.to_string()))?;
    added.extend(ids);
    Ok(added)
}

fn token_strs(api: &Inner, ids: &[u32]) -> Result<Vec<String>, ApiError> {
    ids.iter()
        .map(|&id| api.tokenizer.token_text(id))
        .collect::<Result<_, _>>()
        .map_err(|e| ApiError::internal(e.to_string()))
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

/// The text of token ids (special tokens skipped, as responses show text).
pub(crate) async fn detokenize(
    State(api): State<Arc<Inner>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = move || {
        let body = body_bytes(&api, body)?;
        let req: DetokenizeRequest = parse(&body)?;
        api.check_model(req.model.as_deref())?;
        let vocab = api.tokenizer.hf().get_vocab_size(true);
        if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad_param(
                "tokens",
                format!("token id {bad} is outside the vocabulary (size {vocab})"),
            ));
        }
        let text = api
            .tokenizer
            .decode(&req.tokens)
            .map_err(|e| ApiError::bad_param("tokens", e.to_string()))?;
        Ok::<_, ApiError>(json!({"prompt": text}))
    };
    match tokio::task::spawn_blocking(run).await {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(e) => ApiError::internal(format!("detokenizing failed: {e}")).into_response(),
    }
}
