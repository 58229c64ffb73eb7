//! Real `tandem` processes for end-to-end tests: a local cluster
//! (`tandem up`) read from its startup lines, and the workers' load probes.
//!
//! The binary's path is a parameter (`env!("CARGO_BIN_EXE_tandem")` is only
//! known inside the `tandem` package's own tests).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tandem_proto::worker::v1 as wv1;
use tandem_proto::worker::v1::worker_client::WorkerClient;

/// Stops the process (and with `tandem up`, its children) at the end:
/// SIGTERM first, so `up` stops its children, then SIGKILL after 10 s.
#[derive(Debug)]
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // Already ended (and reaped): its pid may belong to another process.
        if let Ok(Some(_)) = self.0.try_wait() {
            return;
        }
        // SIGTERM lets `up` stop its children (they also exit when `up`'s
        // end of their stdin closes).
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Makes `command` start the way an interactive shell starts a foreground
/// job: in a process group of its own, with SIGINT and SIGQUIT at their
/// default actions, so a test's `kill -INT -- -PGID` is exactly a Ctrl-C.
///
/// Why the reset: a test binary inherits its signal dispositions from
/// whatever ran `cargo test`, and a non-interactive shell's background job
/// (`cargo test &` in a script, `nohup`, some CI runners) has SIGINT and
/// SIGQUIT *ignored*, which every child inherits across `exec`. A Ctrl-C
/// that then lands before `tandem up` has installed its handler is
/// discarded by the kernel, and `up` starts the whole cluster and waits
/// forever (issue 41: the window is the time from `exec` to the handler,
/// microseconds on an idle machine, far longer under load). With the
/// default action, such a Ctrl-C ends `up` before it has started anything,
/// as it would in a terminal.
pub fn as_terminal_job(command: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    command.process_group(0);
    // SAFETY: runs in the forked child before `exec`; `signal` is
    // async-signal-safe and the closure allocates nothing.
    unsafe {
        command.pre_exec(|| {
            for sig in [libc::SIGINT, libc::SIGQUIT] {
                if libc::signal(sig, libc::SIG_DFL) == libc::SIG_ERR {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        })
    }
}

/// The signals a process ignores, from its `/proc/PID/status` text
/// (`SigIgn:` is a hex mask, bit `n - 1` for signal `n`).
pub fn ignored_signals(status: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .expect("a SigIgn line")
}

/// A started `tandem up` (or `serve`/`router`): what its startup lines said.
#[derive(Debug)]
pub struct Started {
    pub process: KillOnDrop,
    /// The gRPC address (`listening on ADDR`).
    pub addr: String,
    /// The OpenAI HTTP API (`http listening on ADDR`), if served.
    pub http: Option<String>,
    pub decode: Vec<String>,
    pub prefill: Vec<String>,
    /// Worker address → pid.
    pub pids: HashMap<String, u32>,
    /// etcd endpoint and cluster name, when `up` started etcd.
    pub etcd: Option<(String, String)>,
    /// The pid of that etcd.
    pub etcd_pid: Option<u32>,
    /// `(role, gRPC address, metrics address)` of every process serving
    /// `/metrics` (`up`'s `metrics ROLE ADDR METRICS_ADDR` lines).
    pub metrics: Vec<(String, String, String)>,
}

impl Started {
    /// The metrics address of the process with this role and gRPC address.
    pub fn metrics_addr(&self, role: &str, addr: &str) -> Option<&str> {
        self.metrics
            .iter()
            .find(|(r, a, _)| r == role && a == addr)
            .map(|(_, _, m)| m.as_str())
    }
}

/// Runs `<tandem> <args>` and reads its startup lines until `listening on`.
/// Panics if it exits first.
pub fn start(tandem: &Path, args: &[&str]) -> Started {
    start_with_env(tandem, args, &[])
}

/// The router flag that names the serving workers in each response's
/// metadata. [`start`] adds it to `up` and [`spawn_component`] to `router`:
/// tests check where calls went ([`Outcome::decode`]); a test of what
/// clients see by default spawns without these helpers.
pub const DEBUG_ROUTING_HEADERS: &str = "--debug-routing-headers";

/// `args` with [`DEBUG_ROUTING_HEADERS`] after a leading `up`.
fn with_routing_headers<'a>(args: &[&'a str]) -> Vec<&'a str> {
    let mut args = args.to_vec();
    if args.first() == Some(&"up") {
        args.insert(1, DEBUG_ROUTING_HEADERS);
    }
    args
}

