//! Frozen peers and hostile inputs against a real `tandem up` cluster
//! (issue 26): a stopped (SIGSTOP) prefill worker costs a request a
//! bounded wait, after which the decode worker prefills locally; a request
//! with too many stop strings is refused naming the field; workers refuse
//! callers without the cluster credential; prefix-cache feeds are capped.
//! Broken and forged prefill peers are `prefill_peers.rs`.

use std::path::Path;
use std::time::{Duration, Instant};

use tandem_tests::cluster::{all_blocks_free, greedy, runtime, Started};

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

/// The decode worker waits 1.5 s + 1 s per 1k prompt tokens for a prefill
/// worker here (the defaults are 5 s + 5 s, too slow for a test).
const PREFILL_WAIT_MS: &str = "1500";
const PREFILL_WAIT_PER_1K_MS: &str = "1000";

/// One prefill and one decode worker; remote prefill from 8 tokens.
fn up(model: &Path) -> Started {
    tandem_tests::cluster::start(
        tandem(),
        &[
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
            "8",
            "--worker-arg=--batch-invariant",
            &format!("--decode-arg=--remote-prefill-timeout-ms={PREFILL_WAIT_MS}"),
            &format!(
                "--decode-arg=--remote-prefill-timeout-per-1k-tokens-ms={PREFILL_WAIT_PER_1K_MS}"
            ),
        ],
    )
}

/// The colocated reference, batch invariant like the cluster's workers.
fn serve(model: &Path) -> Started {
    tandem_tests::cluster::start(
        tandem(),
        &[
            "serve",
            "--model",
            model.to_str().expect("utf8"),
            "--addr",
            "127.0.0.1:0",
            "--num-kv-blocks",
            "512",
            "--batch-invariant",
        ],
    )
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 3 + (i * 7 + salt) % 200).collect()
}

fn signal(pid: u32, sig: &str) {
    let sent = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill");
    assert!(sent.success(), "kill {sig} {pid}");
}

#[test]
fn a_frozen_prefill_worker_costs_a_bounded_wait_then_the_decode_worker_prefills() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let cluster = up(&model);
    let reference = serve(&model);
    let prefill_pid = cluster.pids[&cluster.prefill[0]];
    let rt = runtime();
    let frozen_prompt = prompt(400, 11);
    let want = rt
        .block_on(greedy(&reference.addr, frozen_prompt.clone(), 8))
        .expect("reference");
    rt.block_on(async {
        // Healthy: a long prompt goes through the prefill worker.
        let warm = greedy(&cluster.addr, prompt(400, 5), 8)
            .await
            .expect("warm");
        assert!(warm.prefill.is_some(), "not prefilled remotely: {warm:?}");

        signal(prefill_pid, "-STOP");
        // The router still believes the prefill worker healthy (its probe
        // has not timed out yet), so this call goes to it; the client sets
        // no deadline.
        let started = Instant::now();
        let call = greedy(&cluster.addr, frozen_prompt.clone(), 8);
        let out = tokio::time::timeout(Duration::from_secs(60), call)
            .await
            .expect("the request hung behind a frozen prefill worker")
            .expect("the request completes");
        let took = started.elapsed();
        // The bound: the wait (1.5 s + 0.4 s for 400 tokens) and a local
        // prefill of a tiny model, with room for a loaded machine.
        let bound = Duration::from_millis(1900) + Duration::from_secs(8);
        assert!(took < bound, "took {took:?}, bound {bound:?}");
        assert_eq!(out.tokens, want.tokens, "local prefill after the wait");

        signal(prefill_pid, "-CONT");
        // The prefill worker wakes up and finishes writing for a ticket
        // that is retired: nothing lands, nothing leaks.
        all_blocks_free(&cluster).await;
        let again = greedy(&cluster.addr, prompt(300, 23), 8)
            .await
            .expect("after");
        assert_eq!(again.tokens.len(), 8);
    });
}

/// 60,000 stop strings (what stalled the engine for everyone when each was
/// rescanned per token) are refused up front, naming the field; a request
/// at the limit is served.
#[test]
fn too_many_stop_strings_are_refused_naming_the_field() {
    use tandem_proto::v1;
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let cluster = up(&model);
    let request = |stops: usize| v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::Text(
            "Once upon a time".into(),
        )),
        max_tokens: Some(8),
        stop: (0..stops).map(|i| format!("zq{i}x")).collect(),
        ..Default::default()
    };
    runtime().block_on(async {
        let mut client =
            v1::generation_client::GenerationClient::connect(format!("http://{}", cluster.addr))
                .await
                .expect("router");
        let refused = client
            .generate(request(60_000))
            .await
            .expect_err("60,000 stop strings");
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains("stop"), "{refused:?}");
        let limit = tandem_engine::serving::MAX_STOP_STRINGS;
        let mut served = client
            .generate(request(limit))
            .await
            .expect("at the limit")
            .into_inner();
        while let Some(message) = served.message().await.expect("stream") {
            drop(message);
        }
        all_blocks_free(&cluster).await;
    });
}

