//! The decode pool worker.
//!
//! It serves the worker-internal `Decode.Generate` to the router (and the
//! public `Generate`, which always prefills here, to cluster members). A
//! request whose `RoutedGenerateRequest.prefill` places its prompt on
//! another worker is admitted in remote-prefill mode: the engine reuses
//! this worker's own prefix cache, allocates blocks for the rest of the
//! prompt and parks the request; the request's engine stream then hands it
//! to this crate's [`GrpcPrefiller`] (the engine's `RemotePrefiller`),
//! which calls the placed worker's `Prefill` with those block ids and this
//! worker's transfer endpoint. Blocks arrive through the transport into
//! [`EngineSink`], which hands them to the engine thread in order; the
//! transfer's end resumes the request, which computes its last prompt token
//! here and decodes in the continuous batch. If the prefill worker fails,
//! the engine prefills locally. Short prompts (fewer uncached tokens here
//! than the placement's threshold, the router's) never leave this worker.
//!
//! Observability: the call to the prefill worker runs in a
//! `remote_prefill` span (a child of the request's `generate` span) whose
//! W3C context travels in the call's metadata, so the prefill worker's
//! spans join the same trace. [`DecodeMetrics`] counts remote prefills by
//! outcome, their latency, and the KV bytes received.
//!
//! **Who may write into the KV pool.** Three checks stand between a peer
//! and this worker's blocks:
//!
//! 1. The transport handshake: the peer must prove it holds the cluster
//!    secret (an HMAC challenge–response in `tandem-kv-transfer`; the secret
//!    never travels). Only the cluster's workers are given it.
//! 2. A ticket ([`TransferTickets`]): the transfer id on the wire is a random
//!    64-bit number this worker draws for one parked request and sends only
//!    to the prefill worker the router named, inside the `Prefill` call
//!    (mTLS when the cluster runs TLS, so only a worker with a certificate
//!    from the cluster CA receives it). A block under any other id is
//!    refused before it reaches the engine, so even a peer that passes the
//!    handshake but was not named for this request writes nothing. Tickets
//!    are retired with the transfer.
//! 3. The engine checks every block against the parked request's
//!    destination blocks.
//!
//! We chose tickets over checking transfer peers against etcd membership:
//! the decode worker needs no membership view, the check also holds with
//! static membership (`--no-etcd`, Kubernetes without etcd), and it binds
//! each write to the one request and the one worker it was meant for, not
//! merely to "some registered worker".
//!
//! **Architecture Invariant:** the decode worker owns sampling and its KV
//! blocks; peers can write only into the destination blocks of a transfer
//! it opened, under that transfer's ticket (the sink checks the ticket, the
//! engine every block).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_engine::serving::{
    EngineHandle, PrefillGuard, RemotePrefill, RemotePrefillError, RemotePrefiller,
};
use tandem_kv_transfer::{KvLayoutDescriptor, KvSink, TransferFailure, TransferId, WriteRefused};
use tandem_proto::worker::v1 as wv1;
use tandem_proto::worker::v1::prefill_client::PrefillClient;
use tandem_security::{ClusterChannel, ClusterCredential, PeerRole};
use tandem_server::layout;
use tandem_telemetry::metrics::{Counter, Family, Gauge, Histogram, Registry, LATENCY_BUCKETS};
use tonic::transport::Channel;
use tracing::Instrument;

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

/// The open transfers' tickets: wire transfer id (random, told only to the
/// named prefill worker) → the engine's transfer (the parked request).
/// Each is retired by the transfer's end, its failure, or the request's
/// cancellation ([`TicketGuard`]), so the count goes back to zero.
#[derive(Debug)]
pub struct TransferTickets {
    open: Mutex<HashMap<u64, u64>>,
    random: ring::rand::SystemRandom,
    /// `tandem_kv_transfer_open_tickets`, when registered.
    gauge: Option<Gauge>,
}

impl Default for TransferTickets {
    fn default() -> Self {
        Self {
            open: Mutex::new(HashMap::new()),
            random: ring::rand::SystemRandom::new(),
            gauge: None,
        }
    }
}

/// Retires its ticket when dropped: the remote-prefill task holds it, so a
/// cancelled request (its task aborted mid-call) leaves no ticket open.
#[derive(Debug)]
struct TicketGuard {
    tickets: Arc<TransferTickets>,
    ticket: u64,
}

