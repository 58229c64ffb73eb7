//! A local cluster of real processes (`tandem up`: router, prefill and
//! decode workers on loopback) against the colocated server.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tandem_proto::worker::{ROUTED_DECODE_HEADER, ROUTED_PREFILL_HEADER};
use tandem_tests::cluster::{all_blocks_free, load, KillOnDrop, Outcome, Started};

fn start(args: &[&str]) -> Started {
    tandem_tests::cluster::start(Path::new(env!("CARGO_BIN_EXE_tandem")), args)
}

fn up(model: &Path, prefill: usize, decode: usize) -> Started {
    up_with(model, prefill, decode, &[])
}

/// `up` with `extra` flags.
fn up_with(model: &Path, prefill: usize, decode: usize, extra: &[&str]) -> Started {
    let (prefill, decode) = (prefill.to_string(), decode.to_string());
    let mut args = vec![
        "up",
        "--model",
        model.to_str().expect("utf8"),
        "--prefill",
        &prefill,
        "--decode",
        &decode,
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--kv-cache-memory",
        "32MiB",
        "--remote-prefill-threshold",
        "32",
        "--worker-arg=--batch-invariant",
    ];
    args.extend_from_slice(extra);
    start(&args)
}

/// The colocated reference: `tandem serve`, batch invariant.
fn serve(model: &Path) -> Started {
    start(&[
        "serve",
        "--model",
        model.to_str().expect("utf8"),
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--num-kv-blocks",
        "2048",
        "--batch-invariant",
    ])
}

fn rt() -> tokio::runtime::Runtime {
    tandem_tests::cluster::runtime()
}

async fn generate(addr: &str, prompt: Vec<u32>, max_tokens: u32) -> Result<Outcome, tonic::Status> {
    tandem_tests::cluster::greedy(addr, prompt, max_tokens).await
}

/// 32 mixed requests: prompts of 5..~300 tokens, 4..24 new tokens.
fn workload() -> Vec<(Vec<u32>, u32)> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    (0..32)
        .map(|_| {
            let len = 5 + next(300) as usize;
            let prompt = (0..len).map(|_| next(256) as u32).collect();
            (prompt, 4 + next(21) as u32)
        })
        .collect()
}

async fn run_all(addr: &str, work: &[(Vec<u32>, u32)]) -> Vec<Outcome> {
    let calls = work
        .iter()
        .map(|(p, n)| tokio::spawn(generate_owned(addr.to_string(), p.clone(), *n)));
    let mut out = Vec::new();
    for c in calls.collect::<Vec<_>>() {
        out.push(c.await.expect("task").expect("call"));
    }
    out
}

async fn generate_owned(addr: String, prompt: Vec<u32>, n: u32) -> Result<Outcome, tonic::Status> {
    generate(&addr, prompt, n).await
}

/// Starts `tandem decode-worker <args>` (dying with the test) and returns it
/// with the address it listens on.
fn decode_worker(args: &[&str]) -> (KillOnDrop, String) {
    tandem_tests::cluster::spawn_component(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        "decode-worker",
        args,
    )
}

