//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`
//! with the status code OpenAI uses for the same failure.

use std::borrow::Cow;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tonic::Code;

/// A failed API call, as the client sees it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request parameter at fault, if one is (a path such as
    /// `messages.2.content.0.tool_use_id` where the field is nested).
    pub param: Option<Cow<'static, str>>,
    /// OpenAI's machine-readable code, e.g. `model_not_found`.
    pub code: Option<&'static str>,
    /// Seconds to wait before retrying (a 429 from a full engine queue):
    /// sent as the `Retry-After` header.
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// 400 `invalid_request_error`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 about one parameter.
    pub fn bad_param(param: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.into()),
            ..Self::bad_request(message)
        }
    }

    /// 501: this server does not do that (it names what does).
    pub fn not_implemented(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_IMPLEMENTED,
            ..Self::bad_request(message)
        }
    }

    /// 403: this server will not do that for anyone.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::FORBIDDEN,
            ..Self::bad_request(message)
        }
    }

    /// 429: every slot is busy; retry later.
    pub fn busy(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            retry_after: Some(1),
            ..Self::bad_request(message)
        }
    }

    /// 500: this server failed, not the request.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            ..Self::bad_request(message)
        }
    }

    /// 404 `model_not_found`.
    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            param: Some(Cow::Borrowed("model")),
            code: Some("model_not_found"),
            retry_after: None,
        }
    }

    /// 404 for a path the API does not have.
    pub fn no_route(path: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("No route for {path}."),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 401 `invalid_api_key`: the caller's API key is missing or wrong.
    pub fn unauthorized(reason: &tandem_security::ApiKeyError) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: format!("{reason}. Send your API key as `Authorization: Bearer <key>`."),
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
        }
    }

    /// 413: the request body is over the API's limit.
    pub fn body_too_large(limit: usize) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "The request body is larger than this server's limit of {limit} bytes."
            ),
            param: None,
            code: Some("request_too_large"),
            retry_after: None,
        }
    }

    /// OpenAI's `type` for this status.
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 404 | 405 | 413 | 415 | 422 => "invalid_request_error",
            401 => "authentication_error",
            429 => "rate_limit_error",
            _ => "server_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl ApiError {
    /// Anthropic's `error.type` for this status.
    pub fn anthropic_kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            400..=499 => "invalid_request_error",
            _ => "api_error",
        }
    }

    /// The body in Anthropic's shape: `{"type": "error", "error": {"type",
    /// "message"}}`, the field at fault leading the message.
    pub fn anthropic_body(&self) -> serde_json::Value {
        let message = match &self.param {
            Some(p) => format!("{p}: {}", self.message),
            None => self.message.clone(),
        };
        json!({
            "type": "error",
            "error": {"type": self.anthropic_kind(), "message": message},
        })
    }

    /// The response in Anthropic's shape (the Messages API).
    pub fn into_anthropic_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.anthropic_body())).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        response
    }
}

impl From<tonic::Status> for ApiError {
    /// The backend's gRPC status, mapped the way HTTP gateways map it.
    fn from(s: tonic::Status) -> Self {
        let status = match s.code() {
            Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
                StatusCode::BAD_REQUEST
            }
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        // The engine's retry hint (`retry-after` metadata, whole seconds).
        let retry_after = s
            .metadata()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        // The engine starts a refusal with the request field at fault.
        let param = (status == StatusCode::BAD_REQUEST)
            .then(|| engine_field(s.message()))
            .flatten()
            .map(|f| Cow::Owned(f.to_string()));
        Self {
            status,
            message: s.message().to_string(),
            param,
            code: None,
            retry_after,
        }
    }
}

/// The top-level request field an engine refusal names: its messages start
/// with the field's path and a colon (`max_tokens: …`, `prompt.token_ids:
/// …`) or with the field and `must` (`n must be …`). Only the generation
/// request's own fields count (a worker-plane message may start alike).
fn engine_field(message: &str) -> Option<&str> {
    let end = message.find(|c: char| !(c.is_ascii_lowercase() || c == '_' || c == '.'))?;
    let (path, rest) = message.split_at(end);
    let top = path.split('.').next()?;
    let named = rest.starts_with(':') || rest.starts_with(" must ");
    (named && REQUEST_FIELDS.contains(&top)).then_some(top)
}

/// The generation request's fields an engine refusal may name.
const REQUEST_FIELDS: &[&str] = &[
    "prompt",
    "max_tokens",
    "n",
    "best_of",
    "length_penalty",
    "logprobs",
    "prompt_logprobs",
    "stop",
    "stop_token_ids",
    "response_format",
    "lora",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
];

