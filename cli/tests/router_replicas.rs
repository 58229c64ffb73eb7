//! Router replicas agree: two real `tandem router` processes in front of
//! the same (simulated) workers, listing them in opposite orders, send
//! every request to the same worker: a prefix one worker caches goes to
//! it, and a prompt no worker caches (a tie) goes to the same worker from
//! both, with distinct prompts spread over the pool.

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use tandem_tests::cluster::{call, free_port, greedy_request, spawn_component, KillOnDrop};
use tandem_tests::prometheus::scrape;
use tandem_tests::sim_worker::{SimConfig, SimWorker};

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

const WORKERS: usize = 6;
const FAMILIES: u32 = 8;

/// Family `f`'s prefix: 256 tokens, 16 blocks.
fn prefix(f: u32) -> Vec<u32> {
    (0..256).map(|i| 10_000 * (f + 1) + i).collect()
}

fn router(decode: &[&str], model: &Path) -> (KillOnDrop, String, String) {
    let metrics = format!("127.0.0.1:{}", free_port());
    let (child, addr) = spawn_component(
        tandem(),
        "router",
        &[
            "--addr",
            "127.0.0.1:0",
            "--decode",
            &decode.join(","),
            "--model",
            &model.display().to_string(),
            "--metrics-addr",
            &metrics,
            "--probe-interval-ms",
            "100",
        ],
    );
    (child, addr, metrics)
}

/// Waits until the router at `metrics` sees every worker and indexes
/// `blocks` distinct blocks.
fn wait_for_state(metrics: &str, blocks: f64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = scrape(metrics);
        let healthy = s.value("tandem_router_healthy_workers", &[("role", "decode")]);
        let indexed = s.value("tandem_router_kv_index_blocks", &[]);
        if healthy == Some(WORKERS as f64) && indexed == Some(blocks) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "router {metrics}: {healthy:?} healthy, {indexed:?} blocks indexed (want {WORKERS}, {blocks})"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn two_routers_send_each_request_to_the_same_worker() {
    let rt = tandem_tests::cluster::runtime();
    rt.block_on(async {
        let mut sims = Vec::new();
        for _ in 0..WORKERS {
            let config = SimConfig {
                cache_on_generate: false,
                ..SimConfig::default()
            };
            sims.push(SimWorker::start(config).await.expect("a simulated worker"));
        }
        // Family f whole on worker f % 6, its first half on the next one.
        for f in 0..FAMILIES {
            let p = prefix(f);
            sims[f as usize % WORKERS].cache_tokens(&p);
            sims[(f as usize + 1) % WORKERS].cache_tokens(&p[..128]);
        }
        let model = tempfile::tempdir().expect("tempdir");
        let addrs: Vec<&str> = sims.iter().map(SimWorker::addr).collect();
        let reversed: Vec<&str> = addrs.iter().rev().copied().collect();
        let (_a, a, a_metrics) = router(&addrs, model.path());
        let (_b, b, b_metrics) = router(&reversed, model.path());
        let blocks = f64::from(FAMILIES * 16);
        wait_for_state(&a_metrics, blocks);
        wait_for_state(&b_metrics, blocks);

        let mut tie_picks = HashSet::new();
        for i in 0..40u32 {
            let f = i % FAMILIES;
            let prompt: Vec<u32> = if i < 16 {
                // A cached family and a fresh tail.
                let mut p = prefix(f);
                p.extend((0..40).map(|t| 900_000 + i * 100 + t));
                p
            } else {
                // Nobody caches it: a tie over the pool.
                (0..100).map(|t| 5_000_000 + i * 1000 + t).collect()
            };
            let via_a = call(&a, greedy_request(prompt.clone(), 2))
                .await
                .expect("via a");
            let via_b = call(&b, greedy_request(prompt, 2)).await.expect("via b");
            assert_eq!(
                via_a.decode, via_b.decode,
                "request {i}: the replicas differ"
            );
            let picked = via_a.decode.expect("routing header");
            if i < 16 {
                assert_eq!(
                    picked,
                    addrs[f as usize % WORKERS],
                    "request {i}: the worker caching the whole prefix"
                );
            } else {
                tie_picks.insert(picked);
            }
        }
        assert!(
            tie_picks.len() >= 3,
            "24 uncached prompts went to {} workers only",
            tie_picks.len()
        );
    });
}
