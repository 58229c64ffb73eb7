//! A SIGTERM that comes the moment a process has printed `listening on`
//! (what `tandem up`, a test or Kubernetes may do) is handled, not fatal:
//! a worker leaves etcd and drains, and every server exits with status 0.
//! The handlers are installed before that line is printed; a handler
//! installed on the first poll of the shutdown future comes too late.
//!
//! Needs etcd installed (`.ci/run` installs it).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tandem_tests::cluster::KillOnDrop;
use tandem_tests::etcd::EtcdServer;

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

/// Starts `tandem <args>` with its stderr in `log` and reads stdout up to
/// `listening on`.
fn start(args: &[&str], log: &Path) -> KillOnDrop {
    let child = Command::new(tandem())
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).expect("log file"))
        .spawn()
        .expect("tandem starts");
    tandem_tests::cluster::listening(child, args[0]).0
}

/// SIGTERM now; the exit status within 30 s.
fn terminate(child: &mut Child) -> std::process::ExitStatus {
    let sent = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(sent.success());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        assert!(Instant::now() < deadline, "no exit 30 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Each server three times: the race, where there was one, is narrow.
const ROUNDS: usize = 3;

#[test]
fn a_worker_sigtermed_right_after_it_listens_leaves_etcd_and_exits_cleanly() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model: PathBuf = tmp.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let model = model.to_str().expect("utf8");
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    for role in ["decode-worker", "prefill-worker"] {
        for round in 0..ROUNDS {
            let log = tmp.path().join(format!("{role}-{round}.log"));
            let mut worker = start(
                &[
                    role,
                    "--model",
                    model,
                    "--addr",
                    "127.0.0.1:0",
                    "--etcd",
                    &endpoint,
                    "--cluster",
                    "signals",
                    "--kv-cache-memory",
                    "32MiB",
                ],
                &log,
            );
            let status = terminate(&mut worker.0);
            let log = std::fs::read_to_string(&log).expect("log");
            assert!(status.success(), "{role} (round {round}): {status}\n{log}");
            assert!(
                log.contains("deregistered from etcd"),
                "{role} (round {round}) did not leave etcd:\n{log}"
            );
        }
    }
}

#[test]
fn a_router_or_server_sigtermed_right_after_it_listens_exits_cleanly() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model: PathBuf = tmp.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let model = model.to_str().expect("utf8");
    let commands: [&[&str]; 2] = [
        &[
            "router",
            "--model",
            model,
            "--addr",
            "127.0.0.1:0",
            "--decode",
            "127.0.0.1:1",
        ],
        &[
            "serve",
            "--model",
            model,
            "--addr",
            "127.0.0.1:0",
            "--kv-cache-memory",
            "32MiB",
        ],
    ];
    for args in commands {
        for round in 0..ROUNDS {
            let log = tmp.path().join(format!("{}-{round}.log", args[0]));
            let mut server = start(args, &log);
            let status = terminate(&mut server.0);
            let log = std::fs::read_to_string(&log).expect("log");
            assert!(
                status.success(),
                "{} (round {round}): {status}\n{log}",
                args[0]
            );
        }
    }
}

/// A worker a router follows holds that router's KV-event feed open, and a
/// graceful shutdown waits for open streams: the feed must end when the
/// drain begins, or the worker never exits (it hung until SIGKILL).
#[test]
fn a_worker_a_router_follows_still_exits_on_sigterm() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model: PathBuf = tmp.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let model = model.to_str().expect("utf8");
    for role in ["decode-worker", "prefill-worker"] {
        let log = tmp.path().join(format!("{role}.log"));
        let (mut worker, addr) = tandem_tests::cluster::listening(
            Command::new(tandem())
                .args([role, "--model", model, "--addr", "127.0.0.1:0"])
                .args(["--kv-cache-memory", "32MiB"])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(&log).expect("log file"))
                .spawn()
                .expect("tandem starts"),
            role,
        );
        let pool = if role == "decode-worker" {
            "--decode"
        } else {
            "--prefill"
        };
        let metrics = format!("127.0.0.1:{}", tandem_tests::cluster::free_port());
        let (_router, _) = tandem_tests::cluster::spawn_component(
            tandem(),
            "router",
            &[
                "--model",
                model,
                "--addr",
                "127.0.0.1:0",
                "--metrics-addr",
                &metrics,
            ]
            .into_iter()
            .chain([pool, &addr, "--probe-interval-ms", "50"])
            .chain(if role == "prefill-worker" {
                vec!["--decode", "127.0.0.1:1"]
            } else {
                vec![]
            })
            .collect::<Vec<_>>(),
        );
        // The feed is open once the router has matched the worker's first
        // digest (sent as soon as it is followed).
        let deadline = Instant::now() + Duration::from_secs(20);
        while tandem_tests::prometheus::scrape(&metrics)
            .value("tandem_router_kv_digests_matched_total", &[])
            .unwrap_or(0.0)
            < 1.0
        {
            assert!(
                Instant::now() < deadline,
                "the router never followed {role}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let status = terminate(&mut worker.0);
        let log = std::fs::read_to_string(&log).expect("log");
        assert!(status.success(), "{role}: {status}\n{log}");
    }
}
