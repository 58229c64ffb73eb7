//! `tandem up`: a local cluster — decode workers, prefill workers and a
//! router, each its own process — serving one model, with no arguments.
//!
//! Children are this same binary (`tandem decode-worker`, ...) on free
//! loopback ports; each prints its bound address first. When `etcd` is
//! installed, `up` starts a private one and the workers register there (the
//! router watches it, so workers may come and go); otherwise `up` hands the
//! addresses to the router as static lists. `up`
//! prints the workers' addresses (`decode worker ADDR`, `prefill worker
//! ADDR`), every process's Prometheus endpoint (`metrics ROLE ADDR
//! METRICS_ADDR`, unless `--no-metrics`), the router's OpenAI HTTP API
//! (`http listening on ADDR`, unless `--no-http`) and then the router's
//! gRPC address (`listening on ADDR`), and waits; Ctrl-C stops everything,
//! also during the start: every child has its own process group, so the
//! terminal's SIGINT reaches `up` alone, which gives the children SIGTERM
//! (so they leave etcd and flush their spans) and SIGKILL 5 s later, and
//! stops etcd last. Each start phase is logged (`tandem up: starting etcd`,
//! `tandem up: starting decode-worker`, ...), at `info`.
//! The log format and the OTLP endpoint are passed on to every child.
//!
//! `--tls` runs the cluster with mutual TLS: `up` writes a development CA
//! and per-component certificates (`tandem certs`) into `--tls-dir` (kept)
//! or a temporary directory (removed at the end), gives every child its
//! own certificate, and prints `tls DIR` before the addresses, so clients
//! find `DIR/ca.pem` and `DIR/client.pem` + `DIR/client.key`. `--api-key`
//! and `--api-keys-file` go to the router (the keys through its
//! environment, not its command line).
//!
//! `--planner` sizes the pools while serving: the workers are `tandem
//! worker` processes, and a planner thread (`supervisor.rs`) reads the
//! router's metrics and starts, drains or switches them (etcd and metrics
//! required).

mod announce;
mod process;
mod supervisor;
mod try_it;

use process::{spawn, Children, Spawned};

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_discovery::Role;
use tandem_security::PeerRole;

#[derive(Args, Debug)]
pub struct UpArgs {
    /// Hugging Face checkpoint directory (default: the built-in model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prefill workers (0: decode workers prefill everything).
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    /// Decode workers.
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// The router's public address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    addr: String,
    /// KV cache memory per worker.
    #[arg(long, default_value = "512MiB")]
    kv_cache_memory: String,
    /// Router policy for decode workers: kv, least-loaded, round-robin or
    /// random.
    #[arg(long, default_value = "kv")]
    decode_policy: tandem_router::PolicyKind,
    /// Remote prefill from this many uncached prompt tokens.
    #[arg(long, default_value_t = 256)]
    remote_prefill_threshold: usize,
    /// How workers move KV blocks: `tcp` or `ucx` (passed to every worker
    /// as `--kv-transport`; UCX reads `UCX_TLS` etc. from the environment,
    /// which the workers inherit).
    #[arg(long, default_value_t = tandem_kv_transfer::TransportKind::Tcp)]
    kv_transport: tandem_kv_transfer::TransportKind,
    /// A PEFT LoRA adapter every worker serves as NAME (`--lora NAME=DIR`,
    /// repeatable; passed to each worker as `--lora`).
    #[arg(long = "lora", value_name = "NAME=DIR")]
    lora: Vec<String>,
    /// A KV disk tier for every worker, each in its own directory under
    /// DIR (`decode-worker-0`, `prefill-worker-0`, ...): `up` started
    /// again on the same DIR starts warm. See the workers' `--kv-disk`.
    #[arg(long, value_name = "DIR")]
    kv_disk: Option<std::path::PathBuf>,
    /// Bytes each worker's disk tier may take.
    #[arg(long, default_value = "64GiB", requires = "kv_disk")]
    kv_disk_size: String,
    /// Extra engine flags for the workers, e.g. `--worker-arg=--batch-invariant`.
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    worker_args: Vec<String>,
    /// Extra flags for decode workers only, e.g.
    /// `--decode-arg=--speculative=ngram`.
    #[arg(long = "decode-arg", allow_hyphen_values = true)]
    decode_args: Vec<String>,
    /// Extra flags for the router, e.g. `--router-arg=--chat-template=FILE`
    /// or `--router-arg=--tool-call-parser=hermes`.
    #[arg(long = "router-arg", allow_hyphen_values = true)]
    router_args: Vec<String>,
    /// Extra flags for prefill workers only, e.g. `--prefill-arg=--tp=2`
    /// (each pool has its own parallelism).
    #[arg(long = "prefill-arg", allow_hyphen_values = true)]
    prefill_args: Vec<String>,
    /// The OpenAI-compatible HTTP API of the router.
    #[arg(long, default_value = "127.0.0.1:8000")]
    http_addr: String,
    /// No HTTP API (gRPC only).
    #[arg(long)]
    no_http: bool,
    /// The model name HTTP clients pass (default: the checkpoint
    /// directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// The router names the workers that served each call in its response
    /// metadata (`tandem router --debug-routing-headers`).
    #[arg(long)]
    debug_routing_headers: bool,
    /// Static membership even when etcd is installed.
    #[arg(long)]
    no_etcd: bool,
    /// Worker lease TTL (seconds) with etcd.
    #[arg(long, default_value_t = 10)]
    lease_ttl_s: u64,
    /// No Prometheus endpoints (by default every process serves
    /// `/metrics` on a free loopback port, printed at start).
    #[arg(long)]
    no_metrics: bool,
    /// Mutual TLS between every process and on the router's public gRPC:
    /// writes a development CA and certificates (see `tandem certs`).
    #[arg(long)]
    tls: bool,
    /// Where `--tls` writes the certificates (kept after `up` ends).
    /// Default: a temporary directory removed at the end.
    #[arg(long, requires = "tls")]
    tls_dir: Option<PathBuf>,
    #[command(flatten)]
    api_keys: crate::security_args::ApiKeyArgs,
    /// The workers' shared secret; without it `up` draws a random one.
    #[command(flatten)]
    cluster_token: crate::security_args::ClusterTokenArgs,
    /// Size the pools while serving (the SLA planner): workers are
    /// `tandem worker` processes that `up` starts, stops (drained) and
    /// switches between pools. Needs --planner-profile.
    #[arg(long)]
    planner: bool,
    #[command(flatten)]
    planning: crate::planner_cmd::PlanningArgs,
}

