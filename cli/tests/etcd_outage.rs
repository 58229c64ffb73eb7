//! An etcd outage: etcd is frozen (SIGSTOP) under a running cluster. The
//! router keeps routing on the membership it last saw and the workers keep
//! serving; when etcd comes back, the leases that ran out while it was
//! frozen are gone, the workers register again and the router's view
//! re-syncs, with no restart of anything.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tandem_tests::cluster::{all_blocks_free, greedy, runtime};
use tandem_tests::prometheus::scrape;

const TTL_S: u64 = 2;

/// Sends `SIGCONT` to a stopped process when dropped, so a failing test
/// does not leave etcd frozen.
struct Frozen(u32);

impl Frozen {
    fn freeze(pid: u32) -> Frozen {
        signal("-STOP", pid);
        Frozen(pid)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        signal("-CONT", self.0);
    }
}

fn signal(sig: &str, pid: u32) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

/// A prompt long enough to be prefilled remotely (threshold 8), distinct per `i`.
fn prompt(i: u32) -> Vec<u32> {
    (0..24).map(|j| (i * 31 + j * 7) % 250 + 1).collect()
}

#[test]
fn a_frozen_etcd_does_not_stop_serving_and_membership_resyncs_after() {
    let tandem = Path::new(env!("CARGO_BIN_EXE_tandem"));
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_tests::cluster::gen_model(tandem, tmp.path(), "tiny");
    let ttl = TTL_S.to_string();
    let cluster = tandem_tests::cluster::start(
        tandem,
        &[
            "up",
            "--model",
            tmp.path().to_str().expect("utf8"),
            "--prefill",
            "1",
            "--decode",
            "2",
            "--addr",
            "127.0.0.1:0",
            "--no-http",
            "--kv-cache-memory",
            "32MiB",
            "--remote-prefill-threshold",
            "8",
            "--lease-ttl-s",
            &ttl,
        ],
    );
    let etcd = cluster
        .etcd_pid
        .expect("`tandem up` starts etcd when installed");
    let router_metrics = cluster
        .metrics_addr("router", &cluster.addr)
        .expect("the router serves /metrics")
        .to_string();
    let healthy = |role: &str| {
        scrape(&router_metrics).value("tandem_router_healthy_workers", &[("role", role)])
    };
    let rt = runtime();
    rt.block_on(async {
        let reference = greedy(&cluster.addr, prompt(0), 6)
            .await
            .expect("served")
            .tokens;

        // Frozen for three lease TTLs: every request is still served, by
        // both decode workers, with remote prefill.
        let frozen = Frozen::freeze(etcd);
        let until = Instant::now() + Duration::from_secs(3 * TTL_S);
        let (mut served, mut decodes) = (0u32, BTreeSet::new());
        while Instant::now() < until {
            // Every fifth request repeats the reference prompt; the rest are
            // new prompts, so ties spread them over both decode workers
            // (rendezvous hashing of each prompt's first block).
            let i = if served % 5 == 0 { 0 } else { 1000 + served };
            let o = greedy(&cluster.addr, prompt(i), 6)
                .await
                .unwrap_or_else(|s| panic!("request {served} failed while etcd was frozen: {s}"));
            if served % 5 == 0 {
                assert_eq!(o.tokens, reference, "same prompt, same greedy tokens");
            }
            decodes.extend(o.decode);
            served += 1;
        }
        assert!(served >= 5, "only {served} requests in {}s", 3 * TTL_S);
        assert_eq!(decodes.len(), 2, "both decode workers served: {decodes:?}");
        assert_eq!(healthy("decode"), Some(2.0));
        assert_eq!(healthy("prefill"), Some(1.0));
        drop(frozen);

        // Back: the leases that ran out while etcd was frozen are revoked
        // when it resumes, so the router may see the workers leave and come
        // back as they register again; a request arriving in that window
        // waits for a decode worker (`--worker-wait-ms`), and past that
        // would get UNAVAILABLE (counted, allowed: the bound is the
        // re-sync). Within a bound the router counts every worker again and
        // a run of requests all succeed, on both workers.
        let resumed = Instant::now();
        let deadline = resumed + Duration::from_secs(20);
        let (mut streak, mut failed, mut i) = (0u32, 0u32, 0u32);
        let mut decodes = BTreeSet::new();
        while streak < 12 {
            assert!(
                Instant::now() < deadline,
                "membership did not re-sync within 20 s after etcd resumed \
                 (decode {:?}, prefill {:?}, {failed} failed)",
                healthy("decode"),
                healthy("prefill")
            );
            i += 1;
            let synced = healthy("decode") == Some(2.0) && healthy("prefill") == Some(1.0);
            match greedy(&cluster.addr, prompt(100 + i), 4).await {
                Ok(o) if synced => {
                    streak += 1;
                    decodes.extend(o.decode);
                }
                Ok(_) => streak = 0,
                Err(status) => {
                    assert_eq!(status.code(), tonic::Code::Unavailable, "{status}");
                    failed += 1;
                    streak = 0;
                    decodes.clear();
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        eprintln!(
            "etcd outage: {served} served while frozen; re-synced {:.1}s after resume, \
             {failed} requests got UNAVAILABLE meanwhile",
            resumed.elapsed().as_secs_f64()
        );
        assert_eq!(
            decodes.len(),
            2,
            "both decode workers serve again: {decodes:?}"
        );
        all_blocks_free(&cluster).await;
    });
}