/// The worker plane: a client that learns a worker's address (the router
/// names them in its response metadata) gets nothing around the router's
/// API keys. `Generate` on a decode worker and `Prefill` on a prefill
/// worker refuse callers without the cluster credential, and one derived
/// from another token; the router, which presents it, is served.
#[test]
fn workers_refuse_calls_without_the_cluster_credential() {
    use tandem_proto::v1;
    use tandem_proto::worker::v1 as wv1;
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let cluster = up(&model);
    let (decode, prefill) = (cluster.decode[0].clone(), cluster.prefill[0].clone());
    let generate = || v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
            ids: prompt(20, 1),
        })),
        max_tokens: Some(4),
        ..Default::default()
    };
    runtime().block_on(async {
        let channel = |addr: String| async move {
            tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                .expect("endpoint")
                .connect()
                .await
                .expect("connects")
        };
        let mut bare = v1::generation_client::GenerationClient::new(channel(decode.clone()).await);
        let refused = bare.generate(generate()).await.expect_err("no credential");
        assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
        let forged = tandem_security::ClusterCredential::derive("a-guessed-token");
        let mut wrong = v1::generation_client::GenerationClient::new(
            forged.channel(channel(decode.clone()).await),
        );
        let refused = wrong.generate(generate()).await.expect_err("wrong cluster");
        assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
        // The router's own entry (the typed prefill target) is guarded alike.
        let mut routed = wv1::decode_client::DecodeClient::new(channel(decode.clone()).await);
        let refused = routed
            .generate(wv1::RoutedGenerateRequest {
                request: Some(generate()),
                prefill: Some(wv1::PrefillPlacement {
                    worker: prefill.clone(),
                    min_uncached_tokens: 1,
                }),
                resume: None,
            })
            .await
            .expect_err("no credential");
        assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
        let mut prefill_client =
            wv1::prefill_client::PrefillClient::new(channel(prefill.clone()).await);
        let refused = prefill_client
            .prefill(wv1::PrefillRequest {
                tokens: prompt(20, 2),
                ..Default::default()
            })
            .await
            .expect_err("no credential");
        assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
        // Read-only probes stay open; the router serves.
        tandem_tests::cluster::load(&decode).await;
        let served = greedy(&cluster.addr, prompt(20, 3), 4)
            .await
            .expect("router");
        assert_eq!(served.tokens.len(), 4);
    });
}

/// A worker feeds at most `MAX_KV_SUBSCRIBERS` prefix-cache feeds at once:
/// the next `KvEvents` call is refused (RESOURCE_EXHAUSTED, saying why),
/// and closing one frees its slot. Today's feeds were unbounded in number
/// and backlog, a memory leak any caller could open.
#[test]
fn kv_event_feeds_are_capped_per_worker() {
    use tandem_proto::worker::v1 as wv1;
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let worker = tandem_tests::cluster::start(
        tandem(),
        &[
            "decode-worker",
            "--model",
            model.to_str().expect("utf8"),
            "--addr",
            "127.0.0.1:0",
            "--num-kv-blocks",
            "64",
        ],
    );
    runtime().block_on(async {
        let mut client =
            wv1::worker_client::WorkerClient::connect(format!("http://{}", worker.addr))
                .await
                .expect("worker");
        let limit = tandem_engine::serving::MAX_KV_SUBSCRIBERS;
        let mut feeds = Vec::new();
        for i in 0..limit {
            let mut feed = client
                .kv_events(wv1::KvEventsRequest { dump: true })
                .await
                .unwrap_or_else(|s| panic!("feed {i} under the limit: {s:?}"))
                .into_inner();
            // Each starts with its snapshot's `Cleared`.
            let first = tokio::time::timeout(Duration::from_secs(10), feed.message())
                .await
                .expect("a snapshot in time")
                .expect("stream");
            assert!(first.is_some(), "feed {i} ended at once");
            feeds.push(feed);
        }
        let refused = client
            .kv_events(wv1::KvEventsRequest { dump: true })
            .await
            .expect_err("one feed past the limit");
        assert_eq!(
            refused.code(),
            tonic::Code::ResourceExhausted,
            "{refused:?}"
        );
        assert!(refused.message().contains("subscribers"), "{refused:?}");
        drop(feeds.pop());
        // The server notices the closed stream on its next poll: retry for
        // a bounded while.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match client.kv_events(wv1::KvEventsRequest { dump: true }).await {
                Ok(_) => break,
                Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                    assert!(Instant::now() < deadline, "the freed slot never came back");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(s) => panic!("{s:?}"),
            }
        }
    });
}