#[test]
fn two_prefill_two_decode_workers_match_the_colocated_server() {
    let tmp = tempfile::tempdir().expect("tempdir");
    gen_model(tmp.path(), "tiny");
    let serve = serve(tmp.path());
    let cluster = up(tmp.path(), 2, 2);
    assert_eq!((cluster.prefill.len(), cluster.decode.len()), (2, 2));
    let work = workload();
    let rt = rt();
    let want = rt.block_on(run_all(&serve.addr, &work));
    let got = rt.block_on(run_all(&cluster.addr, &work));
    let mut used_prefill: std::collections::HashMap<String, usize> =
        std::collections::HashMap::new();
    for (i, ((w, g), (prompt, _))) in want.iter().zip(&got).zip(&work).enumerate() {
        assert_eq!(
            w.tokens,
            g.tokens,
            "request {i} ({} prompt tokens)",
            prompt.len()
        );
        assert!(g
            .decode
            .as_ref()
            .is_some_and(|d| cluster.decode.contains(d)));
        // Without a prefill worker: short, mostly cached, or the prefill pool
        // was saturated (`--max-prefill-queue`), so prefilled on the decode
        // worker.
        if let Some(p) = &g.prefill {
            assert!(
                prompt.len() >= 32,
                "a {}-token prompt went to prefill",
                prompt.len()
            );
            *used_prefill.entry(p.clone()).or_default() += 1;
        }
    }
    assert!(
        !used_prefill.is_empty(),
        "long prompts were prefilled remotely"
    );
    // Parallel sampling goes through remote prefill too, and its seeded
    // choices are the colocated server's.
    for (i, (prompt, _)) in work
        .iter()
        .filter(|(p, _)| p.len() >= 64)
        .take(3)
        .enumerate()
    {
        let seed = 40 + i as u64;
        // Not the prompt the workload sent: uncached everywhere.
        let prompt: Vec<u32> = prompt.iter().map(|t| (t + 7) % 256).collect();
        let (want, _) = rt.block_on(sampled(&serve.addr, prompt.clone(), 3, seed));
        let (got, prefill) = rt.block_on(sampled(&cluster.addr, prompt.clone(), 3, seed));
        assert!(prefill.is_some(), "n = 3 was prefilled remotely");
        assert_eq!(got, want, "n = 3, {} prompt tokens", prompt.len());
        assert_eq!(got.len(), 3);
    }
    // Prompt logprobs through remote prefill are the colocated server's;
    // asked again (the prompt now cached), they are whole again.
    for (prompt, _) in work.iter().filter(|(p, _)| p.len() >= 64).take(2) {
        let prompt: Vec<u32> = prompt.iter().map(|t| (t + 11) % 256).collect();
        let (want, _) = rt.block_on(scored(&serve.addr, prompt.clone()));
        for attempt in 0..2 {
            let (got, prefill) = rt.block_on(scored(&cluster.addr, prompt.clone()));
            // The second time the prompt may be cached at the decode
            // worker the router picks: local then, and scored whole all the
            // same.
            assert!(attempt > 0 || prefill.is_some(), "prefilled remotely");
            assert_eq!(got.len(), prompt.len() - 1);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.token_id, prompt[i + 1]);
                assert_eq!(g.token_id, w.token_id);
                assert!(
                    (g.logprob - w.logprob).abs() < 1e-4,
                    "position {i}: {g:?} vs {w:?}"
                );
                let ids =
                    |l: &v1::TokenLogprob| l.top.iter().map(|t| t.token_id).collect::<Vec<_>>();
                assert_eq!(ids(g), ids(w), "position {i}");
            }
        }
    }
    // Beam search goes through remote prefill too: the same hypotheses,
    // in the same order, as the colocated server's.
    for (prompt, _) in work.iter().filter(|(p, _)| p.len() >= 64).take(2) {
        let prompt: Vec<u32> = prompt.iter().map(|t| (t + 13) % 256).collect();
        let (want, _) = rt.block_on(beams(&serve.addr, prompt.clone()));
        let (got, prefill) = rt.block_on(beams(&cluster.addr, prompt.clone()));
        assert!(prefill.is_some(), "beam search was prefilled remotely");
        assert_eq!(got, want, "beams, {} prompt tokens", prompt.len());
        assert_eq!(got.len(), 2);
    }
    // Every block came back on every worker.
    rt.block_on(async {
        all_blocks_free(&cluster).await;
    });
}

/// The 2 best of 4 beams for `prompt` (one delta each, at the end), and
/// the prefill worker the router named (if any).
async fn beams(addr: &str, prompt: Vec<u32>) -> (Vec<Vec<u32>>, Option<String>) {
    let req = v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
            ids: prompt,
        })),
        max_tokens: Some(10),
        n: 2,
        ignore_eos: true,
        beam_search: Some(v1::BeamSearch {
            width: 4,
            ..Default::default()
        }),
        ..Default::default()
    };
    let (mut stream, prefill) = routed_call(addr, req).await;
    let mut choices = vec![Vec::new(); 2];
    while let Some(msg) = stream.message().await.expect("stream") {
        if let Some(v1::generate_response::Event::Delta(d)) = msg.event {
            assert!(d.finish_reason != 0, "one delta per hypothesis, at the end");
            choices[d.index as usize].extend(d.token_ids);
        }
    }
    (choices, prefill)
}

