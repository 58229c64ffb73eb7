//! KV transfer bandwidth: the TCP transport, the UCX transport over UCX's
//! TCP and over shared memory, and `ucx_perftest` (`ucp_put_bw`,
//! `tag_bw`, client and server on loopback) as the ceiling, for block
//! batches of 1 to 64 MiB.
//!
//! ```text
//! cargo build --release -p tandem-bench --bin kv-transfer-bench
//! target/release/kv-transfer-bench --out bench/results/kv-transfer/kv_transfer.json
//! ```
//!
//! One transfer is `write(batch)` + `finish` of one batch of block-layers
//! (a Llama-8B-like layout: 8 KV heads × 128 dims × 16 slots, f16, so 32
//! KiB of K and 32 KiB of V per block-layer, each block from its own
//! memory, as blocks come from a pool), repeated for at least `--seconds`
//! with `--inflight` transfers on the session at a time: 1 measures one
//! transfer's whole round trip (the first write to the receiver's
//! acknowledgement) back to back; more keep the wire busy across those round
//! trips, as a prefill worker streaming many requests does and as
//! `ucx_perftest` does with its window of outstanding operations. Sender
//! and receiver run in this process on separate transports (separate UCX
//! workers and progress threads). Two sinks: `discard` checks lengths only
//! (the transport alone, like `ucx_perftest`, which does not touch the
//! data), `copy` copies every block into a pool as the decode worker's
//! engine does. GB/s are 10^9 bytes per second of K+V payload.
//!
//! The UCX runs set `TLS` (and `NET_DEVICES=lo` for tcp) on their own
//! contexts; `ucx_perftest` gets the same as `UCX_*` variables. The ceiling
//! is the better of `ucp_put_bw` and `tag_bw` with one message of the
//! batch's size; `ratio` is the transport (discard sink) over it. For
//! information it also runs `ucp_put_bw` with 32 KiB messages (the size of
//! the puts the transport issues); that one rewrites the same cache-resident
//! 32 KiB every iteration, so on shared memory it measures the CPU cache, not
//! a transfer, and is not used as the ceiling. Writes one JSON document and
//! prints a table.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use clap::Parser;
use futures_util::stream::{FuturesUnordered, StreamExt};
use serde_json::json;
use tandem_kv_transfer::tcp::TcpTransport;
use tandem_kv_transfer::ucx::{UcxConfig, UcxTransport};
use tandem_kv_transfer::{BlockWrite, KvDtype, KvLayoutDescriptor, KvSink, TransferId, Transport};

#[derive(Parser, Debug)]
#[command(about = "KV transfer bandwidth: TCP, UCX tcp, UCX shared memory, ucx_perftest")]
struct Args {
    /// Batch sizes in MiB.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    sizes_mib: Vec<usize>,
    /// Minimum measuring time per point.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Transfers in flight on the session at a time (1: back to back).
    #[arg(long, default_value_t = 4)]
    inflight: usize,
    /// The ucx_perftest binary.
    #[arg(long, default_value = "ucx_perftest")]
    perftest: PathBuf,
    /// Where to write the JSON results.
    #[arg(long, default_value = "bench/results/kv-transfer/kv_transfer.json")]
    out: PathBuf,
}

const TOKEN: &str = "bench";
const POOL_BLOCKS: u32 = 256;

fn layout() -> KvLayoutDescriptor {
    KvLayoutDescriptor {
        num_layers: 32,
        num_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        dtype: KvDtype::F16,
    }
}

/// A receiver's sink: checks lengths, optionally copies into a pool.
struct BenchSink {
    copy: bool,
    half: usize,
    pool: Mutex<Vec<u8>>,
    finished: AtomicU64,
}

impl BenchSink {
    fn new(copy: bool, layout: &KvLayoutDescriptor) -> Arc<Self> {
        let half = layout.block_layer_bytes();
        let pool = if copy {
            vec![0u8; POOL_BLOCKS as usize * layout.num_layers as usize * 2 * half]
        } else {
            Vec::new()
        };
        Arc::new(Self {
            copy,
            half,
            pool: Mutex::new(pool),
            finished: AtomicU64::new(0),
        })
    }
}

impl KvSink for BenchSink {
    fn num_blocks(&self) -> u32 {
        POOL_BLOCKS
    }

