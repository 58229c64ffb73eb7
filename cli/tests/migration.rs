//! Migration of every request kind, on real processes (`tandem up --decode
//! 2`): a request whose decode worker is SIGKILLed after 20 tokens ends
//! with exactly the output of the same request run uninterrupted — token
//! for token, text, logprobs, finish reasons and usage — for a JSON-schema
//! grammar, stop strings, penalties, seeded sampling at temperature 1,
//! `n = 3` and logprobs. After each kill a replacement decode worker joins
//! (through etcd), so every kind has a worker to be killed and one to go on.
//!
//! And a planned drain: a decode worker sent SIGTERM under load hands its
//! running requests over, and the survivor pulls their KV from it over the
//! KV transport (no re-prefill) and finishes them with the uninterrupted
//! outputs.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tandem_proto::worker::ROUTED_DECODE_HEADER;
use tandem_tests::cluster::KillOnDrop;

const TOKEN: &str = "migration-test-token-81c2";
/// Tokens of choice 0 the client reads before the kill.
const KILL_AFTER: usize = 20;

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

/// `tandem up` with two decode workers and no prefill worker, under the
/// cluster token [`TOKEN`] (so replacement workers may join).
fn up(model: &str, extra: &[&str]) -> tandem_tests::cluster::Started {
    let mut args = vec![
        "up",
        "--model",
        model,
        "--prefill",
        "0",
        "--decode",
        "2",
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--kv-cache-memory",
        "64MiB",
    ];
    args.extend_from_slice(extra);
    tandem_tests::cluster::start_with_env(tandem(), &args, &[("TANDEM_CLUSTER_TOKEN", TOKEN)])
}

/// One choice as the client saw it.
#[derive(Debug, Default, Clone, PartialEq)]
struct Choice {
    tokens: Vec<u32>,
    text: String,
    /// (token, logprob, top alternatives' tokens)
    logprobs: Vec<(u32, f32, Vec<u32>)>,
    finish: i32,
}

#[derive(Debug, Default)]
struct Output {
    choices: BTreeMap<u32, Choice>,
    finished: Option<v1::Finished>,
}

impl Output {
    /// Adds one message of the stream.
    fn record(&mut self, msg: v1::GenerateResponse) {
        match msg.event {
            Some(v1::generate_response::Event::Delta(d)) => {
                let c = self.choices.entry(d.index).or_default();
                c.tokens.extend(&d.token_ids);
                c.text.push_str(&d.text);
                c.logprobs.extend(d.logprobs.into_iter().map(|l| {
                    let top = l.top.iter().map(|t| t.token_id).collect();
                    (l.token_id, l.logprob, top)
                }));
                if d.finish_reason != 0 {
                    c.finish = d.finish_reason;
                }
            }
            Some(v1::generate_response::Event::Finished(f)) => self.finished = Some(f),
            _ => {}
        }
    }
}

/// Calls the router: the decode worker it chose and the response stream.
async fn call(
    router: &str,
    req: v1::GenerateRequest,
) -> (String, tonic::Streaming<v1::GenerateResponse>) {
    let mut client = GenerationClient::connect(format!("http://{router}"))
        .await
        .expect("router");
    let resp = client.generate(req).await.expect("call");
    let decode = resp
        .metadata()
        .get(ROUTED_DECODE_HEADER)
        .and_then(|v| v.to_str().ok())
        .expect("routed")
        .to_string();
    (decode, resp.into_inner())
}

