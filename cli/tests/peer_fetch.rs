//! Peer fetch through real processes: `tandem up --decode 2` whose router
//! alternates between the two (round-robin, so the second request for a
//! prefix lands on the worker that lacks it). The router names the worker
//! holding the prefix as the remote "prefill worker": the chosen worker
//! pulls the blocks over the KV transport instead of computing them, the
//! holder computes only the tail it lacks, and the tokens are those the
//! holder itself gives. Over a throttled link (a network namespace whose
//! veth sends at 1 Mbit/s, a `tc` token bucket), the one fetch that
//! measures the link teaches the router to compute instead.

use std::path::Path;
use std::process::{Command, Stdio};

use tandem_tests::cluster::{free_port, greedy, spawn_component, KillOnDrop};
use tandem_tests::prometheus::scrape;

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

/// A decode worker listening on `host` (inside network namespace `netns`
/// if given): the process, its gRPC and metrics addresses.
fn worker_at(model: &Path, host: &str, netns: Option<&str>) -> (KillOnDrop, String, String) {
    let mut command = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(tandem());
            c
        }
        None => Command::new(tandem()),
    };
    let any = format!("{host}:0");
    let child = command
        .arg("decode-worker")
        .arg("--model")
        .arg(model)
        .args([
            "--num-kv-blocks",
            "256",
            "--addr",
            &any,
            "--transfer-addr",
            &any,
        ])
        .args(["--metrics-addr", &any, "--exit-on-stdin-eof"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("tandem decode-worker starts");
    let (child, addr, metrics) =
        tandem_tests::cluster::listening_with_metrics(child, "decode-worker");
    (child, addr, metrics.expect("metrics before listening"))
}

fn value(metrics: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape(metrics).value(name, labels).unwrap_or(0.0)
}

/// `tandem up` with two decode workers behind a round-robin router, and
/// `extra` flags.
fn two_decode_workers(model: &Path, extra: &[&str]) -> tandem_tests::cluster::Started {
    let mut args = vec![
        "up",
        "--model",
        model.to_str().expect("utf8"),
        "--prefill",
        "0",
        "--decode",
        "2",
        "--decode-policy",
        "round-robin",
        "--addr",
        "127.0.0.1:0",
        "--no-http",
        "--kv-cache-memory",
        "16MiB",
    ];
    args.extend_from_slice(extra);
    tandem_tests::cluster::start(tandem(), &args)
}

/// 30 full blocks of shared prefix, then a 3-token tail of its own.
fn shared_prefix(tail: u32) -> Vec<u32> {
    let mut p: Vec<u32> = (0..30 * 16).map(|i| (i * 17 + 3) % 250).collect();
    p.extend([tail, tail + 1, tail + 2]);
    p
}

#[test]
fn a_prefix_cached_on_one_worker_is_fetched_by_the_other_not_recomputed() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let cluster = two_decode_workers(&model, &[]);
    let router = cluster.addr.clone();
    let metrics_of = |role: &str, addr: &str| -> String {
        cluster
            .metrics_addr(role, addr)
            .unwrap_or_else(|| panic!("{role} {addr} has metrics"))
            .to_string()
    };
    let router_metrics = metrics_of("router", &router);
    let (a, b) = (cluster.decode[0].clone(), cluster.decode[1].clone());
    let (a_metrics, b_metrics) = (
        metrics_of("decode-worker", &a),
        metrics_of("decode-worker", &b),
    );
    let rt = tandem_tests::cluster::runtime();
    let with = shared_prefix;
    let first = rt.block_on(greedy(&router, with(1), 4)).expect("first");
    let home = first.decode.clone().expect("routing header");
    let (holder_metrics, fetcher_metrics) = if home == a {
        (&a_metrics, &b_metrics)
    } else {
        (&b_metrics, &a_metrics)
    };
    // Wait until the router's index shows the prefix on its home worker.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while value(&router_metrics, "tandem_router_kv_index_blocks", &[]) < 30.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the index never saw the prefix"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let computed_before = value(fetcher_metrics, "tandem_engine_computed_tokens_total", &[]);
    let second = rt.block_on(greedy(&router, with(7), 4)).expect("second");
    let other = second.decode.clone().expect("routing header");
    assert_ne!(other, home, "round-robin alternates");
    assert_eq!(
        second.prefill.as_deref(),
        Some(home.as_str()),
        "the holder was named"
    );
    // The fetcher computed the last prompt token and 3 decode steps; the
    // holder served a prefill from its cache (the 3-token tail computed).
    let computed =
        value(fetcher_metrics, "tandem_engine_computed_tokens_total", &[]) - computed_before;
    assert_eq!(computed, 4.0, "the fetcher recomputed the prefix");
    // Both count when the holder's reply arrives, just after the last
    // block (which the tokens waited for).
    wait_until("the fetch to be counted on both", || {
        value(
            fetcher_metrics,
            "tandem_remote_prefills_total",
            &[("outcome", "ok")],
        ) == 1.0
            && value(
                holder_metrics,
                "tandem_prefill_requests_total",
                &[("outcome", "ok")],
            ) == 1.0
    });
    assert_eq!(
        value(holder_metrics, "tandem_prefill_cached_tokens_total", &[]),
        480.0
    );
    assert_eq!(
        value(
            &router_metrics,
            "tandem_router_prefill_placements_total",
            &[("placement", "peer"), ("reason", "peer_unmeasured")]
        ),
        1.0
    );
    // The holder itself computes the same tokens for the same prompt.
    let third = rt.block_on(greedy(&router, with(7), 4)).expect("third");
    assert_eq!(third.decode.as_deref(), Some(home.as_str()));
    assert_eq!(
        third.tokens, second.tokens,
        "fetched K/V gives other tokens"
    );
}

