//! `tandem prefill-worker`, `tandem decode-worker` and `tandem router`: the
//! cluster's processes (`tandem up` starts them for you).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use tandem_decode_worker::DecodeWorkerConfig;
use tandem_prefill_worker::PrefillWorkerConfig;
use tandem_proto::v1;
use tandem_router::{Cluster, PolicyKind, Role, RouterService};
use tandem_server::{Bound, Services};

use crate::engine_args::{
    engine_stopped, exit_after_engine_failure, runtime, shutdown_signal, start_engine, EngineArgs,
};
use crate::security_args::{ApiKeyArgs, TlsArgs};
use crate::telemetry_args::MetricsArgs;

#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// Hugging Face checkpoint directory (default: the built-in model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// gRPC address (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    addr: SocketAddr,
    /// Shared secret every KV transfer handshake must present.
    #[arg(long, env = "TANDEM_CLUSTER_TOKEN", default_value = "tandem-local")]
    cluster_token: String,
    /// Name in membership and logs, unique in the cluster (default: role
    /// and port). In Kubernetes: the pod's name.
    #[arg(long, env = "TANDEM_WORKER_ID")]
    id: Option<String>,
    /// Host (IP or DNS name) peers reach this worker on, with the bound
    /// ports: what it registers in etcd and, on a decode worker, its KV
    /// transfer endpoint. Needed when binding `0.0.0.0` (in Kubernetes: the
    /// pod's IP). Default: the bound address.
    #[arg(long, env = "TANDEM_ADVERTISE_HOST")]
    advertise_host: Option<String>,
    /// How KV blocks move between prefill and decode workers: `tcp` or
    /// `ucx` (UCX reads `UCX_TLS` and its other variables from the
    /// environment). Every worker of a cluster must use the same.
    #[arg(long, env = "TANDEM_KV_TRANSPORT", default_value_t = tandem_kv_transfer::TransportKind::Tcp)]
    kv_transport: tandem_kv_transfer::TransportKind,
    /// Exit when standard input closes (set by `tandem up`, so workers die
    /// with it).
    #[arg(long, hide = true)]
    exit_on_stdin_eof: bool,
    #[command(flatten)]
    membership: MembershipArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    metrics: MetricsArgs,
    #[command(flatten)]
    tls: TlsArgs,
}

/// Where cluster membership lives.
#[derive(Args, Debug, Clone)]
pub struct MembershipArgs {
    /// etcd endpoints (`http://host:port`, comma-separated). Without them,
    /// membership is the router's static lists.
    #[arg(long, env = "TANDEM_ETCD", value_delimiter = ',')]
    etcd: Vec<String>,
    /// Cluster name: the etcd key prefix `/tandem/<cluster>/workers/`.
    #[arg(long, env = "TANDEM_CLUSTER", default_value = "local")]
    cluster: String,
    /// Lease TTL in seconds: a worker that stops renewing leaves after this.
    #[arg(long, env = "TANDEM_LEASE_TTL_S", default_value_t = 10)]
    lease_ttl_s: u64,
}

/// Registers a worker in etcd (when configured).
async fn register(
    m: &MembershipArgs,
    role: tandem_discovery::Role,
    id: &str,
    addr: String,
) -> Result<Option<tandem_discovery::Registration>> {
    if m.etcd.is_empty() {
        return Ok(None);
    }
    let record = tandem_discovery::WorkerRecord {
        role,
        id: id.to_string(),
        addr,
        payload: Vec::new(),
    };
    let reg = tandem_discovery::Registration::register(
        &m.etcd,
        &m.cluster,
        record,
        Duration::from_secs(m.lease_ttl_s.max(1)),
    )
    .await?;
    tracing::info!(key = reg.key(), "registered");
    Ok(Some(reg))
}

impl WorkerArgs {
    /// Binds the worker's gRPC port, names it (`--id`, else `ROLE-PORT`),
    /// registers its advertised address, and prints `listening on ADDR`
    /// once registered, so whoever reads it can route to it.
    async fn bind_and_register(
        &self,
        role: tandem_discovery::Role,
    ) -> Result<(Bound, String, Option<tandem_discovery::Registration>)> {
        let bound = Bound::bind(self.addr).await?;
        let addr = bound.local_addr();
        let id = self
            .id
            .clone()
            .unwrap_or_else(|| format!("{role}-{}", addr.port()));
        let advertised = tandem_server::advertised_addr(self.advertise_host.as_deref(), addr);
        let reg = register(&self.membership, role, &id, advertised).await?;
        println!("listening on {addr}");
        Ok((bound, id, reg))
    }
}

/// The shutdown future of a worker: on SIGTERM or Ctrl-C, or when its
/// engine stops for good (a lost tensor/pipeline-parallel rank), it leaves
/// the membership first (the router stops sending), then the server drains.
async fn leave_then_drain(
    signal: impl std::future::Future<Output = ()>,
    reg: Option<tandem_discovery::Registration>,
    engine: tandem_engine::serving::EngineHandle,
) {
    let failed = tokio::select! {
        () = signal => None,
        why = engine_stopped(engine) => Some(why),
    };
    if let Some(reg) = reg {
        if let Err(e) = reg.deregister().await {
            tracing::warn!(error = %e, "deregistering");
        }
    }
    if let Some(why) = failed {
        exit_after_engine_failure(&why);
    }
    tracing::info!("draining");
}

