//! `tandem prefill-worker`, `tandem decode-worker` and `tandem router`: the
//! cluster's processes (`tandem up` starts them for you).

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
use crate::security_args::{ApiKeyArgs, ClusterTokenArgs, TlsArgs};
use crate::telemetry_args::MetricsArgs;

mod switch;
pub use switch::{run as run_switchable, SwitchableWorkerArgs};

#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// Hugging Face checkpoint directory (default: the built-in model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// gRPC address (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    addr: SocketAddr,
    #[command(flatten)]
    cluster_token: ClusterTokenArgs,
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

/// Where cluster membership lives, and how to reach etcd (TLS, mutual TLS,
/// user and password). The password is read from `TANDEM_ETCD_PASSWORD` or
/// a file, never from the command line, where `ps` shows it to everyone.
#[derive(Args, Debug, Clone)]
pub struct MembershipArgs {
    /// etcd endpoints (`http://host:port`, or `https://host:port` with
    /// --etcd-ca; comma-separated). Without them, membership is the
    /// router's static lists.
    #[arg(long, env = "TANDEM_ETCD", value_delimiter = ',')]
    etcd: Vec<String>,
    /// CA certificate (PEM) that signed etcd's server certificate: talk TLS
    /// to etcd (the endpoints must then be https://).
    #[arg(long, env = "TANDEM_ETCD_CA")]
    etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for etcd's mutual TLS
    /// (`--client-cert-auth`); needs --etcd-key and --etcd-ca.
    #[arg(long, env = "TANDEM_ETCD_CERT")]
    etcd_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "TANDEM_ETCD_KEY")]
    etcd_key: Option<PathBuf>,
    /// etcd user (etcd RBAC auth). Its password comes from the
    /// `TANDEM_ETCD_PASSWORD` environment variable or --etcd-password-file.
    #[arg(long, env = "TANDEM_ETCD_USER")]
    etcd_user: Option<String>,
    /// File holding the etcd user's password (one trailing newline is
    /// ignored), e.g. a mounted Kubernetes secret.
    #[arg(long, env = "TANDEM_ETCD_PASSWORD_FILE")]
    etcd_password_file: Option<PathBuf>,
    /// Cluster name: the etcd key prefix `/tandem/<cluster>/workers/`.
    #[arg(long, env = "TANDEM_CLUSTER", default_value = "local")]
    cluster: String,
    /// Lease TTL in seconds: a worker that stops renewing leaves after this.
    #[arg(long, env = "TANDEM_LEASE_TTL_S", default_value_t = 10)]
    lease_ttl_s: u64,
}

/// The environment variable holding the etcd password.
const ETCD_PASSWORD_ENV: &str = "TANDEM_ETCD_PASSWORD";

impl MembershipArgs {
    /// How to reach etcd: the endpoints plus the TLS files and the user
    /// and password, read and checked here (only meaningful with --etcd).
    pub fn etcd_config(&self) -> Result<tandem_discovery::EtcdConfig> {
        self.etcd_config_with(std::env::var_os(ETCD_PASSWORD_ENV))
    }

