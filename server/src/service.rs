//! The `tandem.v1.Generation` service over an [`EngineHandle`].
//!
//! The same service fronts the colocated server and decode workers. A
//! decode worker adds a [`RemotePrefiller`]: it picks each request's
//! [`PrefillMode`] from the call's metadata (the router names the prefill
//! worker) and, when the engine parks a request for remote prefill, starts
//! the transfer. The transfer's guard lives in the response stream, so a
//! client that goes away cancels the prefill as well as the request.

use std::pin::Pin;
use std::sync::Arc;

use futures_util::Stream;
use tandem_engine::serving::{
    EngineHandle, PrefillMode, RemotePrefill, RequestEvent, RequestStream,
};
use tandem_engine::EngineError;
use tandem_proto::v1;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};

use crate::convert::{event_to_proto, request_from_proto};

/// Gets prompts prefilled by another worker (decode workers only).
pub trait RemotePrefiller: Send + Sync + std::fmt::Debug + 'static {
    /// Where this call's prompt is computed.
    fn mode(&self, metadata: &MetadataMap) -> PrefillMode;

    /// Starts a remote prefill the engine asked for. It must end with
    /// `engine.finish_remote_prefill(prefill.transfer, ..)` (directly or
    /// through the transport); dropping the guard cancels it.
    fn start(
        &self,
        request_id: &str,
        metadata: &MetadataMap,
        prefill: RemotePrefill,
        engine: EngineHandle,
    ) -> PrefillGuard;
}

/// Cancels a remote prefill task when dropped.
#[derive(Debug, Default)]
pub struct PrefillGuard(Option<tokio::task::JoinHandle<()>>);

impl PrefillGuard {
    /// Guards a spawned task.
    pub fn new(task: tokio::task::JoinHandle<()>) -> Self {
        Self(Some(task))
    }
}

impl Drop for PrefillGuard {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.abort();
        }
    }
}

/// Serves `Generate` from a local engine.
#[derive(Debug, Clone)]
pub struct GenerationService {
    engine: EngineHandle,
    prefiller: Option<Arc<dyn RemotePrefiller>>,
}

impl GenerationService {
    /// Prefills everything locally.
    pub fn new(engine: EngineHandle) -> Self {
        Self {
            engine,
            prefiller: None,
        }
    }

    /// Prefills remotely where `prefiller` says so.
    pub fn with_prefiller(engine: EngineHandle, prefiller: Arc<dyn RemotePrefiller>) -> Self {
        Self {
            engine,
            prefiller: Some(prefiller),
        }
    }
}

/// Maps an engine error to a gRPC status.
pub fn status_from_engine(e: EngineError) -> Status {
    match e {
        EngineError::InvalidRequest(msg) => Status::invalid_argument(msg),
        EngineError::Tokenizer(msg) => Status::invalid_argument(format!("prompt: {msg}")),
        other => Status::internal(other.to_string()),
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<v1::GenerateResponse, Status>> + Send>>;

/// What the response stream owns: dropping it aborts the request and
/// cancels its remote prefill.
struct CallState {
    events: RequestStream,
    request_id: String,
    ended: bool,
    metadata: MetadataMap,
    engine: EngineHandle,
    prefiller: Option<Arc<dyn RemotePrefiller>>,
    prefills: Vec<PrefillGuard>,
}

impl CallState {
    /// The next message for the client, handling remote-prefill events.
    async fn next(&mut self) -> Option<Result<v1::GenerateResponse, Status>> {
        if self.ended {
            return None;
        }
        loop {
            let Some(ev) = self.events.next().await else {
                self.ended = true;
                return Some(Err(Status::unavailable(
                    "the engine stopped before the request ended",
                )));
            };
            if let RequestEvent::RemotePrefill(rp) = ev {
                match &self.prefiller {
                    Some(p) => self.prefills.push(p.start(
                        &self.request_id,
                        &self.metadata,
                        rp,
                        self.engine.clone(),
                    )),
                    // Nobody to ask: compute it here.
                    None => self
                        .engine
                        .finish_remote_prefill(rp.transfer, Err("no prefill worker".into())),
                }
                continue;
            }
            if matches!(ev, RequestEvent::Finished(_)) {
                self.ended = true;
                self.prefills.clear();
            }
            return Some(match event_to_proto(&self.request_id, ev) {
                Ok(msg) => Ok(msg),
                Err(e) => {
                    self.ended = true;
                    Err(Status::internal(e))
                }
            });
        }
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
        let mut req =
            request_from_proto(request.into_inner()).map_err(|e| Status::invalid_argument(e.0))?;
        if req.request_id.is_empty() {
            req.request_id = new_request_id();
        }
        if let Some(p) = &self.prefiller {
            req.prefill = p.mode(&metadata);
        }
        let request_id = req.request_id.clone();
        let events = self.engine.submit(req).map_err(status_from_engine)?;
        tracing::debug!(%request_id, "request accepted");
        let state = CallState {
            events,
            request_id,
            ended: false,
            metadata,
            engine: self.engine.clone(),
            prefiller: self.prefiller.clone(),
            prefills: Vec::new(),
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

fn new_request_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("req-{}-{n}", std::process::id())
}