/// Calls the router and reads the stream to its end; with `kill`, the
/// decode worker serving it is SIGKILLed once choice 0 has
/// [`KILL_AFTER`] tokens.
async fn run(
    router: &str,
    req: v1::GenerateRequest,
    kill: Option<&std::collections::HashMap<String, u32>>,
) -> Output {
    let (decode, mut stream) = call(router, req).await;
    let mut out = Output::default();
    let mut killed = kill.is_none();
    let read = async {
        while let Some(msg) = stream.message().await.expect("the stream goes on") {
            out.record(msg);
            let first = out.choices.get(&0).map_or(0, |c| c.tokens.len());
            if !killed && first >= KILL_AFTER {
                killed = true;
                let pid = kill
                    .and_then(|pids| pids.get(&decode))
                    .expect("the worker's pid");
                Command::new("kill")
                    .args(["-9", &pid.to_string()])
                    .status()
                    .expect("kill");
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(120), read)
        .await
        .expect("the stream ended");
    assert!(killed, "the request ended before {KILL_AFTER} tokens");
    out
}

/// The migrated output equals the uninterrupted one.
fn assert_same(kind: &str, whole: &Output, migrated: &Output) {
    assert_eq!(
        whole.choices.keys().collect::<Vec<_>>(),
        migrated.choices.keys().collect::<Vec<_>>(),
        "{kind}: choices"
    );
    for (i, w) in &whole.choices {
        let m = &migrated.choices[i];
        assert_eq!(m.tokens, w.tokens, "{kind}: choice {i}'s tokens");
        assert_eq!(m.text, w.text, "{kind}: choice {i}'s text");
        assert_eq!(m.finish, w.finish, "{kind}: choice {i}'s finish reason");
        assert_eq!(m.logprobs.len(), w.logprobs.len(), "{kind}: logprobs");
        for (a, b) in m.logprobs.iter().zip(&w.logprobs) {
            assert_eq!((a.0, &a.2), (b.0, &b.2), "{kind}: choice {i}'s logprobs");
            assert!((a.1 - b.1).abs() < 1e-3, "{kind}: {a:?} vs {b:?}");
        }
    }
    let (w, m) = (
        whole.finished.as_ref().expect("finished"),
        migrated.finished.as_ref().expect("finished"),
    );
    let usage = |f: &v1::Finished| {
        let u = f.usage.unwrap_or_default();
        (u.prompt_tokens, u.completion_tokens)
    };
    assert_eq!(usage(m), usage(w), "{kind}: usage counts the request once");
    assert_eq!(m.choices, w.choices, "{kind}: choice summaries");
    let e2e = m.timings.map_or(0.0, |t| t.e2e_s);
    let ttft = m.timings.map_or(0.0, |t| t.ttft_s);
    assert!(e2e > ttft && ttft > 0.0, "{kind}: timings {:?}", m.timings);
}

fn request(max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
            ids: (3..40).collect(),
        })),
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn seeded(seed: u64) -> Option<v1::SamplingParams> {
    Some(v1::SamplingParams {
        temperature: Some(1.0),
        seed: Some(seed),
        ..Default::default()
    })
}

/// The request of each kind (the stop string is picked from the text of
/// an unstopped run, so it ends the choice well after the kill).
fn kinds(unstopped: &Output) -> Vec<(&'static str, v1::GenerateRequest)> {
    let mut grammar = request(400);
    grammar.sampling = seeded(11);
    grammar.response_format = Some(v1::ResponseFormat {
        format: Some(v1::response_format::Format::JsonSchema(
            r#"{"type":"object","properties":{"note":{"type":"string","minLength":120,"maxLength":160}},"required":["note"]}"#.into(),
        )),
    });
    let text = &unstopped.choices[&0].text;
    let from = text
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| i >= text.len() * 3 / 4)
        .expect("text");
    let stop: String = text[from..].chars().take(3).collect();
    let mut stops = request(200);
    stops.stop = vec![stop, "never-in-this-text-0".into()];
    let mut penalties = request(200);
    penalties.sampling = Some(v1::SamplingParams {
        temperature: Some(0.0),
        presence_penalty: 0.8,
        frequency_penalty: 0.5,
        repetition_penalty: Some(1.2),
        ..Default::default()
    });
    let mut sampled = request(200);
    sampled.sampling = seeded(5);
    let mut three = request(150);
    three.sampling = seeded(9);
    three.n = 3;
    let mut logprobs = request(200);
    logprobs.sampling = seeded(13);
    logprobs.logprobs = Some(3);
    vec![
        ("grammar", grammar),
        ("stop strings", stops),
        ("penalties", penalties),
        ("seeded sampling", sampled),
        ("n = 3", three),
        ("logprobs", logprobs),
    ]
}

