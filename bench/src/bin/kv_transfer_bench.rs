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
//! KiB of K and 32 KiB of V per block-layer, back to back in one buffer as
//! the prefill worker exports a layer, or each from its own memory with
//! `--scattered`), repeated for at least `--seconds`
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
//! The UCX wires (`--wires`): `ucx-tcp` and `ucx-sm` with the transport's
//! automatic data path (rendezvous on tcp, puts on shared memory), and
//! `ucx-tcp-put` / `ucx-sm-rndv` with the other one forced. They set `TLS`
//! (and `NET_DEVICES=lo` for tcp) on their own contexts; `ucx_perftest`
//! gets the same as `UCX_*` variables, and both see the transport's tuning
//! (`tuning_env`, exported at start as `tandem` does). The ceiling is the
//! better of `ucp_put_bw` and `tag_bw` with one message of the batch's
//! size; each point alternates the transport and perftest `--rounds` times
//! and reports medians, `ratio` being the median of the rounds' transport
//! (discard sink) over ceiling. For
//! information it also runs `ucp_put_bw` with 32 KiB messages (the size of
//! the puts the transport issues); that one rewrites the same cache-resident
//! 32 KiB every iteration, so on shared memory it measures the CPU cache, not
//! a transfer, and is not used as the ceiling.
//!
//! On shared memory the put path's cost is the sender's CPU copying each
//! batch into the receiver's ring, and perftest's `ucp_put_bw` copies into
//! one destination of the message's size, rewritten every iteration and so
//! cache-resident. For the shared-memory wires each round therefore also
//! times the two copies alone, no protocol involved (`memcpy_*`): the batch
//! into one same-size destination (perftest's pattern) and into a ring of
//! the transport's region size in the transport's batches. Their ratio is
//! the fraction of perftest's figure that copying into a ring can reach at
//! all on this machine. Writes one JSON document and prints a table.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use clap::Parser;
use futures_util::stream::{FuturesUnordered, StreamExt};
use serde_json::json;
use tandem_bench::median;
use tandem_kv_transfer::tcp::TcpTransport;
use tandem_kv_transfer::ucx::{
    batch_slots, UcxConfig, UcxDataPath, UcxTransport, MAX_NOTICE_BLOCKS, UCX_TUNING,
};
use tandem_kv_transfer::{
    BlockWrite, KvDtype, KvLayoutDescriptor, KvSink, TransferFailure, TransferId, Transport,
    WriteRefused,
};

