//! `tandem serve` as a real process, called by a Python client generated
//! from `proto/` with grpcio-tools (`tandem_tests::python` builds the venv):
//! reflection lists the service, health says SERVING, `Generate` streams the
//! same tokens `tandem generate` computes, cancellation works, and bad
//! parameters come back as INVALID_ARGUMENT naming the field.
//!
//! Building the venv needs network access to PyPI the first time.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use serde_json::{json, Value};
use tandem_tests::python::{grpc_python, GrpcPython, HarnessError};

/// Kills the server when the test ends, pass or fail.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn tandem(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tandem"));
    c.args(args);
    c
}

fn gen_tiny(dir: &Path) {
    let out = tandem(&["gen-model", "--config", "tiny", "--out"])
        .arg(dir)
        .output()
        .expect("gen-model runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Starts `tandem serve` on a free loopback port; returns it and its address.
fn serve(model: &Path) -> (KillOnDrop, String) {
    let child = tandem(&[
        "serve",
        "--addr",
        "127.0.0.1:0",
        "--kv-cache-memory",
        "64MiB",
        "--model",
    ])
    .arg(model)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit())
    .spawn()
    .expect("starting tandem serve");
    let mut child = KillOnDrop(child);
    let stdout = child.0.stdout.take().expect("piped stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("reading the listening line");
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("tandem serve printed {line:?}"))
        .to_string();
    (child, addr)
}

fn env() -> GrpcPython {
    grpc_python().unwrap_or_else(|e| panic!("building the Python gRPC venv: {e}"))
}

fn token_ids(lines: &[Value]) -> Vec<u64> {
    lines
        .iter()
        .flat_map(|d| {
            d["delta"]["token_ids"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|t| t.as_u64())
        .collect()
}

#[test]
fn python_client_reflects_checks_health_and_streams_tokens() {
    let tmp = tempfile::tempdir().expect("tempdir");
    gen_tiny(tmp.path());
    let py = env();
    let (_server, addr) = serve(tmp.path());

    let lines = py
        .run_client([
            "reflect",
            "--addr",
            &addr,
            "--symbol",
            "tandem.v1.Generation",
        ])
        .expect("reflect");
    let services = lines[0]["services"].as_array().expect("a service list");
    assert!(
        services.contains(&json!("tandem.v1.Generation")),
        "{lines:?}"
    );
    assert!(
        services.contains(&json!("grpc.health.v1.Health")),
        "{lines:?}"
    );
    assert_eq!(lines[1]["methods"][0]["name"], "Generate");
    assert_eq!(lines[1]["methods"][0]["server_streaming"], true);

    let lines = py.run_client(["health", "--addr", &addr]).expect("health");
    assert_eq!(
        lines,
        vec![
            json!({"service": "", "status": "SERVING"}),
            json!({"service": "tandem.v1.Generation", "status": "SERVING"}),
        ]
    );

    let lines = py
        .run_client([
            "generate",
            "--addr",
            &addr,
            "--prompt",
            "hello",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--ignore-eos",
            "--request-id",
            "r-1",
        ])
        .expect("generate");
    let (finished, deltas) = lines.split_last().expect("messages");
    assert_eq!(deltas.len(), 8, "{lines:?}");
    assert!(lines.iter().all(|l| l["request_id"] == "r-1"), "{lines:?}");
    assert_eq!(deltas[7]["delta"]["finish_reason"], "FINISH_REASON_LENGTH");
    let usage = &finished["finished"]["usage"];
    assert_eq!(usage["completion_tokens"], 8);
    assert!(finished["finished"]["timings"]["ttft_s"]
        .as_f64()
        .is_some_and(|t| t > 0.0));

    // The same tokens as the single-request path computes.
    let out = tandem(&[
        "generate",
        "--prompt",
        "hello",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--json",
        "--model",
    ])
    .arg(tmp.path())
    .output()
    .expect("generate runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reference: Value = serde_json::from_slice(&out.stdout).expect("json");
    let want: Vec<u64> = reference["output_ids"]
        .as_array()
        .expect("output_ids")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert_eq!(token_ids(deltas), want);

    // `tandem generate --server` is a client of the same API.
    let out = tandem(&[
        "generate",
        "--server",
        &addr,
        "--prompt",
        "hello",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--json",
    ])
    .output()
    .expect("generate --server runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let remote: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(remote["output_ids"], reference["output_ids"]);
    assert_eq!(remote["text"], reference["text"]);
    assert_eq!(remote["finish_reason"], "length");
    assert_eq!(
        usage["prompt_tokens"],
        reference["prompt_ids"].as_array().map_or(0, Vec::len)
    );

    // Cancelling mid-stream ends the call cleanly; the server keeps serving.
    let lines = py
        .run_client([
            "generate",
            "--addr",
            &addr,
            "--token-ids",
            "7,8,9,10",
            "--max-tokens",
            "200",
            "--ignore-eos",
            "--cancel-after",
            "2",
        ])
        .expect("generate, cancelled");
    assert_eq!(lines.last(), Some(&json!({"cancelled": true, "deltas": 2})));

    for (flag, value, field) in [
        ("--max-tokens", "0", "max_tokens"),
        ("--temperature", "-1", "temperature"),
    ] {
        let err = py
            .run_client(["generate", "--addr", &addr, "--prompt", "x", flag, value])
            .expect_err("rejected");
        match err {
            HarnessError::ScriptFailed { status, stderr, .. } => {
                assert_eq!(status.code(), Some(2), "{stderr}");
                assert!(stderr.contains("INVALID_ARGUMENT"), "{stderr}");
                assert!(stderr.contains(field), "{stderr}");
            }
            other => panic!("expected ScriptFailed, got {other}"),
        }
    }
}

/// `tandem bench serve` against a real server: every request completes, the
/// metrics are consistent with the workload, and the JSON report has them.
#[test]
fn bench_serve_measures_a_running_server() {
    let tmp = tempfile::tempdir().expect("tmp");
    gen_tiny(tmp.path());
    let (_server, addr) = serve(tmp.path());
    let out = tmp.path().join("bench.json");
    let model = tmp.path().to_str().expect("utf8");
    let run = tandem(&[
        "bench",
        "serve",
        "--router",
        &addr,
        "--model",
        model,
        "--num-requests",
        "12",
        "--request-rate",
        "50",
        "--input-len",
        "uniform:8-40",
        "--output-len",
        "fixed:6",
        "--prefix-len",
        "16",
        "--prefix-groups",
        "2",
        "--slo-ttft-ms",
        "60000",
        "--slo-tpot-ms",
        "60000",
        "--out",
    ])
    .arg(&out)
    .arg("--plot")
    .arg(tmp.path().join("plots"))
    .output()
    .expect("bench runs");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    // The summary table in the anchors' shape, and the CDFs.
    let table = String::from_utf8_lossy(&run.stdout);
    assert!(table.contains("Serving Benchmark Result"), "{table}");
    let successful = table
        .lines()
        .find_map(|l| l.strip_prefix("Successful requests:"))
        .map(str::trim);
    assert_eq!(successful, Some("12"), "{table}");
    assert!(table.contains("P99 TPOT (ms):"), "{table}");
    for png in ["ttft_cdf.png", "tpot_cdf.png", "itl_cdf.png", "e2e_cdf.png"] {
        let bytes = std::fs::read(tmp.path().join("plots").join(png)).expect(png);
        assert!(bytes.starts_with(b"\x89PNG"), "{png}");
    }
    // No progress bar in a pipe.
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!stderr.contains('\r'), "{stderr:?}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("report")).expect("json");
    let s = &report["summary"];
    assert_eq!(s["completed"], 12, "{s}");
    assert_eq!(s["failed"], 0);
    assert_eq!(s["slo_attainment"], 1.0, "generous SLOs hold");
    let requests = report["requests"].as_array().expect("records");
    assert_eq!(requests.len(), 12);
    for r in requests {
        assert_eq!(r["output_tokens"], 6, "ignore_eos makes outputs exact: {r}");
        let input = r["input_tokens"].as_u64().expect("input");
        assert!((16 + 8..=16 + 40).contains(&input), "{r}");
        assert_eq!(r["itls"].as_array().map(Vec::len), Some(5), "{r}");
        let (ttft, e2e) = (
            r["ttft"].as_f64().expect("ttft"),
            r["e2e"].as_f64().expect("e2e"),
        );
        assert!(0.0 < ttft && ttft <= e2e, "{r}");
    }
    // Offered at 50 req/s: the sends spread over time (Poisson), not all at 0.
    let last_send = requests
        .iter()
        .filter_map(|r| r["sent_at"].as_f64())
        .fold(0.0, f64::max);
    assert!(last_send > 0.05, "{last_send}");
    assert!(s["output_token_throughput"].as_f64().unwrap_or(0.0) > 0.0);
}