/// The certificates of a `--tls` cluster; a temporary directory is removed
/// when `up` ends.
struct TlsDir {
    certs: tandem_security::DevCerts,
    remove: bool,
}

impl TlsDir {
    fn create(dir: Option<&PathBuf>) -> Result<Self> {
        let (dir, remove) = match dir {
            Some(d) => (d.clone(), false),
            None => (
                std::env::temp_dir().join(format!("tandem-up-tls-{}", std::process::id())),
                true,
            ),
        };
        let certs = tandem_security::write_dev_certs(&dir, &[])
            .with_context(|| format!("writing certificates to {}", dir.display()))?;
        Ok(Self { certs, remove })
    }

    /// The `--tls-*` flags of one component.
    fn args(&self, role: PeerRole) -> Vec<String> {
        crate::security_args::TlsArgs::to_args(&self.certs.config(role))
    }
}

impl Drop for TlsDir {
    fn drop(&mut self) {
        if self.remove {
            let _ = std::fs::remove_dir_all(&self.certs.dir);
        }
    }
}

/// A private etcd for the cluster: killed and its data removed at the end,
/// after the workers (declared before [`Children`], so dropped after them),
/// which leave the membership as they stop.
struct Etcd {
    child: Child,
    endpoint: String,
    dir: PathBuf,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// How many times `up` picks fresh ports for etcd: a port found free can be
/// taken by another process before etcd binds it (tests run clusters side by
/// side), and etcd then exits at once.
const ETCD_START_ATTEMPTS: u32 = 5;

/// Starts etcd on free loopback ports if the binary is installed.
fn start_etcd() -> Result<Option<Etcd>> {
    let installed = Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !installed {
        return Ok(None);
    }
    for attempt in 1..=ETCD_START_ATTEMPTS {
        if let Some(etcd) = try_start_etcd(attempt)? {
            return Ok(Some(etcd));
        }
    }
    bail!("etcd exited at start {ETCD_START_ATTEMPTS} times (its ports taken?); try --no-etcd")
}

/// One try on two fresh ports: `Ok(None)` when etcd exited before it was
/// healthy (a port was taken meanwhile), so the caller tries again.
fn try_start_etcd(attempt: u32) -> Result<Option<Etcd>> {
    let (client, peer) = (free_port()?, free_port()?);
    let dir = std::env::temp_dir().join(format!("tandem-up-etcd-{}-{attempt}", std::process::id()));
    let endpoint = format!("http://127.0.0.1:{client}");
    let mut command = Command::new("etcd");
    command
        .arg("--data-dir")
        .arg(&dir)
        .args([
            "--listen-client-urls",
            &endpoint,
            "--advertise-client-urls",
            &endpoint,
            "--listen-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    outlive_the_terminal_group_not_up(&mut command);
    let child = command.spawn().context("starting etcd")?;
    let mut etcd = Etcd {
        child,
        endpoint,
        dir,
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    // Healthy means etcd itself answers `/health`: a bare connect could
    // reach whatever else took the port.
    while !etcd_healthy(client) {
        if let Ok(Some(status)) = etcd.child.try_wait() {
            tracing::warn!(attempt, client, peer, %status, "etcd exited at start; new ports");
            return Ok(None);
        }
        if std::time::Instant::now() > deadline {
            bail!("etcd did not become healthy on 127.0.0.1:{client}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(Some(etcd))
}

/// Puts etcd in its own process group and ties its life to `up`'s.
///
/// Ctrl-C in a terminal signals the whole foreground process group: in it,
/// etcd would stop at the same moment as the workers, which then fail to
/// leave the membership (their lease revocation finds no etcd). Outside it,
/// etcd is stopped by `up` once the workers are gone. And should `up` die
/// without running its drops (SIGKILL), the kernel sends etcd SIGTERM
/// (`PR_SET_PDEATHSIG`) rather than leave it running with no owner; the
/// workers already exit when `up`'s end of their stdin closes. (The signal
/// follows the thread that forked etcd: `up`'s main thread, which lives as
/// long as `up`.)
fn outlive_the_terminal_group_not_up(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    command.process_group(0);
    let up = std::process::id();
    // SAFETY: the closure runs in the forked child before `exec`; it calls
    // only `prctl` and `getppid`, which are async-signal-safe, and builds
    // its error without allocating (`last_os_error`, `from_raw_os_error`).
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // `up` died between the fork and the `prctl`: no signal will
            // come, so do not start.
            if libc::getppid() as u32 != up {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Whether etcd's `/health` on this loopback port says `"health":"true"`.
/// Bounded: connect, write and read time out, the answer is capped at 64 KiB.
fn etcd_healthy(port: u16) -> bool {
    use std::io::{Read, Write};
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200))
    else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let _ = stream.set_write_timeout(Some(Duration::from_millis(500)));
    let request = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut response = Vec::new();
    let _ = stream.take(64 * 1024).read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response);
    text.starts_with("HTTP/1.1 200") && text.replace(' ', "").contains("\"health\":\"true\"")
}

pub fn run(args: UpArgs, telemetry: &crate::telemetry_args::TelemetryArgs) -> Result<()> {
    if args.decode == 0 {
        bail!("--decode must be at least 1");
    }
    let planner_config = supervisor::check(&args)?;
    let model = match &args.model {
        Some(d) => d.clone(),
        None => crate::default_model::default_model_dir()?,
    };
    let model = model.display().to_string();
    // Before anything is started: a Ctrl-C from here on stops the cluster
    // in order instead of killing `up` with its children half-started.
    let stop = stop_flag()?;
    // The cluster token from the file or the environment, if given (so
    // workers started by hand can join), else a fresh one.
    let token = match args.cluster_token.given()? {
        Some(token) => token,
        None => format!("tandem-{}-{}", std::process::id(), rand_suffix()),
    };
    // The workers' shared secret travels in their environment: a command
    // line is readable by every local user.
    let secret = [(crate::security_args::CLUSTER_TOKEN_ENV, token)];
    // etcd and the certificates are declared before the children, so they
    // outlive them.
    let etcd = if args.no_etcd {
        None
    } else {
        tracing::info!("tandem up: starting etcd");
        start_etcd()?
    };
    let tls = args
        .tls
        .then(|| TlsDir::create(args.tls_dir.as_ref()))
        .transpose()?;
    let cluster_name = format!("up-{}", std::process::id());
    let membership: Vec<String> = etcd.as_ref().map_or_else(Vec::new, |e| {
        let ttl = args.lease_ttl_s.to_string();
        [&e.endpoint, &cluster_name, &ttl]
            .iter()
            .zip(["--etcd", "--cluster", "--lease-ttl-s"])
            .flat_map(|(v, flag)| [flag.to_string(), v.to_string()])
            .collect()
    });
    let children = std::sync::Arc::new(Children::default());
    // Every child: the same logs and trace export, and a metrics port.
    let mut common = telemetry.to_args();
    if !args.no_metrics {
        common.extend(["--metrics-addr".into(), "127.0.0.1:0".into()]);
    }
    let worker =
        |role: PeerRole| worker_args(role, &args, &model, &membership, &common, tls.as_ref());
    // (role, gRPC address, metrics address) of every process.
    let mut metrics: Vec<(&str, String, String)> = Vec::new();
    let mut decode = worker(PeerRole::Decode);
    decode.extend(args.decode_args.iter().cloned());
    let mut pool = Pool {
        children: &children,
        stop: &stop,
        env: &secret,
        metrics: &mut metrics,
    };
    let kv_disk = args
        .kv_disk
        .as_deref()
        .map(|d| (d, args.kv_disk_size.as_str()));
    let decodes = pool.start("decode-worker", &decode, args.decode, kv_disk)?;
    let mut prefill = worker(PeerRole::Prefill);
    prefill.extend(args.prefill_args.iter().cloned());
    let prefills = pool.start("prefill-worker", &prefill, args.prefill, kv_disk)?;
    let decode_addrs: Vec<String> = decodes.iter().map(|d| d.0.clone()).collect();
    let prefill_addrs: Vec<String> = prefills.iter().map(|p| p.0.clone()).collect();
    let router = router_args(
        &args,
        &model,
        &common,
        match etcd.is_some() {
            true => Membership::Etcd(&membership),
            false => Membership::Static {
                decode: &decode_addrs,
                prefill: &prefill_addrs,
            },
        },
        tls.as_ref(),
    );
    // The router presents the worker plane's credential, derived from the
    // same token; API keys go through its environment, not its argv.
    let mut router_env = secret.to_vec();
    router_env.extend(
        (!args.api_keys.api_keys.is_empty())
            .then(|| ("TANDEM_API_KEYS", args.api_keys.api_keys.join(","))),
    );
    let Spawned {
        addr,
        http,
        metrics: router_metrics,
        pid: router_pid,
    } = spawn(&children, &stop, &router, &router_env)?;
    if let Some(m) = &router_metrics {
        metrics.push(("router", addr.clone(), m.clone()));
    }
    announce::announce(&announce::Announcement {
        etcd: etcd
            .as_ref()
            .map(|e| (e.endpoint.as_str(), cluster_name.as_str(), e.child.id())),
        args: &args,
        model: &model,
        tls: tls.as_ref(),
        decodes: &decodes,
        prefills: &prefills,
        metrics: &metrics,
        addr: &addr,
        http: http.as_deref(),
    });
    let _planner = match (planner_config, router_metrics) {
        (Some(config), Some(router_metrics)) => {
            let started: Vec<(u32, Role)> = (prefills.iter().map(|p| (p.1, Role::Prefill)))
                .chain(decodes.iter().map(|d| (d.1, Role::Decode)))
                .collect();
            let supervisor = supervisor::Supervisor::new(
                children.clone(),
                stop.clone(),
                secret.to_vec(),
                [prefill, decode],
                &started,
                tls.is_none(),
            );
            Some(supervisor::start(
                &args.planning,
                config,
                &router_metrics,
                supervisor,
            )?)
        }
        _ => None,
    };
    watch(&children, &stop, router_pid)
}

/// A worker's command line: `ROLE-worker` on the cluster's model,
/// membership, logs and `role`'s certificate, then `--worker-arg`s.
fn worker_args(
    role: PeerRole,
    args: &UpArgs,
    model: &str,
    membership: &[String],
    common: &[String],
    tls: Option<&TlsDir>,
) -> Vec<String> {
    // Under the planner: `tandem worker`, which can switch pools.
    let mut a = match args.planner {
        true => vec!["worker".into(), "--role".into(), role.to_string()],
        false => vec![format!("{role}-worker")],
    };
    a.extend([
        "--model".into(),
        model.to_string(),
        "--kv-cache-memory".into(),
        args.kv_cache_memory.clone(),
        "--kv-transport".into(),
        args.kv_transport.to_string(),
    ]);
    a.extend(membership.iter().cloned());
    a.extend(common.iter().cloned());
    if let Some(t) = tls {
        a.extend(t.args(role));
    }
    a.extend(args.lora.iter().map(|l| format!("--lora={l}")));
    a.extend(args.worker_args.iter().cloned());
    a
}

/// Where started processes go, and what they share.
struct Pool<'a> {
    children: &'a Children,
    stop: &'a StopFlag,
    env: &'a [(&'a str, String)],
    metrics: &'a mut Vec<(&'static str, String, String)>,
}

impl Pool<'_> {
    /// Starts `count` processes of `command`, one after another, each
    /// with its own disk tier under `kv_disk` if given; their (gRPC
    /// address, pid).
    fn start(
        &mut self,
        role: &'static str,
        command: &[String],
        count: usize,
        kv_disk: Option<(&std::path::Path, &str)>,
    ) -> Result<Vec<(String, u32)>> {
        let mut started = Vec::with_capacity(count);
        for i in 0..count {
            let mut command = command.to_vec();
            if let Some((dir, size)) = kv_disk {
                let own = dir.join(format!("{role}-{i}"));
                command.extend([
                    "--kv-disk".into(),
                    own.display().to_string(),
                    "--kv-disk-size".into(),
                    size.to_string(),
                ]);
            }
            let p = spawn(self.children, self.stop, &command, self.env)?;
            if let Some(m) = p.metrics {
                self.metrics.push((role, p.addr.clone(), m));
            }
            started.push((p.addr, p.pid));
        }
        Ok(started)
    }
}

/// How the router learns of the workers.
enum Membership<'a> {
    /// It watches the same etcd (these flags).
    Etcd(&'a [String]),
    /// Fixed lists of addresses.
    Static {
        decode: &'a [String],
        prefill: &'a [String],
    },
}

/// The router's command line.
fn router_args(
    args: &UpArgs,
    model: &str,
    common: &[String],
    membership: Membership<'_>,
    tls: Option<&TlsDir>,
) -> Vec<String> {
    let mut router = vec![
        "router".to_string(),
        "--addr".into(),
        args.addr.clone(),
        "--model".into(),
        model.to_string(),
        "--decode-policy".into(),
        args.decode_policy.name().to_string(),
        "--remote-prefill-threshold".into(),
        args.remote_prefill_threshold.to_string(),
    ];
    router.extend(common.iter().cloned());
    if args.debug_routing_headers {
        router.push("--debug-routing-headers".into());
    }
    if let Some(t) = tls {
        router.extend(t.args(PeerRole::Router));
    }
    if let Some(f) = &args.api_keys.api_keys_file {
        router.extend(["--api-keys-file".into(), f.display().to_string()]);
    }
    if !args.no_http {
        router.extend(["--http-addr".into(), args.http_addr.clone()]);
        if let Some(name) = &args.served_model_name {
            router.extend(["--served-model-name".into(), name.clone()]);
        }
    }
    router.extend(args.router_args.iter().cloned());
    match membership {
        Membership::Etcd(flags) => router.extend(flags.iter().cloned()),
        Membership::Static { decode, prefill } => {
            router.extend(["--decode".into(), decode.join(",")]);
            if !prefill.is_empty() {
                router.extend(["--prefill".into(), prefill.join(",")]);
            }
        }
    }
    router
}

/// Waits for Ctrl-C / SIGTERM or for the router to die; a worker that
/// dies unasked is reported and left out (the router stops sending to it).
/// The children are killed on the way out ([`Children`]' drop).
fn watch(children: &Children, stop: &StopFlag, router_pid: u32) -> Result<()> {
    let mut reported = Vec::new();
    while !stopping(stop) {
        for (pid, status, expected) in children.exited()? {
            if pid == router_pid {
                bail!("the router exited ({status}); stopping the cluster");
            }
            if !expected && !reported.contains(&pid) {
                reported.push(pid);
                eprintln!("a worker (pid {pid}) exited: {status}");
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("stopping the cluster");
    Ok(())
}

/// A flag raised by Ctrl-C or SIGTERM.
///
/// The handlers are installed before this returns (a tokio `Signal`
/// registers when it is created, not when first polled), so a signal that
/// comes right after cannot take the default action and kill `up`.
fn stop_flag() -> Result<StopFlag> {
    use tokio::signal::unix::{signal, SignalKind};
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let raised = flag.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the signal runtime")?;
    let (mut interrupt, mut terminate) = {
        let _in_runtime = rt.enter();
        (
            signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
            signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
        )
    };
    std::thread::spawn(move || {
        rt.block_on(async {
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
        });
        raised.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    Ok(flag)
}

type StopFlag = std::sync::Arc<std::sync::atomic::AtomicBool>;

fn stopping(stop: &StopFlag) -> bool {
    stop.load(std::sync::atomic::Ordering::Relaxed)
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id().into());
    h.finish()
}