#[test]
fn every_request_kind_migrates_exactly_when_its_decode_worker_is_killed() {
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_tests::cluster::gen_model(tandem(), tmp.path(), "small");
    let model = tmp.path().to_str().expect("utf8");
    let token_dir = tempfile::tempdir().expect("tempdir");
    let token_file = token_dir.path().join("token");
    std::fs::write(&token_file, TOKEN).expect("token file");
    let cluster = up(model, &["--lease-ttl-s", "2"]);
    let (etcd, name) = cluster.etcd.clone().expect("`tandem up` starts etcd");
    let mut pids = cluster.pids.clone();
    let mut replacements: Vec<KillOnDrop> = Vec::new();
    let rt = tandem_tests::cluster::runtime();
    let router_metrics = cluster
        .metrics_addr("router", &cluster.addr)
        .expect("router metrics")
        .to_string();
    let unstopped = rt.block_on(run(&cluster.addr, request(200), None));
    for (n, (kind, req)) in kinds(&unstopped).into_iter().enumerate() {
        let (whole, migrated) = rt.block_on(async {
            let whole = run(&cluster.addr, req.clone(), None).await;
            (whole, run(&cluster.addr, req, Some(&pids)).await)
        });
        assert_same(kind, &whole, &migrated);
        let resumed = tandem_tests::prometheus::scrape(&router_metrics)
            .value("tandem_router_migrations_total", &[("result", "resumed")]);
        assert_eq!(
            resumed,
            Some(n as f64 + 1.0),
            "{kind}: the request migrated"
        );
        // A new worker takes the killed one's place.
        let (worker, addr) = tandem_tests::cluster::spawn_component(
            tandem(),
            "decode-worker",
            &[
                "--model",
                model,
                "--etcd",
                &etcd,
                "--cluster",
                &name,
                "--lease-ttl-s",
                "2",
                "--kv-cache-memory",
                "64MiB",
                "--cluster-token-file",
                token_file.to_str().expect("utf8"),
            ],
        );
        pids.insert(addr.clone(), worker.0.id());
        replacements.push(worker);
        rt.block_on(wait_for_worker(&cluster.addr, &addr));
    }
}

/// Sends small requests until one lands on `addr` (it joined the router's
/// membership), for at most 20 s.
async fn wait_for_worker(router: &str, addr: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut i = 0u32;
    while Instant::now() < deadline {
        i += 1;
        let req = tandem_tests::cluster::greedy_request(vec![i % 200 + 1, 7, 9], 1);
        if let Ok(o) = tandem_tests::cluster::call(router, req).await {
            if o.decode.as_deref() == Some(addr) {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the replacement worker {addr} never got a request");
}

/// The drain test's requests: distinct 300-token prompts (past the remote
/// prefill threshold the cluster runs with), greedy and seeded, one with
/// two choices, one with logprobs.
fn drain_load() -> Vec<v1::GenerateRequest> {
    (0..6u32)
        .map(|i| {
            let mut r = request(160);
            r.prompt = Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
                ids: (0..300).map(|t| (t * 7 + i * 31) % 250 + 3).collect(),
            }));
            match i {
                1 => r.sampling = seeded(17),
                2 => {
                    r.sampling = seeded(23);
                    r.n = 2;
                }
                3 => {
                    r.sampling = seeded(29);
                    r.logprobs = Some(2);
                }
                _ => {}
            }
            r
        })
        .collect()
}

