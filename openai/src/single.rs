//! Answers of one prompt and one choice — Anthropic's Messages and OpenAI's
//! Responses — driven the same way: the backend's events are folded into
//! an [`Answer`] (the parsed output, usage, finish reason, matched stop),
//! and a [`Dialect`] says what that answer looks like on the wire, as one
//! body or as its event stream.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{stream, StreamExt};
use serde_json::Value;
use tandem_proto::v1;

use crate::chat_output::ChatOutput;
use crate::error::{ApiError, Spelling};
use crate::params::Plan;
use crate::tools::parse::Piece;
use crate::Inner;

/// One choice's answer as the backend's events arrive.
#[derive(Debug)]
pub(crate) struct Answer {
    pub output: ChatOutput,
    pub output_tokens: u32,
    pub cached_tokens: u32,
    /// The engine's finish reason (OpenAI's words).
    pub finish: Option<&'static str>,
    /// The stop string that ended it, if one did.
    pub matched_stop: Option<String>,
}

impl Answer {
    pub fn new(output: ChatOutput) -> Self {
        Self {
            output,
            output_tokens: 0,
            cached_tokens: 0,
            finish: None,
            matched_stop: None,
        }
    }

    /// Folds in one backend event; returns the output pieces it completed.
    pub fn add(&mut self, msg: v1::GenerateResponse) -> Vec<Piece> {
        match msg.event {
            Some(v1::generate_response::Event::Delta(d)) => {
                let finish = crate::response::finish_reason(d.finish_reason);
                if finish.is_some() {
                    self.finish = finish;
                }
                self.output.push(&d.text, finish.is_some())
            }
            Some(v1::generate_response::Event::Finished(f)) => {
                if let Some(u) = &f.usage {
                    self.output_tokens = u.completion_tokens;
                    self.cached_tokens = u.cached_tokens;
                }
                if let Some(c) = f.choices.first() {
                    if !c.matched_stop.is_empty() {
                        self.matched_stop = Some(c.matched_stop.clone());
                    }
                    self.finish = self
                        .finish
                        .or_else(|| crate::response::finish_reason(c.finish_reason));
                }
                Vec::new()
            }
            Some(v1::generate_response::Event::PromptLogprobs(_)) | None => Vec::new(),
        }
    }

    /// What was held back, once the backend is done.
    pub fn close(&mut self) -> Vec<Piece> {
        self.output.close()
    }
}

/// An endpoint's wire format for an [`Answer`].
pub(crate) trait Dialect: Send + 'static {
    /// The response's id (also the backend request's).
    fn id(&self) -> &str;
    fn answer(&mut self) -> &mut Answer;
    /// The unstreamed body.
    fn body(&self) -> Value;
    /// The stream's first events.
    fn opening(&mut self) -> Vec<Event>;
    /// The events for newly parsed pieces.
    fn events(&mut self, pieces: &[Piece]) -> Vec<Event>;
    /// The stream's last events, once the backend is done.
    fn finish(&mut self) -> Vec<Event>;
    /// A backend failure mid-stream (the status line is long gone).
    fn error_event(&mut self, e: &ApiError) -> Event;
    /// A failure before anything was sent.
    fn error_response(e: ApiError) -> Response;
    /// The engine's request fields this API spells otherwise
    /// ([`ApiError::spelled`]).
    const FIELDS: &'static [(&'static str, &'static str)];
}

/// Prepares a request on the blocking pool (parsing, rendering and
/// tokenizing a long conversation take milliseconds of CPU), then runs
/// its prompt and answers in its dialect.
pub(crate) async fn prepare_and_respond<D: Dialect>(
    api: Arc<Inner>,
    prepare: impl FnOnce(&Inner) -> Result<(Plan, Vec<u32>, D), ApiError> + Send + 'static,
) -> Response {
    let inner = api.clone();
    let prepared = tokio::task::spawn_blocking(move || prepare(&inner))
        .await
        .unwrap_or_else(|e| {
            Err(ApiError::internal(format!(
                "preparing the prompt failed: {e}"
            )))
        });
    match prepared {
        Ok((plan, ids, dialect)) => respond(&api, &plan, ids, dialect).await,
        Err(e) => D::error_response(e),
    }
}

/// Runs `ids` with `plan` and answers in `dialect`, streamed or not.
async fn respond<D: Dialect>(api: &Inner, plan: &Plan, ids: Vec<u32>, mut dialect: D) -> Response {
    let prompt = v1::generate_request::Prompt::TokenIds(v1::TokenIds { ids });
    let id = dialect.id().to_string();
    let spelling = Spelling {
        fields: D::FIELDS,
        max_tokens: plan.max_tokens_param,
    };
    let mut events = match api.start(&id, plan, vec![prompt], None).await {
        Ok(s) => s,
        Err(e) => return D::error_response(spelling.apply(e)),
    };
    tracing::debug!(%id, stream = plan.stream, "single-choice request");
    if !plan.stream {
        while let Some((_, item)) = events.next().await {
            match item {
                Ok(msg) => {
                    dialect.answer().add(msg);
                }
                Err(status) => return D::error_response(spelling.apply(ApiError::from(status))),
            }
        }
        dialect.answer().close();
        return Json(dialect.body()).into_response();
    }
    let opening = dialect.opening();
    let state = (events, dialect, false);
    let body = stream::iter(opening).chain(
        stream::unfold(state, move |(mut events, mut dialect, done)| async move {
            if done {
                return None;
            }
            loop {
                match events.next().await {
                    Some((_, Ok(msg))) => {
                        let pieces = dialect.answer().add(msg);
                        let out = dialect.events(&pieces);
                        if !out.is_empty() {
                            return Some((out, (events, dialect, false)));
                        }
                    }
                    Some((_, Err(status))) => {
                        let e = spelling.apply(ApiError::from(status));
                        let out = vec![dialect.error_event(&e)];
                        return Some((out, (events, dialect, true)));
                    }
                    None => {
                        let pieces = dialect.answer().close();
                        let mut out = dialect.events(&pieces);
                        out.extend(dialect.finish());
                        return Some((out, (events, dialect, true)));
                    }
                }
            }
        })
        .flat_map(stream::iter),
    );
    Sse::new(body.map(Ok::<_, Infallible>))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}
