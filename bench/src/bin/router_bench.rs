//! Router benchmark: the KV index alone, then a real router process in
//! front of simulated workers, so only the router is measured.
//!
//! ```text
//! cargo build --release -p tandem -p tandem-bench
//! target/release/router-bench --tandem target/release/tandem --out router.json --plot-dir bench/results
//! ```
//!
//! * **Index** (in this process, one thread): the bitmap index
//!   (`tandem_router::index::KvIndex`), walked and with the workers' sets
//!   certified prefix-closed (bisected), against the index it replaced
//!   (`tandem_bench::old_kv_index`), in the same run: decision latency (the
//!   match for every candidate plus the `kv` policy) at 64 workers with
//!   32k-token prompts, block events applied per second, and bytes per
//!   million blocks (a counting allocator).
//! * **Router** (`tandem router` with static membership in front of
//!   16 / 64 / 256 [`SimWorker`]s that stream real KV events and load
//!   reports and answer `Generate` with a fixed token stream): decision
//!   latency from the router's own histogram and end-to-end latency per
//!   prompt length (1k–128k tokens sharing prefixes), block events the
//!   router applied per second, and the request rate it sustains with
//!   1k-token prompts before its p99 doubles.
//!
//! The router, the simulated workers and the client share the machine's
//! cores: a rate here is a floor for a router with cores of its own.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::{json, Value};
use tandem_bench::old_kv_index::OldKvIndex;
use tandem_bench::percentile;
use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tandem_router::index::KvIndex;
use tandem_router::{Candidate, KvPolicy, PromptFacts, RoutingPolicy};
use tandem_tests::sim_worker::{SimConfig, SimWorker};

/// Counts live heap bytes, for the index's memory per block.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call forwards to the system allocator with the caller's
// layout; the counter is only arithmetic on the side.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's layout contract, passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[derive(Parser, Debug)]
#[command(about = "tandem router benchmark (JSON output)")]
struct Args {
    /// The tandem binary.
    #[arg(long, default_value = "target/release/tandem")]
    tandem: PathBuf,
    /// Requests per latency measurement.
    #[arg(long, default_value_t = 300)]
    requests: usize,
    /// Worker counts for the router runs.
    #[arg(long, value_delimiter = ',', default_value = "16,64,256")]
    workers: Vec<usize>,
    /// Offered request rates (per second) for the sustained-rate search.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "250,500,1000,2000,3000,4000,5000,6000,8000"
    )]
    rates: Vec<f64>,
    /// Seconds per offered rate.
    #[arg(long, default_value_t = 3.0)]
    rate_seconds: f64,
    /// Pin the router process to this CPU (`taskset -c`); run the bench
    /// itself under `taskset -c <another>` so the router has a core of its
    /// own and the simulated workers and the client share the rest.
    #[arg(long)]
    router_cpu: Option<usize>,
    /// Skip the router-process runs (index only).
    #[arg(long)]
    index_only: bool,
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write `router_rate_p99.png` here.
    #[arg(long)]
    plot_dir: Option<PathBuf>,
}

const BLOCK: usize = 16;

/// xorshift64: deterministic token streams.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        tandem_bench::xorshift(&mut self.0)
    }
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next() % 50_000) as u32).collect()
    }
}

/// `families` shared prefixes of `prefix` tokens, and a prompt maker:
/// family `i % families` plus a fresh tail up to `total` tokens.
struct Workload {
    prefixes: Vec<Vec<u32>>,
    rng: Rng,
}

impl Workload {
    fn new(families: usize, prefix: usize, seed: u64) -> Self {
        let mut rng = Rng(seed | 1);
        let prefixes = (0..families).map(|_| rng.tokens(prefix)).collect();
        Self { prefixes, rng }
    }