/// The prompt logprobs (3 alternatives) of `prompt`, and the prefill
/// worker the router named (if any); checks they precede the first token.
async fn scored(addr: &str, prompt: Vec<u32>) -> (Vec<v1::TokenLogprob>, Option<String>) {
    let req = v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
            ids: prompt,
        })),
        max_tokens: Some(2),
        prompt_logprobs: Some(3),
        ..Default::default()
    };
    let (mut stream, prefill) = routed_call(addr, req).await;
    let (mut scores, mut tokens_first) = (None, false);
    while let Some(msg) = stream.message().await.expect("stream") {
        match msg.event {
            Some(v1::generate_response::Event::PromptLogprobs(p)) => {
                assert!(scores.is_none() && !tokens_first, "once, before any token");
                scores = Some(p.logprobs);
            }
            Some(v1::generate_response::Event::Delta(_)) => tokens_first |= scores.is_none(),
            _ => {}
        }
    }
    (scores.expect("prompt scores"), prefill)
}

/// Calls the router: the response stream and the prefill worker the
/// router named (if any).
async fn routed_call(
    addr: &str,
    req: v1::GenerateRequest,
) -> (tonic::Streaming<v1::GenerateResponse>, Option<String>) {
    let mut c = GenerationClient::connect(format!("http://{addr}"))
        .await
        .expect("connects");
    let resp = c.generate(req).await.expect("call");
    let prefill = resp
        .metadata()
        .get(ROUTED_PREFILL_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    (resp.into_inner(), prefill)
}

/// `n` choices sampled at temperature 1 with `seed`: each choice's tokens,
/// and the prefill worker the router named (if any).
async fn sampled(
    addr: &str,
    prompt: Vec<u32>,
    n: u32,
    seed: u64,
) -> (Vec<Vec<u32>>, Option<String>) {
    let req = v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
            ids: prompt,
        })),
        sampling: Some(v1::SamplingParams {
            temperature: Some(1.0),
            seed: Some(seed),
            ..Default::default()
        }),
        max_tokens: Some(12),
        n,
        ignore_eos: true,
        ..Default::default()
    };
    let (mut stream, prefill) = routed_call(addr, req).await;
    let mut choices = vec![Vec::new(); n as usize];
    while let Some(msg) = stream.message().await.expect("stream") {
        if let Some(v1::generate_response::Event::Delta(d)) = msg.event {
            choices[d.index as usize].extend(d.token_ids);
        }
    }
    (choices, prefill)
}

#[test]
fn without_prefill_workers_the_cluster_still_serves() {
    let tmp = tempfile::tempdir().expect("tempdir");
    gen_model(tmp.path(), "tiny");
    let cluster = up(tmp.path(), 0, 1);
    let rt = rt();
    let prompt: Vec<u32> = (0..200).map(|i| i % 256).collect();
    let out = rt
        .block_on(generate(&cluster.addr, prompt, 6))
        .expect("served");
    assert_eq!(out.tokens.len(), 6);
    assert_eq!(out.prefill, None);
}

#[test]
fn a_shared_prefix_goes_back_to_the_worker_that_holds_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    gen_model(tmp.path(), "tiny");
    let cluster = up(tmp.path(), 0, 2);
    let rt = rt();
    let prefix = |p: u32| -> Vec<u32> { (0..256).map(|i| (i * 7 + p * 31) % 256).collect() };
    let with = |p: u32, s: u32| {
        let mut v = prefix(p);
        v.extend([s, s + 1, s + 2]);
        v
    };
    // New prefixes spread over both workers (ties go by rendezvous hash
    // with the workers' addresses, so 16 prefixes: all on one worker is a
    // 1-in-32,768 chance; 6 would be 1 in 32) ...
    let homes: Vec<String> = (0..16)
        .map(|p| {
            rt.block_on(generate(&cluster.addr, with(p, 1), 2))
                .expect("call")
                .decode
                .expect("routed")
        })
        .collect();
    assert!(
        homes.iter().any(|h| h != &homes[0]),
        "new prefixes all went to one worker: {homes:?}"
    );
    // ... and each comes back to the worker that holds it, once the KV-event
    // feed has reached the router.
    std::thread::sleep(Duration::from_millis(500));
    for (p, home) in homes.iter().enumerate() {
        let o = rt
            .block_on(generate(&cluster.addr, with(p as u32, 9), 2))
            .expect("call");
        assert_eq!(o.decode.as_ref(), Some(home), "prefix {p} left its worker");
    }
}

fn gen_model(dir: &Path, preset: &str) {
    tandem_tests::cluster::gen_model(Path::new(env!("CARGO_BIN_EXE_tandem")), dir, preset);
}