/// [`start`] with extra environment variables (which `tandem up` passes on
/// to its workers, e.g. `UCX_TLS`).
pub fn start_with_env(tandem: &Path, args: &[&str], env: &[(&str, &str)]) -> Started {
    let child = Command::new(tandem)
        .args(with_routing_headers(args))
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("tandem starts");
    started(child, args)
}

/// Reads the startup lines of a `tandem` child the caller spawned itself
/// (with a piped stdout) until `listening on`. `args` name it in the panic
/// if it exits first.
pub fn started(mut child: Child, args: &[&str]) -> Started {
    let stdout = child.stdout.take().expect("a piped stdout");
    let process = KillOnDrop(child);
    let (mut decode, mut prefill, mut pids, mut etcd, mut http) =
        (Vec::new(), Vec::new(), HashMap::new(), None, None);
    let mut metrics = Vec::new();
    let mut etcd_pid = None;
    let mut lines = BufReader::new(stdout).lines();
    let mut worker = |rest: &str, into: &mut Vec<String>| {
        let mut parts = rest.split(' ');
        let addr = parts.next().expect("address").to_string();
        let pid: u32 = parts.next().and_then(|p| p.parse().ok()).expect("pid");
        pids.insert(addr.clone(), pid);
        into.push(addr);
    };
    loop {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("tandem {args:?} exited before listening"))
            .expect("a line");
        if let Some(rest) = line.strip_prefix("decode worker ") {
            worker(rest, &mut decode);
        } else if let Some(rest) = line.strip_prefix("prefill worker ") {
            worker(rest, &mut prefill);
        } else if let Some(rest) = line.strip_prefix("etcd ") {
            let parts: Vec<&str> = rest.split(' ').collect();
            let [e, c, pid] = parts[..] else {
                panic!("`etcd ENDPOINT CLUSTER PID` expected, got {line:?}");
            };
            etcd = Some((e.to_string(), c.to_string()));
            etcd_pid = pid.parse().ok();
        } else if let Some(a) = line.strip_prefix("http listening on ") {
            http = Some(a.to_string());
        } else if let Some(rest) = line.strip_prefix("metrics ") {
            let parts: Vec<&str> = rest.split(' ').collect();
            if let [role, addr, m] = parts[..] {
                metrics.push((role.to_string(), addr.to_string(), m.to_string()));
            }
        } else if let Some(a) = line.strip_prefix("listening on ") {
            // Keep draining stdout so the child never blocks.
            std::thread::spawn(move || for _ in lines {});
            return Started {
                process,
                addr: a.to_string(),
                http,
                decode,
                prefill,
                pids,
                etcd,
                etcd_pid,
                metrics,
            };
        }
    }
}

/// A loopback port nothing listens on now (another process may take it
/// before the caller binds it; tests bind it at once).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Writes a generated model (`<tandem> gen-model --config <preset>`) into
/// `dir`; panics with its stderr if that fails.
pub fn gen_model(tandem: &Path, dir: &Path, preset: &str) {
    let out = Command::new(tandem)
        .args(["gen-model", "--config", preset, "--out"])
        .arg(dir)
        .output()
        .expect("gen-model");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A 2-thread runtime for a test's async clients.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// One worker's load report.
pub async fn load(addr: &str) -> wv1::LoadReport {
    let mut c = WorkerClient::connect(format!("http://{addr}"))
        .await
        .expect("worker connects");
    c.load(wv1::LoadRequest {})
        .await
        .expect("load")
        .into_inner()
}

/// Waits (at most 10 s per worker) until every worker of the cluster has
/// freed all its blocks and has nothing running, waiting or parked.
pub async fn all_blocks_free(cluster: &Started) {
    for w in cluster.decode.iter().chain(&cluster.prefill) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let l = load(w).await;
            if l.free_blocks == l.num_blocks && l.running + l.waiting + l.parked == 0 {
                break;
            }
            assert!(Instant::now() < deadline, "{w} holds blocks: {l:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// What one greedy call produced, and where the router sent it.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    /// Drafted tokens, from the `Finished` message.
    pub drafted: u64,
    /// The decode and prefill workers (the router's `routed-*` headers).
    pub decode: Option<String>,
    pub prefill: Option<String>,
}

/// A greedy call through `addr` (`ignore_eos`), ending with `Finished`.
pub async fn greedy(
    addr: &str,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> Result<Outcome, tonic::Status> {
    call(addr, greedy_request(prompt, max_tokens)).await
}

/// A greedy request (`ignore_eos`) for `max_tokens` tokens of `prompt`.
pub fn greedy_request(prompt: Vec<u32>, max_tokens: u32) -> tandem_proto::v1::GenerateRequest {
    use tandem_proto::v1;
    v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
            ids: prompt,
        })),
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..Default::default()
    }
}