/// Streams `req`, sending `signal` with the decode worker it was routed to
/// once choice 0 has 10 tokens (the first to get there does).
async fn stream_and_signal(
    router: String,
    req: v1::GenerateRequest,
    signal: std::sync::Arc<tokio::sync::watch::Sender<Option<String>>>,
) -> (String, Output) {
    let (decode, mut stream) = call(&router, req).await;
    let mut out = Output::default();
    while let Some(msg) = stream.message().await.expect("no request fails") {
        out.record(msg);
        if out.choices.get(&0).map_or(0, |c| c.tokens.len()) >= 10 {
            signal.send_if_modified(|s| {
                let first = s.is_none();
                if first {
                    *s = Some(decode.clone());
                }
                first
            });
        }
    }
    (decode, out)
}

#[test]
fn a_drained_decode_workers_streams_go_on_with_their_kv_moved() {
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_tests::cluster::gen_model(tandem(), tmp.path(), "small");
    let model = tmp.path().to_str().expect("utf8");
    let cluster = up(model, &["--remote-prefill-threshold", "16"]);
    let rt = tandem_tests::cluster::runtime();
    let router = cluster.addr.clone();
    let load = drain_load();
    let (tx, mut rx) = tokio::sync::watch::channel(None::<String>);
    let tx = std::sync::Arc::new(tx);
    let pids = cluster.pids.clone();
    let (outputs, victim, stall) = rt.block_on(async {
        let calls: Vec<_> = load
            .iter()
            .map(|r| tokio::spawn(stream_and_signal(router.clone(), r.clone(), tx.clone())))
            .collect();
        let victim = rx
            .wait_for(Option::is_some)
            .await
            .expect("a stream got going")
            .clone()
            .expect("a worker");
        let sent = Instant::now();
        Command::new("kill")
            .args(["-TERM", &pids[&victim].to_string()])
            .status()
            .expect("kill");
        let mut outputs = Vec::new();
        for c in calls {
            outputs.push(c.await.expect("the call's task"));
        }
        (outputs, victim, sent.elapsed())
    });
    let moved = outputs.iter().filter(|(d, _)| *d == victim).count();
    assert!(moved >= 1, "some streams ran on the drained worker");
    // Uninterrupted, one at a time, on the surviving worker, and only now:
    // run first, they would leave their prompts in a prefix cache, and a
    // stream moved to the worker holding one has nothing left to pull.
    let whole: Vec<Output> = load
        .iter()
        .map(|r| rt.block_on(run(&router, r.clone(), None)))
        .collect();
    for (i, ((_, out), w)) in outputs.iter().zip(&whole).enumerate() {
        assert_same(&format!("request {i}"), w, out);
    }
    let metrics = tandem_tests::prometheus::scrape(
        cluster
            .metrics_addr("router", &cluster.addr)
            .expect("router metrics"),
    );
    let drained = metrics.value(
        "tandem_router_migrations_total",
        &[
            ("cause", "drain"),
            ("result", "resumed"),
            ("path", "kv_moved"),
        ],
    );
    assert_eq!(
        drained,
        Some(moved as f64),
        "every stream there moved with its KV"
    );
    let survivor = cluster
        .decode
        .iter()
        .find(|d| **d != victim)
        .expect("the other worker");
    let survivor_metrics = tandem_tests::prometheus::scrape(
        cluster
            .metrics_addr("decode-worker", survivor)
            .expect("decode metrics"),
    );
    let pulled = survivor_metrics.sum("tandem_remote_prefills_total", &[("outcome", "ok")]);
    let failed = survivor_metrics.sum("tandem_remote_prefills_total", &[("outcome", "failed")]);
    assert!(
        pulled >= moved as f64,
        "{pulled} KV pulls for {moved} streams"
    );
    assert_eq!(failed, 0.0, "no pull fell back to a re-prefill");
    eprintln!(
        "drain: {moved} streams moved with their KV; the calls ended {stall:?} after SIGTERM"
    );
}