impl Drop for TicketGuard {
    fn drop(&mut self) {
        self.tickets.retire(self.ticket);
    }
}

impl TransferTickets {
    /// Tickets that export their count as `tandem_kv_transfer_open_tickets`.
    pub fn registered(registry: &Registry) -> Self {
        Self {
            gauge: Some(registry.gauge(
                "tandem_kv_transfer_open_tickets",
                "Remote prefills this decode worker has open (a ticket per parked request).",
            )),
            ..Self::default()
        }
    }

    fn publish(&self, open: usize) {
        if let Some(g) = &self.gauge {
            g.set(open as f64);
        }
    }

    /// Draws a fresh ticket for the engine's `transfer`.
    pub fn issue(&self, transfer: u64) -> Result<u64, PrefillStartError> {
        let mut open = self
            .open
            .lock()
            .map_err(|_| PrefillStartError::TicketsPoisoned)?;
        loop {
            let mut bytes = [0u8; 8];
            ring::rand::SecureRandom::fill(&self.random, &mut bytes)
                .map_err(|_| PrefillStartError::NoRandomness)?;
            let ticket = u64::from_le_bytes(bytes);
            if let std::collections::hash_map::Entry::Vacant(e) = open.entry(ticket) {
                e.insert(transfer);
                self.publish(open.len());
                return Ok(ticket);
            }
        }
    }

    /// The engine transfer of an open ticket.
    pub fn lookup(&self, ticket: u64) -> Option<u64> {
        self.open.lock().ok()?.get(&ticket).copied()
    }

    /// Closes a ticket; the engine transfer it named, if it was open.
    pub fn retire(&self, ticket: u64) -> Option<u64> {
        let mut open = self.open.lock().ok()?;
        let transfer = open.remove(&ticket);
        self.publish(open.len());
        transfer
    }

    /// How many tickets are open.
    pub fn len(&self) -> usize {
        self.open.lock().map_or(0, |o| o.len())
    }

