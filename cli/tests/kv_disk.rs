//! The KV disk tier through real processes: a decode worker killed with
//! SIGKILL and started again on the same `--kv-disk` directory serves a
//! prompt it had cached from its disk tier (its metrics say so), with the
//! tokens of the cold run; two workers cannot share one directory.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tandem_tests::cluster::{free_port, greedy, spawn_component, KillOnDrop, Outcome};
use tandem_tests::prometheus::scrape;

/// A decode worker on `model` at `addr` with its disk tier in `disk`: the
/// process, its gRPC address and its metrics address.
fn worker(model: &Path, disk: &Path, addr: &str) -> (KillOnDrop, String, String) {
    let child = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .arg("decode-worker")
        .arg("--model")
        .arg(model)
        .arg("--kv-disk")
        .arg(disk)
        .args(["--kv-disk-size", "64MiB", "--num-kv-blocks", "64"])
        .args(["--addr", addr, "--metrics-addr", "127.0.0.1:0"])
        .arg("--exit-on-stdin-eof")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("tandem decode-worker starts");
    let (child, addr, metrics) =
        tandem_tests::cluster::listening_with_metrics(child, "decode-worker");
    (child, addr, metrics.expect("metrics before listening"))
}

fn metric(metrics: &str, name: &str) -> f64 {
    scrape(metrics).value(name, &[]).unwrap_or(0.0)
}