/// A decode worker frozen (SIGSTOP) mid-stream: the router's channel stops
/// getting answers to its HTTP/2 keep-alive pings, drops the connection
/// and moves the stream to the other decode worker with the tokens so
/// far. The client, which set no deadline, gets the whole greedy output
/// within the keep-alive bound, not never.
#[test]
fn a_frozen_decode_worker_mid_stream_costs_a_bounded_wait_then_the_stream_moves() {
    use tandem_proto::v1;
    use tandem_proto::worker::ROUTED_DECODE_HEADER;
    // Long enough (on `small`) that the worker is still decoding when it
    // freezes, not done with every token already buffered on its way.
    const TOKENS: u32 = 600;
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "small");
    let cluster = tandem_tests::cluster::start(
        tandem(),
        &[
            "up",
            "--model",
            model.to_str().expect("utf8"),
            "--prefill",
            "1",
            "--decode",
            "2",
            "--addr",
            "127.0.0.1:0",
            "--no-http",
            "--kv-cache-memory",
            "32MiB",
            "--worker-arg=--batch-invariant",
        ],
    );
    let reference = serve(&model);
    let ids = prompt(6, 41);
    let rt = runtime();
    let want = rt
        .block_on(greedy(&reference.addr, ids.clone(), TOKENS))
        .expect("reference")
        .tokens;
    rt.block_on(async {
        let mut client =
            v1::generation_client::GenerationClient::connect(format!("http://{}", cluster.addr))
                .await
                .expect("router");
        let response = client
            .generate(v1::GenerateRequest {
                prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
                    ids: ids.clone(),
                })),
                sampling: Some(v1::SamplingParams {
                    temperature: Some(0.0),
                    ..Default::default()
                }),
                max_tokens: Some(TOKENS),
                ignore_eos: true,
                ..Default::default()
            })
            .await
            .expect("generate");
        let decode = response
            .metadata()
            .get(ROUTED_DECODE_HEADER)
            .and_then(|v| v.to_str().ok())
            .expect("the decode worker's address")
            .to_string();
        let pid = cluster.pids[&decode];
        let mut stream = response.into_inner();
        let mut tokens = Vec::new();
        // The first tokens arrive, then the worker freezes.
        while tokens.is_empty() {
            match stream.message().await.expect("stream").map(|m| m.event) {
                Some(Some(v1::generate_response::Event::Delta(d))) => tokens.extend(d.token_ids),
                Some(_) => {}
                None => panic!("the stream ended before its first token"),
            }
        }
        signal(pid, "-STOP");
        let frozen_at = Instant::now();
        let frozen_with = tokens.len();
        let rest = async {
            let mut finished = false;
            while let Some(msg) = stream.message().await? {
                match msg.event {
                    Some(v1::generate_response::Event::Delta(d)) => tokens.extend(d.token_ids),
                    Some(v1::generate_response::Event::Finished(_)) => finished = true,
                    Some(v1::generate_response::Event::PromptLogprobs(_)) | None => {}
                }
            }
            Ok::<_, tonic::Status>(finished)
        };
        let outcome = tokio::time::timeout(Duration::from_secs(90), rest).await;
        let took = frozen_at.elapsed();
        signal(pid, "-CONT");
        let finished = outcome
            .expect("the stream hung behind a frozen decode worker")
            .expect("the stream moved instead of failing");
        assert!(finished, "no Finished after {took:?}");
        // The bound: keep-alive interval + timeout, and room to re-route.
        let bound = tandem_security::tls::KEEPALIVE_INTERVAL
            + tandem_security::tls::KEEPALIVE_TIMEOUT
            + Duration::from_secs(10);
        assert!(took < bound, "took {took:?}, bound {bound:?}");
        eprintln!("stream moved {took:?} after the freeze, {frozen_with} tokens in");
        assert!(
            frozen_with < TOKENS as usize,
            "every token had arrived before the freeze"
        );
        assert_eq!(tokens, want, "the moved stream's tokens");
    });
}