#[test]
fn a_killed_decode_workers_request_migrates_and_the_worker_is_dropped() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // Big enough that a long generation is still running when we kill.
    gen_model(tmp.path(), "small");
    let model = tmp.path().to_str().expect("utf8");
    // The cluster's token, given to `up` (in its environment) and to the
    // worker started later (in a file), so the router may call it.
    const TOKEN: &str = "late-joiner-token-5d1e";
    let token_dir = tempfile::tempdir().expect("tempdir");
    let token_file = token_dir.path().join("token");
    std::fs::write(&token_file, TOKEN).expect("token file");
    let cluster = tandem_tests::cluster::start_with_env(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &[
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
            "--lease-ttl-s",
            "2",
        ],
        &[("TANDEM_CLUSTER_TOKEN", TOKEN)],
    );
    let (etcd, name) = cluster
        .etcd
        .clone()
        .expect("`tandem up` starts etcd when installed");
    let rt = rt();
    rt.block_on(async {
        let mut c = GenerationClient::connect(format!("http://{}", cluster.addr))
            .await
            .expect("router");
        const LONG: u32 = 400;
        let long = v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
                ids: (1..20).collect(),
            })),
            max_tokens: Some(LONG),
            ignore_eos: true,
            ..Default::default()
        };
        let resp = c.generate(long).await.expect("call");
        let victim = resp
            .metadata()
            .get(ROUTED_DECODE_HEADER)
            .and_then(|v| v.to_str().ok())
            .expect("routed")
            .to_string();
        let mut stream = resp.into_inner();
        let mut tokens = 0usize;
        if let Some(v1::generate_response::Event::Delta(d)) = stream
            .message()
            .await
            .expect("a message")
            .expect("a delta")
            .event
        {
            tokens += d.token_ids.len();
        }
        let pid = cluster.pids[&victim];
        Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .expect("kill");
        // The in-flight request migrates to the survivor: its stream goes
        // on to all its tokens, with usage in terms of the original prompt.
        let usage = tokio::time::timeout(Duration::from_secs(60), async {
            let mut usage = None;
            while let Some(msg) = stream.message().await.expect("the stream continues") {
                match msg.event {
                    Some(v1::generate_response::Event::Delta(d)) => tokens += d.token_ids.len(),
                    Some(v1::generate_response::Event::Finished(f)) => usage = f.usage,
                    Some(v1::generate_response::Event::PromptLogprobs(_)) | None => {}
                }
            }
            usage
        })
        .await
        .expect("the migrated stream ended")
        .expect("a Finished message with usage");
        assert_eq!(tokens, LONG as usize, "every token arrived once");
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (19, LONG));
        let router_metrics = cluster
            .metrics_addr("router", &cluster.addr)
            .expect("router metrics");
        let migrated = tandem_tests::prometheus::scrape(router_metrics)
            .value("tandem_router_migrations_total", &[("result", "resumed")]);
        assert_eq!(migrated, Some(1.0));
        // Within the lease TTL + 2 s, every request goes to the survivor.
        tokio::time::sleep(Duration::from_secs(4)).await;
        for i in 0..8u32 {
            let o = generate(&cluster.addr, vec![i, i + 1, i + 2], 2)
                .await
                .expect("served elsewhere");
            assert_ne!(o.decode.as_deref(), Some(victim.as_str()));
        }
    });
    // A worker started later joins without a router restart.
    let (late, addr) = decode_worker(&[
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
    ]);
    let reached = rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut i = 100u32;
        while Instant::now() < deadline {
            i += 1;
            if let Ok(o) = generate(&cluster.addr, vec![i, i * 3 % 256, 7], 2).await {
                if o.decode.as_deref() == Some(addr.as_str()) {
                    return true;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    });
    assert!(reached, "the late worker {addr} never got a request");
    drop(late);
}