/// How long each of the two copies runs per round.
const COPY_SECONDS: f64 = 0.3;

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
    /// Wires to measure: tcp, ucx-tcp, ucx-tcp-put, ucx-sm, ucx-sm-rndv.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "tcp,ucx-tcp,ucx-tcp-put,ucx-sm,ucx-sm-rndv"
    )]
    wires: Vec<String>,
    /// Rounds per point: the transport and `ucx_perftest` alternate, and
    /// medians are reported (the ceiling alone varies 2x run to run).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// The UCX receive region per connection in MiB (default: the
    /// transport's own).
    #[arg(long)]
    region_mib: Option<usize>,
    /// The UCX sender's batch in KiB (default: the transport's own).
    #[arg(long)]
    batch_kib: Option<usize>,
    /// Give each block its own memory (by default a batch's blocks lie
    /// back to back in one buffer, as the prefill worker exports a layer).
    #[arg(long)]
    scattered: bool,
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
        rows: tandem_kv_transfer::KvRows::PerHead,
        num_layers: 32,
        num_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        dtype: KvDtype::F16,
        sliding_window: 0,
        windowed_layers: 0,
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
    ) -> Result<(), WriteRefused> {
        for got in [k.len(), v.len()] {
            if got != self.half {
                let want = self.half;
                return Err(WriteRefused::WrongLength { got, want });
            }
        }
        if self.copy {
            let at = (layer as usize * POOL_BLOCKS as usize + block as usize) * 2 * self.half;
            let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
            let slot = pool
                .get_mut(at..at + 2 * self.half)
                .ok_or(WriteRefused::NotADestination(block))?;
            slot[..self.half].copy_from_slice(k);
            slot[self.half..].copy_from_slice(v);
        }
        Ok(())
    }

    fn finish(&self, _: TransferId, outcome: Result<(), TransferFailure>) {
        if outcome.is_ok() {
            self.finished.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// UCX transport settings the command line overrides.
#[derive(Debug, Clone, Copy)]
struct Tuning {
    region_mib: Option<usize>,
    batch_kib: Option<usize>,
}

impl Tuning {
    /// The transport's default settings with these overrides.
    fn config(self) -> UcxConfig {
        let mut config = UcxConfig::new(TOKEN);
        if let Some(mib) = self.region_mib {
            config.region_bytes = mib << 20;
        }
        if let Some(kib) = self.batch_kib {
            config.batch_bytes = kib << 10;
        }
        config
    }
}

fn ucx(settings: &[(&str, &str)], data_path: UcxDataPath, tuning: Tuning) -> Result<UcxTransport> {
    let mut config = tuning.config();
    config.data_path = data_path;
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
    scattered: bool,
) -> Result<f64> {
    let l = layout();
    let (rx, tx) = (make()?, make()?);
    let sink = BenchSink::new(copy, &l);
    let listener = rx.listen("127.0.0.1:0", l, sink.clone()).await?;
    let session = tx.connect(listener.endpoint(), l).await?;
    let half = l.block_layer_bytes();
    let count = (batch_bytes / (2 * half)).max(1);
    // As the prefill worker exports them: the batch's blocks back to back
    // in one buffer (K₀ V₀ K₁ V₁ …); `scattered`: each from its own memory.
    let whole = Bytes::from(
        (0..count)
            .flat_map(|_| [vec![0x5au8; half], vec![0xa5u8; half]])
            .flatten()
            .collect::<Vec<u8>>(),
    );
    let batch: Vec<BlockWrite> = (0..count)
        .map(|i| {
            let at = i * 2 * half;
            let (k, v) = if scattered {
                (
                    Bytes::copy_from_slice(&whole[at..at + half]),
                    Bytes::copy_from_slice(&whole[at + half..at + 2 * half]),
                )
            } else {
                (
                    whole.slice(at..at + half),
                    whole.slice(at + half..at + 2 * half),
                )
            };
            BlockWrite {
                layer: (i / POOL_BLOCKS as usize) as u32 % l.num_layers,
                dst_block: (i % POOL_BLOCKS as usize) as u32,
                k,
                v,
            }
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

/// The copy bound of the put path on shared memory: GB/s of copying a
/// `batch_bytes` source into one destination of the same size every time
/// (as `ucp_put_bw` does), and into a ring of `region_bytes` in pieces of at
/// most `chunk_bytes`, wrapping at its end (as the transport's sender does;
/// a batch larger than the ring passes through it in pieces).
fn copy_bound(batch_bytes: usize, region_bytes: usize, chunk_bytes: usize) -> (f64, f64) {
    let source = vec![0x5au8; batch_bytes];
    let mut same = vec![0u8; batch_bytes];
    let mut ring = vec![0u8; region_bytes.max(1)];
    let chunk = chunk_bytes.clamp(1, ring.len());
    let rate = |copy: &mut dyn FnMut()| {
        copy(); // first touch
        let start = Instant::now();
        let mut copies = 0u64;
        while copies < 100_000 && start.elapsed().as_secs_f64() < COPY_SECONDS {
            copy();
            copies += 1;
        }
        copies as f64 * batch_bytes as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    let same_gbps = rate(&mut || {
        same.copy_from_slice(&source);
        std::hint::black_box(&mut same);
    });
    let mut cursor = 0usize;
    let ring_gbps = rate(&mut || {
        for piece in source.chunks(chunk) {
            // Where the transport's batch wraps, it is two copies too.
            let first = piece.len().min(ring.len() - cursor);
            ring[cursor..cursor + first].copy_from_slice(&piece[..first]);
            ring[..piece.len() - first].copy_from_slice(&piece[first..]);
            cursor = (cursor + piece.len()) % ring.len();
        }
        std::hint::black_box(&mut ring);
    });
    (same_gbps, ring_gbps)
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
    // As `tandem` does: UCX's tuning through the environment, set while
    // this process has one thread.
    for (name, value) in tandem_kv_transfer::ucx::tuning_env() {
        std::env::set_var(name, value);
    }
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
    let tuning = Tuning {
        region_mib: args.region_mib,
        batch_kib: args.batch_kib,
    };
    let ucx_wire = |settings: Settings, path: UcxDataPath| -> (Make, Option<Settings>) {
        (
            Box::new(move || Ok(Box::new(ucx(settings, path, tuning)?) as Box<dyn Transport>)),
            Some(settings),
        )
    };
    let mut transports: Vec<(&str, Make, Option<Settings>)> = Vec::new();
    // The ring the UCX transports use, and the batch their senders copy
    // (as `UcxTransport` derives it: whole slots, at most half the ring).
    let config = tuning.config();
    let slot_bytes = 2 * layout().block_layer_bytes();
    let slots = config.region_slots(slot_bytes);
    let chunk_bytes =
        batch_slots(config.batch_bytes, slot_bytes, MAX_NOTICE_BLOCKS, slots) * slot_bytes;
    for wire in &args.wires {
        let (name, (make, env)): (&str, (Make, Option<Settings>)) = match wire.as_str() {
            "tcp" => (
                "tcp",
                (
                    Box::new(|| Ok(Box::new(TcpTransport::new(TOKEN)) as Box<dyn Transport>)),
                    None,
                ),
            ),
            // The automatic data path: rendezvous on tcp, puts on shared memory.
            "ucx-tcp" => ("ucx-tcp", ucx_wire(UCX_TCP, UcxDataPath::Auto)),
            "ucx-tcp-put" => ("ucx-tcp-put", ucx_wire(UCX_TCP, UcxDataPath::Put)),
            "ucx-sm" => ("ucx-sm", ucx_wire(UCX_SM, UcxDataPath::Auto)),
            "ucx-sm-rndv" => ("ucx-sm-rndv", ucx_wire(UCX_SM, UcxDataPath::Rendezvous)),
            other => bail!("--wires: unknown wire {other:?}"),
        };
        transports.push((name, make, env));
    }
    let mut rows = Vec::new();
    println!(
        "{:<12} {:>6} {:>10} {:>10} {:>10} {:>10} {:>8} {:>10}",
        "wire", "MiB", "discard", "copy", "put_bw", "tag_bw", "ratio", "ring/same"
    );
    let block_put = layout().block_layer_bytes();
    if args.rounds == 0 {
        bail!("--rounds: at least 1");
    }
    for (name, make, ucx_env) in &transports {
        // perftest runs with the wire's settings; the tuning is in this
        // process's environment, which it inherits: both sides of the
        // ratio use the same UCX configuration.
        let env: Option<Vec<(String, String)>> = ucx_env.map(|settings| {
            settings
                .iter()
                .map(|(k, v)| (format!("UCX_{k}"), v.to_string()))
                .collect()
        });
        let env: Option<Vec<(&str, &str)>> = env
            .as_ref()
            .map(|e| e.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect());
        let put_block = match &env {
            Some(env) => {
                let gbps = perftest(&args.perftest, "ucp_put_bw", block_put, env)?;
                println!(
                    "{name:<12} ucp_put_bw of {block_put}-byte messages (cache-resident, \
                     information only): {gbps:.2} GB/s"
                );
                Some(gbps)
            }
            None => None,
        };
        for &mib in &args.sizes_mib {
            let bytes = mib << 20;
            let (mut discard, mut put, mut tag, mut ratio) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            // Shared memory only: elsewhere the kernel or the NIC copies.
            let with_copy_bound = *ucx_env == Some(UCX_SM);
            let (mut copy_same, mut copy_ring) = (Vec::new(), Vec::new());
            for _ in 0..args.rounds {
                let d = rt.block_on(measure(
                    make.as_ref(),
                    bytes,
                    false,
                    args.seconds,
                    args.inflight,
                    args.scattered,
                ))?;
                discard.push(d);
                if let Some(env) = &env {
                    let p = perftest(&args.perftest, "ucp_put_bw", bytes, env)?;
                    let t = perftest(&args.perftest, "tag_bw", bytes, env)?;
                    put.push(p);
                    tag.push(t);
                    ratio.push(d / p.max(t));
                }
                if with_copy_bound {
                    let (same, ring) = copy_bound(bytes, slots * slot_bytes, chunk_bytes);
                    copy_same.push(same);
                    copy_ring.push(ring);
                }
            }
            let copy = rt.block_on(measure(
                make.as_ref(),
                bytes,
                true,
                args.seconds,
                args.inflight,
                args.scattered,
            ))?;
            // The tcp wire has no perftest ceiling: those stay empty.
            let median_of = |xs: &[f64]| (!xs.is_empty()).then(|| median(xs));
            let (put_m, tag_m, ratio_m) = (median_of(&put), median_of(&tag), median_of(&ratio));
            let ring_fraction: Vec<f64> = copy_ring
                .iter()
                .zip(&copy_same)
                .map(|(r, s)| r / s)
                .collect();
            let ring_fraction_m = median_of(&ring_fraction);
            let discard_m = median(&discard);
            let fmt = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2}"));
            let percent =
                |x: Option<f64>| x.map_or("-".to_string(), |r| format!("{:.0}%", r * 100.0));
            println!(
                "{name:<12} {mib:>6} {discard_m:>10.2} {copy:>10.2} {:>10} {:>10} {:>8} {:>10}",
                fmt(put_m),
                fmt(tag_m),
                percent(ratio_m),
                percent(ring_fraction_m),
            );
            rows.push(json!({
                "transport": name,
                "batch_mib": mib,
                "gbps_discard": discard_m,
                "gbps_discard_rounds": discard,
                "gbps_copy": copy,
                "perftest_put_bw_gbps": put_m,
                "perftest_tag_bw_gbps": tag_m,
                "perftest_put_bw_rounds": put,
                "perftest_tag_bw_rounds": tag,
                "perftest_put_bw_block_gbps": put_block,
                "fraction_of_perftest": ratio_m,
                "fraction_of_perftest_rounds": ratio,
                "memcpy_same_gbps": median_of(&copy_same),
                "memcpy_ring_gbps": median_of(&copy_ring),
                "memcpy_same_gbps_rounds": copy_same,
                "memcpy_ring_gbps_rounds": copy_ring,
                "memcpy_ring_fraction": ring_fraction_m,
            }));
        }
    }
    let doc = json!({
        "benchmark": "kv-transfer",
        "layout": layout().to_string(),
        "block_layer_bytes": layout().block_layer_bytes(),
        "seconds_per_point": args.seconds,
        "transfers_in_flight": args.inflight,
        "rounds": args.rounds,
        "region_mib": args.region_mib,
        "batch_kib": args.batch_kib,
        "ring_bytes": slots * slot_bytes,
        "sender_batch_bytes": chunk_bytes,
        // In effect for the UCX transports and perftest alike.
        "ucx_environment": UCX_TUNING
            .iter()
            .map(|(k, _)| {
                let name = format!("UCX_{k}");
                let value = std::env::var(&name).unwrap_or_default();
                format!("{name}={value}")
            })
            .collect::<Vec<_>>(),
        "blocks_scattered": args.scattered,
        "rows": rows,
    });
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&doc)?)?;
    println!("wrote {}", args.out.display());
    Ok(())
}
