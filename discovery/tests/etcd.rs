//! Registration and watching against a real etcd (one per test, started by
//! `tandem_tests::etcd::EtcdServer`; the tests fail, not skip, without the
//! `etcd` binary). Every wait is bounded.

use std::time::{Duration, Instant};

use tandem_discovery::{
    watch, worker_key, DiscoveryError, EtcdConfig, MembershipEvent, MembershipEvents, Registration,
    Role, WorkerRecord, DEFAULT_TTL,
};
use tandem_tests::etcd::EtcdServer;

const CLUSTER: &str = "test";

fn record(role: Role, id: &str, port: u16) -> WorkerRecord {
    WorkerRecord {
        role,
        id: id.to_string(),
        addr: format!("127.0.0.1:{port}"),
        payload: format!("info of {id}").into_bytes(),
    }
}

fn etcd() -> EtcdServer {
    EtcdServer::start().unwrap_or_else(|e| panic!("{e}"))
}

/// The next event within `limit`, and how long it took.
async fn next_event(events: &mut MembershipEvents, limit: Duration) -> (MembershipEvent, Duration) {
    let start = Instant::now();
    match tokio::time::timeout(limit, events.recv()).await {
        Ok(Some(event)) => (event, start.elapsed()),
        Ok(None) => panic!("the membership stream ended"),
        Err(_) => panic!("no membership event within {limit:?}"),
    }
}

/// Asserts nothing arrives for `quiet`.
async fn expect_quiet(events: &mut MembershipEvents, quiet: Duration) {
    if let Ok(event) = tokio::time::timeout(quiet, events.recv()).await {
        panic!("expected no event for {quiet:?}, got {event:?}");
    }
}

