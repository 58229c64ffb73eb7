//! The decode pool worker.
//!
//! It serves the public `Generate` API to the router. A request whose call
//! metadata names a prefill worker ([`PREFILL_HEADER`]) is admitted in
//! remote-prefill mode: the engine reuses this worker's own prefix cache,
//! allocates blocks for the rest of the prompt and parks the request; this
//! crate then calls the prefill worker's `Prefill` with those block ids and
//! this worker's transfer endpoint. Blocks arrive through the transport into
//! [`EngineSink`], which hands them to the engine thread in order; the
//! transfer's end resumes the request, which computes its last prompt token
//! here and decodes in the continuous batch. If the prefill worker fails,
//! the engine prefills locally. Short prompts (fewer uncached tokens than
//! the threshold) never leave this worker.
//!
//! Observability: the call to the prefill worker runs in a
//! `remote_prefill` span (a child of the request's `generate` span) whose
//! W3C context travels in the call's metadata, so the prefill worker's
//! spans join the same trace. [`DecodeMetrics`] counts remote prefills by
//! outcome, their latency, and the KV bytes received.
//!
//! **Architecture Invariant:** the decode worker owns sampling and its KV
//! blocks; peers can write only into the destination blocks of a transfer
//! it opened (the engine checks every write).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tandem_engine::serving::{EngineHandle, PrefillMode, RemotePrefill};
use tandem_kv_transfer::{KvLayoutDescriptor, KvSink, TransferId};
use tandem_proto::worker::v1 as wv1;
use tandem_proto::worker::v1::prefill_client::PrefillClient;
use tandem_server::{layout, PrefillGuard, RemotePrefiller};
use tandem_telemetry::metrics::{Counter, Family, Histogram, Registry, LATENCY_BUCKETS};
use tonic::metadata::MetadataMap;
use tonic::transport::Channel;
use tracing::Instrument;

pub use tandem_proto::worker::PREFILL_HEADER;

/// The decode worker's own instruments (beside the `Generation`
/// service's and the engine's).
#[derive(Debug, Clone)]
pub struct DecodeMetrics {
    remote_prefills: Family<Counter>,
    remote_prefill_duration: Histogram,
    received_bytes: Counter,
    received_blocks: Counter,
}

impl DecodeMetrics {
    pub fn register(registry: &Registry) -> Self {
        Self {
            remote_prefills: registry.counter_family(
                "tandem_remote_prefills_total",
                "Prefills asked of a prefill worker, by outcome (failed ones fall back to local prefill).",
                &["outcome"],
            ),
            remote_prefill_duration: registry.histogram(
                "tandem_remote_prefill_duration_seconds",
                "From asking a prefill worker to its reply (every block applied here).",
                LATENCY_BUCKETS,
            ),
            received_bytes: registry.counter(
                "tandem_kv_transfer_received_bytes_total",
                "K and V bytes received from prefill workers.",
            ),
            received_blocks: registry.counter(
                "tandem_kv_transfer_received_block_layers_total",
                "Block-layers (one layer of one block) received from prefill workers.",
            ),
        }
    }
}

/// Delivers received blocks to the engine thread.
#[derive(Debug)]
pub struct EngineSink {
    engine: EngineHandle,
    num_blocks: u32,
    metrics: DecodeMetrics,
}

impl EngineSink {
    pub fn new(engine: EngineHandle, metrics: DecodeMetrics) -> Self {
        let num_blocks = u32::try_from(engine.limits().num_blocks).unwrap_or(u32::MAX);
        Self {
            engine,
            num_blocks,
            metrics,
        }
    }
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

impl KvSink for EngineSink {
    fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    fn write(
        &self,
        transfer: TransferId,
        layer: u32,
        block: u32,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), String> {
        self.metrics.received_bytes.add((k.len() + v.len()) as u64);
        self.metrics.received_blocks.inc();
        // The engine checks the block belongs to this transfer.
        self.engine
            .write_kv(transfer.0, layer as usize, block, floats(k), floats(v));
        Ok(())
    }