    /// No ticket is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why a remote prefill could not start (the engine then prefills locally).
#[derive(Debug, thiserror::Error)]
pub enum PrefillStartError {
    #[error("the transfer tickets' lock is poisoned")]
    TicketsPoisoned,
    #[error("no secure randomness for a transfer ticket")]
    NoRandomness,
    #[error("the prefill clients' lock is poisoned")]
    ClientsPoisoned,
    #[error("prefill worker {addr}: {source}")]
    Endpoint {
        addr: String,
        #[source]
        source: tandem_security::TlsError,
    },
}

/// Delivers received blocks to the engine thread, for open tickets only.
#[derive(Debug)]
pub struct EngineSink {
    engine: EngineHandle,
    num_blocks: u32,
    metrics: DecodeMetrics,
    tickets: Arc<TransferTickets>,
}

impl EngineSink {
    pub fn new(
        engine: EngineHandle,
        metrics: DecodeMetrics,
        tickets: Arc<TransferTickets>,
    ) -> Self {
        let num_blocks = u32::try_from(engine.limits().num_blocks).unwrap_or(u32::MAX);
        Self {
            engine,
            num_blocks,
            metrics,
            tickets,
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
    ) -> Result<(), WriteRefused> {
        let Some(engine_transfer) = self.tickets.lookup(transfer.0) else {
            tracing::warn!(
                ticket = transfer.0,
                "KV block for a transfer this worker did not open; refused"
            );
            return Err(WriteRefused::UnknownTransfer(transfer));
        };
        self.metrics.received_bytes.add((k.len() + v.len()) as u64);
        self.metrics.received_blocks.inc();
        // The engine checks the block belongs to this transfer.
        self.engine
            .write_kv(engine_transfer, layer as usize, block, floats(k), floats(v));
        Ok(())
    }

    fn finish(&self, transfer: TransferId, outcome: Result<(), TransferFailure>) {
        if let Some(engine_transfer) = self.tickets.retire(transfer.0) {
            let outcome = outcome.map_err(|f| RemotePrefillError::Transfer(Box::new(f)));
            self.engine.finish_remote_prefill(engine_transfer, outcome);
        }
    }
}

/// How long a decode worker waits for a prefill worker before it prefills
/// locally: `base` plus `per_1k_tokens` for every thousand prompt tokens
/// it asked for. A frozen prefill worker (stopped, deadlocked, its host
/// partitioned) then costs a request this bound, not forever.
///
/// The defaults, 5 s + 5 s per 1k tokens, allow 200 tokens/s of prefill,
/// below what the CPU engine does on the models it serves here and far
/// below any GPU, plus room for a queue; raise them for a slow pool rather
/// than wait on a dead one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillDeadline {
    pub base: Duration,
    pub per_1k_tokens: Duration,
}

impl Default for PrefillDeadline {
    fn default() -> Self {
        Self {
            base: Duration::from_secs(5),
            per_1k_tokens: Duration::from_secs(5),
        }
    }
}

impl PrefillDeadline {
    /// The bound for a prefill of `tokens` prompt tokens.
    pub fn for_tokens(&self, tokens: usize) -> Duration {
        let per_token = self.per_1k_tokens.as_secs_f64() / 1000.0;
        self.base + Duration::from_secs_f64(per_token * tokens as f64)
    }
}

/// Asks prefill workers over gRPC.
#[derive(Debug)]
pub struct GrpcPrefiller {
    /// Where prefill workers push to.
    transfer_endpoint: String,
    layout: KvLayoutDescriptor,
    clients: Mutex<HashMap<String, PrefillClient<ClusterChannel<Channel>>>>,
    /// Presented on every call to a prefill worker.
    credential: ClusterCredential,
    metrics: DecodeMetrics,
    /// mTLS to prefill workers, when the cluster runs TLS.
    tls: Option<tandem_security::LoadedTls>,
    /// Shared with the [`EngineSink`].
    tickets: Arc<TransferTickets>,
    deadline: PrefillDeadline,
    /// Seconds per block each peer's remote prefills took, reported to
    /// the router (which weighs peer fetches with them).
    costs: tandem_server::PeerFetchCosts,
}

impl GrpcPrefiller {
    pub fn new(
        transfer_endpoint: String,
        layout: KvLayoutDescriptor,
        metrics: DecodeMetrics,
        tls: Option<tandem_security::LoadedTls>,
        tickets: Arc<TransferTickets>,
        credential: ClusterCredential,
    ) -> Self {
        Self {
            transfer_endpoint,
            layout,
            clients: Mutex::new(HashMap::new()),
            credential,
            metrics,
            tls,
            tickets,
            deadline: PrefillDeadline::default(),
            costs: tandem_server::PeerFetchCosts::default(),
        }
    }

    /// Records each remote prefill's seconds per block in `costs`.
    pub fn with_costs(mut self, costs: tandem_server::PeerFetchCosts) -> Self {
        self.costs = costs;
        self
    }

    /// Waits at most `deadline` for each prefill worker's answer.
    pub fn with_deadline(mut self, deadline: PrefillDeadline) -> Self {
        self.deadline = deadline;
        self
    }