/// With `--no-peer-fetch` the worker that lacks the prefix computes it,
/// however well placed the holder is: no holder is named, nothing moves.
#[test]
fn with_peer_fetch_off_the_worker_lacking_a_prefix_computes_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let cluster = two_decode_workers(&model, &["--router-arg=--no-peer-fetch"]);
    let router = cluster.addr.clone();
    let router_metrics = cluster
        .metrics_addr("router", &router)
        .expect("router metrics")
        .to_string();
    let rt = tandem_tests::cluster::runtime();
    let first = rt
        .block_on(greedy(&router, shared_prefix(1), 4))
        .expect("first");
    wait_until("the index to see the prefix", || {
        value(&router_metrics, "tandem_router_kv_index_blocks", &[]) >= 30.0
    });
    let home = first.decode.expect("routing header");
    let other_metrics = cluster
        .decode
        .iter()
        .find(|d| **d != home)
        .and_then(|d| cluster.metrics_addr("decode-worker", d))
        .expect("the other worker's metrics")
        .to_string();
    let before = value(&other_metrics, "tandem_engine_computed_tokens_total", &[]);
    let second = rt
        .block_on(greedy(&router, shared_prefix(7), 4))
        .expect("second");
    assert_ne!(second.decode.as_deref(), Some(home.as_str()));
    assert_eq!(second.prefill, None, "no holder is named");
    let computed = value(&other_metrics, "tandem_engine_computed_tokens_total", &[]) - before;
    assert!(computed >= 480.0, "the prefix was computed: {computed}");
    assert_eq!(
        value(
            &router_metrics,
            "tandem_router_prefill_placements_total",
            &[("placement", "peer"), ("reason", "peer_unmeasured")]
        ),
        0.0
    );
}

