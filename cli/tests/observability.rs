//! Observability of real processes: one OpenTelemetry trace across router,
//! decode and prefill workers (collected by an OTLP server in this test
//! process), Prometheus `/metrics` on every component, and JSON logs that
//! name the request.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tandem_proto::worker::ROUTED_PREFILL_HEADER;
use tandem_tests::cluster::{all_blocks_free, KillOnDrop, Started};
use tandem_tests::otlp::{is_ancestor, Collector, Span};
use tandem_tests::prometheus::{scrape, Scrape};

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

fn up(model: &Path, extra: &[&str]) -> Started {
    let mut args = vec![
        "up",
        "--model",
        model.to_str().expect("utf8"),
        "--prefill",
        "1",
        "--decode",
        "1",
        "--addr",
        "127.0.0.1:0",
        "--no-http",
        "--kv-cache-memory",
        "32MiB",
        "--remote-prefill-threshold",
        "32",
    ];
    args.extend_from_slice(extra);
    tandem_tests::cluster::start(tandem(), &args)
}

/// Sends one greedy request; returns the prefill worker the router named.
async fn generate(addr: &str, prompt: Vec<u32>, max_tokens: u32, id: &str) -> Option<String> {
    let mut c = GenerationClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let resp = c
        .generate(v1::GenerateRequest {
            request_id: id.to_string(),
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
        })
        .await
        .expect("generate");
    let prefill = resp
        .metadata()
        .get(ROUTED_PREFILL_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut stream = resp.into_inner();
    let mut finished = false;
    while let Some(msg) = stream.message().await.expect("stream") {
        if let Some(v1::generate_response::Event::Finished(_)) = msg.event {
            finished = true;
        }
    }
    assert!(finished, "no Finished message");
    prefill
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 7 + seed * 13) % 250 + 1)
        .collect()
}

fn find<'a>(spans: &'a [Span], service: &str, name: &str) -> Vec<&'a Span> {
    spans
        .iter()
        .filter(|s| s.service == service && s.name == name)
        .collect()
}

#[test]
fn one_trace_holds_router_decode_and_prefill_spans() {
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_tests::cluster::gen_model(tandem(), tmp.path(), "tiny");
    let collector = Collector::start().expect("collector");
    let endpoint = collector.endpoint();
    let cluster = up(tmp.path(), &["--otlp-endpoint", &endpoint]);
    let rt = tandem_tests::cluster::runtime();
    let prefill = rt.block_on(generate(&cluster.addr, prompt(100, 1), 6, "trace-me"));
    assert!(
        prefill.is_some(),
        "a 100-token prompt is prefilled remotely"
    );

    let complete = |spans: &[Span]| {
        let routers = find(spans, "tandem-router", "generate");
        routers.iter().any(|r| {
            let same = |s: &&Span| s.trace_id == r.trace_id;
            find(spans, "tandem-decode-worker", "generate")
                .iter()
                .any(same)
                && find(spans, "tandem-prefill-worker", "prefill_request")
                    .iter()
                    .any(same)
                && find(spans, "tandem-prefill-worker", "kv_transfer")
                    .iter()
                    .any(same)
                && find(spans, "tandem-decode-worker", "decode")
                    .iter()
                    .any(same)
        })
    };
    // Batches leave every 500 ms; the router's span ends with the stream.
    let spans = collector.wait_for(Duration::from_secs(30), complete);
    let router = find(&spans, "tandem-router", "generate")
        .into_iter()
        .find(|s| s.attributes.get("request_id").map(String::as_str) == Some("trace-me"))
        .unwrap_or_else(|| panic!("no router span for the request in {spans:#?}"));
    let trace: Vec<Span> = spans
        .iter()
        .filter(|s| s.trace_id == router.trace_id)
        .cloned()
        .collect();
    let one = |service: &str, name: &str| -> Span {
        let found = find(&trace, service, name);
        assert_eq!(
            found.len(),
            1,
            "one {service} {name} span in the trace: {trace:#?}"
        );
        found[0].clone()
    };
    let decode = one("tandem-decode-worker", "generate");
    let remote = one("tandem-decode-worker", "remote_prefill");
    let prefill = one("tandem-prefill-worker", "prefill_request");
    let routing = one("tandem-router", "routing");
    let transfer = one("tandem-prefill-worker", "kv_transfer");

    // The parent links: router → decode worker → prefill worker.
    assert!(
        is_ancestor(&trace, router, &decode),
        "router span is the decode span's ancestor"
    );
    assert!(is_ancestor(&trace, &decode, &remote));
    assert!(
        is_ancestor(&trace, &decode, &prefill),
        "decode span is the prefill span's ancestor"
    );
    assert!(is_ancestor(&trace, router, &prefill));
    assert!(!is_ancestor(&trace, &prefill, &decode));
    assert!(is_ancestor(&trace, router, &routing));
    assert!(is_ancestor(&trace, &prefill, &transfer));

    // Every hop carries the same request id.
    for s in [&decode, &prefill] {
        assert_eq!(
            s.attributes.get("request_id").map(String::as_str),
            Some("trace-me")
        );
    }
    // The routing decision names the workers and the reasons.
    assert_eq!(
        routing.attributes.get("decode_policy").map(String::as_str),
        Some("kv")
    );
    assert!(
        routing.attributes.contains_key("decode_reason"),
        "{routing:?}"
    );
    assert!(routing
        .attributes
        .get("decode_candidates")
        .is_some_and(|c| c.contains("matched_blocks=")));
    assert_eq!(
        routing
            .attributes
            .get("prefill_placement")
            .map(String::as_str),
        Some("remote")
    );
    // The transfer's bytes, and the engine's phases on both workers.
    let bytes: u64 = transfer
        .attributes
        .get("bytes")
        .and_then(|b| b.parse().ok())
        .expect("kv_transfer records its bytes");
    assert!(bytes > 0);
    for (service, name) in [
        ("tandem-prefill-worker", "queue"),
        ("tandem-prefill-worker", "prefill"),
        ("tandem-prefill-worker", "prefill_chunk"),
        ("tandem-decode-worker", "queue"),
        ("tandem-decode-worker", "prefill"),
        ("tandem-decode-worker", "decode"),
    ] {
        let found = find(&trace, service, name);
        assert!(!found.is_empty(), "no {service} {name} span in {trace:#?}");
    }
    let chunk = find(&trace, "tandem-prefill-worker", "prefill_chunk")[0].clone();
    assert!(is_ancestor(&trace, &prefill, &chunk));
    let decode_phase = find(&trace, "tandem-decode-worker", "decode")[0].clone();
    assert!(is_ancestor(&trace, &decode, &decode_phase));
}