    /// [`Self::etcd_config`] with the password variable's value given.
    fn etcd_config_with(
        &self,
        env_password: Option<std::ffi::OsString>,
    ) -> Result<tandem_discovery::EtcdConfig> {
        let mut config = tandem_discovery::EtcdConfig::new(self.etcd.iter().cloned());
        let identity = match (&self.etcd_cert, &self.etcd_key) {
            (Some(cert), Some(key)) => Some((
                read_file(cert, "etcd client certificate")?,
                read_file(key, "etcd client key")?,
            )),
            (None, None) => None,
            _ => anyhow::bail!(
                "--etcd-cert and --etcd-key (TANDEM_ETCD_CERT, TANDEM_ETCD_KEY) go together: \
                 give both for etcd's mutual TLS, or neither"
            ),
        };
        match (&self.etcd_ca, identity) {
            (Some(ca), identity) => {
                let mut tls = tandem_discovery::EtcdTls::new(read_file(ca, "etcd CA certificate")?);
                if let Some((cert, key)) = identity {
                    tls = tls.with_identity(cert, key);
                }
                config = config.with_tls(tls);
            }
            (None, Some(_)) => anyhow::bail!(
                "--etcd-cert/--etcd-key need --etcd-ca (TANDEM_ETCD_CA): the CA that signed \
                 etcd's server certificate"
            ),
            (None, None) => {}
        }
        // An empty variable counts as unset (a Kubernetes secret key that is
        // absent can still define the variable).
        let env_password = env_password
            .filter(|p| !p.is_empty())
            .map(|p| {
                p.into_string()
                    .map_err(|_| anyhow::anyhow!("{ETCD_PASSWORD_ENV} is not valid UTF-8"))
            })
            .transpose()?;
        let password = match (env_password, &self.etcd_password_file) {
            (Some(_), Some(_)) => anyhow::bail!(
                "the etcd password is given twice: set {ETCD_PASSWORD_ENV} or \
                 --etcd-password-file, not both"
            ),
            (Some(password), None) => Some(password),
            (None, Some(path)) => {
                let text = String::from_utf8(read_file(path, "etcd password file")?).with_context(
                    || format!("the etcd password file {} is not UTF-8", path.display()),
                )?;
                let password = text.strip_suffix('\n').unwrap_or(&text);
                Some(password.strip_suffix('\r').unwrap_or(password).to_string())
            }
            (None, None) => None,
        };
        match (&self.etcd_user, password) {
            (Some(user), Some(password)) => {
                if password.is_empty() {
                    anyhow::bail!("the etcd password for user {user:?} is empty");
                }
                config = config.with_user(user.clone(), password);
            }
            (Some(user), None) => anyhow::bail!(
                "--etcd-user {user:?} needs a password: set {ETCD_PASSWORD_ENV} or give \
                 --etcd-password-file (never on the command line)"
            ),
            (None, Some(_)) => anyhow::bail!(
                "an etcd password is set ({ETCD_PASSWORD_ENV} or --etcd-password-file) but no \
                 --etcd-user (TANDEM_ETCD_USER)"
            ),
            (None, None) => {}
        }
        config.check()?;
        Ok(config)
    }
}

