//! The Python gRPC client harness (`tandem_tests::python`): the venv builds,
//! the generated `tandem.v1` stubs import, and `tests/python/client.py` works
//! end to end against `tests/python/echo_server.py`, a Python server of the
//! same API. `tandem serve`'s own acceptance test uses the same client.
//!
//! Building the venv needs network access to PyPI the first time.

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};

use serde_json::{json, Value};
use tandem_tests::python::{grpc_python, GrpcPython, HarnessError};

/// Kills the child when the test ends, pass or fail.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn env() -> GrpcPython {
    grpc_python().unwrap_or_else(|e| panic!("building the Python gRPC venv: {e}"))
}

/// Starts the echo server and returns it with its `127.0.0.1:port`.
fn echo_server(py: &GrpcPython) -> (KillOnDrop, String) {
    let child = py
        .command()
        .arg(py.scripts.join("echo_server.py"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("starting echo_server.py");
    let mut child = KillOnDrop(child);
    let stdout = child.0.stdout.take().expect("piped stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("reading the echo server's port");
    let port: Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("echo server printed {line:?} instead of its port: {e}"));
    let port = port["port"].as_u64().expect("a port number");
    (child, format!("127.0.0.1:{port}"))
}

#[test]
fn stubs_and_grpc_packages_import() {
    let py = env();
    assert!(py.stubs.join("tandem/v1/generate_pb2.py").is_file());
    assert!(py.stubs.join("tandem/v1/generate_pb2_grpc.py").is_file());
    let out = py
        .command()
        .args([
            "-c",
            "import json\n\
             from tandem.v1 import generate_pb2, generate_pb2_grpc\n\
             from grpc_health.v1 import health_pb2_grpc\n\
             from grpc_reflection.v1alpha import reflection_pb2_grpc\n\
             svc = generate_pb2.DESCRIPTOR.services_by_name['Generation']\n\
             print(json.dumps({'service': svc.full_name,\n\
                               'stub': hasattr(generate_pb2_grpc, 'GenerationStub')}))",
        ])
        .output()
        .expect("running the venv's python");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(
        got,
        json!({"service": "tandem.v1.Generation", "stub": true})
    );
}

#[test]
fn client_help_works_for_every_mode() {
    let py = env();
    let client = py.client_script();
    for mode in [None, Some("reflect"), Some("health"), Some("generate")] {
        let mut cmd = py.command();
        cmd.arg(&client);
        cmd.args(mode);
        let out = cmd.arg("--help").output().expect("running client.py");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "client.py {mode:?} --help: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("usage:"), "{stdout}");
    }
}

#[test]
fn client_lists_services_checks_health_and_streams_from_a_server() {
    let py = env();
    let (_server, addr) = echo_server(&py);

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
    let method = &lines[1]["methods"][0];
    assert_eq!(method["name"], "Generate");
    assert_eq!(method["server_streaming"], true);

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
            "3",
            "--request-id",
            "r-1",
        ])
        .expect("generate");
    let (finished, deltas) = lines.split_last().expect("at least one message");
    assert_eq!(deltas.len(), 3, "{lines:?}");
    let tokens: Vec<u64> = deltas
        .iter()
        .flat_map(|d| {
            d["delta"]["token_ids"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|t| t.as_u64())
        .collect();
    assert_eq!(
        tokens,
        b"hel".iter().map(|&b| u64::from(b)).collect::<Vec<_>>()
    );
    let text: String = deltas
        .iter()
        .filter_map(|d| d["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, "hel");
    assert!(lines.iter().all(|l| l["request_id"] == "r-1"), "{lines:?}");
    assert_eq!(deltas[2]["delta"]["finish_reason"], "FINISH_REASON_LENGTH");
    let finished = &finished["finished"];
    assert_eq!(finished["usage"]["prompt_tokens"], 5);
    assert_eq!(finished["usage"]["completion_tokens"], 3);
    assert_eq!(
        finished["choices"][0]["finish_reason"],
        "FINISH_REASON_LENGTH"
    );
    assert!(
        finished["timings"]["e2e_s"].as_f64().is_some(),
        "{finished}"
    );

    let lines = py
        .run_client([
            "generate",
            "--addr",
            &addr,
            "--token-ids",
            "7,8,9,10",
            "--cancel-after",
            "2",
        ])
        .expect("generate, cancelled");
    assert_eq!(lines.last(), Some(&json!({"cancelled": true, "deltas": 2})));

    // An RPC error fails the client, with the status in the error.
    let err = py
        .run_client([
            "generate",
            "--addr",
            &addr,
            "--prompt",
            "x",
            "--max-tokens",
            "0",
        ])
        .expect_err("max_tokens 0 is rejected");
    match err {
        HarnessError::ScriptFailed { status, stderr, .. } => {
            assert_eq!(status.code(), Some(2), "{stderr}");
            assert!(stderr.contains("INVALID_ARGUMENT"), "{stderr}");
        }
        other => panic!("expected ScriptFailed, got {other}"),
    }
}

#[test]
fn client_fails_cleanly_without_a_server() {
    let py = env();
    // Port 1 on loopback: nothing listens there.
    let err = py
        .run_client([
            "health",
            "--addr",
            "127.0.0.1:1",
            "--connect-timeout",
            "0.5",
        ])
        .expect_err("no server");
    match err {
        HarnessError::ScriptFailed { status, stderr, .. } => {
            assert_eq!(status.code(), Some(3), "{stderr}");
            assert!(stderr.contains("could not connect"), "{stderr}");
        }
        other => panic!("expected ScriptFailed, got {other}"),
    }
}