#[test]
fn a_mismatched_worker_is_refused_and_a_cancelled_request_frees_both_workers() {
    let tmp = tempfile::tempdir().expect("tempdir");
    gen_model(tmp.path(), "small");
    let model = tmp.path().to_str().expect("utf8");
    let cluster = start(&[
        "up",
        "--model",
        model,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--kv-cache-memory",
        "64MiB",
        "--remote-prefill-threshold",
        "32",
    ]);
    let (etcd, name) = cluster
        .etcd
        .clone()
        .expect("`tandem up` starts etcd when installed");
    // A decode worker with another block size joins the membership ...
    let (_odd, odd_addr) = decode_worker(&[
        "--model",
        model,
        "--etcd",
        &etcd,
        "--cluster",
        &name,
        "--block-size",
        "32",
        "--kv-cache-memory",
        "64MiB",
    ]);
    std::thread::sleep(Duration::from_secs(1));
    let rt = rt();
    rt.block_on(async {
        // ... and never gets a request.
        for i in 0..12u32 {
            let o = generate(&cluster.addr, vec![i, 2 * i, 3], 2)
                .await
                .expect("served");
            assert_ne!(o.decode.as_deref(), Some(odd_addr.as_str()));
        }
        // A request prefilled remotely, cancelled mid-stream, frees its
        // blocks on the decode and the prefill worker.
        let mut c = GenerationClient::connect(format!("http://{}", cluster.addr))
            .await
            .expect("router");
        let req = v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
                ids: (0..600).map(|i| i % 256).collect(),
            })),
            max_tokens: Some(1200),
            ignore_eos: true,
            ..Default::default()
        };
        let resp = c.generate(req).await.expect("call");
        assert!(
            resp.metadata().get(ROUTED_PREFILL_HEADER).is_some(),
            "prefilled remotely"
        );
        let mut stream = resp.into_inner();
        stream.message().await.expect("message").expect("a delta");
        let busy = load(&cluster.decode[0]).await;
        assert!(busy.free_blocks < busy.num_blocks);
        drop(stream);
        drop(c);
        all_blocks_free(&cluster).await;
        let decoded = load(&cluster.decode[0]).await.computed_tokens;
        assert!(
            decoded < 600 + 1200 / 2,
            "the request ran on after the client left"
        );
    });
}

/// Decode workers that speculate (an early-exit draft: the model's first
/// layer) give the colocated server's greedy tokens, and say so in their
/// metrics.
#[test]
fn speculating_decode_workers_give_the_same_tokens() {
    let tmp = tempfile::tempdir().expect("tempdir");
    gen_model(tmp.path(), "tiny");
    let serve = serve(tmp.path());
    let cluster = up_with(
        tmp.path(),
        1,
        1,
        &[
            "--decode-arg=--speculative=draft-model",
            "--decode-arg=--draft-layers=1",
            "--decode-arg=--no-adaptive-speculation",
        ],
    );
    let work: Vec<(Vec<u32>, u32)> = workload().into_iter().take(12).collect();
    let rt = rt();
    let want = rt.block_on(run_all(&serve.addr, &work));
    let got = rt.block_on(run_all(&cluster.addr, &work));
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(w.tokens, g.tokens, "request {i}");
        assert_eq!(w.drafted, 0, "the plain server does not speculate");
    }
    // Every request of more than two tokens drafted (fixed k, no adaptation).
    assert!(
        got.iter()
            .zip(&work)
            .all(|(g, (_, n))| *n <= 2 || g.drafted > 0),
        "per-request speculation stats reach the client through the router"
    );
    let decode = &cluster.decode[0];
    let metrics = cluster
        .metrics_addr("decode-worker", decode)
        .expect("decode metrics");
    let s = tandem_tests::prometheus::scrape(metrics);
    let drafted = s.sum("tandem_spec_drafted_tokens_total", &[]);
    let accepted = s.sum("tandem_spec_accepted_tokens_total", &[]);
    assert!(drafted > 0.0, "the decode worker speculated");
    assert!(accepted <= drafted);
}

/// A client's deadline (`grpc-timeout`) reaches the decode worker through
/// the router: the stream ends with DEADLINE_EXCEEDED and the worker frees
/// the request's blocks.
#[test]
fn a_client_deadline_is_propagated_and_frees_the_workers() {
    let tmp = tempfile::tempdir().expect("tempdir");
    gen_model(tmp.path(), "small");
    let cluster = up(tmp.path(), 0, 1);
    rt().block_on(async {
        let mut c = GenerationClient::connect(format!("http://{}", cluster.addr))
            .await
            .expect("connect");
        let mut req = tonic::Request::new(v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
                ids: (1..100).collect(),
            })),
            max_tokens: Some(1900),
            ignore_eos: true,
            ..Default::default()
        });
        req.set_timeout(Duration::from_millis(400));
        let started = Instant::now();
        let mut stream = c.generate(req).await.expect("call").into_inner();
        let status = loop {
            match stream.message().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("1900 tokens ended before a 400 ms deadline"),
                Err(status) => break status,
            }
        };
        assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
        assert!(started.elapsed() < Duration::from_secs(10));
        all_blocks_free(&cluster).await;
    });
}