    fn prompt(&mut self, i: usize, total: usize) -> Vec<u32> {
        let p = &self.prefixes[i % self.prefixes.len()];
        let mut t = p[..p.len().min(total)].to_vec();
        let tail = total - t.len();
        t.extend(self.rng.tokens(tail));
        t
    }
}

fn candidates(matched: &[usize]) -> Vec<Candidate> {
    matched
        .iter()
        .enumerate()
        .map(|(w, &m)| Candidate {
            matched_blocks: m,
            disk_blocks: 0,
            disk_block_cost: None,
            active_requests: w % 3,
            active_blocks: 100 * (w % 5),
            adapter_cold: false,
            identity: w as u64,
        })
        .collect()
}

/// Decision latency of both indexes on one state: `workers` workers each
/// caching three full prompts of prefix families. The bitmap index twice:
/// walked, and with every worker's set certified prefix-closed (as the
/// workers' feeds say), bisected.
fn index_decisions(workers: usize, prompt_tokens: usize, requests: usize) -> Value {
    let mut wl = Workload::new(32, prompt_tokens * 3 / 4, 7);
    let new = KvIndex::default();
    let bisected = KvIndex::default();
    let mut old = OldKvIndex::default();
    for w in 0..workers {
        for f in [w % 32, (w + 7) % 32, (w + 13) % 32] {
            let hashes = tandem_block_hash::block_hashes(&wl.prompt(f, prompt_tokens), BLOCK);
            new.stored(w, &hashes);
            bisected.stored(w, &hashes);
            for &h in &hashes {
                old.stored(w, h);
            }
        }
        // Whole prompts, stored parents first: closed.
        bisected.set_prefix_closed(w, true);
    }
    let prompts: Vec<Vec<u64>> = (0..requests)
        .map(|i| tandem_block_hash::block_hashes(&wl.prompt(i, prompt_tokens), BLOCK))
        .collect();
    let slots: Vec<usize> = (0..workers).collect();
    let policy = KvPolicy::default();
    let mut times = [Vec::new(), Vec::new(), Vec::new()];
    let mut agree = 0;
    for hashes in &prompts {
        let facts = PromptFacts {
            blocks: hashes.len(),
            key: hashes[0],
        };
        let t = Instant::now();
        let m = new.matched(&slots, hashes);
        let a = policy.pick(&candidates(&m), facts);
        times[0].push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        let m_old: Vec<usize> = slots.iter().map(|&w| old.matched(w, hashes)).collect();
        let b = policy.pick(&candidates(&m_old), facts);
        times[1].push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        let m_bisected = bisected.matched(&slots, hashes);
        let c = policy.pick(&candidates(&m_bisected), facts);
        times[2].push(t.elapsed().as_secs_f64() * 1e6);
        agree += usize::from(a == b && a == c && m == m_old && m == m_bisected);
    }
    let row = |t: &[f64]| json!({"p50_us": percentile(t, 50.0), "p99_us": percentile(t, 99.0)});
    json!({
        "workers": workers,
        "prompt_tokens": prompt_tokens,
        "requests": requests,
        "bitmap": row(&times[0]),
        "bitmap_bisected": row(&times[2]),
        "old": row(&times[1]),
        "p99_ratio_old_over_bitmap": percentile(&times[1], 99.0) / percentile(&times[0], 99.0),
        "same_matches_and_picks": agree,
    })
}

