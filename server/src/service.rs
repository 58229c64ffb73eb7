//! The `tandem.v1.Generation` service over an [`EngineHandle`].
//!
//! The same service fronts the colocated server and decode workers. A
//! decode worker also serves the worker-internal `tandem.worker.v1.Decode`:
//! the router's `RoutedGenerateRequest`, whose typed `prefill` placement
//! becomes the request's [`PrefillMode::Remote`]. The engine's stream starts
//! that prefill through the decode worker's prefiller (see
//! `tandem_engine::serving::remote`); this service only translates. The
//! public `Generate` always prefills locally: nothing a client sends can
//! point a worker at a prefill peer. Dropping the response stream (a client
//! that went away) drops the engine's stream, which cancels the prefill as
//! well as the request.
//!
//! Observability: each call gets a `generate` span (a child of the
//! caller's span when the call carries a W3C `traceparent`) that lives as
//! long as the response stream and is the parent of the engine's phase
//! spans; every log line about the request is inside it, so it names the
//! `request_id`. When the request ends, [`ServingMetrics`] records how, and
//! its timings.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use tandem_engine::serving::{
    EngineHandle, FailureScope, PrefillMode, PrefillPlacement, RequestEvent, RequestFailure,
    RequestStream, Resume, ResumedChoice,
};
use tandem_engine::EngineError;
use tandem_proto::v1;
use tandem_proto::worker::v1 as wv1;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Request, Response, Status};

use crate::convert::{event_to_proto, request_from_proto};
use crate::metrics::{Outcome, ServingMetrics};

/// Serves `Generate` from a local engine.
#[derive(Debug, Clone)]
pub struct GenerationService {
    engine: EngineHandle,
    metrics: Arc<ServingMetrics>,
}

impl GenerationService {
    /// Prefills everything locally. Its metrics go to a registry of its own
    /// until [`Self::with_metrics`] names the process's.
    pub fn new(engine: EngineHandle) -> Self {
        Self {
            engine,
            metrics: ServingMetrics::register(&tandem_telemetry::Registry::new()),
        }
    }

    /// Records requests in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<ServingMetrics>) -> Self {
        self.metrics = metrics;
        self
    }
}

/// The metadata key of a refusal's retry hint, in whole seconds (as HTTP's
/// `Retry-After`).
pub const RETRY_AFTER_HEADER: &str = "retry-after";

/// Maps an engine error to a gRPC status. A full queue is
/// RESOURCE_EXHAUSTED with a `retry-after` hint.
pub fn status_from_engine(e: EngineError) -> Status {
    match e {
        EngineError::InvalidRequest(msg) => Status::invalid_argument(msg),
        EngineError::Tokenizer(msg) => Status::invalid_argument(format!("prompt: {msg}")),
        EngineError::Overloaded { retry_after, .. } => {
            let mut status = Status::resource_exhausted(e.to_string());
            let secs = retry_after.as_secs_f64().ceil().max(1.0) as u64;
            status
                .metadata_mut()
                .insert(RETRY_AFTER_HEADER, MetadataValue::from(secs));
            status
        }
        EngineError::Stopped(_) => Status::unavailable(e.to_string()),
        // The compute backend failed: the worker may be broken.
        EngineError::Backend { .. } => Status::internal(e.to_string()),
        // Anything else went wrong with this request only.
        other => tandem_proto::worker::request_error(Status::internal(other.to_string())),
    }
}

