//! The `tandem.v1.Generation` service over an [`EngineHandle`].

use std::pin::Pin;

use futures_util::Stream;
use tandem_engine::serving::{EngineHandle, RequestEvent};
use tandem_engine::EngineError;
use tandem_proto::v1;
use tonic::{Request, Response, Status};

use crate::convert::{event_to_proto, request_from_proto};

/// Serves `Generate` from a local engine.
#[derive(Debug, Clone)]
pub struct GenerationService {
    engine: EngineHandle,
}

impl GenerationService {
    pub fn new(engine: EngineHandle) -> Self {
        Self { engine }
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

#[tonic::async_trait]
impl v1::generation_server::Generation for GenerationService {
    type GenerateStream = ResponseStream;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let mut req =
            request_from_proto(request.into_inner()).map_err(|e| Status::invalid_argument(e.0))?;
        if req.request_id.is_empty() {
            req.request_id = new_request_id();
        }
        let request_id = req.request_id.clone();
        let events = self.engine.submit(req).map_err(status_from_engine)?;
        tracing::debug!(%request_id, "request accepted");
        // The engine stream moves into the response stream: when tonic drops
        // it (the call ends or the client goes away), the request is aborted.
        let stream = futures_util::stream::unfold(
            (events, request_id, false),
            |(mut events, id, ended)| async move {
                if ended {
                    return None;
                }
                let Some(ev) = events.next().await else {
                    // The engine went away before the request's end.
                    let status = Status::unavailable("the engine stopped before the request ended");
                    return Some((Err(status), (events, id, true)));
                };
                let last = matches!(ev, RequestEvent::Finished(_));
                match event_to_proto(&id, ev) {
                    Ok(msg) => Some((Ok(msg), (events, id, last))),
                    Err(e) => Some((Err(Status::internal(e)), (events, id, true))),
                }
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }
}

fn new_request_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("req-{}-{n}", std::process::id())
}