/// `name_count` of a histogram in `s` (0 when absent).
fn count(s: &Scrape, name: &str) -> f64 {
    s.value(&format!("{name}_count"), &[]).unwrap_or(0.0)
}

fn check_kv_blocks(s: &Scrape, who: &str) {
    let capacity = s
        .value("tandem_kv_cache_capacity_blocks", &[])
        .unwrap_or_else(|| panic!("{who}: no capacity"));
    let used = s
        .value("tandem_kv_cache_blocks", &[("state", "used")])
        .unwrap_or_else(|| panic!("{who}: no used blocks"));
    let free = s
        .value("tandem_kv_cache_blocks", &[("state", "free")])
        .unwrap_or_else(|| panic!("{who}: no free blocks"));
    let cached = s
        .value("tandem_kv_cache_cached_blocks", &[])
        .unwrap_or_else(|| panic!("{who}: no cached blocks"));
    assert!(capacity > 0.0, "{who}");
    assert_eq!(used + free, capacity, "{who}: used + free == capacity");
    assert_eq!(
        used, 0.0,
        "{who}: every request is over, so no block is in use"
    );
    assert!(
        cached > 0.0 && cached <= capacity,
        "{who}: cached {cached} of {capacity}"
    );
    let ratio = s
        .value("tandem_kv_cache_usage_ratio", &[])
        .expect("usage ratio");
    assert!((ratio - used / capacity).abs() < 1e-9, "{who}");
    let (q, h) = (
        s.value("tandem_prefix_cache_queries_total", &[])
            .expect("queries"),
        s.value("tandem_prefix_cache_hits_total", &[])
            .expect("hits"),
    );
    assert!(h <= q, "{who}: {h} hits of {q} lookups");
    let hit_ratio = s
        .value("tandem_prefix_cache_hit_ratio", &[])
        .expect("hit ratio");
    let want = if q == 0.0 { 0.0 } else { h / q };
    assert!((hit_ratio - want).abs() < 1e-9, "{who}");
    for g in [
        "tandem_num_requests_waiting",
        "tandem_num_requests_running",
        "tandem_num_requests_parked",
    ] {
        assert_eq!(s.value(g, &[]), Some(0.0), "{who}: {g}");
    }
}