/// Block events per second on one thread, in steady state: `workers`
/// workers of `capacity` blocks each, every event a `Stored` of 64 fresh
/// hashes, and once a worker is full a `Removed` of its 64 oldest (what
/// an engine's LRU sends).
fn index_events(workers: usize, capacity: usize, events: usize) -> Value {
    let mut rng = Rng(99);
    let per_worker = capacity / 64;
    let batches: Vec<Vec<u64>> = (0..events + workers * per_worker)
        .map(|_| (0..64).map(|_| rng.next()).collect())
        .collect();
    // Fill every worker, untimed, then time `events` store + evict pairs.
    let (fill, timed) = batches.split_at(workers * per_worker);
    let evicted = |i: usize| &batches[i];
    let hashes = (timed.len() * 64 * 2) as f64;
    let new = KvIndex::default();
    for (i, b) in fill.iter().enumerate() {
        new.stored(i % workers, b);
    }
    let t = Instant::now();
    for (i, b) in timed.iter().enumerate() {
        new.stored(i % workers, b);
        new.removed(i % workers, evicted(i));
    }
    let new_rate = hashes / t.elapsed().as_secs_f64();
    let blocks = new.len();
    drop(new);
    let mut old = OldKvIndex::default();
    for (i, b) in fill.iter().enumerate() {
        for &h in b {
            old.stored(i % workers, h);
        }
    }
    let t = Instant::now();
    for (i, b) in timed.iter().enumerate() {
        for &h in b {
            old.stored(i % workers, h);
        }
        for &h in evicted(i) {
            old.removed(i % workers, h);
        }
    }
    let old_rate = hashes / t.elapsed().as_secs_f64();
    json!({
        "workers": workers,
        "capacity_blocks_per_worker": capacity,
        "indexed_blocks": blocks,
        "block_events": hashes,
        "bitmap_per_s": new_rate,
        "old_per_s": old_rate,
        "ratio": new_rate / old_rate,
    })
}