/// A router over `first` and `second` that alternates between them,
/// `first` first: the process, its gRPC and metrics addresses.
fn round_robin_router(model: &Path, first: &str, second: &str) -> (KillOnDrop, String, String) {
    let metrics = format!("127.0.0.1:{}", free_port());
    let decode = format!("{first},{second}");
    let (child, addr) = spawn_component(
        tandem(),
        "router",
        &[
            "--addr",
            "127.0.0.1:0",
            "--decode",
            &decode,
            "--decode-policy",
            "round-robin",
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

/// A network namespace joined to this one by a veth pair, its end sending
/// at `rate` (a `tc` token bucket); deleted (with the pair) on drop.
struct SlowLink {
    ns: String,
    /// This side's address and the namespace's.
    here: String,
    there: String,
}

impl SlowLink {
    /// `tag` tells apart the links of tests running at once (one process).
    fn new(rate: &str, tag: u8) -> Self {
        let id = std::process::id();
        let (ns, here_if, there_if) = (
            format!("tpf{id}{tag}"),
            format!("tr{id}{tag}"),
            format!("ta{id}{tag}"),
        );
        let (net, base) = (format!("10.77.{}", id % 250), u32::from(tag) * 4);
        let (here, there) = (format!("{net}.{}", base + 1), format!("{net}.{}", base + 2));
        let link = Self {
            ns: ns.clone(),
            here: here.clone(),
            there: there.clone(),
        };
        let run = |args: &[&str]| {
            let ok = Command::new(args[0])
                .args(&args[1..])
                .status()
                .is_ok_and(|s| s.success());
            assert!(
                ok,
                "`{}` failed (this test needs root and iproute2)",
                args.join(" ")
            );
        };
        run(&["ip", "netns", "add", &ns]);
        run(&[
            "ip", "link", "add", &here_if, "type", "veth", "peer", "name", &there_if,
        ]);
        run(&["ip", "link", "set", &there_if, "netns", &ns]);
        run(&["ip", "addr", "add", &format!("{here}/30"), "dev", &here_if]);
        run(&["ip", "link", "set", &here_if, "up"]);
        let inside = |args: &[&str]| {
            let mut all = vec!["ip", "netns", "exec", ns.as_str()];
            all.extend_from_slice(args);
            run(&all);
        };
        inside(&[
            "ip",
            "addr",
            "add",
            &format!("{there}/30"),
            "dev",
            &there_if,
        ]);
        inside(&["ip", "link", "set", &there_if, "up"]);
        inside(&["ip", "link", "set", "lo", "up"]);
        // A token bucket (tbf): this kernel has no netem. 5 s of queue, so
        // nothing is dropped, only slowed.
        inside(&[
            "tc", "qdisc", "add", "dev", &there_if, "root", "tbf", "rate", rate, "burst", "32kb",
            "latency", "5s",
        ]);
        link
    }
}

impl Drop for SlowLink {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn over_a_throttled_link_the_router_recomputes_once_it_has_measured_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let link = SlowLink::new("1mbit", 0);
    // B here; A behind the slow link, so blocks A sends B crawl.
    let (_b, b, b_metrics) = worker_at(&model, &link.here, None);
    let (_a, a, _) = worker_at(&model, &link.there, Some(&link.ns));
    // B first: round-robin sends requests 1, 3, 5 to B and 2, 4 to A.
    let (_router, router, router_metrics) = round_robin_router(&model, &b, &a);
    let rt = tandem_tests::cluster::runtime();
    let call = |prompt: Vec<u32>| rt.block_on(greedy(&router, prompt, 2)).expect("call");
    let prefix = |seed: u32| -> Vec<u32> {
        let mut p: Vec<u32> = (0..30 * 16)
            .map(|i| (i * 17 + seed * 101 + 3) % 250)
            .collect();
        p.extend([seed, seed + 1, seed + 2]);
        p
    };
    let indexed = || value(&router_metrics, "tandem_router_kv_index_blocks", &[]);
    // 1. B measures its prefill on a cold prompt of its own.
    let r1 = call((0..100).map(|i| (i * 7 + 11) % 250).collect());
    assert_eq!(r1.decode.as_deref(), Some(b.as_str()));
    // 2. A computes prefix 1; 3. B fetches it: the link is not measured.
    let before = indexed();
    let r2 = call(prefix(1));
    assert_eq!(r2.decode.as_deref(), Some(a.as_str()));
    wait_until("the index to see A's prefix", || {
        indexed() >= before + 30.0 - 0.5
    });
    let mut again = prefix(1);
    *again.last_mut().expect("a tail") += 100;
    let r3 = call(again);
    assert_eq!(
        (r3.decode.as_deref(), r3.prefill.as_deref()),
        (Some(b.as_str()), Some(a.as_str()))
    );
    let fetched = |m: &str| value(m, "tandem_remote_prefills_total", &[("outcome", "ok")]);
    // Counted when the holder's reply arrives, just after the last block
    // (which the tokens waited for).
    wait_until("B's remote prefill to be counted", || {
        fetched(&b_metrics) == 1.0
    });
    // The router learns what that fetch cost B, per block.
    wait_until("B's measured fetch cost", || {
        value(
            &router_metrics,
            "tandem_router_peer_fetch_seconds_per_block",
            &[("worker", &b), ("peer", &a)],
        ) > 0.0
    });
    // 4. A computes prefix 2; 5. B lacks it, but fetching is measured
    // slower than computing: B computes it.
    let before = indexed();
    let r4 = call(prefix(2));
    assert_eq!(r4.decode.as_deref(), Some(a.as_str()));
    wait_until("the index to see prefix 2", || {
        indexed() >= before + 30.0 - 0.5
    });
    let computed = value(&b_metrics, "tandem_engine_computed_tokens_total", &[]);
    let mut again = prefix(2);
    *again.last_mut().expect("a tail") += 100;
    let r5 = call(again);
    assert_eq!(
        (r5.decode.as_deref(), r5.prefill.as_deref()),
        (Some(b.as_str()), None)
    );
    assert_eq!(fetched(&b_metrics), 1.0, "no second fetch");
    let now = value(&b_metrics, "tandem_engine_computed_tokens_total", &[]);
    assert!(
        now - computed >= 480.0,
        "B computed the prefix: {}",
        now - computed
    );
    assert_eq!(
        value(
            &router_metrics,
            "tandem_router_prefill_placements_total",
            &[("placement", "peer"), ("reason", "peer_unmeasured")]
        ),
        1.0
    );
}

/// The holder dies (SIGKILL) while its blocks crawl over a throttled link:
/// the fetcher's request still completes, computing the prompt itself, to
/// the tokens the holder gave for the same prompt, and no block of the
/// broken transfer is taken as K/V.
#[test]
fn a_holder_that_dies_mid_fetch_leaves_the_request_to_be_computed() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let link = SlowLink::new("512kbit", 1);
    let (_b, b, b_metrics) = worker_at(&model, &link.here, None);
    let (mut holder, a, _) = worker_at(&model, &link.there, Some(&link.ns));
    let (_router, router, router_metrics) = round_robin_router(&model, &b, &a);
    let rt = tandem_tests::cluster::runtime();
    let prompt: Vec<u32> = (0..30 * 16 + 3).map(|i| (i * 19 + 5) % 250).collect();
    // 1 to B (a short warm-up), 2 to A: A computes the prompt.
    let _ = rt
        .block_on(greedy(&router, vec![1, 2, 3], 2))
        .expect("warm-up");
    let indexed = || value(&router_metrics, "tandem_router_kv_index_blocks", &[]);
    let before = indexed();
    let held = rt
        .block_on(greedy(&router, prompt.clone(), 4))
        .expect("on A");
    assert_eq!(held.decode.as_deref(), Some(a.as_str()));
    wait_until("the index to see A's prompt", || {
        indexed() >= before + 30.0 - 0.5
    });
    // 3 to B, which fetches from A; A dies while the blocks crawl.
    let fetching = {
        let (router, prompt) = (router.clone(), prompt.clone());
        std::thread::spawn(move || {
            tandem_tests::cluster::runtime().block_on(greedy(&router, prompt, 4))
        })
    };
    wait_until("the fetch to start", || {
        value(
            &b_metrics,
            "tandem_kv_transfer_received_block_layers_total",
            &[],
        ) > 0.0
    });
    holder.0.kill().expect("SIGKILL");
    let got = fetching
        .join()
        .expect("the call thread")
        .expect("the request completes");
    assert_eq!(got.decode.as_deref(), Some(b.as_str()));
    assert_eq!(
        got.tokens, held.tokens,
        "B computed the prompt itself, to A's tokens"
    );
    assert_eq!(
        value(
            &b_metrics,
            "tandem_remote_prefills_total",
            &[("outcome", "ok")]
        ),
        0.0,
        "the broken transfer did not count as a fetch"
    );
}