/// The engine's request fields that an HTTP API spells otherwise: the LoRA
/// adapter is chosen by `model` in every one of them.
pub(crate) const COMPLETIONS_FIELDS: &[(&str, &str)] = &[("lora", "model")];
/// As [`COMPLETIONS_FIELDS`] for APIs whose prompt is a conversation.
pub(crate) const MESSAGES_FIELDS: &[(&str, &str)] = &[("prompt", "messages"), ("lora", "model")];

/// How an engine refusal's field is spelled for an endpoint and request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Spelling {
    /// The engine fields the endpoint spells otherwise.
    pub fields: &'static [(&'static str, &'static str)],
    /// What the request called its output limit
    /// ([`crate::params::Plan::max_tokens_param`]).
    pub max_tokens: &'static str,
}

impl Spelling {
    pub(crate) fn apply(self, e: ApiError) -> ApiError {
        e.spelled(&[("max_tokens", self.max_tokens)])
            .spelled(self.fields)
    }
}

impl ApiError {
    /// This error with its `param` in the calling API's words (`fields`
    /// maps engine field names to that API's).
    pub(crate) fn spelled(mut self, fields: &[(&str, &'static str)]) -> Self {
        if let Some(p) = &self.param {
            if let Some(&(_, to)) = fields.iter().find(|(from, _)| from == p) {
                self.param = Some(Cow::Borrowed(to));
            }
        }
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_codes_map_to_http_statuses() {
        let cases = [
            (Code::InvalidArgument, 400),
            (Code::NotFound, 404),
            (Code::ResourceExhausted, 429),
            (Code::Unavailable, 503),
            (Code::Internal, 500),
        ];
        for (code, http) in cases {
            let e = ApiError::from(tonic::Status::new(code, "m"));
            assert_eq!(e.status.as_u16(), http, "{code:?}");
            assert_eq!(e.message, "m");
        }
    }

    #[test]
    fn an_engine_refusal_names_its_field_as_the_api_spells_it() {
        let param = |msg: &str, fields: &[(&str, &'static str)]| {
            ApiError::from(tonic::Status::invalid_argument(msg))
                .spelled(fields)
                .param
                .map(|p| p.into_owned())
        };
        let field = |msg: &str| param(msg, &[]);
        assert_eq!(
            field("max_tokens: prompt (3) + …").as_deref(),
            Some("max_tokens")
        );
        assert_eq!(field("n must be between 1 and 4").as_deref(), Some("n"));
        assert_eq!(
            field("prompt.token_ids: token id 9").as_deref(),
            Some("prompt")
        );
        assert_eq!(field("the engine stopped"), None);
        assert_eq!(field("mustard"), None);
        assert_eq!(field("layout: the workers' KV layouts differ"), None);
        assert_eq!(
            param("prompt: too long", MESSAGES_FIELDS).as_deref(),
            Some("messages")
        );
        assert_eq!(
            param("prompt: too long", COMPLETIONS_FIELDS).as_deref(),
            Some("prompt")
        );
        assert_eq!(
            param("lora: adapter `a`", COMPLETIONS_FIELDS).as_deref(),
            Some("model")
        );
        // Only a request's fault names a field.
        let e = ApiError::from(tonic::Status::internal("max_tokens: odd"));
        assert_eq!(e.param, None);
    }

    #[test]
    fn a_full_queue_is_a_429_with_retry_after() {
        let mut s = tonic::Status::resource_exhausted("full");
        s.metadata_mut()
            .insert("retry-after", tonic::metadata::MetadataValue::from(3u64));
        let e = ApiError::from(s);
        assert_eq!((e.status.as_u16(), e.retry_after), (429, Some(3)));
        assert_eq!(e.kind(), "rate_limit_error");
        let r = e.into_response();
        assert_eq!(r.headers()[axum::http::header::RETRY_AFTER], "3");
    }

    #[test]
    fn a_refused_key_is_a_401_authentication_error() {
        let e = ApiError::unauthorized(&tandem_security::ApiKeyError::Invalid);
        assert_eq!(e.status.as_u16(), 401);
        let b = e.body();
        assert_eq!(b["error"]["type"], "authentication_error");
        assert_eq!(b["error"]["code"], "invalid_api_key");
    }

    #[test]
    fn body_has_openai_shape() {
        let b = ApiError::model_not_found("gpt-x").body();
        assert_eq!(b["error"]["code"], "model_not_found");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["param"], "model");
        assert!(b["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("gpt-x"));
    }
}
