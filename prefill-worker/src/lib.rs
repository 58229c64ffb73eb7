//! The prefill pool worker.
//!
//! A decode worker calls `Prefill` with the prompt (minus its last token),
//! the first logical block it lacks, its destination block ids and its
//! transfer endpoint. This worker runs the prompt through its own engine as
//! an export request (chunked, reusing its own prefix cache) and, as soon as
//! each layer of a step is computed, copies that layer's blocks out and
//! queues them on the transfer session: the network moves layer `l` while
//! layer `l + 1` computes. When the engine is done, the session's `finish`
//! waits until the decode worker has applied every block; only then does the
//! call return. Cancelling the call aborts both the engine request and the
//! transfer, so the decode worker frees its blocks.
//!
//! **Architecture Invariant:** a prefill worker never samples: the decode
//! worker computes the prompt's last token itself, so sampling state lives
//! in one place.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use tandem_engine::serving::{
    EngineHandle, ExportedBlock, KvExport, PrefillMode, Prompt, Request, RequestEvent,
};
use tandem_kv_transfer::{BlockWrite, KvLayoutDescriptor, Session, TransferId, Transport};
use tandem_proto::worker::v1 as wv1;
use tandem_server::{layout, status_from_engine};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio::sync::Mutex;
use tonic::{Request as GrpcRequest, Response, Status};

/// Serves `tandem.worker.v1.Prefill`.
#[derive(Debug, Clone)]
pub struct PrefillService {
    engine: EngineHandle,
    transport: Arc<dyn Transport>,
    layout: KvLayoutDescriptor,
    /// One session per decode worker, opened on first use.
    sessions: Arc<Mutex<HashMap<String, Arc<dyn Session>>>>,
}

impl PrefillService {
    pub fn new(
        engine: EngineHandle,
        transport: Arc<dyn Transport>,
        layout: KvLayoutDescriptor,
    ) -> Self {
        Self {
            engine,
            transport,
            layout,
            sessions: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    async fn session(&self, endpoint: &str) -> Result<Arc<dyn Session>, Status> {
        let mut sessions = self.sessions.lock().await;
        if let Some(s) = sessions.get(endpoint) {
            return Ok(s.clone());
        }
        let s: Arc<dyn Session> = Arc::from(
            self.transport
                .connect(endpoint, self.layout)
                .await
                .map_err(|e| Status::unavailable(format!("KV transfer to {endpoint}: {e}")))?,
        );
        sessions.insert(endpoint.to_string(), s.clone());
        Ok(s)
    }

    async fn forget_session(&self, endpoint: &str) {
        self.sessions.lock().await.remove(endpoint);
    }
}

/// Hands each computed layer's blocks to the writer task, renamed to the
/// decode worker's block ids.
#[derive(Debug)]
struct Exporter {
    from_block: usize,
    dst_blocks: Vec<u32>,
    out: UnboundedSender<Vec<BlockWrite>>,
}

impl KvExport for Exporter {
    fn layer_ready(&self, layer: usize, blocks: &[ExportedBlock<'_>]) {
        let batch: Vec<BlockWrite> = blocks
            .iter()
            .filter_map(|b| {
                let dst = *self
                    .dst_blocks
                    .get(b.logical.checked_sub(self.from_block)?)?;
                Some(BlockWrite {
                    layer: layer as u32,
                    dst_block: dst,
                    k: Bytes::copy_from_slice(bytemuck::cast_slice(b.k)),
                    v: Bytes::copy_from_slice(bytemuck::cast_slice(b.v)),
                })
            })
            .collect();
        if !batch.is_empty() {
            // A closed channel means the call was cancelled; nothing to do.
            let _ = self.out.send(batch);
        }
    }
}

/// Aborts a transfer unless disarmed (the call finished cleanly).
struct AbortOnDrop {
    session: Arc<dyn Session>,
    transfer: TransferId,
    armed: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let (session, transfer) = (self.session.clone(), self.transfer);
            tokio::spawn(async move {
                let _ = session.abort(transfer).await;
            });
        }
    }
}

#[tonic::async_trait]
impl wv1::prefill_server::Prefill for PrefillService {
    async fn prefill(
        &self,
        request: GrpcRequest<wv1::PrefillRequest>,
    ) -> Result<Response<wv1::PrefillReply>, Status> {
        let r = request.into_inner();
        let theirs = r
            .layout
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("layout: required"))
            .and_then(|l| layout::from_proto(l).map_err(Status::invalid_argument))?;
        self.layout
            .check_compatible(&theirs)
            .map_err(|e| Status::failed_precondition(format!("KV layout mismatch: {e}")))?;
        let from_block = r.from_block as usize;
        let bs = self.layout.block_size as usize;
        let needed = r.tokens.len().div_ceil(bs).saturating_sub(from_block);
        if r.dst_blocks.len() < needed {
            return Err(Status::invalid_argument(format!(
                "dst_blocks: {} blocks for {needed} blocks of prompt",
                r.dst_blocks.len()
            )));
        }
        let session = self.session(&r.transfer_endpoint).await?;
        let transfer = TransferId(r.transfer_id);
        let mut guard = AbortOnDrop {
            session: session.clone(),
            transfer,
            armed: true,
        };
        let (tx, mut rx) = unbounded_channel::<Vec<BlockWrite>>();
        let writer_session = session.clone();
        let writer = tokio::spawn(async move {
            let mut sent = 0usize;
            while let Some(batch) = rx.recv().await {
                sent += batch.len();
                writer_session.write(transfer, batch).await?;
            }
            Ok::<usize, tandem_kv_transfer::TransferError>(sent)
        });
        let exporter = Arc::new(Exporter {
            from_block,
            dst_blocks: r.dst_blocks,
            out: tx,
        });
        let mut req = Request::new(Prompt::Tokens(r.tokens), 1);
        req.request_id = r.request_id;
        req.max_tokens = None;
        req.prefill = PrefillMode::Export {
            sink: exporter,
            from_block,
        };
        let mut events = self.engine.submit(req).map_err(status_from_engine)?;
        let cached = loop {
            match events.next().await {
                Some(RequestEvent::Finished(s)) => break s.usage.cached_tokens,
                Some(RequestEvent::Error(e)) => return Err(Status::internal(e)),
                Some(_) => {}
                None => return Err(Status::unavailable("the engine stopped")),
            }
        };
        // The engine dropped its exporter with the finished request, which
        // closed the channel: the writer ends once it has sent everything.
        let sent = match writer.await {
            Ok(Ok(n)) => n,
            Ok(Err(e)) => {
                self.forget_session(session.endpoint()).await;
                return Err(Status::unavailable(format!("KV transfer failed: {e}")));
            }
            Err(e) => return Err(Status::internal(format!("transfer task: {e}"))),
        };
        session
            .finish(transfer)
            .await
            .map_err(|e| Status::unavailable(format!("KV transfer did not complete: {e}")))?;
        guard.armed = false;
        let blocks_sent =
            u32::try_from(sent / self.layout.num_layers.max(1) as usize).unwrap_or(u32::MAX);
        Ok(Response::new(wv1::PrefillReply {
            cached_tokens: u32::try_from(cached).unwrap_or(u32::MAX),
            blocks_sent,
        }))
    }
}