#[derive(Args, Debug)]
pub struct DecodeWorkerArgs {
    #[command(flatten)]
    worker: WorkerArgs,
    /// Where prefill workers push KV blocks (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    transfer_addr: String,
    /// Prefill remotely only when at least this many prompt tokens are not
    /// cached here.
    #[arg(long, default_value_t = 256)]
    remote_prefill_threshold: usize,
}

/// Exits the process once stdin reaches end of file (exporting the spans
/// it still holds first).
pub fn exit_on_stdin_eof() {
    std::thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
        tandem_telemetry::flush();
        std::process::exit(0);
    });
}

pub fn run_prefill(args: WorkerArgs) -> Result<()> {
    if args.exit_on_stdin_eof {
        exit_on_stdin_eof();
    }
    let tls = args.tls.load()?;
    let engine = start_engine(args.model.as_deref(), &args.engine)?;
    runtime()?.block_on(async move {
        let registry = tandem_telemetry::Registry::new();
        args.metrics.start(&registry).await?;
        let signal = shutdown_signal();
        let (bound, id, reg) = args
            .bind_and_register(tandem_discovery::Role::Prefill)
            .await?;
        let config = PrefillWorkerConfig {
            id,
            model: engine.model_name,
            cluster_token: args.cluster_token,
            advertise_host: args.advertise_host,
            kv_transport: args.kv_transport,
            tls,
        };
        tandem_prefill_worker::run(
            engine.handle.clone(),
            engine.kv_layout,
            bound,
            config,
            &registry,
            leave_then_drain(signal, reg, engine.handle.clone()),
        )
        .await?;
        Ok(())
    })
}

pub fn run_decode(args: DecodeWorkerArgs) -> Result<()> {
    let w = args.worker;
    if w.exit_on_stdin_eof {
        exit_on_stdin_eof();
    }
    let tls = w.tls.load()?;
    let engine = start_engine(w.model.as_deref(), &w.engine)?;
    runtime()?.block_on(async move {
        let registry = tandem_telemetry::Registry::new();
        w.metrics.start(&registry).await?;
        let signal = shutdown_signal();
        let (bound, id, reg) = w.bind_and_register(tandem_discovery::Role::Decode).await?;
        let config = DecodeWorkerConfig {
            id,
            model: engine.model_name,
            cluster_token: w.cluster_token,
            transfer_bind: args.transfer_addr,
            advertise_host: w.advertise_host,
            remote_prefill_threshold: args.remote_prefill_threshold,
            kv_transport: w.kv_transport,
            tls,
        };
        tandem_decode_worker::run(
            engine.handle.clone(),
            engine.kv_layout,
            bound,
            config,
            &registry,
            leave_then_drain(signal, reg, engine.handle.clone()),
        )
        .await?;
        Ok(())
    })
}

#[derive(Args, Debug)]
pub struct RouterArgs {
    /// Public gRPC address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    addr: SocketAddr,
    /// Decode workers (`host:port`, comma-separated), when membership is
    /// static.
    #[arg(long, value_delimiter = ',')]
    decode: Vec<String>,
    /// Prefill workers (`host:port`, comma-separated); none means decode
    /// workers prefill everything themselves.
    #[arg(long, value_delimiter = ',')]
    prefill: Vec<String>,
    /// Checkpoint directory, for its tokenizer (prefix-aware routing of text
    /// prompts). Default: the built-in model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// kv, least-loaded, round-robin or random.
    #[arg(long, default_value = "kv")]
    decode_policy: PolicyKind,
    #[arg(long, default_value = "least-loaded")]
    prefill_policy: PolicyKind,
    /// Use a prefill worker only from this many uncached prompt tokens.
    #[arg(long, default_value_t = 256)]
    remote_prefill_threshold: usize,
    /// Prefill locally when every prefill worker has this many requests in
    /// flight (the prefill pool is saturated).
    #[arg(long, default_value_t = 8)]
    max_prefill_queue: usize,
    /// How often each worker is probed (ms).
    #[arg(long, default_value_t = 500)]
    probe_interval_ms: u64,
    /// How long a request waits for a healthy decode worker when there is
    /// none (ms, within its deadline) before UNAVAILABLE: rides out
    /// membership blips such as workers re-registering after an etcd outage.
    #[arg(long, default_value_t = tandem_router::DEFAULT_WORKER_WAIT.as_millis() as u64)]
    worker_wait_ms: u64,
    /// Exit when standard input closes (set by `tandem up`).
    #[arg(long, hide = true)]
    exit_on_stdin_eof: bool,
    #[command(flatten)]
    membership: MembershipArgs,
    #[command(flatten)]
    http: crate::http_args::HttpArgs,
    #[command(flatten)]
    metrics: MetricsArgs,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    api_keys: ApiKeyArgs,
}