async fn raw_client(server: &EtcdServer) -> etcd_client::Client {
    etcd_client::Client::connect(server.endpoints(), None)
        .await
        .expect("raw etcd client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_then_up_and_prompt_down_on_deregister() {
    let server = etcd();
    let eps = EtcdConfig::new(server.endpoints());
    let p0 = record(Role::Prefill, "p0", 5000);
    let d0 = record(Role::Decode, "d0", 5001);
    let _reg_p0 = Registration::register(&eps, CLUSTER, p0.clone(), DEFAULT_TTL)
        .await
        .expect("register p0");
    let _reg_d0 = Registration::register(&eps, CLUSTER, d0.clone(), DEFAULT_TTL)
        .await
        .expect("register d0");

    let (snapshot, mut events) = watch(&eps, CLUSTER).await.expect("watch");
    assert_eq!(
        snapshot,
        vec![p0.clone(), d0.clone()],
        "sorted by role, then id"
    );

    let d1 = record(Role::Decode, "d1", 5002);
    let reg_d1 = Registration::register(&eps, CLUSTER, d1.clone(), DEFAULT_TTL)
        .await
        .expect("register d1");
    assert_eq!(reg_d1.key(), worker_key(CLUSTER, Role::Decode, "d1"));
    let (event, _) = next_event(&mut events, Duration::from_secs(5)).await;
    assert_eq!(event, MembershipEvent::Up(d1));

    let start = Instant::now();
    reg_d1.deregister().await.expect("deregister d1");
    let (event, _) = next_event(&mut events, Duration::from_secs(2)).await;
    let took = start.elapsed();
    assert_eq!(
        event,
        MembershipEvent::Down {
            role: Role::Decode,
            id: "d1".to_string()
        }
    );
    assert!(took < Duration::from_secs(2), "Down took {took:?}");

    // The survivors are still there for a fresh watcher.
    let (snapshot, _events) = watch(&eps, CLUSTER).await.expect("second watch");
    assert_eq!(snapshot, vec![p0, d0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_registration_expires_after_its_ttl() {
    let server = etcd();
    let eps = EtcdConfig::new(server.endpoints());
    let (snapshot, mut events) = watch(&eps, CLUSTER).await.expect("watch");
    assert!(snapshot.is_empty());

    let w = record(Role::Decode, "short", 6000);
    let reg = Registration::register(&eps, CLUSTER, w.clone(), Duration::from_secs(2))
        .await
        .expect("register");
    let ttl = reg.ttl();
    assert!(ttl >= Duration::from_secs(2), "granted {ttl:?}");
    let (event, _) = next_event(&mut events, Duration::from_secs(5)).await;
    assert_eq!(event, MembershipEvent::Up(w));

    // Kept alive: no expiry over two TTLs.
    expect_quiet(&mut events, ttl * 2).await;

    // `kill -9`: the keep-alive stops, nothing revokes the lease.
    drop(reg);
    let limit = ttl + Duration::from_secs(2);
    let (event, took) = next_event(&mut events, limit).await;
    assert_eq!(
        event,
        MembershipEvent::Down {
            role: Role::Decode,
            id: "short".to_string()
        }
    );
    assert!(
        took >= ttl / 2,
        "Down after {took:?} is too early for a lease expiry (TTL {ttl:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_is_replaced_and_the_worker_comes_back() {
    let server = etcd();
    let eps = EtcdConfig::new(server.endpoints());
    let w = record(Role::Prefill, "p-lost", 7000);
    let reg = Registration::register(&eps, CLUSTER, w.clone(), Duration::from_secs(3))
        .await
        .expect("register");
    let (snapshot, mut events) = watch(&eps, CLUSTER).await.expect("watch");
    assert_eq!(snapshot, vec![w.clone()]);

    // What a long partition looks like to etcd: the lease is gone.
    let old_lease = reg.lease_id();
    raw_client(&server)
        .await
        .lease_revoke(old_lease)
        .await
        .expect("revoke behind the registration's back");
    let (event, _) = next_event(&mut events, Duration::from_secs(2)).await;
    assert_eq!(
        event,
        MembershipEvent::Down {
            role: Role::Prefill,
            id: "p-lost".to_string()
        }
    );
    // The next renewal (within TTL/3) finds the lease gone and re-registers.
    let (event, took) = next_event(&mut events, reg.ttl() + Duration::from_secs(2)).await;
    assert_eq!(event, MembershipEvent::Up(w));
    assert!(took <= reg.ttl(), "came back after {took:?}");
    assert_ne!(reg.lease_id(), old_lease, "a fresh lease");

    // And deregistering revokes the new lease.
    reg.deregister().await.expect("deregister");
    let (event, _) = next_event(&mut events, Duration::from_secs(2)).await;
    assert!(matches!(event, MembershipEvent::Down { .. }), "{event:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_records_are_ignored() {
    let server = etcd();
    let eps = EtcdConfig::new(server.endpoints());
    let mut raw = raw_client(&server).await;
    let bad_key = worker_key(CLUSTER, Role::Decode, "garbage");
    raw.put(bad_key.as_str(), "not a record", None)
        .await
        .expect("put garbage");
    raw.put(format!("/tandem/{CLUSTER}/workers/router/x"), "{}", None)
        .await
        .expect("put a bad role");
    let good = record(Role::Decode, "good", 8000);
    raw.put(
        worker_key(CLUSTER, Role::Decode, "good"),
        good.encode(),
        None,
    )
    .await
    .expect("put a good record");

    let (snapshot, mut events) = watch(&eps, CLUSTER).await.expect("watch");
    assert_eq!(snapshot, vec![good.clone()]);

    // A garbled update of a present worker takes it out; a good one is Up.
    raw.put(worker_key(CLUSTER, Role::Decode, "good"), "garbled", None)
        .await
        .expect("garble");
    let (event, _) = next_event(&mut events, Duration::from_secs(5)).await;
    assert_eq!(
        event,
        MembershipEvent::Down {
            role: Role::Decode,
            id: "good".to_string()
        }
    );
    raw.put(bad_key.as_str(), "still garbage", None)
        .await
        .expect("put garbage again");
    let fixed = record(Role::Decode, "good", 8001);
    raw.put(
        worker_key(CLUSTER, Role::Decode, "good"),
        fixed.encode(),
        None,
    )
    .await
    .expect("fix");
    let (event, _) = next_event(&mut events, Duration::from_secs(5)).await;
    assert_eq!(event, MembershipEvent::Up(fixed));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_and_the_keep_alive_survive_an_etcd_restart() {
    let mut server = etcd();
    let eps = EtcdConfig::new(server.endpoints());
    let a = record(Role::Decode, "a", 9000);
    let b = record(Role::Decode, "b", 9001);
    let reg_a = Registration::register(&eps, CLUSTER, a.clone(), Duration::from_secs(4))
        .await
        .expect("register a");
    let reg_b = Registration::register(&eps, CLUSTER, b.clone(), Duration::from_secs(4))
        .await
        .expect("register b");
    let (snapshot, mut events) = watch(&eps, CLUSTER).await.expect("watch");
    assert_eq!(snapshot, vec![a.clone(), b.clone()]);

    tokio::task::block_in_place(|| server.stop());
    tokio::time::sleep(Duration::from_millis(500)).await;
    tokio::task::block_in_place(|| server.restart()).unwrap_or_else(|e| panic!("{e}"));

    // Both keep-alives reconnect; nobody disappears over two TTLs, and the
    // resync reports no spurious change.
    expect_quiet(&mut events, reg_a.ttl() * 2).await;

    // The watcher follows the restarted etcd.
    let start = Instant::now();
    reg_b
        .deregister()
        .await
        .expect("deregister b after the restart");
    let (event, _) = next_event(&mut events, Duration::from_secs(5)).await;
    assert_eq!(
        event,
        MembershipEvent::Down {
            role: Role::Decode,
            id: "b".to_string()
        }
    );
    assert!(start.elapsed() < Duration::from_secs(2));
    let c = record(Role::Prefill, "c", 9002);
    let _reg_c = Registration::register(&eps, CLUSTER, c.clone(), DEFAULT_TTL)
        .await
        .expect("register c after the restart");
    let (event, _) = next_event(&mut events, Duration::from_secs(5)).await;
    assert_eq!(event, MembershipEvent::Up(c.clone()));

    let (snapshot, _events) = watch(&eps, CLUSTER).await.expect("second watch");
    assert_eq!(snapshot, vec![c, a]);
    drop(reg_a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_etcd_is_an_error_naming_the_endpoint() {
    // A port nothing listens on: start etcd, note its endpoint, stop it.
    let mut server = etcd();
    let eps = EtcdConfig::new(server.endpoints());
    tokio::task::block_in_place(|| server.stop());
    let start = Instant::now();
    let err = Registration::register(&eps, CLUSTER, record(Role::Decode, "x", 1), DEFAULT_TTL)
        .await
        .expect_err("nothing listens");
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );
    assert!(
        matches!(
            err,
            DiscoveryError::Unreachable { .. } | DiscoveryError::Unavailable { .. }
        ),
        "{err:?}"
    );
    let expected = format!("cannot reach etcd at {}", eps.endpoints()[0]);
    assert!(err.to_string().contains(&expected), "{err}");
    let err = watch(&eps, CLUSTER).await.expect_err("nothing listens");
    assert!(err.to_string().contains(&expected), "{err}");
}

#[tokio::test]
async fn bad_names_are_refused_before_any_network() {
    let eps = EtcdConfig::new(["http://127.0.0.1:1"]);
    let err = Registration::register(&eps, "a/b", record(Role::Decode, "x", 1), DEFAULT_TTL)
        .await
        .expect_err("bad cluster");
    assert!(err.to_string().contains("cluster name"), "{err}");
    let err = Registration::register(&eps, CLUSTER, record(Role::Decode, "", 1), DEFAULT_TTL)
        .await
        .expect_err("empty id");
    assert!(err.to_string().contains("worker id"), "{err}");
    let err = watch(&EtcdConfig::new(Vec::<String>::new()), CLUSTER)
        .await
        .expect_err("no endpoints");
    assert!(matches!(err, DiscoveryError::NoEndpoints), "{err:?}");
}

/// A worker's key deleted or overwritten behind its back (its lease still
/// alive) is put back by the worker within a renewal interval: routers see
/// it go, then come back with its own record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overwritten_or_deleted_key_is_put_back() {
    let server = etcd();
    let eps = EtcdConfig::new(server.endpoints());
    let w = record(Role::Decode, "d-restore", 7100);
    let reg = Registration::register(&eps, CLUSTER, w.clone(), Duration::from_secs(3))
        .await
        .expect("register");
    let (snapshot, mut events) = watch(&eps, CLUSTER).await.expect("watch");
    assert_eq!(snapshot, vec![w.clone()]);
    let key = worker_key(CLUSTER, Role::Decode, "d-restore");
    let mut raw = raw_client(&server).await;
    let impostor = record(Role::Decode, "d-restore", 7999);
    raw.put(key.as_str(), impostor.encode(), None)
        .await
        .expect("overwrite");
    let (event, _) = next_event(&mut events, Duration::from_secs(2)).await;
    assert_eq!(event, MembershipEvent::Up(impostor));
    // Within a renewal interval (TTL/3) plus slack, the worker's own record.
    let (event, took) = next_event(&mut events, reg.ttl()).await;
    assert_eq!(event, MembershipEvent::Up(w.clone()));
    assert!(took < reg.ttl(), "put back after {took:?}");

    raw.delete(key.as_str(), None).await.expect("delete");
    let (event, _) = next_event(&mut events, Duration::from_secs(2)).await;
    assert!(matches!(event, MembershipEvent::Down { .. }), "{event:?}");
    let (event, _) = next_event(&mut events, reg.ttl()).await;
    assert_eq!(event, MembershipEvent::Up(w));
    let lease = reg.lease_id();
    let got = raw.get(key.as_str(), None).await.expect("get");
    assert_eq!(
        got.kvs()[0].lease(),
        lease,
        "under the worker's lease again"
    );
}