/// How a prefill worker presents itself.
#[derive(Debug, Clone)]
pub struct PrefillWorkerConfig {
    pub id: String,
    pub model: String,
    pub cluster_token: String,
    /// Host peers reach this worker on (e.g. the pod IP), when it differs
    /// from the bound address (e.g. `0.0.0.0`).
    pub advertise_host: Option<String>,
}

/// Serves `Prefill` and `Worker` on `bound` until `shutdown`.
pub async fn run(
    engine: EngineHandle,
    kv_layout: tandem_engine::KvLayout,
    bound: tandem_server::Bound,
    config: PrefillWorkerConfig,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tandem_server::ServeError> {
    let layout = layout::descriptor(&kv_layout);
    let transport: Arc<dyn Transport> = Arc::new(tandem_kv_transfer::tcp::TcpTransport::new(
        config.cluster_token,
    ));
    let limits = engine.limits();
    let info = wv1::WorkerInfo {
        id: config.id,
        role: wv1::Role::Prefill as i32,
        address: tandem_server::advertised_addr(
            config.advertise_host.as_deref(),
            bound.local_addr(),
        ),
        model: config.model,
        layout: Some(layout::to_proto(&layout)),
        transfer_endpoint: String::new(),
        num_blocks: u32::try_from(limits.num_blocks).unwrap_or(u32::MAX),
        max_model_len: u32::try_from(limits.max_model_len).unwrap_or(u32::MAX),
    };
    let mut services = tandem_server::Services::default();
    services.add(
        wv1::prefill_server::PrefillServer::new(PrefillService::new(
            engine.clone(),
            transport,
            layout,
        )),
        "tandem.worker.v1.Prefill",
        wv1::FILE_DESCRIPTOR_SET,
    );
    services.add(
        wv1::worker_server::WorkerServer::new(tandem_server::WorkerService::new(engine, info)),
        "tandem.worker.v1.Worker",
        wv1::FILE_DESCRIPTOR_SET,
    );
    tandem_server::serve_services(bound, services, shutdown).await
}