/// A file's bytes; the error names the file and what it is for.
fn read_file(path: &std::path::Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading the {what} {}", path.display()))
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
        &m.etcd_config()?,
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
    pub(crate) async fn bind_and_register(
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
/// A decode worker (`hand_over`) in a pool of more than one in etcd hands
/// its requests over (see [`hand_over`]); otherwise it finishes them.
pub(crate) async fn leave_then_drain(
    signal: impl std::future::Future<Output = ()>,
    reg: Option<tandem_discovery::Registration>,
    engine: tandem_engine::serving::EngineHandle,
    hand_over: bool,
) {
    let failed = tokio::select! {
        () = signal => None,
        why = engine_stopped(engine.clone()) => Some(why),
    };
    // Handing over needs another worker to take the requests (a pool of
    // one drains by finishing them) and a healthy engine.
    let mut hand_over = hand_over && failed.is_none();
    if let Some(mut reg) = reg {
        if hand_over {
            hand_over = match reg.peers().await {
                Ok(peers) => peers > 0,
                Err(e) => {
                    tracing::warn!(error = %e, "listing the pool; finishing requests here");
                    false
                }
            };
        }
        if let Err(e) = reg.deregister().await {
            tracing::warn!(error = %e, "deregistering");
        }
    } else {
        // Static membership: nobody here knows who could take them.
        hand_over = false;
    }
    if let Some(why) = failed {
        exit_after_engine_failure(&why);
    }
    if hand_over {
        self::hand_over(&engine).await;
    }
    tracing::info!("draining");
}

/// How long a draining decode worker's engine must stay idle before it
/// takes its KV to be pulled: the router resumes each handed-over request
/// at once, and its new worker asks for the blocks within milliseconds.
const HANDOVER_QUIET: Duration = Duration::from_secs(2);
/// The longest a draining decode worker waits for its KV to be pulled.
const HANDOVER_LIMIT: Duration = Duration::from_secs(60);

/// Ends every running request here as handed over (the router resumes it
/// on another decode worker, which pulls its KV blocks from this one's
/// prefix cache over the KV transport instead of prefilling them again),
/// then serves those pulls until the engine has been idle for
/// [`HANDOVER_QUIET`].
async fn hand_over(engine: &tandem_engine::serving::EngineHandle) {
    let before = engine.stats();
    let handed = before.running + before.waiting + before.parked;
    engine.hand_over();
    tracing::info!(requests = handed, "handing requests over");
    if handed == 0 {
        return;
    }
    let start = tokio::time::Instant::now();
    let mut quiet_since = start;
    while start.elapsed() < HANDOVER_LIMIT {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let s = engine.stats();
        if s.running + s.waiting + s.parked > 0 {
            quiet_since = tokio::time::Instant::now();
        } else if quiet_since.elapsed() >= HANDOVER_QUIET {
            return;
        }
    }
    tracing::warn!("KV pulls still running after {HANDOVER_LIMIT:?}; draining anyway");
}

const DEFAULT_TRANSFER_ADDR: &str = "127.0.0.1:0";
const DEFAULT_PREFILL_WAIT_MS: u64 = 5000;

/// The decode role's own settings.
#[derive(Args, Debug, Clone)]
pub struct DecodeOptions {
    /// Where prefill workers push KV blocks (port 0 picks a free port).
    #[arg(long, default_value = DEFAULT_TRANSFER_ADDR)]
    transfer_addr: String,
    /// Wait this long for a prefill worker's answer (plus the per-1k-token
    /// allowance) before prefilling locally: a frozen prefill worker costs
    /// a request this much, not forever.
    #[arg(long, default_value_t = DEFAULT_PREFILL_WAIT_MS)]
    remote_prefill_timeout_ms: u64,
    /// Added to the prefill wait for every 1000 prompt tokens sent.
    #[arg(long, default_value_t = DEFAULT_PREFILL_WAIT_MS)]
    remote_prefill_timeout_per_1k_tokens_ms: u64,
}

#[derive(Args, Debug)]
pub struct DecodeWorkerArgs {
    #[command(flatten)]
    worker: WorkerArgs,
    #[command(flatten)]
    decode: DecodeOptions,
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

/// What a worker command has once its engine runs and its server is bound
/// and registered.
struct Launched {
    engine: crate::engine_args::StartedEngine,
    registry: tandem_telemetry::Registry,
    bound: Bound,
    /// Its id in membership.
    id: String,
    cluster_token: String,
    tls: Option<tandem_security::LoadedTls>,
    /// Resolves on SIGINT/SIGTERM once the worker has left membership and
    /// drained (a decode worker hands its requests over first).
    shutdown: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
}

impl WorkerArgs {
    /// Starts the engine, serves metrics, binds and registers as `role`,
    /// then runs `serve` until the shutdown it is given resolves: the part
    /// both workers share.
    fn launch<F, Fut>(self, role: tandem_discovery::Role, serve: F) -> Result<()>
    where
        F: FnOnce(Self, Launched) -> Fut,
        Fut: std::future::Future<Output = Result<()>>,
    {
        if self.exit_on_stdin_eof {
            exit_on_stdin_eof();
        }
        let tls = self.tls.load()?;
        let cluster_token = self.cluster_token.load()?;
        let mut engine = start_engine(self.model.as_deref(), &self.engine)?;
        // The other ranks of a `--tp`/`--pp` worker stop when this is
        // dropped: held here until `serve` returns, whatever part of
        // `engine` the serving future keeps.
        let ranks = engine._ranks.take();
        runtime()?.block_on(async move {
            let registry = tandem_telemetry::Registry::new();
            self.metrics.start(&registry).await?;
            let signal = shutdown_signal();
            let (bound, id, reg) = self.bind_and_register(role).await?;
            let hand_over = role == tandem_discovery::Role::Decode;
            let shutdown = Box::pin(leave_then_drain(
                signal,
                reg,
                engine.handle.clone(),
                hand_over,
            ));
            let launched = Launched {
                engine,
                registry,
                bound,
                id,
                cluster_token,
                tls,
                shutdown,
            };
            let served = serve(self, launched).await;
            drop(ranks);
            served
        })
    }
}

/// What serving a role needs besides its bound server and its shutdown.
pub(crate) struct RoleContext<'a> {
    pub engine: &'a crate::engine_args::StartedEngine,
    pub registry: &'a tandem_telemetry::Registry,
    pub worker: &'a WorkerArgs,
    pub decode: &'a DecodeOptions,
    pub id: String,
    pub cluster_token: &'a str,
    pub tls: Option<&'a tandem_security::LoadedTls>,
}

/// Serves `role` on `bound` with the engine until `shutdown` resolves and
/// the server has drained.
pub(crate) async fn serve_role(
    role: tandem_discovery::Role,
    ctx: RoleContext<'_>,
    bound: Bound,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    let (handle, layout) = (ctx.engine.handle.clone(), ctx.engine.kv_layout);
    match role {
        tandem_discovery::Role::Prefill => {
            let config = PrefillWorkerConfig {
                id: ctx.id,
                model: ctx.engine.model_name.clone(),
                cluster_token: ctx.cluster_token.to_string(),
                advertise_host: ctx.worker.advertise_host.clone(),
                kv_transport: ctx.worker.kv_transport,
                tls: ctx.tls.cloned(),
            };
            tandem_prefill_worker::run(handle, layout, bound, config, ctx.registry, shutdown)
                .await?;
        }
        tandem_discovery::Role::Decode => {
            let d = ctx.decode;
            let config = DecodeWorkerConfig {
                id: ctx.id,
                model: ctx.engine.model_name.clone(),
                cluster_token: ctx.cluster_token.to_string(),
                transfer_bind: d.transfer_addr.clone(),
                advertise_host: ctx.worker.advertise_host.clone(),
                remote_prefill_deadline: tandem_decode_worker::PrefillDeadline {
                    base: Duration::from_millis(d.remote_prefill_timeout_ms),
                    per_1k_tokens: Duration::from_millis(d.remote_prefill_timeout_per_1k_tokens_ms),
                },
                kv_transport: ctx.worker.kv_transport,
                tls: ctx.tls.cloned(),
            };
            tandem_decode_worker::run(handle, layout, bound, config, ctx.registry, shutdown)
                .await?;
        }
    }
    Ok(())
}

pub fn run_prefill(args: WorkerArgs) -> Result<()> {
    run_role(
        tandem_discovery::Role::Prefill,
        args,
        DecodeOptions::default_values(),
    )
}

pub fn run_decode(args: DecodeWorkerArgs) -> Result<()> {
    run_role(tandem_discovery::Role::Decode, args.worker, args.decode)
}

fn run_role(role: tandem_discovery::Role, args: WorkerArgs, decode: DecodeOptions) -> Result<()> {
    args.launch(role, |w, l| async move {
        let ctx = RoleContext {
            engine: &l.engine,
            registry: &l.registry,
            worker: &w,
            decode: &decode,
            id: l.id.clone(),
            cluster_token: &l.cluster_token,
            tls: l.tls.as_ref(),
        };
        serve_role(role, ctx, l.bound, l.shutdown).await
    })
}

impl DecodeOptions {
    /// The flags' defaults (a prefill worker has none of them).
    fn default_values() -> Self {
        Self {
            transfer_addr: DEFAULT_TRANSFER_ADDR.into(),
            remote_prefill_timeout_ms: DEFAULT_PREFILL_WAIT_MS,
            remote_prefill_timeout_per_1k_tokens_ms: DEFAULT_PREFILL_WAIT_MS,
        }
    }
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
    /// Name the decode and prefill worker that served each call in its
    /// response metadata (`x-tandem-decode-worker`, `x-tandem-prefill-worker`).
    /// Off by default: clients are not told worker addresses.
    #[arg(long)]
    debug_routing_headers: bool,
    /// Never let a decode worker pull a prompt's prefix from another decode
    /// worker holding more of it: compute it instead (e.g. when the links
    /// between decode workers are slow, or to measure routing alone).
    #[arg(long)]
    no_peer_fetch: bool,
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
    /// Workers take calls only with the credential derived from it.
    #[command(flatten)]
    cluster_token: ClusterTokenArgs,
}

/// Follows etcd membership: workers that register get traffic, workers
/// that leave (or whose lease expires) stop getting it (`crate::membership`).
async fn follow_membership(cluster: Arc<Cluster>, m: MembershipArgs) -> Result<()> {
    let (snapshot, events) = tandem_discovery::watch(&m.etcd_config()?, &m.cluster).await?;
    crate::membership::follow(cluster, snapshot, events);
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
    let tokenizer = tandem_engine::checkpoint::tokenizer_of(&dir)
        .with_context(|| format!("loading the tokenizer of {}", dir.display()))?
        .map(Arc::new);
    let tls = args.tls.load()?;
    let api_keys = args.api_keys.load()?;
    let credential = tandem_security::ClusterCredential::derive(&args.cluster_token.load()?);
    runtime()?.block_on(async move {
        if args.membership.etcd.is_empty() && args.decode.is_empty() {
            anyhow::bail!("give --decode workers, or --etcd for dynamic membership");
        }
        let cluster = Cluster::with_tls(
            Duration::from_millis(args.probe_interval_ms),
            tls.clone(),
            credential,
        );
        if !args.membership.etcd.is_empty() {
            follow_membership(cluster.clone(), args.membership.clone()).await?;
        }
        for d in &args.decode {
            cluster.add(Role::Decode, d)?;
        }
        for p in &args.prefill {
            cluster.add(Role::Prefill, p)?;
        }
        cluster.wait_probed(Duration::from_secs(10)).await;
        let registry = tandem_telemetry::Registry::new();
        tandem_router::register_cluster(&registry, cluster.clone());
        let adapters: Arc<dyn tandem_openai::Adapters> =
            Arc::new(crate::lora_args::ClusterAdapters(cluster.clone()));
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
            .with_worker_wait(Duration::from_millis(args.worker_wait_ms))
            .with_routing_headers(args.debug_routing_headers)
            .with_peer_fetch(!args.no_peer_fetch),
        );
        args.metrics.start(&registry).await?;
        let bound = Bound::bind(args.addr).await?;
        let api = args
            .http
            .api(&dir, service.clone(), api_keys.clone(), Some(adapters))?;
        args.http.serve(api.as_ref()).await?;
        let signal = shutdown_signal();
        println!("listening on {}", bound.local_addr());
        let mut services = public_services(service, api.as_ref(), &api_keys);
        services.with_tls(tls.as_ref().map(|t| t.server()));
        tandem_server::serve_services(bound, services, signal).await?;
        Ok(())
    })
}

/// The public services (the router's or `tandem serve`'s): `Generation`
/// over `service`, and `Chat` over `api` when the model has a tokenizer.
/// Messages are bounded by [`tandem_server::MAX_GRPC_MESSAGE_BYTES`], and
/// every call is checked against `api_keys` (`UNAUTHENTICATED` without a
/// valid `authorization: Bearer KEY`; no keys, no check). Health and
/// reflection, added by `serve_services`, stay open.
pub(crate) fn public_services<S: v1::generation_server::Generation>(
    service: Arc<S>,
    api: Option<&tandem_openai::OpenAi>,
    api_keys: &tandem_security::ApiKeys,
) -> Services {
    let mut services = Services::guarded_generation(service, api_keys.interceptor());
    if let Some(api) = api {
        let chat = v1::chat_server::ChatServer::new(api.chat_service())
            .max_decoding_message_size(tandem_server::MAX_GRPC_MESSAGE_BYTES)
            .max_encoding_message_size(tandem_server::MAX_GRPC_MESSAGE_BYTES);
        services.add(
            tonic::service::interceptor::InterceptedService::new(chat, api_keys.interceptor()),
            v1::CHAT_SERVICE,
            v1::FILE_DESCRIPTOR_SET,
        );
    }
    services
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cmd {
        #[command(flatten)]
        m: MembershipArgs,
    }

    fn parse(args: &[&str]) -> MembershipArgs {
        let mut argv = vec!["t", "--etcd", "https://127.0.0.1:2379"];
        argv.extend_from_slice(args);
        match Cmd::try_parse_from(argv) {
            Ok(cmd) => cmd.m,
            Err(e) => panic!("{e}"),
        }
    }

    fn files() -> (tempfile::TempDir, String, String) {
        let dir = tempfile::tempdir().expect("tempdir");
        let pem = dir.path().join("x.pem");
        std::fs::write(&pem, "PEM").expect("write");
        let pw = dir.path().join("pw");
        std::fs::write(&pw, "s3cret\n").expect("write");
        let (pem, pw) = (pem.display().to_string(), pw.display().to_string());
        (dir, pem, pw)
    }

    fn error(args: &[&str], env_password: Option<&str>) -> String {
        match parse(args).etcd_config_with(env_password.map(Into::into)) {
            Ok(config) => panic!("accepted: {config:?}"),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn tls_user_and_password_make_one_config() {
        let (_dir, pem, pw) = files();
        let args = ["--etcd-ca", &pem, "--etcd-cert", &pem, "--etcd-key", &pem];
        let err = parse(&args)
            .etcd_config_with(Some("env-pw".into()))
            .expect_err("env pw without user");
        assert!(format!("{err:#}").contains("--etcd-user"), "{err:#}");
        let mut with_user = args.to_vec();
        with_user.extend(["--etcd-user", "tandem", "--etcd-password-file", &pw]);
        let config = parse(&with_user).etcd_config_with(None).expect("config");
        assert_eq!(config.user(), Some("tandem"));
        assert!(config.tls().is_some_and(|t| t.has_identity()));
        assert!(!format!("{config:?}").contains("s3cret"));
    }

    #[test]
    fn half_an_identity_a_missing_ca_or_password_and_unreadable_files_are_errors() {
        let (_dir, pem, pw) = files();
        let e = error(&["--etcd-ca", &pem, "--etcd-cert", &pem], None);
        assert!(e.contains("go together"), "{e}");
        let e = error(&["--etcd-cert", &pem, "--etcd-key", &pem], None);
        assert!(e.contains("need --etcd-ca"), "{e}");
        let e = error(&["--etcd-ca", &pem, "--etcd-user", "u"], None);
        assert!(e.contains("needs a password"), "{e}");
        let e = error(
            &[
                "--etcd-ca",
                &pem,
                "--etcd-user",
                "u",
                "--etcd-password-file",
                &pw,
            ],
            Some("x"),
        );
        assert!(e.contains("not both"), "{e}");
        let e = error(&["--etcd-ca", "/nonexistent/ca.pem"], None);
        assert!(
            e.contains("/nonexistent/ca.pem") && e.contains("etcd CA"),
            "{e}"
        );
        // https without a CA: the discovery crate's check.
        let e = error(&[], None);
        assert!(e.contains("https://127.0.0.1:2379"), "{e}");
    }
}
