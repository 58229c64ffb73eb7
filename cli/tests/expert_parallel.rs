//! `--ep` workers as real processes: a Qwen3-MoE model (`tiny-moe`: 8
//! experts, 2 per token) whose experts are split over rank processes gives
//! the same greedy tokens as one process for 16 concurrent mixed requests,
//! alone (`--ep 2`), with a feature split inside each expert group (`--tp 2
//! --ep 2`), pipelined (`--pp 2 --ep 2`) and in a disaggregated cluster
//! whose pools split differently (prefill `--tp 2`, decode `--ep 2`); a
//! split the model cannot take is refused at start.

use std::path::Path;

use tandem_tests::cluster::{greedy, Outcome, Started};

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

fn serve(model: &str, split: &[&str]) -> Started {
    let mut args = vec![
        "serve",
        "--model",
        model,
        "--addr",
        "127.0.0.1:0",
        "--num-kv-blocks",
        "512",
        "--batch-invariant",
    ];
    args.extend(split);
    tandem_tests::cluster::start(tandem(), &args)
}

/// 16 prompts of 5..~200 tokens.
fn prompts() -> Vec<Vec<u32>> {
    (0..16u32)
        .map(|i| {
            let n = 5 + (i * 37) % 200;
            (0..n).map(|t| (t * 13 + i * 101 + 7) % 500 + 3).collect()
        })
        .collect()
}

/// One prompt after another (a busy prefill pool would make the router
/// prefill locally), 16 tokens each.
fn run_each(addr: &str) -> Vec<Outcome> {
    let rt = tandem_tests::cluster::runtime();
    rt.block_on(async {
        let mut out = Vec::new();
        for p in prompts() {
            out.push(greedy(addr, p, 16).await.expect("greedy call"));
        }
        out
    })
}

/// Every prompt at once (so they share batches), 16 tokens each.
fn run_all(addr: &str) -> Vec<Outcome> {
    let rt = tandem_tests::cluster::runtime();
    rt.block_on(async {
        let calls: Vec<_> = prompts()
            .into_iter()
            .map(|p| {
                let addr = addr.to_string();
                tokio::spawn(async move { greedy(&addr, p, 16).await })
            })
            .collect();
        let mut out = Vec::new();
        for c in calls {
            out.push(c.await.expect("task").expect("greedy call"));
        }
        out
    })
}

fn tokens(o: &[Outcome]) -> Vec<Vec<u32>> {
    o.iter().map(|x| x.tokens.clone()).collect()
}

fn moe_model() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_tests::cluster::gen_model(tandem(), tmp.path(), "tiny-moe");
    tmp
}

#[test]
fn expert_parallel_workers_give_the_same_greedy_tokens() {
    let tmp = moe_model();
    let model = tmp.path().to_str().expect("utf8");
    let want = tokens(&run_all(&serve(model, &[]).addr));
    assert!(want.iter().all(|t| t.len() == 16));
    for split in [
        &["--ep", "2"][..],
        &["--tp", "2", "--ep", "2"][..],
        &["--pp", "2", "--ep", "2"][..],
    ] {
        let worker = serve(model, split);
        assert_eq!(tokens(&run_all(&worker.addr)), want, "{split:?}");
    }
}

#[test]
fn a_disaggregated_cluster_with_an_expert_parallel_decode_pool_agrees() {
    let tmp = moe_model();
    let model = tmp.path().to_str().expect("utf8");
    let want = tokens(&run_all(&serve(model, &[]).addr));
    let cluster = tandem_tests::cluster::start(
        tandem(),
        &[
            "up",
            "--model",
            model,
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
            "16",
            "--worker-arg=--batch-invariant",
            "--prefill-arg=--tp=2",
            "--decode-arg=--ep=2",
        ],
    );
    let got = run_each(&cluster.addr);
    let long = got.iter().zip(prompts()).filter(|(_, p)| p.len() >= 16);
    for (o, p) in long {
        assert!(
            o.prefill.is_some(),
            "a {}-token prompt was prefilled remotely: {o:?}",
            p.len()
        );
    }
    assert_eq!(tokens(&got), want);
}

#[test]
fn an_expert_split_the_model_cannot_take_is_refused_at_start() {
    // A Qwen3-MoE of 6 experts and 4 heads: 4 ranks split its heads, but
    // its experts do not make 4 groups. Refused before any rank starts.
    let model =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/golden/qwen3moe_step2_f32");
    let out = std::process::Command::new(tandem())
        .args(["serve", "--addr", "127.0.0.1:0", "--ep", "4", "--model"])
        .arg(&model)
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--ep 4: num_experts 6"), "{err}");
    assert!(!err.contains("rank 1"), "no rank was started: {err}");
}
