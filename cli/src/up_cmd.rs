//! `tandem up`: a local cluster — decode workers, prefill workers and a
//! router, each its own process — serving one model, with no arguments.
//!
//! Children are this same binary (`tandem decode-worker`, ...) on free
//! loopback ports; each prints its bound address first, which `up` reads
//! and hands to the router (static membership: etcd comes later). `up`
//! prints the workers' addresses (`decode worker ADDR`, `prefill worker
//! ADDR`) and then the router's (`listening on ADDR`), and waits; Ctrl-C
//! stops everything.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;

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
    /// Router policy for decode workers.
    #[arg(long, default_value = "kv")]
    decode_policy: String,
    /// Remote prefill from this many uncached prompt tokens.
    #[arg(long, default_value_t = 256)]
    remote_prefill_threshold: usize,
    /// Extra engine flags for the workers, e.g. `--worker-arg=--batch-invariant`.
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    worker_args: Vec<String>,
}

/// Children are killed when `up` ends, however it ends.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
        }
        for c in &mut self.0 {
            let _ = c.wait();
        }
    }
}

/// Starts `tandem <args>` and returns it with the address it printed.
fn spawn(children: &mut Children, args: &[String]) -> Result<String> {
    let exe = std::env::current_exe().context("finding the tandem binary")?;
    let mut child = Command::new(exe)
        .args(args)
        .arg("--exit-on-stdin-eof")
        // A pipe nobody writes: it closes when `up` dies, however it dies,
        // and the child then exits too.
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting tandem {}", args.join(" ")))?;
    let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
    children.0.push(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next();
        let _ = tx.send(first);
        // Keep draining so the child never blocks on a full pipe.
        for _ in lines {}
    });
    let line = rx
        .recv_timeout(Duration::from_secs(300))
        .map_err(|_| anyhow!("tandem {} did not start", args[0]))?
        .ok_or_else(|| anyhow!("tandem {} exited before listening", args[0]))??;
    line.strip_prefix("listening on ")
        .map(str::to_string)
        .ok_or_else(|| anyhow!("tandem {} printed {line:?}", args[0]))
}

pub fn run(args: UpArgs) -> Result<()> {
    if args.decode == 0 {
        bail!("--decode must be at least 1");
    }
    let model = match &args.model {
        Some(d) => d.clone(),
        None => crate::default_model::default_model_dir()?,
    };
    let model = model.display().to_string();
    let token = format!("tandem-{}-{}", std::process::id(), rand_suffix());
    let mut children = Children(Vec::new());
    let worker = |role: &str| -> Vec<String> {
        let mut a = vec![
            role.to_string(),
            "--model".into(),
            model.clone(),
            "--cluster-token".into(),
            token.clone(),
            "--kv-cache-memory".into(),
            args.kv_cache_memory.clone(),
        ];
        a.extend(args.worker_args.iter().cloned());
        a
    };
    let mut decodes = Vec::new();
    for _ in 0..args.decode {
        let mut a = worker("decode-worker");
        a.extend([
            "--remote-prefill-threshold".into(),
            args.remote_prefill_threshold.to_string(),
        ]);
        decodes.push(spawn(&mut children, &a)?);
    }
    let mut prefills = Vec::new();
    for _ in 0..args.prefill {
        prefills.push(spawn(&mut children, &worker("prefill-worker"))?);
    }
    let mut router = vec![
        "router".to_string(),
        "--addr".into(),
        args.addr.clone(),
        "--model".into(),
        model.clone(),
        "--decode".into(),
        decodes.join(","),
        "--decode-policy".into(),
        args.decode_policy.clone(),
        "--remote-prefill-threshold".into(),
        args.remote_prefill_threshold.to_string(),
    ];
    if !prefills.is_empty() {
        router.extend(["--prefill".into(), prefills.join(",")]);
    }
    let addr = spawn(&mut children, &router)?;
    eprintln!(
        "tandem cluster: {} decode ({}), {} prefill ({}); router on {addr}",
        decodes.len(),
        decodes.join(", "),
        prefills.len(),
        prefills.join(", ")
    );
    // Scripts and tests read these: the workers, then the router last.
    for d in &decodes {
        println!("decode worker {d}");
    }
    for p in &prefills {
        println!("prefill worker {p}");
    }
    println!("listening on {addr}");
    // Wait for Ctrl-C / SIGTERM or for any child to die; the children are
    // killed on the way out.
    let stop = stop_flag()?;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        for c in &mut children.0 {
            if let Some(status) = c.try_wait()? {
                bail!("a cluster process exited ({status}); stopping the cluster");
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("stopping the cluster");
    Ok(())
}

/// A flag raised by Ctrl-C or SIGTERM.
fn stop_flag() -> Result<std::sync::Arc<std::sync::atomic::AtomicBool>> {
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let raised = flag.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the signal runtime")?;
    std::thread::spawn(move || {
        rt.block_on(crate::engine_args::shutdown_signal());
        raised.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    Ok(flag)
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id().into());
    h.finish()
}
