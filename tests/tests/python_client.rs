//! The Python gRPC client harness (`tandem_tests::python`): the venv builds,
//! the generated `tandem.v1` stubs import, and `tests/python/client.py` runs
//! and fails cleanly without a server. The client's end-to-end use against
//! the real `tandem serve` process is `cli/tests/serve.rs`.
//!
//! Building the venv needs network access to PyPI the first time.

use serde_json::{json, Value};
use tandem_tests::python::{grpc_python, GrpcPython, HarnessError};

fn env() -> GrpcPython {
    grpc_python().unwrap_or_else(|e| panic!("building the Python gRPC venv: {e}"))
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
