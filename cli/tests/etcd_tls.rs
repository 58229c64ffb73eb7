//! Real processes against an etcd that requires mutual TLS: a decode worker
//! registers and the router follows membership through `--etcd-ca`,
//! `--etcd-cert` and `--etcd-key`, and a generation goes through; a worker
//! without the TLS flags exits with an error that says why.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tandem_tests::cluster::{greedy, runtime, spawn_component, KillOnDrop};
use tandem_tests::etcd::EtcdServer;

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

fn path(p: &Path) -> String {
    p.to_str().expect("utf8").to_string()
}

/// Runs `tandem args` to completion (at most 60 s); its exit success and
/// stderr.
fn run_to_exit(args: &[&str]) -> (bool, String) {
    let mut child = KillOnDrop(
        Command::new(tandem())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("tandem starts"),
    );
    let mut stderr = child.0.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.0.try_wait().expect("try_wait") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "tandem {args:?} still runs after 60 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    (status.success(), reader.join().expect("stderr reader"))
}

#[test]
fn a_worker_and_the_router_use_a_mutual_tls_etcd() {
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_tests::cluster::gen_model(tandem(), tmp.path(), "tiny");
    let model = path(tmp.path());
    let etcd = EtcdServer::start_tls().unwrap_or_else(|e| panic!("{e}"));
    let files = etcd.tls().expect("TLS files");
    let endpoint = etcd.endpoint();
    let (ca, cert, key) = (
        path(&files.ca),
        path(&files.client_cert),
        path(&files.client_key),
    );
    let membership = [
        "--etcd",
        &endpoint,
        "--etcd-ca",
        &ca,
        "--etcd-cert",
        &cert,
        "--etcd-key",
        &key,
        "--cluster",
        "mtls",
    ];
    let worker = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "decode-worker",
            "--model",
            &model,
            "--addr",
            "127.0.0.1:0",
            "--kv-cache-memory",
            "32MiB",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };

    // Without TLS settings the https endpoint is refused, naming it.
    let plain = worker(&["--etcd", &endpoint, "--cluster", "mtls"]);
    let plain: Vec<&str> = plain.iter().map(String::as_str).collect();
    let (ok, stderr) = run_to_exit(&plain);
    assert!(!ok, "a worker without --etcd-ca started");
    assert!(
        stderr.contains(&endpoint) && stderr.contains("CA certificate"),
        "{stderr}"
    );

    let args = worker(&membership);
    let args: Vec<&str> = args.iter().skip(1).map(String::as_str).collect();
    let (_decode, decode_addr) = spawn_component(tandem(), "decode-worker", &args);
    let mut router_args = vec!["--addr", "127.0.0.1:0", "--model", &model];
    router_args.extend_from_slice(&membership);
    let (_router, router_addr) = spawn_component(tandem(), "router", &router_args);

    let out = runtime()
        .block_on(greedy(&router_addr, vec![1, 2, 3, 4, 5], 8))
        .unwrap_or_else(|s| panic!("generation through the router failed: {s}"));
    assert_eq!(out.tokens.len(), 8, "{out:?}");
    assert_eq!(out.decode.as_deref(), Some(decode_addr.as_str()));
}