/// Waits (at most 20 s) until `name` reaches `at_least`.
fn wait_for(metrics: &str, name: &str, at_least: f64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = metric(metrics, name);
        if now >= at_least {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} stayed at {now}, below {at_least}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A router over the decode workers at `decode`: the process, its gRPC
/// address and its metrics address.
fn router(decode: &[&str], model: &Path) -> (KillOnDrop, String, String) {
    let metrics = format!("127.0.0.1:{}", free_port());
    let (child, addr) = spawn_component(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        "router",
        &[
            "--addr",
            "127.0.0.1:0",
            "--decode",
            &decode.join(","),
            "--model",
            model.to_str().expect("utf8"),
            "--metrics-addr",
            &metrics,
            "--probe-interval-ms",
            "100",
        ],
    );
    (child, addr, metrics)
}

/// A greedy 8-token call through the router, retried (at most 20 s) while
/// the router has no healthy worker.
fn generate(router: &str, prompt: &[u32]) -> Outcome {
    let rt = tandem_tests::cluster::runtime();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match rt.block_on(greedy(router, prompt.to_vec(), 8)) {
            Ok(o) => return o,
            Err(e) if Instant::now() < deadline => {
                eprintln!("retrying: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("the call failed: {e}"),
        }
    }
}

#[test]
fn a_killed_worker_restarted_on_its_disk_tier_serves_its_old_prefix_from_disk() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("model");
    tandem_tests::cluster::gen_model(Path::new(env!("CARGO_BIN_EXE_tandem")), &model, "tiny");
    let disk = tmp.path().join("kv");
    // 20 full blocks of prompt, then a partial one.
    let prompt: Vec<u32> = (0..20 * 16 + 3).map(|i| (i * 11 + 5) % 250).collect();

    let (mut first, addr, metrics) = worker(&model, &disk, "127.0.0.1:0");
    let (_router, router, router_metrics) = router(&[&addr], &model);
    let cold = generate(&router, &prompt);
    wait_for(&metrics, "tandem_kv_disk_written_blocks_total", 20.0);
    // `tandem plan --kv-disk-size` counts the files the worker writes.
    let plan = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "plan",
            "--memory",
            "64MiB",
            "--kv-disk-size",
            "64MiB",
            "--json",
            "--model",
        ])
        .arg(&model)
        .output()
        .expect("plan runs");
    let plan: serde_json::Value = serde_json::from_slice(&plan.stdout).expect("plan JSON");
    let store = std::fs::read_dir(&disk)
        .expect("dir")
        .next()
        .expect("store")
        .expect("entry");
    let file = std::fs::read_dir(store.path())
        .expect("store dir")
        .filter_map(Result::ok)
        .find(|e| e.path().extension().is_some_and(|x| x == "kvb"))
        .expect("a block file");
    let file_bytes = file.metadata().expect("metadata").len();
    assert_eq!(plan["kv_disk"]["block_file_bytes"], file_bytes);
    assert_eq!(plan["kv_disk"]["blocks"], (64u64 << 20) / file_bytes);
    // A second worker on the same directory is refused, not corrupting it.
    let refused = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .arg("decode-worker")
        .arg("--model")
        .arg(&model)
        .arg("--kv-disk")
        .arg(&disk)
        .args(["--addr", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .output()
        .expect("runs");
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("in use by another process"), "{err}");

    first.0.kill().expect("SIGKILL");
    first.0.wait().expect("reaped");
    // Restarted where it was (a pod keeps its address): the router finds it
    // again at its next probe.
    let (_second, _, metrics) = worker(&model, &disk, &addr);
    wait_for(&metrics, "tandem_kv_disk_blocks", 20.0);
    // The restarted worker's feed announces what its disk tier holds.
    wait_for(&router_metrics, "tandem_router_kv_disk_index_blocks", 20.0);
    let warm = generate(&router, &prompt);
    assert_eq!(warm.tokens, cold.tokens, "tokens from restored K/V");
    assert_eq!(metric(&metrics, "tandem_kv_disk_hits_total"), 20.0);
    assert_eq!(metric(&metrics, "tandem_kv_disk_load_failures_total"), 0.0);
    // The prompt's last 3 tokens and 7 decode steps ran, nothing more.
    assert_eq!(
        metric(&metrics, "tandem_engine_computed_tokens_total"),
        10.0
    );
    // It measured a restore; a cold prompt makes it measure a prefill:
    // the router then weighs its disk hits by their measured ratio.
    let other: Vec<u32> = (0..200).map(|i| (i * 13 + 7) % 250).collect();
    let _ = generate(&router, &other);
    let cost = || {
        scrape(&router_metrics)
            .value("tandem_router_disk_block_cost", &[("worker", &addr)])
            .unwrap_or(0.0)
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while cost() <= 0.0 {
        assert!(
            Instant::now() < deadline,
            "the router never got the worker's measured cost"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("measured disk block cost: {}", cost());
}

/// Two workers, each with its own disk tier; prefixes spread over them.
/// Worker A is killed and restarted: its pool is empty, its disk holds its
/// prefixes. The router sends each prefix home again: A's for their disk
/// hits (a miss everywhere else), B's for their pool hits.
#[test]
fn the_router_sends_a_prefix_to_the_worker_whose_disk_holds_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("model");
    tandem_tests::cluster::gen_model(Path::new(env!("CARGO_BIN_EXE_tandem")), &model, "tiny");
    let (mut a, a_addr, _) = worker(&model, &tmp.path().join("a"), "127.0.0.1:0");
    let (_b, b_addr, _) = worker(&model, &tmp.path().join("b"), "127.0.0.1:0");
    let (_router, router, router_metrics) = router(&[&a_addr, &b_addr], &model);
    // 16 prefixes of 4 full blocks: all on one of two workers is a
    // 1-in-32,768 chance (ties go by rendezvous hash).
    let prompt = |p: u32| -> Vec<u32> {
        (0..4 * 16 + 2)
            .map(|i| (i * 7 + p * 37 + 1) % 250)
            .collect()
    };
    let homes: Vec<String> = (0..16)
        .map(|p| {
            generate(&router, &prompt(p))
                .decode
                .expect("routing header")
        })
        .collect();
    let on_a = homes.iter().filter(|h| **h == a_addr).count();
    assert!(on_a > 0 && on_a < 16, "prefixes did not spread: {homes:?}");
    // Each prefix's 4 full blocks, on the disk of the worker that ran it.
    wait_for(&router_metrics, "tandem_router_kv_disk_index_blocks", 64.0);

    a.0.kill().expect("SIGKILL");
    a.0.wait().expect("reaped");
    // The router drops A's entries when its feed breaks ...
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&router_metrics, "tandem_router_kv_disk_index_blocks") >= 64.0 {
        assert!(
            Instant::now() < deadline,
            "the router never dropped A's entries"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (_a, _, a_metrics) = worker(&model, &tmp.path().join("a"), &a_addr);
    // ... and the restarted A's dump puts its disk blocks back (and no
    // pool blocks); it is routed to once probed healthy again.
    wait_for(&router_metrics, "tandem_router_kv_disk_index_blocks", 64.0);
    let healthy = || {
        scrape(&router_metrics)
            .value("tandem_router_healthy_workers", &[("role", "decode")])
            .unwrap_or(0.0)
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while healthy() < 2.0 {
        assert!(Instant::now() < deadline, "A never came back");
        std::thread::sleep(Duration::from_millis(20));
    }
    for (p, home) in homes.iter().enumerate() {
        // The blocks a worker reports in use are part of its cost: a probe
        // (every 100 ms) that caught the previous request mid-flight would
        // tip a 4-block decision. Two probe intervals: the view is idle.
        std::thread::sleep(Duration::from_millis(250));
        let again = generate(&router, &prompt(p as u32));
        assert_eq!(
            again.decode.as_ref(),
            Some(home),
            "prefix {p} left its worker"
        );
    }
    assert_eq!(
        metric(&a_metrics, "tandem_kv_disk_hits_total"),
        4.0 * on_a as f64,
        "A read every prefix it had from disk"
    );
}

/// `tandem up --kv-disk DIR` gives each worker its own directory under
/// DIR (two workers cannot share one), and the worker that served a
/// prompt wrote its blocks there.
#[test]
fn up_gives_each_worker_its_own_disk_tier() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("model");
    tandem_tests::cluster::gen_model(Path::new(env!("CARGO_BIN_EXE_tandem")), &model, "tiny");
    let disk = tmp.path().join("kv");
    let cluster = tandem_tests::cluster::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &[
            "up",
            "--model",
            model.to_str().expect("utf8"),
            "--prefill",
            "0",
            "--decode",
            "2",
            "--addr",
            "127.0.0.1:0",
            "--no-http",
            "--kv-cache-memory",
            "16MiB",
            "--kv-disk",
            disk.to_str().expect("utf8"),
            "--kv-disk-size",
            "16MiB",
        ],
    );
    let prompt: Vec<u32> = (0..20 * 16 + 3).map(|i| (i * 3 + 1) % 250).collect();
    let served = generate(&cluster.addr, &prompt)
        .decode
        .expect("routing header");
    let index = cluster
        .decode
        .iter()
        .position(|d| *d == served)
        .expect("one of the cluster's workers");
    let metrics = cluster
        .metrics_addr("decode-worker", &served)
        .expect("metrics")
        .to_string();
    wait_for(&metrics, "tandem_kv_disk_written_blocks_total", 20.0);
    let files = |i: usize| -> usize {
        let dir = disk.join(format!("decode-worker-{i}"));
        std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .filter_map(Result::ok)
            .filter(|e| e.path().is_dir())
            .flat_map(|store| std::fs::read_dir(store.path()).expect("store"))
            .filter_map(Result::ok)
            .filter(|e| e.path().extension().is_some_and(|x| x == "kvb"))
            .count()
    };
    assert_eq!(files(index), 20);
    assert_eq!(files(1 - index), 0);
}