fn router_role(r: tandem_discovery::Role) -> Role {
    match r {
        tandem_discovery::Role::Prefill => Role::Prefill,
        tandem_discovery::Role::Decode => Role::Decode,
    }
}

/// Follows etcd membership: workers that register get traffic, workers
/// that leave (or whose lease expires) stop getting it.
async fn follow_membership(cluster: Arc<Cluster>, m: MembershipArgs) -> Result<()> {
    let (snapshot, mut events) = tandem_discovery::watch(&m.etcd, &m.cluster).await?;
    let mut addrs = HashMap::new();
    for r in snapshot {
        cluster
            .add(router_role(r.role), &r.addr)
            .map_err(anyhow::Error::msg)?;
        addrs.insert((r.role, r.id), r.addr);
    }
    tokio::spawn(async move {
        while let Some(ev) = events.recv().await {
            match ev {
                tandem_discovery::MembershipEvent::Up(r) => {
                    tracing::info!(role = %r.role, id = %r.id, addr = %r.addr, "worker joined");
                    if let Err(e) = cluster.add(router_role(r.role), &r.addr) {
                        tracing::warn!(error = %e, "ignoring worker");
                    }
                    addrs.insert((r.role, r.id), r.addr);
                }
                tandem_discovery::MembershipEvent::Down { role, id } => {
                    if let Some(addr) = addrs.remove(&(role, id.clone())) {
                        tracing::info!(%role, %id, %addr, "worker left");
                        cluster.remove(&addr);
                    }
                }
            }
        }
    });
    Ok(())
}

pub fn run_router(args: RouterArgs) -> Result<()> {
    if args.exit_on_stdin_eof {
        exit_on_stdin_eof();
    }
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => crate::default_model::default_model_dir()?,
    };
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = if tok_path.is_file() {
        Some(Arc::new(
            tandem_engine::tokenizer::Tokenizer::from_file(&tok_path)
                .with_context(|| format!("loading {}", tok_path.display()))?,
        ))
    } else {
        None
    };
    let tls = args.tls.load()?;
    let api_keys = args.api_keys.load()?;
    runtime()?.block_on(async move {
        if args.membership.etcd.is_empty() && args.decode.is_empty() {
            anyhow::bail!("give --decode workers, or --etcd for dynamic membership");
        }
        let cluster = Cluster::with_tls(Duration::from_millis(args.probe_interval_ms), tls.clone());
        if !args.membership.etcd.is_empty() {
            follow_membership(cluster.clone(), args.membership.clone()).await?;
        }
        for d in &args.decode {
            cluster.add(Role::Decode, d).map_err(anyhow::Error::msg)?;
        }
        for p in &args.prefill {
            cluster.add(Role::Prefill, p).map_err(anyhow::Error::msg)?;
        }
        cluster.wait_probed(Duration::from_secs(10)).await;
        let registry = tandem_telemetry::Registry::new();
        tandem_router::register_cluster(&registry, cluster.clone());
        let service = Arc::new(
            RouterService::new(
                cluster,
                tokenizer,
                args.decode_policy.build(),
                args.prefill_policy.build(),
                args.remote_prefill_threshold,
                args.max_prefill_queue,
            )
            .with_metrics(tandem_router::RouterMetrics::register(&registry))
            .with_worker_wait(Duration::from_millis(args.worker_wait_ms)),
        );
        args.metrics.start(&registry).await?;
        let bound = Bound::bind(args.addr).await?;
        args.http
            .start(&dir, service.clone(), api_keys.clone())
            .await?;
        let signal = shutdown_signal();
        println!("listening on {}", bound.local_addr());
        let mut services = public_generation(service, &api_keys);
        services.with_tls(tls.as_ref().map(|t| t.server()));
        tandem_server::serve_services(bound, services, signal).await?;
        Ok(())
    })
}

/// The public `Generation` service (the router's or `tandem serve`'s):
/// messages bounded by [`tandem_server::MAX_GRPC_MESSAGE_BYTES`], and every
/// call checked against `api_keys` (`UNAUTHENTICATED` without a valid
/// `authorization: Bearer KEY`; no keys, no check). Health and reflection,
/// added by `serve_services`, stay open.
pub(crate) fn public_generation<S: v1::generation_server::Generation>(
    service: Arc<S>,
    api_keys: &tandem_security::ApiKeys,
) -> Services {
    let server = v1::generation_server::GenerationServer::from_arc(service)
        .max_decoding_message_size(tandem_server::MAX_GRPC_MESSAGE_BYTES)
        .max_encoding_message_size(tandem_server::MAX_GRPC_MESSAGE_BYTES);
    let mut services = Services::default();
    services.add(
        tonic::service::interceptor::InterceptedService::new(server, api_keys.interceptor()),
        v1::GENERATION_SERVICE,
        v1::FILE_DESCRIPTOR_SET,
    );
    services
}