/// One call through `addr`, ending with `Finished`: its tokens (every
/// choice's, in arrival order) and where it was routed.
pub async fn call(
    addr: &str,
    req: tandem_proto::v1::GenerateRequest,
) -> Result<Outcome, tonic::Status> {
    use tandem_proto::v1;
    use tandem_proto::worker::{ROUTED_DECODE_HEADER, ROUTED_PREFILL_HEADER};
    let mut c = v1::generation_client::GenerationClient::connect(format!("http://{addr}"))
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let resp = c.generate(req).await?;
    let header = |k: &str| {
        resp.metadata()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let mut out = Outcome {
        decode: header(ROUTED_DECODE_HEADER),
        prefill: header(ROUTED_PREFILL_HEADER),
        ..Outcome::default()
    };
    let mut stream = resp.into_inner();
    let mut finished = false;
    while let Some(msg) = stream.message().await? {
        match msg.event {
            Some(v1::generate_response::Event::Delta(d)) => out.tokens.extend(d.token_ids),
            Some(v1::generate_response::Event::Finished(f)) => {
                finished = true;
                out.drafted = f.speculation.map_or(0, |s| s.drafted_tokens);
            }
            Some(v1::generate_response::Event::PromptLogprobs(_)) | None => {}
        }
    }
    if !finished {
        return Err(tonic::Status::internal("the stream ended without Finished"));
    }
    Ok(out)
}

/// Starts `<tandem> <subcommand> <args> --exit-on-stdin-eof` (a router, with
/// [`DEBUG_ROUTING_HEADERS`], or a worker) and reads its `listening on ADDR`
/// line; the process and the address. Panics if it exits first.
pub fn spawn_component(tandem: &Path, subcommand: &str, args: &[&str]) -> (KillOnDrop, String) {
    let mut command = Command::new(tandem);
    command.arg(subcommand);
    if subcommand == "router" {
        command.arg(DEBUG_ROUTING_HEADERS);
    }
    let child = command
        .args(args)
        .arg("--exit-on-stdin-eof")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("tandem {subcommand} starts: {e}"));
    listening(child, subcommand)
}

/// Reads a started `tandem` server's stdout (piped) up to its `listening on
/// ADDR` line, then drains the rest in the background so it never blocks;
/// the process (stopped on drop) and the address. Panics if it exits first.
pub fn listening(child: Child, what: &str) -> (KillOnDrop, String) {
    let (child, addr, _) = listening_with_metrics(child, what);
    (child, addr)
}

/// [`listening`], also keeping the `metrics listening on ADDR` line a
/// server started with `--metrics-addr` prints before it.
pub fn listening_with_metrics(
    mut child: Child,
    what: &str,
) -> (KillOnDrop, String, Option<String>) {
    let stdout = child.stdout.take().expect("a piped stdout");
    let child = KillOnDrop(child);
    let mut lines = BufReader::new(stdout).lines();
    let mut metrics = None;
    loop {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("tandem {what} exited before listening"))
            .expect("a line");
        if let Some(m) = line.strip_prefix("metrics listening on ") {
            metrics = Some(m.trim().to_string());
        } else if let Some(addr) = line.strip_prefix("listening on ") {
            let addr = addr.trim().to_string();
            std::thread::spawn(move || for _ in lines {});
            return (child, addr, metrics);
        }
    }
}

/// A raw HTTP/1.1 exchange (`Connection: close`): the status code and the
/// body. `auth` is an `Authorization` header's value.
pub fn http(addr: &str, method: &str, path: &str, auth: Option<&str>, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    s.set_write_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let auth = auth.map_or(String::new(), |a| format!("Authorization: {a}\r\n"));
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .expect("sends");
    // A server refusing a body may stop reading it and close: a failed
    // write is not the test's concern, the answer is.
    let _ = s.write_all(body.as_bytes());
    let mut response = String::new();
    // What arrived before a reset is kept.
    let _ = s.read_to_string(&mut response);
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {response:?}"));
    let body = response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    (status, body)
}