#[test]
fn metrics_on_every_component_count_what_was_served() {
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_tests::cluster::gen_model(tandem(), tmp.path(), "tiny");
    let cluster = up(tmp.path(), &[]);
    assert_eq!(
        cluster.metrics.len(),
        3,
        "router and both workers serve metrics"
    );
    let rt = tandem_tests::cluster::runtime();
    // Long prompts go to the prefill worker, short ones stay local; the
    // repeated one hits the prefix cache.
    let work: Vec<(Vec<u32>, u32)> = vec![
        (prompt(100, 1), 5),
        (prompt(10, 2), 3),
        (prompt(120, 3), 4),
        (prompt(8, 4), 6),
        (prompt(100, 1), 2),
        (prompt(70, 5), 3),
    ];
    let n = work.len() as f64;
    let mut remote = 0.0;
    for (i, (p, m)) in work.into_iter().enumerate() {
        if rt
            .block_on(generate(&cluster.addr, p, m, &format!("m-{i}")))
            .is_some()
        {
            remote += 1.0;
        }
    }
    assert!(remote >= 2.0, "long prompts were prefilled remotely");
    rt.block_on(all_blocks_free(&cluster));

    let decode_addr = &cluster.decode[0];
    let prefill_addr = &cluster.prefill[0];
    let router = scrape(
        cluster
            .metrics_addr("router", &cluster.addr)
            .expect("router metrics"),
    );
    let prefill = scrape(
        cluster
            .metrics_addr("prefill-worker", prefill_addr)
            .expect("prefill metrics"),
    );
    // The decode worker counts a remote prefill when the prefill worker's
    // reply arrives, which may trail the request's end by a moment.
    let decode_metrics = cluster
        .metrics_addr("decode-worker", decode_addr)
        .expect("decode metrics");
    let replied = prefill.sum("tandem_prefill_requests_total", &[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let decode = loop {
        let s = scrape(decode_metrics);
        if s.sum("tandem_remote_prefills_total", &[]) >= replied
            || std::time::Instant::now() > deadline
        {
            break s;
        }
        std::thread::sleep(Duration::from_millis(50));
    };

    // Router: every request, every decision (each timed), every placement.
    assert_eq!(count(&router, "tandem_router_decision_seconds"), n);
    // The workers' digests of their caches (one a second) match what the
    // router's index made of their events.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let kv = loop {
        let s = scrape(
            cluster
                .metrics_addr("router", &cluster.addr)
                .expect("router metrics"),
        );
        if s.sum("tandem_router_kv_digests_matched_total", &[]) >= 2.0
            || std::time::Instant::now() > deadline
        {
            break s;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(kv.sum("tandem_router_kv_digests_matched_total", &[]) >= 2.0);
    assert_eq!(
        kv.value("tandem_router_kv_resyncs_total", &[("reason", "digest")]),
        Some(0.0)
    );
    assert_eq!(
        kv.value("tandem_router_kv_resyncs_total", &[("reason", "gap")]),
        Some(0.0)
    );
    assert!(kv.sum("tandem_router_kv_index_blocks", &[]) > 0.0);
    assert_eq!(
        router.value("tandem_router_requests_total", &[("outcome", "finished")]),
        Some(n)
    );
    assert_eq!(router.sum("tandem_router_requests_total", &[]), n);
    assert_eq!(
        count(&router, "tandem_router_time_to_first_token_seconds"),
        n
    );
    assert_eq!(
        count(&router, "tandem_router_e2e_request_latency_seconds"),
        n
    );
    assert_eq!(
        router.sum("tandem_router_decisions_total", &[("pool", "decode")]),
        n
    );
    assert_eq!(
        router.sum("tandem_router_decisions_total", &[("pool", "prefill")]),
        remote
    );
    assert_eq!(
        router.sum(
            "tandem_router_prefill_placements_total",
            &[("placement", "remote")]
        ),
        remote
    );
    assert_eq!(router.sum("tandem_router_prefill_placements_total", &[]), n);
    assert!(
        router
            .value(
                "tandem_router_prefill_placements_total",
                &[("placement", "local"), ("reason", "below_threshold")]
            )
            .is_some_and(|v| v >= 2.0),
        "short prompts stay local, and say why"
    );
    assert_eq!(
        router.value("tandem_router_healthy_workers", &[("role", "decode")]),
        Some(1.0)
    );

    // Decode worker: the TTFT histogram counts the requests served.
    assert_eq!(count(&decode, "tandem_time_to_first_token_seconds"), n);
    assert_eq!(count(&decode, "tandem_e2e_request_latency_seconds"), n);
    assert_eq!(count(&decode, "tandem_request_queue_time_seconds"), n);
    assert_eq!(
        decode.value("tandem_requests_total", &[("outcome", "finished")]),
        Some(n)
    );
    // The router named a prefill worker `remote` times; the decode worker
    // asks it only when its own prefix cache leaves enough uncached (the
    // repeated prompt is cached there by then).
    let asked = decode
        .value("tandem_remote_prefills_total", &[("outcome", "ok")])
        .expect("remote prefills");
    assert!(asked >= 2.0 && asked <= remote, "{asked} of {remote}");
    assert_eq!(
        decode.sum("tandem_remote_prefills_total", &[]),
        asked,
        "none failed"
    );
    assert_eq!(
        count(&decode, "tandem_remote_prefill_duration_seconds"),
        asked
    );
    check_kv_blocks(&decode, "decode worker");
    assert!(
        decode
            .value("tandem_prefix_cache_hits_total", &[])
            .unwrap_or(0.0)
            > 0.0,
        "the repeated prompt hit the decode worker's prefix cache"
    );

    // Prefill worker: its calls, and the bytes both ends agree on.
    assert_eq!(
        prefill.value("tandem_prefill_requests_total", &[("outcome", "ok")]),
        Some(asked)
    );
    assert_eq!(count(&prefill, "tandem_prefill_duration_seconds"), asked);
    assert_eq!(
        count(&prefill, "tandem_kv_transfer_duration_seconds"),
        asked
    );
    assert!(
        prefill
            .family("tandem_time_to_first_token_seconds")
            .is_none(),
        "never samples"
    );
    check_kv_blocks(&prefill, "prefill worker");
    let sent = prefill
        .value("tandem_kv_transfer_sent_bytes_total", &[])
        .expect("sent bytes");
    assert!(sent > 0.0);
    assert_eq!(
        decode.value("tandem_kv_transfer_received_bytes_total", &[]),
        Some(sent),
        "bytes sent == bytes received"
    );
    assert_eq!(
        decode.value("tandem_kv_transfer_received_block_layers_total", &[]),
        prefill.value("tandem_kv_transfer_sent_block_layers_total", &[])
    );
}

#[test]
fn serve_logs_json_naming_the_request_and_serves_metrics() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // A mixture of experts, so the per-expert counters are served too.
    tandem_tests::cluster::gen_model(tandem(), tmp.path(), "tiny-moe");
    let mut child = Command::new(tandem())
        .args([
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .args([
            "--kv-cache-memory",
            "32MiB",
            "--log-format",
            "json",
            "--model",
        ])
        .arg(tmp.path())
        .env("RUST_LOG", "info,tandem_server=debug,tandem_engine=debug")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tandem serve starts");
    let stdout = child.stdout.take().expect("stdout");
    let stderr = child.stderr.take().expect("stderr");
    let process = KillOnDrop(child);
    let logs = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<String>>()
    });
    let mut lines = BufReader::new(stdout).lines();
    let mut next = || lines.next().expect("a line").expect("utf8");
    let metrics = next()
        .strip_prefix("metrics listening on ")
        .expect("the metrics line first")
        .to_string();
    let addr = next()
        .strip_prefix("listening on ")
        .expect("then the gRPC line")
        .to_string();
    let rt = tandem_tests::cluster::runtime();
    rt.block_on(generate(&addr, prompt(40, 9), 5, "log-me"));
    rt.block_on(generate(&addr, prompt(20, 8), 3, "log-me-too"));

    let s = scrape(&metrics);
    assert_eq!(count(&s, "tandem_time_to_first_token_seconds"), 2.0);
    assert_eq!(count(&s, "tandem_time_per_output_token_seconds"), 2.0);
    assert_eq!(s.value("tandem_generation_tokens_total", &[]), Some(8.0));
    assert_eq!(s.value("tandem_prompt_tokens_total", &[]), Some(60.0));
    // Every token run is routed to 2 of 8 experts on each of 2 layers.
    let computed = s.value("tandem_engine_computed_tokens_total", &[]);
    let computed = computed.expect("computed tokens");
    assert!(computed >= 60.0, "{computed}");
    for layer in ["0", "1"] {
        let routed: f64 = (0..8)
            .map(|e| {
                let labels = [("layer", layer), ("expert", &e.to_string())];
                s.value("tandem_moe_routed_tokens_total", &labels)
                    .unwrap_or_else(|| panic!("layer {layer} expert {e} counted"))
            })
            .sum();
        assert_eq!(routed, 2.0 * computed, "layer {layer}");
    }

    drop(process); // SIGTERM: the server exits and closes stderr
    let logs = logs.join().expect("log reader");
    let mut about_request = 0;
    for line in &logs {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        let message = v["fields"]["message"].as_str().unwrap_or_default();
        if ["request accepted", "request finished"].contains(&message) {
            about_request += 1;
            // The event's span, and the spans it is inside.
            let ids: Vec<&str> = v["spans"]
                .as_array()
                .into_iter()
                .flatten()
                .chain([&v["span"]])
                .filter_map(|s| s["request_id"].as_str())
                .collect();
            assert!(
                ids.iter().any(|id| id.starts_with("log-me")),
                "a line about a request names it: {line}"
            );
        }
    }
    assert_eq!(about_request, 4, "accepted and finished, twice: {logs:#?}");
}
