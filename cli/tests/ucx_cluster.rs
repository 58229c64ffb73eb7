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

/// Waits (bounded) until the decode worker has received KV blocks, i.e. a
/// transfer is under way.
async fn wait_for_blocks(cluster: &Started) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while received_block_layers(cluster) == 0.0 {
        assert!(Instant::now() < deadline, "no KV block ever arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn kill(pid: u32) {
    let status = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
}

/// Polls until `worker` holds no blocks and runs nothing; returns how long
/// that took.
async fn until_idle(worker: &str, limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let l = tandem_tests::cluster::load(worker).await;
        if l.free_blocks == l.num_blocks && l.running + l.waiting + l.parked == 0 {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "{worker} still holds blocks: {l:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn long_prompt() -> Vec<u32> {
    (0..1500u32).map(|i| (i * 7 + 3) % 256).collect()
}

/// Kills the prefill worker once blocks are arriving: the decode worker
/// sees the transfer fail within 5 s, frees its blocks, and retries with
/// local prefill, giving the tokens an undisturbed run gives.
fn prefill_killed_mid_transfer(model: &Path, env: &[(&str, &str)], expected: &[u32]) {
    let cluster = up(model, "ucx", env);
    let prefill_pid = cluster.pids[&cluster.prefill[0]];
    let m = cluster
        .metrics_addr("decode-worker", &cluster.decode[0])
        .expect("decode metrics")
        .to_string();
    let rt = tandem_tests::cluster::runtime();
    rt.block_on(async {
        let call = tokio::spawn(generate_owned(cluster.addr.clone(), long_prompt(), 4));
        wait_for_blocks(&cluster).await;
        kill(prefill_pid);
        let killed = Instant::now();
        // The failure surfaces at the decode worker within 5 s.
        loop {
            let failed = scrape(&m).sum("tandem_remote_prefills_total", &[("outcome", "failed")]);
            if failed == 1.0 {
                break;
            }
            assert!(
                killed.elapsed() < Duration::from_secs(5),
                "the transfer's failure took over 5 s to surface"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let surfaced = killed.elapsed();
        let outcome = tokio::time::timeout(Duration::from_secs(30), call)
            .await
            .expect("the request ended (no hang)")
            .expect("task")
            .expect("the request succeeded after the kill (local prefill)");
        assert_eq!(outcome.tokens, expected, "local retry gave other tokens");
        until_idle(&cluster.decode[0], Duration::from_secs(10)).await;
        eprintln!("{env:?}: prefill killed; failure surfaced after {surfaced:?}");
    });
}

#[test]
fn a_peer_killed_mid_transfer_fails_fast_frees_blocks_and_never_hangs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_tests::cluster::gen_model(tandem(), tmp.path(), "small");
    // What the request yields when nothing fails.
    let expected = {
        let cluster = up(tmp.path(), "tcp", &[]);
        let rt = tandem_tests::cluster::runtime();
        rt.block_on(generate(&cluster.addr, long_prompt(), 4))
            .expect("reference call")
            .tokens
    };
    prefill_killed_mid_transfer(tmp.path(), UCX_TCP, &expected);
    prefill_killed_mid_transfer(tmp.path(), UCX_SM, &expected);

    // The decode worker killed mid-transfer: the client's call fails
    // cleanly and the prefill worker frees its blocks within 5 s.
    let cluster = up(tmp.path(), "ucx", UCX_TCP);
    let decode_pid = cluster.pids[&cluster.decode[0]];
    let rt = tandem_tests::cluster::runtime();
    rt.block_on(async {
        let call = tokio::spawn(generate_owned(cluster.addr.clone(), long_prompt(), 4));
        wait_for_blocks(&cluster).await;
        kill(decode_pid);
        let freed = until_idle(&cluster.prefill[0], Duration::from_secs(5)).await;
        let outcome = tokio::time::timeout(Duration::from_secs(10), call)
            .await
            .expect("the request ended (no hang)")
            .expect("task");
        assert!(outcome.is_err(), "{outcome:?}");
        eprintln!("decode killed; prefill worker idle after {freed:?}");
    });
}