/// A failed request's status: `INTERNAL`, marked as the request's own
/// unless the engine failed (then the router may take the worker for
/// broken, and should).
pub fn status_from_failure(failure: RequestFailure) -> Status {
    match failure.scope {
        FailureScope::Request => {
            tandem_proto::worker::request_error(Status::internal(failure.message))
        }
        FailureScope::Engine => Status::internal(failure.message),
        FailureScope::HandedOver => {
            tandem_proto::worker::handed_over(Status::unavailable(failure.message))
        }
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<v1::GenerateResponse, Status>> + Send>>;

/// What the response stream owns: dropping it aborts the request and
/// cancels its remote prefill.
struct CallState {
    events: RequestStream,
    request_id: String,
    ended: bool,
    /// The call's span: ends when the stream is dropped.
    span: tracing::Span,
    metrics: Arc<ServingMetrics>,
    /// The client's deadline (`grpc-timeout`): past it the stream ends with
    /// DEADLINE_EXCEEDED and dropping the state aborts the request.
    deadline: Option<tokio::time::Instant>,
    /// The LoRA adapter it runs under, for the per-adapter counters.
    lora: Option<String>,
}

impl CallState {
    fn end(&mut self, outcome: Outcome) {
        self.ended = true;
        self.span.record("outcome", outcome.as_str());
        if outcome != Outcome::Finished {
            self.metrics.ended(outcome);
        }
    }
}

impl Drop for CallState {
    fn drop(&mut self) {
        if !self.ended {
            self.end(Outcome::Cancelled);
            tracing::debug!(parent: &self.span, "request cancelled");
        }
    }
}

impl CallState {
    /// The next message for the client, or DEADLINE_EXCEEDED once the
    /// client's deadline has passed.
    async fn next(&mut self) -> Option<Result<v1::GenerateResponse, Status>> {
        let Some(deadline) = self.deadline else {
            return self.next_event().await;
        };
        match tokio::time::timeout_at(deadline, self.next_event()).await {
            Ok(item) => item,
            Err(_) if self.ended => None,
            Err(_) => {
                self.end(Outcome::DeadlineExceeded);
                self.events.abort();
                tracing::debug!(parent: &self.span, "deadline exceeded");
                Some(Err(Status::deadline_exceeded(
                    "the request's deadline (grpc-timeout) passed before it ended",
                )))
            }
        }
    }

    /// The next message for the client.
    async fn next_event(&mut self) -> Option<Result<v1::GenerateResponse, Status>> {
        if self.ended {
            return None;
        }
        let Some(ev) = self.events.next().await else {
            self.end(Outcome::Error);
            return Some(Err(Status::unavailable(
                "the engine stopped before the request ended",
            )));
        };
        match &ev {
            RequestEvent::Finished(summary) => {
                self.metrics.finished(summary, self.lora.as_deref());
                self.end(Outcome::Finished);
            }
            RequestEvent::Error(e) if e.scope == FailureScope::HandedOver => {
                tracing::info!(parent: &self.span, "request handed over");
                self.end(Outcome::HandedOver);
            }
            RequestEvent::Error(e) => {
                tracing::warn!(parent: &self.span, error = %e, "request failed");
                self.end(Outcome::Error);
            }
            _ => {}
        }
        Some(match event_to_proto(&self.request_id, ev) {
            Ok(msg) => Ok(msg),
            Err(e) => {
                if !self.ended {
                    self.end(Outcome::Error);
                }
                Err(status_from_failure(e))
            }
        })
    }
}

#[tonic::async_trait]
impl v1::generation_server::Generation for GenerationService {
    type GenerateStream = ResponseStream;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let metadata = request.metadata().clone();
        self.serve(metadata, request.into_inner(), None, None).await
    }
}

#[tonic::async_trait]
impl wv1::decode_server::Decode for GenerationService {
    type GenerateStream = ResponseStream;

    async fn generate(
        &self,
        request: Request<wv1::RoutedGenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let metadata = request.metadata().clone();
        let routed = request.into_inner();
        let Some(inner) = routed.request else {
            return Err(Status::invalid_argument(
                "RoutedGenerateRequest.request is required",
            ));
        };
        let placement = routed
            .prefill
            .filter(|p| !p.worker.is_empty())
            .map(|p| PrefillPlacement {
                worker: p.worker,
                min_uncached: p.min_uncached_tokens.max(1) as usize,
            });
        let resume = routed.resume.map(resume_from_proto).transpose()?;
        self.serve(metadata, inner, placement, resume).await
    }
}

impl GenerationService {
    /// One call: `placement` is the router's (`None` from the public API,
    /// or when the router chose local prefill).
    async fn serve(
        &self,
        metadata: MetadataMap,
        request: v1::GenerateRequest,
        placement: Option<PrefillPlacement>,
        resume: Option<Resume>,
    ) -> Result<Response<ResponseStream>, Status> {
        let deadline = tandem_proto::deadline::grpc_timeout(&metadata)
            .map(|t| tokio::time::Instant::now() + t);
        let span = tracing::info_span!(
            "generate",
            otel.kind = "server",
            request_id = tracing::field::Empty,
            remote_prefill = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        tandem_telemetry::propagation::set_parent(&span, &metadata);
        let mut req = match request_from_proto(request) {
            Ok(r) => r,
            Err(e) => {
                self.metrics.ended(Outcome::Invalid);
                span.record("outcome", Outcome::Invalid.as_str());
                return Err(Status::invalid_argument(e.0));
            }
        };
        if req.request_id.is_empty() {
            req.request_id = new_request_id();
        }
        req.resume = resume;
        span.record("request_id", req.request_id.as_str());
        span.record("remote_prefill", placement.is_some());
        if let Some(placement) = placement {
            req.prefill = PrefillMode::Remote(placement);
        }
        let request_id = req.request_id.clone();
        let lora = req.lora.clone();
        req.span = span.clone();
        // Validation tokenizes text prompts and compiles response formats:
        // milliseconds to seconds of CPU, run on the blocking pool so the
        // async threads keep serving every other call's I/O.
        let (engine, submit_span) = (self.engine.clone(), span.clone());
        let submitted =
            tokio::task::spawn_blocking(move || submit_span.in_scope(|| engine.submit(req)))
                .await
                .unwrap_or_else(|e| {
                    Err(EngineError::Stopped(format!(
                        "the request's validation task failed: {e}"
                    )))
                });
        let events = match submitted {
            Ok(ev) => ev,
            Err(e) => {
                let outcome = match e {
                    EngineError::InvalidRequest(_) | EngineError::Tokenizer(_) => Outcome::Invalid,
                    EngineError::Overloaded { .. } => Outcome::Overloaded,
                    _ => Outcome::Error,
                };
                self.metrics.ended(outcome);
                span.record("outcome", outcome.as_str());
                tracing::debug!(parent: &span, error = %e, "request refused");
                return Err(status_from_engine(e));
            }
        };
        tracing::debug!(parent: &span, "request accepted");
        let state = CallState {
            events,
            request_id,
            ended: false,
            span,
            metrics: self.metrics.clone(),
            deadline,
            lora,
        };
        // The state moves into the response stream: when tonic drops it (the
        // call ends or the client goes away), the request is aborted.
        let stream = futures_util::stream::unfold(state, |mut st| async move {
            let item = st.next().await?;
            Some((item, st))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// The router's resume, as the engine takes it.
fn resume_from_proto(r: wv1::Resume) -> Result<Resume, Status> {
    let seconds = |s: f64, field: &str| {
        Duration::try_from_secs_f64(s).map_err(|_| {
            Status::invalid_argument(format!(
                "RoutedGenerateRequest.resume.{field}: {s} is not a duration"
            ))
        })
    };
    Ok(Resume {
        choices: r
            .choices
            .into_iter()
            .map(|c| ResumedChoice {
                index: c.index,
                tokens: c.token_ids,
            })
            .collect(),
        elapsed: seconds(r.elapsed_s, "elapsed_s")?,
        first_token_after: r
            .first_token_s
            .map(|s| seconds(s, "first_token_s"))
            .transpose()?,
    })
}

fn new_request_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("req-{}-{n}", std::process::id())
}
