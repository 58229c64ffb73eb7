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
//! Observability: each call runs in a `prefill_request` span whose parent
//! is the decode worker's `remote_prefill` span (W3C `traceparent` in the
//! call's metadata); the engine's `queue`/`prefill`/`prefill_chunk` spans
//! and the `kv_transfer` span (bytes, block-layers) are its children.
//! [`PrefillMetrics`] counts calls by outcome, their latency and the bytes
//! sent.
//!
//! **Architecture Invariant:** a prefill worker never samples: the decode
//! worker computes the prompt's last token itself, so sampling state lives
//! in one place.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;
use tandem_engine::serving::{
    EngineHandle, ExportedBlock, KvExport, PrefillMode, Prompt, PromptLogprobs, Request,
    RequestEvent,
};
use tandem_engine::{KvGroups, TokenLogprob, FREED};
use tandem_kv_transfer::{BlockWrite, KvLayoutDescriptor, Session, TransferId, Transport};
use tandem_proto::worker::v1 as wv1;
use tandem_server::{layout, status_from_engine};
use tandem_telemetry::metrics::{Counter, Family, Histogram, Registry, LATENCY_BUCKETS};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio::sync::Mutex;
use tonic::{Request as GrpcRequest, Response, Status};
use tracing::Instrument;

/// The prefill worker's own instruments (beside the engine's).
#[derive(Debug, Clone)]
pub struct PrefillMetrics {
    requests: Family<Counter>,
    duration: Histogram,
    prompt_tokens: Counter,
    cached_tokens: Counter,
    sent_bytes: Counter,
    sent_blocks: Counter,
    transfer_duration: Histogram,
}

impl PrefillMetrics {
    pub fn register(registry: &Registry) -> Self {
        Self {
            requests: registry.counter_family(
                "tandem_prefill_requests_total",
                "Prefill calls by how they ended.",
                &["outcome"],
            ),
            duration: registry.histogram(
                "tandem_prefill_duration_seconds",
                "Prefill calls that succeeded, from arrival to every block applied at the decode worker.",
                LATENCY_BUCKETS,
            ),
            prompt_tokens: registry.counter(
                "tandem_prefill_prompt_tokens_total",
                "Prompt tokens of successful prefill calls.",
            ),
            cached_tokens: registry.counter(
                "tandem_prefill_cached_tokens_total",
                "Of those, tokens found in this worker's prefix cache.",
            ),
            sent_bytes: registry.counter(
                "tandem_kv_transfer_sent_bytes_total",
                "K and V bytes sent to decode workers.",
            ),
            sent_blocks: registry.counter(
                "tandem_kv_transfer_sent_block_layers_total",
                "Block-layers (one layer of one block) sent to decode workers.",
            ),
            transfer_duration: registry.histogram(
                "tandem_kv_transfer_duration_seconds",
                "From a transfer's start to the decode worker's acknowledgement of its last block.",
                LATENCY_BUCKETS,
            ),
        }
    }
}

/// Records one call's outcome when dropped; a call dropped before it set
/// one was cancelled.
struct CallRecord {
    metrics: PrefillMetrics,
    started: Instant,
    outcome: Option<&'static str>,
}

impl Drop for CallRecord {
    fn drop(&mut self) {
        let outcome = self.outcome.unwrap_or("cancelled");
        self.metrics.requests.with(&[outcome]).inc();
        if outcome == "ok" {
            self.metrics
                .duration
                .observe_duration(self.started.elapsed());
        }
        tracing::Span::current().record("outcome", outcome);
    }
}

/// Serves `tandem.worker.v1.Prefill`.
#[derive(Debug, Clone)]
pub struct PrefillService {
    engine: EngineHandle,
    transport: Arc<dyn Transport>,
    layout: KvLayoutDescriptor,
    /// How `layout`'s layers share blocks: `dst_blocks` has one entry per
    /// group per logical block.
    groups: Arc<KvGroups>,
    /// One session per decode worker, opened on first use.
    sessions: Arc<Mutex<HashMap<String, Arc<dyn Session>>>>,
    metrics: PrefillMetrics,
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
            groups: Arc::new(KvGroups::of(&layout::engine_layout(&layout))),
            layout,
            sessions: Arc::new(Mutex::new(HashMap::new())),
            metrics: PrefillMetrics::register(&Registry::new()),
        }
    }

    /// Records calls in `metrics` (by default, a registry of its own).
    pub fn with_metrics(mut self, metrics: PrefillMetrics) -> Self {
        self.metrics = metrics;
        self
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
    /// Logical-major, one entry per layer group ([`KvGroups`]).
    dst_blocks: Vec<u32>,
    groups: Arc<KvGroups>,
    out: UnboundedSender<Vec<BlockWrite>>,
}