    fn write(
        &self,
        _: TransferId,
        layer: u32,
        block: u32,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), String> {
        if k.len() != self.half || v.len() != self.half {
            return Err("wrong length".into());
        }
        if self.copy {
            let at = (layer as usize * POOL_BLOCKS as usize + block as usize) * 2 * self.half;
            let mut pool = self.pool.lock().map_err(|_| "poisoned".to_string())?;
            let slot = pool
                .get_mut(at..at + 2 * self.half)
                .ok_or_else(|| "out of range".to_string())?;
            slot[..self.half].copy_from_slice(k);
            slot[self.half..].copy_from_slice(v);
        }
        Ok(())
    }

    fn finish(&self, _: TransferId, outcome: Result<(), String>) {
        if outcome.is_ok() {
            self.finished.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn ucx(settings: &[(&str, &str)]) -> Result<UcxTransport> {
    let mut config = UcxConfig::new(TOKEN);
    config.ucx_settings = settings
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Ok(UcxTransport::with_config(config)?)
}

/// GB/s of one transport for one batch size and sink.
async fn measure(
    make: &dyn Fn() -> Result<Box<dyn Transport>>,
    batch_bytes: usize,
    copy: bool,
    seconds: f64,
    inflight: usize,
) -> Result<f64> {
    let l = layout();
    let (rx, tx) = (make()?, make()?);
    let sink = BenchSink::new(copy, &l);
    let listener = rx.listen("127.0.0.1:0", l, sink.clone()).await?;
    let session = tx.connect(listener.endpoint(), l).await?;
    let half = l.block_layer_bytes();
    let count = (batch_bytes / (2 * half)).max(1);
    let batch: Vec<BlockWrite> = (0..count)
        .map(|i| BlockWrite {
            layer: (i / POOL_BLOCKS as usize) as u32 % l.num_layers,
            dst_block: (i % POOL_BLOCKS as usize) as u32,
            k: Bytes::from(vec![0x5au8; half]),
            v: Bytes::from(vec![0xa5u8; half]),
        })
        .collect();
    let payload = count * 2 * half;
    // Warm up (connection set-up, registration caches).
    for t in 0..2u64 {
        session.write(TransferId(t), batch.clone()).await?;
        session.finish(TransferId(t)).await?;
    }
    let one = |t: u64| {
        let (session, batch) = (&session, batch.clone());
        async move {
            session.write(TransferId(t), batch).await?;
            session.finish(TransferId(t)).await
        }
    };
    let start = Instant::now();
    let (mut started, mut done) = (0u64, 0u64);
    let mut flying = FuturesUnordered::new();
    loop {
        let more = started < 3 || start.elapsed().as_secs_f64() < seconds;
        if more && started < 100_000 && flying.len() < inflight.max(1) {
            flying.push(one(100 + started));
            started += 1;
            continue;
        }
        match flying.next().await {
            Some(result) => {
                result?;
                done += 1;
            }
            None => break,
        }
    }
    let secs = start.elapsed().as_secs_f64();
    drop(flying);
    drop(session);
    drop(listener);
    Ok(done as f64 * payload as f64 / secs / 1e9)
}

/// `ucx_perftest` server + client on loopback; GB/s of the final line.
fn perftest(bin: &PathBuf, test: &str, size: usize, env: &[(&str, &str)]) -> Result<f64> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port()
        .to_string();
    let iters = ((1usize << 30) / size).clamp(20, 2000).to_string();
    let size = size.to_string();
    let mut server = Command::new(bin)
        .args(["-p", &port])
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {} (install ucx-utils)", bin.display()))?;
    let mut last = Err(anyhow!("no attempt"));
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(200));
        let out = Command::new(bin)
            .args([
                "127.0.0.1",
                "-p",
                &port,
                "-t",
                test,
                "-s",
                &size,
                "-n",
                &iters,
            ])
            .envs(env.iter().copied())
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        last = text
            .lines()
            .find_map(|l| l.strip_prefix("Final:"))
            .and_then(|rest| {
                let cols: Vec<f64> = rest
                    .split_whitespace()
                    .filter_map(|c| c.parse().ok())
                    .collect();
                // iterations, p50, avg lat, overall lat, avg BW, overall BW, ...
                cols.get(5).copied()
            })
            .map(|mbps| mbps * 1024.0 * 1024.0 / 1e9)
            .ok_or_else(|| anyhow!("{test} -s {size}: no result: {text}"));
        if last.is_ok() {
            break;
        }
    }
    let _ = server.kill();
    let _ = server.wait();
    last
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.sizes_mib.is_empty() || args.sizes_mib.iter().any(|&s| s == 0 || s > 1024) {
        bail!("--sizes-mib: 1..=1024 MiB each");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    const UCX_TCP: &[(&str, &str)] = &[("TLS", "tcp"), ("NET_DEVICES", "lo")];
    const UCX_SM: &[(&str, &str)] = &[("TLS", "posix,cma,self")];
    type Make = Box<dyn Fn() -> Result<Box<dyn Transport>>>;
    type Settings = &'static [(&'static str, &'static str)];
    let transports: Vec<(&str, Make, Option<Settings>)> = vec![
        (
            "tcp",
            Box::new(|| Ok(Box::new(TcpTransport::new(TOKEN)) as Box<dyn Transport>)),
            None,
        ),
        (
            "ucx-tcp",
            Box::new(|| Ok(Box::new(ucx(UCX_TCP)?) as Box<dyn Transport>)),
            Some(UCX_TCP),
        ),
        (
            "ucx-sm",
            Box::new(|| Ok(Box::new(ucx(UCX_SM)?) as Box<dyn Transport>)),
            Some(UCX_SM),
        ),
    ];
    let mut rows = Vec::new();
    println!(
        "{:<8} {:>6} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "wire", "MiB", "discard", "copy", "put_bw", "tag_bw", "ratio"
    );
    let block_put = layout().block_layer_bytes();
    for (name, make, ucx_env) in &transports {
        let env_of = |settings: Settings| -> Vec<(String, String)> {
            settings
                .iter()
                .map(|(k, v)| (format!("UCX_{k}"), v.to_string()))
                .collect()
        };
        let put_block = match ucx_env {
            Some(settings) => {
                let env = env_of(settings);
                let env: Vec<(&str, &str)> =
                    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                let gbps = perftest(&args.perftest, "ucp_put_bw", block_put, &env)?;
                println!(
                    "{name:<8} ucp_put_bw of {block_put}-byte messages (cache-resident, \
                     information only): {gbps:.2} GB/s"
                );
                Some(gbps)
            }
            None => None,
        };
        for &mib in &args.sizes_mib {
            let bytes = mib << 20;
            let discard = rt.block_on(measure(
                make.as_ref(),
                bytes,
                false,
                args.seconds,
                args.inflight,
            ))?;
            let copy = rt.block_on(measure(
                make.as_ref(),
                bytes,
                true,
                args.seconds,
                args.inflight,
            ))?;
            let (put, tag) = match ucx_env {
                Some(settings) => {
                    let env = env_of(settings);
                    let env: Vec<(&str, &str)> =
                        env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                    (
                        Some(perftest(&args.perftest, "ucp_put_bw", bytes, &env)?),
                        Some(perftest(&args.perftest, "tag_bw", bytes, &env)?),
                    )
                }
                None => (None, None),
            };
            let ceiling = match (put, tag) {
                (Some(p), Some(t)) => Some(p.max(t)),
                _ => None,
            };
            let ratio = ceiling.map(|c| discard / c);
            let fmt = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2}"));
            println!(
                "{name:<8} {mib:>6} {discard:>10.2} {copy:>10.2} {:>10} {:>10} {:>8}",
                fmt(put),
                fmt(tag),
                ratio.map_or("-".to_string(), |r| format!("{:.0}%", r * 100.0))
            );
            rows.push(json!({
                "transport": name,
                "batch_mib": mib,
                "gbps_discard": discard,
                "gbps_copy": copy,
                "perftest_put_bw_gbps": put,
                "perftest_tag_bw_gbps": tag,
                "perftest_put_bw_block_gbps": put_block,
                "ceiling_gbps": ceiling,
                "fraction_of_perftest": ratio,
            }));
        }
    }
    let doc = json!({
        "benchmark": "kv-transfer",
        "layout": layout().to_string(),
        "block_layer_bytes": layout().block_layer_bytes(),
        "seconds_per_point": args.seconds,
        "transfers_in_flight": args.inflight,
        "rows": rows,
    });
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&doc)?)?;
    println!("wrote {}", args.out.display());
    Ok(())
}
