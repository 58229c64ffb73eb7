//! The disaggregated cluster over the UCX KV transport (`tandem up
//! --kv-transport ucx`) against the same cluster over TCP: the same tokens
//! with UCX over its own TCP and over shared memory, and a prefill worker
//! killed mid-transfer neither hangs nor loses the request.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tandem_proto::worker::{ROUTED_DECODE_HEADER, ROUTED_PREFILL_HEADER};
use tandem_tests::cluster::{all_blocks_free, Started};
use tandem_tests::prometheus::scrape;

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

/// UCX over its TCP transport, on loopback only.
const UCX_TCP: &[(&str, &str)] = &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")];
/// UCX over shared memory.
const UCX_SM: &[(&str, &str)] = &[("UCX_TLS", "posix,cma,self")];

fn up(model: &Path, transport: &str, env: &[(&str, &str)]) -> Started {
    tandem_tests::cluster::start_with_env(
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
            "--no-etcd",
            "--kv-cache-memory",
            "32MiB",
            "--remote-prefill-threshold",
            "16",
            "--kv-transport",
            transport,
            "--worker-arg=--batch-invariant",
        ],
        env,
    )
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcome {
    tokens: Vec<u32>,
    prefill: Option<String>,
    decode: Option<String>,
}

fn request(prompt: Vec<u32>, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
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
    }
}

async fn generate(addr: &str, prompt: Vec<u32>, max_tokens: u32) -> Result<Outcome, tonic::Status> {
    let mut c = GenerationClient::connect(format!("http://{addr}"))
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let resp = c.generate(request(prompt, max_tokens)).await?;
    let header = |k: &str| {
        resp.metadata()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let (prefill, decode) = (header(ROUTED_PREFILL_HEADER), header(ROUTED_DECODE_HEADER));
    let mut stream = resp.into_inner();
    let mut tokens = Vec::new();
    while let Some(msg) = stream.message().await? {
        if let Some(v1::generate_response::Event::Delta(d)) = msg.event {
            tokens.extend(d.token_ids);
        }
    }
    Ok(Outcome {
        tokens,
        prefill,
        decode,
    })
}

/// Eight prompts of 40..~200 tokens (all prefilled remotely), 6 new tokens.
fn workload() -> Vec<Vec<u32>> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    (0..8)
        .map(|_| {
            let len = 40 + next(160) as usize;
            (0..len).map(|_| next(256) as u32).collect()
        })
        .collect()
}

/// Runs the workload concurrently; every request must have gone to the
/// prefill worker.
fn run(cluster: &Started) -> Vec<Vec<u32>> {
    let rt = tandem_tests::cluster::runtime();
    rt.block_on(async {
        let calls: Vec<_> = workload()
            .into_iter()
            .map(|p| tokio::spawn(generate_owned(cluster.addr.clone(), p, 6)))
            .collect();
        let mut out = Vec::new();
        for c in calls {
            let o = c.await.expect("task").expect("call");
            assert!(o.prefill.is_some(), "not prefilled remotely: {o:?}");
            out.push(o.tokens);
        }
        all_blocks_free(cluster).await;
        out
    })
}

async fn generate_owned(
    addr: String,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> Result<Outcome, tonic::Status> {
    generate(&addr, prompt, max_tokens).await
}

fn received_block_layers(cluster: &Started) -> f64 {
    let decode = &cluster.decode[0];
    let m = cluster
        .metrics_addr("decode-worker", decode)
        .expect("decode metrics");
    let s = scrape(m);
    s.sum("tandem_kv_transfer_received_block_layers_total", &[])
}

#[test]
fn ucx_over_tcp_and_shared_memory_gives_the_same_tokens_as_tcp() {
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_tests::cluster::gen_model(tandem(), tmp.path(), "tiny");
    let reference = {
        let cluster = up(tmp.path(), "tcp", &[]);
        run(&cluster)
    };
    assert_eq!(reference.len(), 8);
    for (name, env) in [("ucx tcp", UCX_TCP), ("ucx shared memory", UCX_SM)] {
        let cluster = up(tmp.path(), "ucx", env);
        let tokens = run(&cluster);
        assert_eq!(tokens, reference, "{name}: tokens differ from TCP's");
        // The blocks really moved over the transport.
        let received = received_block_layers(&cluster);
        assert!(received > 0.0, "{name}: no KV received ({received})");
    }
}

#[test]
fn a_prefill_worker_killed_mid_transfer_fails_over_to_local_prefill() {
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_tests::cluster::gen_model(tandem(), tmp.path(), "small");
    let prompt: Vec<u32> = (0..1500u32).map(|i| (i * 7 + 3) % 256).collect();
    // What the request yields when nothing fails (on the same cluster
    // shape, so the numerics are the same).
    let expected = {
        let cluster = up(tmp.path(), "ucx", UCX_TCP);
        let rt = tandem_tests::cluster::runtime();
        rt.block_on(generate(&cluster.addr, prompt.clone(), 4))
            .expect("reference call")
            .tokens
    };
    let cluster = up(tmp.path(), "ucx", UCX_TCP);
    let prefill_pid = cluster.pids[&cluster.prefill[0]];
    let rt = tandem_tests::cluster::runtime();
    let (outcome, elapsed_after_kill) = rt.block_on(async {
        let call = tokio::spawn(generate_owned(cluster.addr.clone(), prompt.clone(), 4));
        // Kill the prefill worker once the first blocks have arrived.
        let deadline = Instant::now() + Duration::from_secs(30);
        while received_block_layers(&cluster) == 0.0 {
            assert!(Instant::now() < deadline, "no KV block ever arrived");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Command::new("kill")
            .args(["-9", &prefill_pid.to_string()])
            .status()
            .expect("kill");
        let killed = Instant::now();
        let outcome = tokio::time::timeout(Duration::from_secs(30), call)
            .await
            .expect("the request ended (no hang)")
            .expect("task");
        let elapsed = killed.elapsed();
        // The decode worker freed the transfer's blocks.
        let decode = &cluster.decode[0];
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let l = tandem_tests::cluster::load(decode).await;
            if l.free_blocks == l.num_blocks && l.running + l.waiting + l.parked == 0 {
                break;
            }
            assert!(Instant::now() < deadline, "decode holds blocks: {l:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        (outcome, elapsed)
    });
    let m = cluster
        .metrics_addr("decode-worker", &cluster.decode[0])
        .expect("decode metrics");
    let failed = scrape(m).sum("tandem_remote_prefills_total", &[("outcome", "failed")]);
    assert_eq!(failed, 1.0, "the remote prefill did not fail mid-transfer");
    // Retried with local prefill: the same tokens as without the kill.
    let outcome = outcome.expect("the request succeeded after the kill");
    assert_eq!(outcome.tokens, expected);
    assert!(
        elapsed_after_kill < Duration::from_secs(20),
        "took {elapsed_after_kill:?} after the kill"
    );
    eprintln!("request done {elapsed_after_kill:?} after the prefill worker was killed");
}