    fn client(
        &self,
        addr: &str,
    ) -> Result<PrefillClient<ClusterChannel<Channel>>, PrefillStartError> {
        let mut clients = self
            .clients
            .lock()
            .map_err(|_| PrefillStartError::ClientsPoisoned)?;
        if let Some(c) = clients.get(addr) {
            return Ok(c.clone());
        }
        let channel = tandem_security::tls::endpoint(self.tls.as_ref(), addr)
            .map_err(|source| PrefillStartError::Endpoint {
                addr: addr.to_string(),
                source,
            })?
            .connect_lazy();
        let c = PrefillClient::new(self.credential.channel(channel));
        clients.insert(addr.to_string(), c.clone());
        Ok(c)
    }
}

impl RemotePrefiller for GrpcPrefiller {
    fn start(
        &self,
        request_id: &str,
        prefill_worker: &str,
        prefill: RemotePrefill,
        engine: EngineHandle,
        span: &tracing::Span,
    ) -> PrefillGuard {
        let transfer = prefill.transfer;
        let pspan = tracing::info_span!(
            parent: span,
            "remote_prefill",
            otel.kind = "client",
            prefill_worker,
            tokens = prefill.tokens.len(),
            cached_tokens = prefill.cached_tokens,
            blocks = prefill.blocks.len(),
            transfer,
            outcome = tracing::field::Empty,
        );
        let client = self
            .client(prefill_worker)
            .and_then(|c| self.tickets.issue(transfer).map(|ticket| (c, ticket)));
        let (mut client, ticket) = match client {
            Ok(c) => c,
            Err(e) => {
                pspan.record("outcome", "failed");
                self.metrics.remote_prefills.with(&["failed"]).inc();
                tracing::warn!(parent: &pspan, error = %e, "remote prefill not started");
                engine
                    .finish_remote_prefill(transfer, Err(RemotePrefillError::NotStarted(e.into())));
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
            transfer_id: ticket,
            layout: Some(layout::to_proto(&self.layout)),
            prompt_logprobs: prefill.prompt_logprobs.map(|p| p.top as u32),
            last_token: prefill
                .prompt_logprobs
                .and_then(|p| p.next_token)
                .unwrap_or_default(),
            lora: prefill
                .lora
                .as_ref()
                .map(|l| l.name.clone())
                .unwrap_or_default(),
            lora_hash_root: prefill.lora.as_ref().map_or(0, |l| l.hash_root),
        };
        let limit = self.deadline.for_tokens(req.tokens.len());
        let dst_blocks = req.dst_blocks.len();
        let mut call = tonic::Request::new(req);
        // Sent as grpc-timeout, so the prefill worker can give up on its
        // side, and enforced here by tonic's channel even if it never
        // answers at all (a `DEADLINE_EXCEEDED`-like "Timeout expired").
        call.set_timeout(limit);
        tandem_telemetry::propagation::inject(&pspan, call.metadata_mut());
        let metrics = self.metrics.clone();
        let tickets = self.tickets.clone();
        let (costs, peer, blocks) = (self.costs.clone(), prefill_worker.to_string(), dst_blocks);
        let guard = TicketGuard {
            tickets: tickets.clone(),
            ticket,
        };
        let started = Instant::now();
        let task = async move {
            let _guard = guard;
            // Success is reported by the transport (the sink's finish);
            // failure before or without a transfer is reported here. A
            // second finish for one transfer is ignored by the engine.
            match client.prefill(call).await {
                Ok(reply) => {
                    // A scoring request's prompt logprobs: handed over
                    // before the finish below, which the engine ignores
                    // once the transfer and the scores are in.
                    let scores = reply.into_inner().prompt_logprobs;
                    if !scores.is_empty() {
                        let scores = scores
                            .into_iter()
                            .map(tandem_server::logprob_from_proto)
                            .collect();
                        engine.remote_prompt_logprobs(transfer, scores);
                    }
                    metrics.remote_prefills.with(&["ok"]).inc();
                    metrics
                        .remote_prefill_duration
                        .observe_duration(started.elapsed());
                    costs.record(&peer, blocks, started.elapsed().as_secs_f64());
                    tracing::Span::current().record("outcome", "ok");
                    // The transport calls the sink's finish before it
                    // acknowledges the transfer, and a prefill worker
                    // replies only after that: this is a no-op then. A
                    // peer that replies without finishing would otherwise
                    // leave the request parked for ever.
                    tickets.retire(ticket);
                    engine.finish_remote_prefill(transfer, Err(RemotePrefillError::Unfinished));
                }
                Err(status) => {
                    metrics.remote_prefills.with(&["failed"]).inc();
                    tracing::Span::current().record("outcome", "failed");
                    tracing::warn!(transfer, error = %status.message(), "remote prefill failed");
                    tickets.retire(ticket);
                    let failed = RemotePrefillError::PrefillWorker(status.message().to_string());
                    engine.finish_remote_prefill(transfer, Err(failed));
                }
            }
        };
        let task = tokio::spawn(task.instrument(pspan));
        PrefillGuard::on_drop(move || task.abort())
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
    /// How long to wait for a prefill worker before prefilling locally.
    pub remote_prefill_deadline: PrefillDeadline,
    /// How KV blocks arrive (`--kv-transport`); prefill workers must use
    /// the same.
    pub kv_transport: tandem_kv_transfer::TransportKind,
    /// mTLS on the gRPC server and on calls to prefill workers; plain gRPC
    /// when `None`.
    pub tls: Option<tandem_security::LoadedTls>,
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
    let tickets = Arc::new(TransferTickets::registered(registry));
    tandem_server::register_transport(registry, transport.clone());
    let listener = transport
        .listen(
            &config.transfer_bind,
            layout,
            Arc::new(EngineSink::new(
                engine.clone(),
                metrics.clone(),
                tickets.clone(),
            )),
        )
        .await?;
    let endpoint = match (&config.advertise_host, listener.endpoint().parse()) {
        (Some(host), Ok(bound)) => tandem_server::advertised_addr(Some(host), bound),
        _ => listener.endpoint().to_string(),
    };
    tracing::info!(%endpoint, transport = %config.kv_transport, "receiving KV blocks");
    // Routers' KV-event feeds end when the shutdown begins, so the drain
    // is not held open by them.
    let (shutdown, feeds_end) = tandem_server::shutdown_ending_feeds(shutdown);
    let info = tandem_server::WorkerIdentity {
        id: config.id,
        role: wv1::Role::Decode,
        model: config.model,
        address: tandem_server::advertised_addr(
            config.advertise_host.as_deref(),
            bound.local_addr(),
        ),
        transfer_endpoint: endpoint.clone(),
    }
    .info(&engine, &layout);
    let credential = tandem_security::ClusterCredential::derive(&config.cluster_token);
    let peer_costs = tandem_server::PeerFetchCosts::default();
    let prefiller = Arc::new(
        GrpcPrefiller::new(
            endpoint,
            layout,
            metrics,
            config.tls.clone(),
            tickets,
            credential.clone(),
        )
        .with_deadline(config.remote_prefill_deadline)
        .with_costs(peer_costs.clone()),
    );
    tandem_server::register_engine(registry, engine.clone());
    // Requests the router placed on a prefill worker start there through
    // this worker's prefiller.
    engine.set_remote_prefiller(prefiller);
    // Generate is for the router alone: a client that learns this
    // worker's address must not get around the router's API keys.
    let generation = Arc::new(
        tandem_server::GenerationService::new(engine.clone())
            .with_metrics(tandem_server::ServingMetrics::register(registry)),
    );
    // With TLS, only a certificate with the router's role may call.
    let guard = credential
        .interceptor()
        .require_roles(config.tls.is_some(), &[PeerRole::Router]);
    let mut services =
        tandem_server::Services::guarded_generation(generation.clone(), guard.clone());
    services.add(
        tonic::service::interceptor::InterceptedService::new(
            wv1::decode_server::DecodeServer::from_arc(generation)
                .max_decoding_message_size(tandem_server::MAX_GRPC_MESSAGE_BYTES)
                .max_encoding_message_size(tandem_server::MAX_GRPC_MESSAGE_BYTES),
            guard,
        ),
        "tandem.worker.v1.Decode",
        wv1::FILE_DESCRIPTOR_SET,
    );
    // A draining decode worker's requests go on elsewhere: their new
    // worker pulls the KV from here, through the same `Prefill` a prefill
    // worker serves (computing only what is not cached: a last partial
    // block).
    let pull = tandem_prefill_worker::PrefillService::new(engine.clone(), transport, layout)
        .with_metrics(tandem_prefill_worker::PrefillMetrics::register(registry));
    tandem_prefill_worker::add_guarded(&mut services, pull, &credential, config.tls.is_some());
    services.add(
        wv1::worker_server::WorkerServer::new(
            tandem_server::WorkerService::new(engine, info)
                .with_feeds_end(feeds_end)
                .with_peer_costs(peer_costs),
        ),
        "tandem.worker.v1.Worker",
        wv1::FILE_DESCRIPTOR_SET,
    );
    services.with_tls(config.tls.as_ref().map(|t| t.server()));
    tandem_server::serve_services(bound, services, shutdown).await?;
    drop(listener);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_are_random_and_retire_once() {
        let tickets = TransferTickets::default();
        let a = tickets.issue(7).expect("ticket");
        let b = tickets.issue(8).expect("ticket");
        assert_ne!(a, b);
        // Not the engine's sequential ids: a peer cannot guess them.
        assert!(a > 1 << 20 || b > 1 << 20, "{a} {b}");
        assert_eq!(tickets.lookup(a), Some(7));
        assert_eq!(tickets.lookup(a ^ 1), None);
        assert_eq!(tickets.retire(a), Some(7));
        assert_eq!(tickets.retire(a), None);
        assert_eq!(tickets.lookup(a), None);
        assert_eq!(tickets.len(), 1);
    }
}
