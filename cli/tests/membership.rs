//! Membership by identity, against a real etcd and real processes: a
//! record the router cannot use is skipped (the router still starts and
//! serves), and a decode worker restarted on the same address under a new
//! id keeps its traffic when the old id's lease expires.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tandem_discovery::{EtcdConfig, Registration, Role, WorkerRecord};
use tandem_tests::cluster::{free_port, KillOnDrop};
use tandem_tests::etcd::EtcdServer;

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

const CLUSTER: &str = "membership";
const TTL_S: &str = "2";

fn decode_worker(model: &str, etcd: &str, id: &str, addr: &str) -> KillOnDrop {
    let args = [
        "--model",
        model,
        "--addr",
        addr,
        "--id",
        id,
        "--etcd",
        etcd,
        "--cluster",
        CLUSTER,
        "--lease-ttl-s",
        TTL_S,
        "--kv-cache-memory",
        "32MiB",
    ];
    tandem_tests::cluster::spawn_component(tandem(), "decode-worker", &args).0
}

fn greedy(rt: &tokio::runtime::Runtime, router: &str) -> Result<Option<String>, tonic::Status> {
    let prompt: Vec<u32> = (0..20).collect();
    let call = tandem_tests::cluster::greedy(router, prompt, 4);
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), call).await })
        .map_err(|_| tonic::Status::deadline_exceeded("no answer in 10 s"))?
        .map(|o| o.decode)
}

#[test]
fn a_bad_record_is_skipped_and_a_restart_on_the_same_address_keeps_traffic() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model: PathBuf = tmp.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let model = model.to_str().expect("utf8");
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let rt = tandem_tests::cluster::runtime();

    // A record whose address no channel can be made from, present before
    // the router starts (it used to stop the router from starting).
    let bad = WorkerRecord {
        role: Role::Decode,
        id: "bad-record".into(),
        addr: "not an address".into(),
        payload: Vec::new(),
    };
    let _bad = rt
        .block_on(Registration::register(
            &EtcdConfig::new([endpoint.clone()]),
            CLUSTER,
            bad,
            Duration::from_secs(60),
        ))
        .expect("registered");

    let addr = format!("127.0.0.1:{}", free_port());
    let mut old = decode_worker(model, &endpoint, "decode-old", &addr);
    let (_router, router) = tandem_tests::cluster::spawn_component(
        tandem(),
        "router",
        &[
            "--model",
            model,
            "--addr",
            "127.0.0.1:0",
            "--etcd",
            &endpoint,
            "--cluster",
            CLUSTER,
        ],
    );
    let served_by = greedy(&rt, &router).expect("the router serves beside a bad record");
    assert_eq!(served_by.as_deref(), Some(addr.as_str()));

    // The worker dies without deregistering; its replacement takes the same
    // address under a new id while the old lease is still alive.
    let _ = Command::new("kill")
        .args(["-KILL", &old.0.id().to_string()])
        .status();
    let _ = old.0.wait();
    let _new = decode_worker(model, &endpoint, "decode-new", &addr);

    // Past the old lease's expiry (2 s TTL), the address still gets traffic.
    std::thread::sleep(Duration::from_secs(4));
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut served = 0;
    while Instant::now() < deadline {
        let by = greedy(&rt, &router)
            .unwrap_or_else(|s| panic!("after the old id expired, request {served} failed: {s}"));
        assert_eq!(by.as_deref(), Some(addr.as_str()));
        served += 1;
    }
    assert!(served > 0);
}