impl KvExport for Exporter {
    fn layer_ready(&self, layer: usize, blocks: &[ExportedBlock<'_>]) {
        let (g, group) = (self.groups.num_groups(), self.groups.group(layer));
        let picked: Vec<(u32, &ExportedBlock<'_>)> = blocks
            .iter()
            .filter_map(|b| {
                let j = b.logical.checked_sub(self.from_block)?;
                let dst = *self.dst_blocks.get(j * g + group)?;
                (dst != FREED).then_some((dst, b))
            })
            .collect();
        if picked.is_empty() {
            return;
        }
        // One copy out of the pool into one buffer, K₀ V₀ K₁ V₁ …, sliced
        // per block: a transport can then send the layer as one contiguous
        // range (UCX's rendezvous moves that several times faster than a
        // scatter-gather list).
        let bytes = |x: &[f32]| std::mem::size_of_val(x);
        let total = picked.iter().map(|(_, b)| bytes(b.k) + bytes(b.v)).sum();
        let mut buf = BytesMut::with_capacity(total);
        for (_, b) in &picked {
            buf.extend_from_slice(bytemuck::cast_slice(b.k));
            buf.extend_from_slice(bytemuck::cast_slice(b.v));
        }
        let buf = buf.freeze();
        let mut at = 0;
        let batch: Vec<BlockWrite> = picked
            .iter()
            .map(|(dst, b)| {
                let (k, v) = (bytes(b.k), bytes(b.v));
                let write = BlockWrite {
                    layer: layer as u32,
                    dst_block: *dst,
                    k: buf.slice(at..at + k),
                    v: buf.slice(at + k..at + k + v),
                };
                at += k + v;
                write
            })
            .collect();
        // A closed channel means the call was cancelled; nothing to do.
        let _ = self.out.send(batch);
    }
}

type WriterTask = tokio::task::JoinHandle<Result<usize, tandem_kv_transfer::TransferError>>;

/// Aborts a transfer unless disarmed (the call finished cleanly). The
/// writer task goes first and the abort is sent only once it has stopped:
/// a write sent after the abort would reopen the transfer at the receiver,
/// and one connection's cancelled prefills would pile up there until it
/// hits its limit of open transfers.
struct AbortOnDrop {
    session: Arc<dyn Session>,
    transfer: TransferId,
    /// The task forwarding exported blocks to the session, while it runs.
    writer: Option<WriterTask>,
    armed: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        let writer = self.writer.take();
        if let Some(w) = &writer {
            w.abort();
        }
        if self.armed {
            let (session, transfer) = (self.session.clone(), self.transfer);
            tokio::spawn(async move {
                if let Some(w) = writer {
                    let _ = w.await;
                }
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
        let span = tracing::info_span!(
            "prefill_request",
            otel.kind = "server",
            request_id = tracing::field::Empty,
            tokens = tracing::field::Empty,
            from_block = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        tandem_telemetry::propagation::set_parent(&span, request.metadata());
        let r = request.into_inner();
        span.record("request_id", r.request_id.as_str());
        span.record("tokens", r.tokens.len());
        span.record("from_block", r.from_block);
        let record = CallRecord {
            metrics: self.metrics.clone(),
            started: Instant::now(),
            outcome: None,
        };
        self.run_prefill(r, record, span.clone())
            .instrument(span)
            .await
    }
}

impl PrefillService {
    async fn run_prefill(
        &self,
        r: wv1::PrefillRequest,
        mut record: CallRecord,
        span: tracing::Span,
    ) -> Result<Response<wv1::PrefillReply>, Status> {
        let result = self.prefill_inner(r, span).await;
        record.outcome = Some(if result.is_ok() { "ok" } else { "error" });
        if let Err(status) = &result {
            tracing::warn!(code = ?status.code(), error = %status.message(), "prefill failed");
        }
        result
    }

    /// The adapter a prefill runs under, refused unless this worker's copy
    /// is the decode worker's (equal hash roots: the same weights).
    fn check_lora(&self, r: &wv1::PrefillRequest) -> Result<Option<String>, Status> {
        if r.lora.is_empty() {
            return Ok(None);
        }
        let reg = self.engine.lora().ok_or_else(|| {
            Status::failed_precondition(format!(
                "lora: this prefill worker serves no adapters (asked for `{}`)",
                r.lora
            ))
        })?;
        let adapter = reg.resolve(&r.lora).map_err(status_from_engine)?;
        if adapter.hash_root() != r.lora_hash_root {
            return Err(Status::failed_precondition(format!(
                "lora: adapter `{}` here differs from the decode worker's (other weights)",
                r.lora
            )));
        }
        Ok(Some(r.lora.clone()))
    }

    /// The caller's layout and destination blocks, checked against this
    /// worker's: the first block to send.
    fn check_geometry(&self, r: &wv1::PrefillRequest) -> Result<usize, Status> {
        let theirs = r
            .layout
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("layout: required"))
            .and_then(|l| {
                layout::from_proto(l).map_err(|e| Status::invalid_argument(format!("layout: {e}")))
            })?;
        self.layout
            .check_compatible(&theirs)
            .map_err(|e| Status::failed_precondition(format!("KV layout mismatch: {e}")))?;
        let from_block = r.from_block as usize;
        let bs = self.layout.block_size as usize;
        let groups = self.groups.num_groups();
        let needed = r.tokens.len().div_ceil(bs).saturating_sub(from_block) * groups;
        if r.dst_blocks.len() < needed {
            return Err(Status::invalid_argument(format!(
                "dst_blocks: {} entries for {needed} (blocks of prompt × {groups} layer groups)",
                r.dst_blocks.len()
            )));
        }
        Ok(from_block)
    }

    /// The task that forwards exported batches to `session` until the
    /// exporter's channel closes: the block-layers it sent.
    fn spawn_writer(
        &self,
        session: Arc<dyn Session>,
        transfer: TransferId,
        mut batches: tokio::sync::mpsc::UnboundedReceiver<Vec<BlockWrite>>,
        kv_span: tracing::Span,
    ) -> WriterTask {
        let metrics = self.metrics.clone();
        tokio::spawn(
            async move {
                let (mut sent, mut sent_bytes) = (0usize, 0usize);
                while let Some(batch) = batches.recv().await {
                    let n = batch.len();
                    let bytes: usize = batch.iter().map(|b| b.k.len() + b.v.len()).sum();
                    session.write(transfer, batch).await?;
                    sent += n;
                    sent_bytes += bytes;
                    metrics.sent_bytes.add(bytes as u64);
                    metrics.sent_blocks.add(n as u64);
                }
                let span = tracing::Span::current();
                span.record("block_layers", sent);
                span.record("bytes", sent_bytes);
                Ok::<usize, tandem_kv_transfer::TransferError>(sent)
            }
            .instrument(kv_span),
        )
    }

    /// Runs `req` (an export) to its end: the prompt tokens it found cached
    /// and the prompt's scores, if asked.
    async fn run_export(&self, req: Request) -> Result<(usize, Vec<TokenLogprob>), Status> {
        let mut events = self.engine.submit(req).map_err(status_from_engine)?;
        let mut scores = Vec::new();
        loop {
            match events.next().await {
                Some(RequestEvent::PromptLogprobs(lps)) => scores = lps,
                Some(RequestEvent::Finished(s)) => return Ok((s.usage.cached_tokens, scores)),
                Some(RequestEvent::Error(e)) => return Err(tandem_server::status_from_failure(e)),
                Some(_) => {}
                None => return Err(Status::unavailable("the engine stopped")),
            }
        }
    }

    async fn prefill_inner(
        &self,
        r: wv1::PrefillRequest,
        span: tracing::Span,
    ) -> Result<Response<wv1::PrefillReply>, Status> {
        let from_block = self.check_geometry(&r)?;
        let lora = self.check_lora(&r)?;
        let session = self.session(&r.transfer_endpoint).await?;
        let transfer = TransferId(r.transfer_id);
        let (tx, rx) = unbounded_channel::<Vec<BlockWrite>>();
        let kv_span = tracing::info_span!(
            "kv_transfer",
            transfer = r.transfer_id,
            endpoint = %r.transfer_endpoint,
            bytes = tracing::field::Empty,
            block_layers = tracing::field::Empty,
        );
        let transfer_started = Instant::now();
        let mut guard = AbortOnDrop {
            session: session.clone(),
            transfer,
            writer: Some(self.spawn_writer(session.clone(), transfer, rx, kv_span.clone())),
            armed: true,
        };
        let exporter = Arc::new(Exporter {
            from_block,
            dst_blocks: r.dst_blocks,
            groups: self.groups.clone(),
            out: tx,
        });
        let prompt_tokens = r.tokens.len();
        let mut req = Request::new(Prompt::Tokens(r.tokens), 1);
        req.request_id = r.request_id;
        req.max_tokens = None;
        req.lora = lora;
        req.span = span;
        req.prefill = PrefillMode::Export {
            sink: exporter,
            from_block,
        };
        // The client asked for prompt logprobs: score the prompt here, the
        // decode worker's last token included (this prefill's last row).
        req.prompt_logprobs = r.prompt_logprobs.map(|top| PromptLogprobs {
            top: top as usize,
            next_token: Some(r.last_token),
        });
        let (cached, scores) = self.run_export(req).await?;
        // The engine dropped its exporter with the finished request, which
        // closed the channel: the writer ends once it has sent everything.
        // (Awaited in place: cancelled meanwhile, the guard still stops it.)
        let written = match guard.writer.as_mut() {
            Some(writer) => writer.await,
            None => return Err(Status::internal("the transfer task is gone")),
        };
        guard.writer = None;
        let sent = match written {
            Ok(Ok(n)) => n,
            Ok(Err(e)) => {
                self.forget_session(session.endpoint()).await;
                return Err(Status::unavailable(format!("KV transfer failed: {e}")));
            }
            Err(e) => return Err(Status::internal(format!("transfer task: {e}"))),
        };
        session
            .finish(transfer)
            .instrument(kv_span)
            .await
            .map_err(|e| Status::unavailable(format!("KV transfer did not complete: {e}")))?;
        guard.armed = false;
        self.metrics
            .transfer_duration
            .observe_duration(transfer_started.elapsed());
        self.metrics.prompt_tokens.add(prompt_tokens as u64);
        self.metrics.cached_tokens.add(cached as u64);
        let blocks_sent =
            u32::try_from(sent / self.layout.num_layers.max(1) as usize).unwrap_or(u32::MAX);
        Ok(Response::new(wv1::PrefillReply {
            prompt_logprobs: scores
                .into_iter()
                .map(tandem_server::logprob_to_proto)
                .collect(),
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
    /// How KV blocks are sent (`--kv-transport`); decode workers must use
    /// the same.
    pub kv_transport: tandem_kv_transfer::TransportKind,
    /// mTLS on the gRPC server (clients need a certificate from the
    /// cluster CA); plain gRPC when `None`.
    pub tls: Option<tandem_security::LoadedTls>,
}

/// Errors running a prefill worker.
#[derive(Debug, thiserror::Error)]
pub enum PrefillWorkerError {
    #[error("KV transport: {0}")]
    Transfer(#[from] tandem_kv_transfer::TransferError),
    #[error(transparent)]
    Serve(#[from] tandem_server::ServeError),
}

/// Adds `Prefill` to `services`, for decode workers alone: the cluster
/// credential and, with TLS, a certificate with the decode role. A prefill
/// worker serves it, and so does a decode worker (a draining one's requests
/// are pulled from it).
pub fn add_guarded(
    services: &mut tandem_server::Services,
    prefill: PrefillService,
    credential: &tandem_security::ClusterCredential,
    tls: bool,
) {
    let guard = credential
        .interceptor()
        .require_roles(tls, &[tandem_security::PeerRole::Decode]);
    services.add(
        tonic::service::interceptor::InterceptedService::new(
            wv1::prefill_server::PrefillServer::new(prefill),
            guard,
        ),
        "tandem.worker.v1.Prefill",
        wv1::FILE_DESCRIPTOR_SET,
    );
}

/// Serves `Prefill` and `Worker` on `bound` until `shutdown`.
pub async fn run(
    engine: EngineHandle,
    kv_layout: tandem_engine::KvLayout,
    bound: tandem_server::Bound,
    config: PrefillWorkerConfig,
    registry: &Registry,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), PrefillWorkerError> {
    let layout = layout::descriptor(&kv_layout);
    let transport: Arc<dyn Transport> =
        tandem_kv_transfer::transport(config.kv_transport, &config.cluster_token)?;
    tandem_server::register_transport(registry, transport.clone());
    // Routers' KV-event feeds end when the shutdown begins, so the drain
    // is not held open by them.
    let (shutdown, feeds_end) = tandem_server::shutdown_ending_feeds(shutdown);
    let info = tandem_server::WorkerIdentity {
        id: config.id,
        role: wv1::Role::Prefill,
        model: config.model,
        address: tandem_server::advertised_addr(
            config.advertise_host.as_deref(),
            bound.local_addr(),
        ),
        transfer_endpoint: String::new(),
    }
    .info(&engine, &layout);
    tandem_server::register_engine(registry, engine.clone());
    let mut services = tandem_server::Services::default();
    let credential = tandem_security::ClusterCredential::derive(&config.cluster_token);
    let prefill = PrefillService::new(engine.clone(), transport, layout)
        .with_metrics(PrefillMetrics::register(registry));
    add_guarded(&mut services, prefill, &credential, config.tls.is_some());
    services.add(
        wv1::worker_server::WorkerServer::new(
            tandem_server::WorkerService::new(engine, info).with_feeds_end(feeds_end),
        ),
        "tandem.worker.v1.Worker",
        wv1::FILE_DESCRIPTOR_SET,
    );
    services.with_tls(config.tls.as_ref().map(|t| t.server()));
    Ok(tandem_server::serve_services(bound, services, shutdown).await?)
}