    fn finish(&self, transfer: TransferId, outcome: Result<(), String>) {
        self.engine.finish_remote_prefill(transfer.0, outcome);
    }
}

/// Asks prefill workers over gRPC.
#[derive(Debug)]
pub struct GrpcPrefiller {
    /// Remote prefill only when at least this many prompt tokens are uncached.
    threshold: usize,
    /// Where prefill workers push to.
    transfer_endpoint: String,
    layout: KvLayoutDescriptor,
    clients: Mutex<HashMap<String, PrefillClient<Channel>>>,
    metrics: DecodeMetrics,
}

impl GrpcPrefiller {
    pub fn new(
        threshold: usize,
        transfer_endpoint: String,
        layout: KvLayoutDescriptor,
        metrics: DecodeMetrics,
    ) -> Self {
        Self {
            threshold,
            transfer_endpoint,
            layout,
            clients: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    fn client(&self, addr: &str) -> Result<PrefillClient<Channel>, String> {
        let mut clients = self.clients.lock().map_err(|_| "client cache poisoned")?;
        if let Some(c) = clients.get(addr) {
            return Ok(c.clone());
        }
        let channel = Channel::from_shared(format!("http://{addr}"))
            .map_err(|e| format!("bad prefill address {addr}: {e}"))?
            .connect_lazy();
        let c = PrefillClient::new(channel);
        clients.insert(addr.to_string(), c.clone());
        Ok(c)
    }
}

fn prefill_target(metadata: &MetadataMap) -> Option<String> {
    metadata
        .get(PREFILL_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

impl RemotePrefiller for GrpcPrefiller {
    fn mode(&self, metadata: &MetadataMap) -> PrefillMode {
        match prefill_target(metadata) {
            Some(_) => PrefillMode::Remote {
                min_uncached: self.threshold,
            },
            None => PrefillMode::Local,
        }
    }

    fn start(
        &self,
        request_id: &str,
        metadata: &MetadataMap,
        prefill: RemotePrefill,
        engine: EngineHandle,
        span: &tracing::Span,
    ) -> PrefillGuard {
        let transfer = prefill.transfer;
        let target = prefill_target(metadata);
        let pspan = tracing::info_span!(
            parent: span,
            "remote_prefill",
            otel.kind = "client",
            prefill_worker = target.as_deref().unwrap_or_default(),
            tokens = prefill.tokens.len(),
            cached_tokens = prefill.cached_tokens,
            blocks = prefill.blocks.len(),
            transfer,
            outcome = tracing::field::Empty,
        );
        let client = target
            .ok_or_else(|| "no prefill worker named".to_string())
            .and_then(|addr| self.client(&addr));
        let mut client = match client {
            Ok(c) => c,
            Err(e) => {
                pspan.record("outcome", "failed");
                self.metrics.remote_prefills.with(&["failed"]).inc();
                tracing::warn!(parent: &pspan, error = %e, "remote prefill not started");
                engine.finish_remote_prefill(transfer, Err(e));
                return PrefillGuard::default();
            }
        };
        let bs = self.layout.block_size as usize;
        let req = wv1::PrefillRequest {
            request_id: request_id.to_string(),
            from_block: u32::try_from(prefill.cached_tokens / bs).unwrap_or(u32::MAX),
            tokens: prefill.tokens,
            dst_blocks: prefill.blocks,
            transfer_endpoint: self.transfer_endpoint.clone(),
            transfer_id: transfer,
            layout: Some(layout::to_proto(&self.layout)),
        };
        let mut call = tonic::Request::new(req);
        tandem_telemetry::propagation::inject(&pspan, call.metadata_mut());
        let metrics = self.metrics.clone();
        let started = Instant::now();
        let task = async move {
            // Success is reported by the transport (the sink's finish);
            // failure before or without a transfer is reported here. A
            // second finish for one transfer is ignored by the engine.
            match client.prefill(call).await {
                Ok(_) => {
                    metrics.remote_prefills.with(&["ok"]).inc();
                    metrics
                        .remote_prefill_duration
                        .observe_duration(started.elapsed());
                    tracing::Span::current().record("outcome", "ok");
                }
                Err(status) => {
                    metrics.remote_prefills.with(&["failed"]).inc();
                    tracing::Span::current().record("outcome", "failed");
                    tracing::warn!(transfer, error = %status.message(), "remote prefill failed");
                    engine.finish_remote_prefill(
                        transfer,
                        Err(format!("prefill worker: {}", status.message())),
                    );
                }
            }
        };
        PrefillGuard::new(tokio::spawn(task.instrument(pspan)))
    }
}

/// How a decode worker presents itself and where it receives blocks.
#[derive(Debug, Clone)]
pub struct DecodeWorkerConfig {
    pub id: String,
    pub model: String,
    pub cluster_token: String,
    /// Where the transfer listener binds (`ip:port`, port 0 for any).
    pub transfer_bind: String,
    /// Host peers reach this worker on (e.g. the pod IP), for its gRPC
    /// address and its transfer endpoint, when it differs from the bound
    /// addresses (e.g. `0.0.0.0`).
    pub advertise_host: Option<String>,
    /// Remote prefill only from this many uncached prompt tokens.
    pub remote_prefill_threshold: usize,
    /// How KV blocks arrive (`--kv-transport`); prefill workers must use
    /// the same.
    pub kv_transport: tandem_kv_transfer::TransportKind,
}

/// Errors starting a decode worker.
#[derive(Debug, thiserror::Error)]
pub enum DecodeWorkerError {
    #[error("KV transfer listener: {0}")]
    Transfer(#[from] tandem_kv_transfer::TransferError),
    #[error(transparent)]
    Serve(#[from] tandem_server::ServeError),
}

/// Serves `Generate` (with remote prefill) and `Worker` on `bound`, and
/// receives KV blocks on the transfer listener, until `shutdown`.
pub async fn run(
    engine: EngineHandle,
    kv_layout: tandem_engine::KvLayout,
    bound: tandem_server::Bound,
    config: DecodeWorkerConfig,
    registry: &Registry,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), DecodeWorkerError> {
    let layout = layout::descriptor(&kv_layout);
    let metrics = DecodeMetrics::register(registry);
    let transport = tandem_kv_transfer::transport(config.kv_transport, &config.cluster_token)?;
    let listener = transport
        .listen(
            &config.transfer_bind,
            layout,
            Arc::new(EngineSink::new(engine.clone(), metrics.clone())),
        )
        .await?;
    let endpoint = match (&config.advertise_host, listener.endpoint().parse()) {
        (Some(host), Ok(bound)) => tandem_server::advertised_addr(Some(host), bound),
        _ => listener.endpoint().to_string(),
    };
    tracing::info!(%endpoint, transport = %config.kv_transport, "receiving KV blocks");
    let limits = engine.limits();
    let info = wv1::WorkerInfo {
        id: config.id,
        role: wv1::Role::Decode as i32,
        address: tandem_server::advertised_addr(
            config.advertise_host.as_deref(),
            bound.local_addr(),
        ),
        model: config.model,
        layout: Some(layout::to_proto(&layout)),
        transfer_endpoint: endpoint.clone(),
        num_blocks: u32::try_from(limits.num_blocks).unwrap_or(u32::MAX),
        max_model_len: u32::try_from(limits.max_model_len).unwrap_or(u32::MAX),
    };
    let prefiller = Arc::new(GrpcPrefiller::new(
        config.remote_prefill_threshold,
        endpoint,
        layout,
        metrics,
    ));
    tandem_server::register_engine(registry, engine.clone());
    let mut services = tandem_server::Services::generation(
        tandem_server::GenerationService::with_prefiller(engine.clone(), prefiller)
            .with_metrics(tandem_server::ServingMetrics::register(registry)),
    );
    services.add(
        wv1::worker_server::WorkerServer::new(tandem_server::WorkerService::new(engine, info)),
        "tandem.worker.v1.Worker",
        wv1::FILE_DESCRIPTOR_SET,
    );
    tandem_server::serve_services(bound, services, shutdown).await?;
    drop(listener);
    Ok(())
}