/// Heap bytes per million distinct blocks, each held by `holders` of 64
/// workers.
fn index_memory(blocks: usize, holders: usize) -> Value {
    let mut rng = Rng(5);
    let all: Vec<u64> = (0..blocks).map(|_| rng.next()).collect();
    let per_million = |bytes: isize| bytes as f64 * 1e6 / blocks as f64;
    let before = LIVE.load(Ordering::Relaxed);
    let new = KvIndex::default();
    for (i, chunk) in all.chunks(64).enumerate() {
        for k in 0..holders {
            new.stored((i + k * 13) % 64, chunk);
        }
    }
    let new_bytes = LIVE.load(Ordering::Relaxed) - before;
    let estimate = new.memory_bytes();
    drop(new);
    let before = LIVE.load(Ordering::Relaxed);
    let mut old = OldKvIndex::default();
    for (i, chunk) in all.chunks(64).enumerate() {
        for k in 0..holders {
            for &h in chunk {
                old.stored((i + k * 13) % 64, h);
            }
        }
    }
    let old_bytes = LIVE.load(Ordering::Relaxed) - before;
    drop(old);
    json!({
        "blocks": blocks,
        "holders_per_block": holders,
        "bitmap_bytes_per_million_blocks": per_million(new_bytes),
        "bitmap_estimate_bytes_per_million_blocks": per_million(estimate as isize),
        "old_bytes_per_million_blocks": per_million(old_bytes),
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut report = json!({"bench": "router-bench", "block_size": BLOCK});
    eprintln!("index: decisions");
    report["index_decisions"] = json!([
        index_decisions(64, 32 * 1024, args.requests),
        index_decisions(256, 32 * 1024, args.requests),
        index_decisions(64, 1024, args.requests),
    ]);
    eprintln!("index: events");
    report["index_events"] = json!([
        index_events(64, 16 * 1024, 100_000),
        index_events(16, 4 * 1024, 100_000),
    ]);
    eprintln!("index: memory");
    report["index_memory"] = json!([index_memory(1 << 20, 1), index_memory(1 << 20, 4)]);
    if !args.index_only {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        report["router"] = rt.block_on(router_runs(&args))?;
    }
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(out) = &args.out {
        std::fs::write(out, text + "\n").with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// A `tandem router` process in front of `workers` simulated workers.
struct Rig {
    _sims: Vec<SimWorker>,
    router: tandem_tests::cluster::KillOnDrop,
    addr: String,
    metrics: String,
    _model: tempfile::TempDir,
}

async fn rig(args: &Args, workers: usize) -> Result<Rig> {
    let mut sims = Vec::with_capacity(workers);
    for _ in 0..workers {
        // Digests as often as a real worker sends them.
        let config = SimConfig {
            digest_period: Duration::from_secs(1),
            ..SimConfig::default()
        };
        sims.push(SimWorker::start(config).await?);
    }
    let decode: Vec<&str> = sims.iter().map(|s| s.addr()).collect();
    // No tokenizer.json: prompts are token ids.
    let model = tempfile::tempdir()?;
    let metrics = format!("127.0.0.1:{}", tandem_tests::cluster::free_port());
    let list = decode.join(",");
    let model_dir = model.path().display().to_string();
    let router_args = [
        "--addr",
        "127.0.0.1:0",
        "--decode",
        &list,
        "--model",
        &model_dir,
        "--metrics-addr",
        &metrics,
    ];
    let (router, addr) = match args.router_cpu {
        None => tandem_tests::cluster::spawn_component(&args.tandem, "router", &router_args),
        Some(cpu) => {
            let tandem = args.tandem.display().to_string();
            let cpu = cpu.to_string();
            let mut pinned = vec![cpu.as_str(), tandem.as_str(), "router"];
            pinned.extend(router_args);
            tandem_tests::cluster::spawn_component(std::path::Path::new("taskset"), "-c", &pinned)
        }
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = metrics.clone();
        let scrape =
            tokio::task::spawn_blocking(move || tandem_tests::prometheus::scrape(&m)).await?;
        let healthy = scrape
            .value("tandem_router_healthy_workers", &[("role", "decode")])
            .unwrap_or(0.0);
        if healthy as usize == workers {
            break;
        }
        if Instant::now() > deadline {
            bail!("{healthy} of {workers} workers healthy after 60 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(Rig {
        _sims: sims,
        router,
        addr,
        metrics,
        _model: model,
    })
}

/// CPU seconds (user + system) the process `pid` has used, from
/// `/proc/PID/stat` (Linux; clock ticks of 1/100 s).
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return f64::NAN;
    };
    // Fields after the command name, which is in parentheses.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 here.
    (tick(11) + tick(12)) / 100.0
}

fn request(prompt: Vec<u32>) -> v1::GenerateRequest {
    tandem_tests::cluster::greedy_request(prompt, 1)
}

/// One call to its end; its latency in µs.
async fn one(
    client: &mut GenerationClient<tonic::transport::Channel>,
    prompt: Vec<u32>,
) -> Result<f64> {
    let t = Instant::now();
    let mut stream = client.generate(request(prompt)).await?.into_inner();
    while stream.message().await?.is_some() {}
    Ok(t.elapsed().as_secs_f64() * 1e6)
}

async fn scrape(rig: &Rig) -> Result<tandem_tests::prometheus::Scrape> {
    let m = rig.metrics.clone();
    Ok(tokio::task::spawn_blocking(move || tandem_tests::prometheus::scrape(&m)).await?)
}

/// Cumulative decision-histogram buckets: (upper bound s, count).
fn decision_buckets(s: &tandem_tests::prometheus::Scrape) -> Vec<(f64, f64)> {
    let Some(f) = s.family("tandem_router_decision_seconds") else {
        return Vec::new();
    };
    let mut b: Vec<(f64, f64)> = f
        .samples
        .iter()
        .filter(|x| x.name.ends_with("_bucket"))
        .filter_map(|x| Some((x.labels.get("le")?.parse::<f64>().ok()?, x.value)))
        .collect();
    b.sort_by(|x, y| x.0.total_cmp(&y.0));
    b
}

/// The `q` quantile of the decisions between two scrapes, in µs, linearly
/// interpolated inside its bucket, and the bucket's upper bound.
fn decision_quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> (f64, f64) {
    let delta: Vec<(f64, f64)> = after
        .iter()
        .zip(before.iter().chain(std::iter::repeat(&(0.0, 0.0))))
        .map(|(a, b)| (a.0, a.1 - b.1))
        .collect();
    let total = delta.last().map_or(0.0, |d| d.1);
    let want = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, cum) in &delta {
        if cum >= want && total > 0.0 {
            let frac = if cum > prev.1 {
                (want - prev.1) / (cum - prev.1)
            } else {
                1.0
            };
            let hi = if le.is_finite() { le } else { prev.0 * 2.0 };
            return ((prev.0 + frac * (hi - prev.0)) * 1e6, hi * 1e6);
        }
        prev = (le, cum);
    }
    (f64::NAN, f64::NAN)
}

/// Latency per prompt length over one rig: router decision (its
/// histogram) and end to end, requests one at a time.
async fn latencies(args: &Args, rig: &Rig, workers: usize) -> Result<Value> {
    let mut client = GenerationClient::connect(format!("http://{}", rig.addr)).await?;
    let mut rows = Vec::new();
    for tokens in [1024usize, 8 * 1024, 32 * 1024, 128 * 1024] {
        let n = if tokens >= 128 * 1024 {
            args.requests / 4
        } else {
            args.requests
        };
        let mut wl = Workload::new(workers.max(8) / 2, tokens * 3 / 4, tokens as u64);
        // Warm: each family routed once, so workers cache them.
        for i in 0..wl.prefixes.len() {
            one(&mut client, wl.prompt(i, tokens)).await?;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let before = decision_buckets(&scrape(rig).await?);
        let mut e2e = Vec::with_capacity(n);
        for i in 0..n {
            e2e.push(one(&mut client, wl.prompt(i, tokens)).await?);
        }
        let after = decision_buckets(&scrape(rig).await?);
        let (p50, _) = decision_quantile(&before, &after, 0.50);
        let (p99, p99_bucket) = decision_quantile(&before, &after, 0.99);
        rows.push(json!({
            "prompt_tokens": tokens,
            "requests": n,
            "decision_p50_us": p50,
            "decision_p99_us": p99,
            "decision_p99_bucket_le_us": p99_bucket,
            "e2e_p50_us": percentile(&e2e, 50.0),
            "e2e_p99_us": percentile(&e2e, 99.0),
        }));
        eprintln!(
            "  {workers} workers, {tokens} tokens: {}",
            rows.last().map_or(String::new(), Value::to_string)
        );
    }
    Ok(json!(rows))
}

/// Open-loop load at each offered rate with 1k-token prompts (32 shared
/// prefixes); the end-to-end p99 and what was achieved.
async fn rates(args: &Args, rig: &Rig) -> Result<Value> {
    let mut channels = Vec::new();
    for _ in 0..4 {
        channels.push(
            tonic::transport::Endpoint::from_shared(format!("http://{}", rig.addr))?
                .connect()
                .await?,
        );
    }
    let wl = Arc::new(std::sync::Mutex::new(Workload::new(32, 768, 3)));
    let mut rows = Vec::new();
    let mut base_p99 = None;
    for &rate in &args.rates {
        let before = scrape(rig).await?;
        let events_before = before.sum("tandem_router_kv_events_applied_total", &[]);
        let cpu_before = cpu_seconds(rig.router.0.id());
        let n = (rate * args.rate_seconds) as usize;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let start = Instant::now();
        let period = Duration::from_secs_f64(1.0 / rate);
        for i in 0..n {
            let at = start + period.mul_f64(i as f64);
            tokio::time::sleep_until(at.into()).await;
            let prompt = wl.lock().map_or_else(
                |e| e.into_inner().prompt(i, 1024),
                |mut w| w.prompt(i, 1024),
            );
            let mut client = GenerationClient::new(channels[i % channels.len()].clone());
            let tx = tx.clone();
            tokio::spawn(async move {
                let _ = tx.send(one(&mut client, prompt).await.ok());
            });
        }
        drop(tx);
        let mut lat = Vec::with_capacity(n);
        let mut failed = 0;
        while let Some(r) = rx.recv().await {
            match r {
                Some(us) => lat.push(us),
                None => failed += 1,
            }
        }
        let elapsed = start.elapsed().as_secs_f64();
        let router_cpu = cpu_seconds(rig.router.0.id()) - cpu_before;
        let after = scrape(rig).await?;
        let events = after.sum("tandem_router_kv_events_applied_total", &[]) - events_before;
        let p99 = percentile(&lat, 99.0);
        // The base is the lower p99 of the two lightest loads: one short
        // step's p99 is a handful of samples' worth of noise.
        if rows.len() < 2 {
            base_p99 = Some(base_p99.map_or(p99, |b: f64| b.min(p99)));
        }
        let base = base_p99.unwrap_or(p99);
        let row = json!({
            "offered_per_s": rate,
            "achieved_per_s": lat.len() as f64 / elapsed,
            "failed": failed,
            "e2e_p50_us": percentile(&lat, 50.0),
            "e2e_p99_us": p99,
            "p99_over_base": p99 / base,
            "block_events_applied_per_s": events / elapsed,
            // The router's own CPU: what one core of it would sustain.
            "router_cpu_share": router_cpu / elapsed,
            "router_cpu_us_per_request": router_cpu * 1e6 / lat.len().max(1) as f64,
        });
        eprintln!("  rate {rate}: {row}");
        rows.push(row);
        if p99 > 4.0 * base {
            break;
        }
    }
    let sustained = rows
        .iter()
        .filter(|r| {
            r["p99_over_base"].as_f64().unwrap_or(f64::INFINITY) <= 2.0
                && r["failed"].as_u64() == Some(0)
                && r["achieved_per_s"].as_f64().unwrap_or(0.0)
                    >= 0.95 * r["offered_per_s"].as_f64().unwrap_or(f64::INFINITY)
        })
        .filter_map(|r| r["offered_per_s"].as_f64())
        .fold(0.0, f64::max);
    Ok(json!({"steps": rows, "sustained_per_s_before_p99_doubles": sustained}))
}

async fn router_runs(args: &Args) -> Result<Value> {
    let mut out = Vec::new();
    let mut curves = Vec::new();
    for &workers in &args.workers {
        eprintln!("router: {workers} workers");
        let rig = rig(args, workers).await?;
        let lat = latencies(args, &rig, workers).await?;
        let rate = rates(args, &rig).await?;
        let points = rate["steps"]
            .as_array()
            .map(|s| {
                s.iter()
                    .filter_map(|r| {
                        Some((
                            r["offered_per_s"].as_f64()?,
                            r["e2e_p99_us"].as_f64()? / 1e3,
                        ))
                    })
                    .collect()
            })
            .unwrap_or_default();
        curves.push(tandem_loadgen::plot::Series::new(
            format!("{workers} workers"),
            points,
        ));
        let s = scrape(&rig).await?;
        out.push(json!({
            "workers": workers,
            "latency": lat,
            "rate": rate,
            "index_blocks": s.sum("tandem_router_kv_index_blocks", &[]),
            "index_bytes": s.sum("tandem_router_kv_index_bytes", &[]),
            "resyncs": s.sum("tandem_router_kv_resyncs_total", &[]),
        }));
    }
    if let Some(dir) = &args.plot_dir {
        std::fs::create_dir_all(dir)?;
        let chart = tandem_loadgen::plot::Chart {
            title: "router: end-to-end p99 against offered load (1k-token prompts)".into(),
            x_label: "offered requests/s".into(),
            y_label: "p99 (ms)".into(),
            x_log: true,
            series: curves,
        };
        tandem_loadgen::plot::line_chart(&dir.join("router_rate_p99.png"), &chart)?;
    }
    Ok(json!(out))
}
