//! Registration and watching against a real etcd that requires mutual TLS
//! (`EtcdServer::start_tls`) or a user and password (RBAC auth enabled on
//! a plain etcd). Every wait is bounded.

use std::time::{Duration, Instant};

use etcd_client::Permission;
use tandem_discovery::{
    watch, DiscoveryError, EtcdConfig, EtcdTls, MembershipEvent, MembershipEvents, Registration,
    Role, WorkerRecord,
};
use tandem_tests::etcd::EtcdServer;

const CLUSTER: &str = "secure";
const USER: &str = "tandem";
const PASSWORD: &str = "tandem-password";

fn record(id: &str, port: u16) -> WorkerRecord {
    WorkerRecord {
        role: Role::Decode,
        id: id.to_string(),
        addr: format!("127.0.0.1:{port}"),
        payload: Vec::new(),
    }
}

fn read(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The config a legitimate client of a TLS etcd uses.
fn mtls_config(server: &EtcdServer) -> EtcdConfig {
    let files = server.tls().expect("a TLS etcd");
    EtcdConfig::new(server.endpoints()).with_tls(
        EtcdTls::new(read(&files.ca))
            .with_identity(read(&files.client_cert), read(&files.client_key)),
    )
}

async fn next_event(events: &mut MembershipEvents, limit: Duration) -> MembershipEvent {
    match tokio::time::timeout(limit, events.recv()).await {
        Ok(Some(event)) => event,
        Ok(None) => panic!("the membership stream ended"),
        Err(_) => panic!("no membership event within {limit:?}"),
    }
}

fn down(id: &str) -> MembershipEvent {
    MembershipEvent::Down {
        role: Role::Decode,
        id: id.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_and_watch_over_mutual_tls() {
    let server = EtcdServer::start_tls().unwrap_or_else(|e| panic!("{e}"));
    assert!(server.endpoint().starts_with("https://"));
    let config = mtls_config(&server);
    let d0 = record("d0", 5000);
    let _reg_d0 = Registration::register(&config, CLUSTER, d0.clone(), Duration::from_secs(5))
        .await
        .expect("register over mTLS");
    let (snapshot, mut events) = watch(&config, CLUSTER).await.expect("watch over mTLS");
    assert_eq!(snapshot, vec![d0]);

    let d1 = record("d1", 5001);
    let reg_d1 = Registration::register(&config, CLUSTER, d1.clone(), Duration::from_secs(5))
        .await
        .expect("register d1");
    assert_eq!(
        next_event(&mut events, Duration::from_secs(5)).await,
        MembershipEvent::Up(d1)
    );
    reg_d1.deregister().await.expect("deregister d1");
    assert_eq!(
        next_event(&mut events, Duration::from_secs(5)).await,
        down("d1")
    );
}

/// Registers with `config`, which etcd must refuse; the error, within a
/// bound.
async fn refused(config: &EtcdConfig) -> DiscoveryError {
    let start = Instant::now();
    let err = Registration::register(config, CLUSTER, record("x", 1), Duration::from_secs(5))
        .await
        .expect_err("etcd must refuse this client");
    let took = start.elapsed();
    eprintln!("refused in {took:?}: {err}");
    assert!(
        took < Duration::from_secs(8),
        "refusal took {took:?}: {err}"
    );
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_or_a_missing_client_certificate_is_a_clear_error() {
    let server = EtcdServer::start_tls().unwrap_or_else(|e| panic!("{e}"));
    let files = server.tls().expect("TLS files");
    let endpoint = server.endpoint();

    // A CA that did not sign etcd's certificate.
    let other = tempfile::tempdir().expect("tempdir");
    let other_ca = tandem_security::write_dev_certs(other.path(), &[])
        .expect("a second CA")
        .ca;
    let wrong_ca = EtcdConfig::new(server.endpoints()).with_tls(
        EtcdTls::new(read(&other_ca))
            .with_identity(read(&files.client_cert), read(&files.client_key)),
    );
    let err = refused(&wrong_ca).await;
    assert!(matches!(err, DiscoveryError::Unavailable { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("cannot reach etcd at {endpoint}")),
        "{text}"
    );
    assert!(text.contains("TLS settings"), "{text}");

    // The right CA, but no client certificate for --client-cert-auth.
    let no_identity = EtcdConfig::new(server.endpoints()).with_tls(EtcdTls::new(read(&files.ca)));
    let err = refused(&no_identity).await;
    assert!(matches!(err, DiscoveryError::Unavailable { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("cannot reach etcd at {endpoint}")),
        "{text}"
    );
    assert!(text.contains("client certificate"), "{text}");

    // Plaintext to a TLS etcd is refused before any connection.
    let http = endpoint.replacen("https://", "http://", 1);
    let err =
        refused(&EtcdConfig::new([http.clone()]).with_tls(EtcdTls::new(read(&files.ca)))).await;
    assert!(
        matches!(err, DiscoveryError::SchemeMismatch { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains(&http), "{err}");

    // And the legitimate client still gets in (the refusals were real).
    let _reg = Registration::register(
        &mtls_config(&server),
        CLUSTER,
        record("ok", 2),
        Duration::from_secs(5),
    )
    .await
    .expect("the right CA and certificate");
}

/// Creates user [`USER`] (read-write on `/tandem/`) and `root`, and turns
/// authentication on.
async fn enable_auth(server: &EtcdServer) {
    let mut root = etcd_client::Client::connect(server.endpoints(), None)
        .await
        .expect("raw etcd client");
    root.user_add("root", "root-password", None)
        .await
        .expect("add root");
    root.role_add("root").await.expect("add role root");
    root.user_grant_role("root", "root")
        .await
        .expect("grant root");
    root.user_add(USER, PASSWORD, None).await.expect("add user");
    root.role_add(USER).await.expect("add role");
    root.role_grant_permission(USER, Permission::read_write("/tandem/").with_prefix())
        .await
        .expect("grant /tandem/");
    root.user_grant_role(USER, USER).await.expect("grant role");
    root.auth_enable().await.expect("enable auth");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_auth_works_and_survives_an_etcd_restart() {
    let mut server = EtcdServer::start().unwrap_or_else(|e| panic!("{e}"));
    enable_auth(&server).await;
    let config = EtcdConfig::new(server.endpoints()).with_user(USER, PASSWORD);

    // Without credentials, or with a wrong password: refused, clearly.
    let err = refused(&EtcdConfig::new(server.endpoints())).await;
    assert!(err.to_string().contains("etcd at"), "{err}");
    let wrong = EtcdConfig::new(server.endpoints()).with_user(USER, "wrong");
    let err = refused(&wrong).await;
    assert!(matches!(err, DiscoveryError::Auth { .. }), "{err:?}");
    assert!(err.to_string().contains("\"tandem\""), "{err}");
    assert!(
        !err.to_string().contains("wrong"),
        "the password leaked: {err}"
    );
    let err = watch(&wrong, CLUSTER)
        .await
        .expect_err("a wrong password watches nothing");
    assert!(matches!(err, DiscoveryError::Auth { .. }), "{err:?}");

    // A short TTL (as in etcd.rs's restart test): a keep-alive that cannot
    // renew loses the key quickly.
    let ttl = Duration::from_secs(4);
    let d0 = record("d0", 5000);
    let reg_d0 = Registration::register(&config, CLUSTER, d0.clone(), ttl)
        .await
        .expect("register with a password");
    let (snapshot, mut events) = watch(&config, CLUSTER)
        .await
        .expect("watch with a password");
    assert_eq!(snapshot, vec![d0.clone()]);

    // Every token etcd issued dies with it.
    tokio::task::block_in_place(|| server.restart()).unwrap_or_else(|e| panic!("{e}"));

    // The keep-alive re-authenticates: d0 outlives several TTLs. A
    // keep-alive stuck on its old token lets the lease expire (`Down`).
    let quiet = reg_d0.ttl() * 2;
    if let Ok(event) = tokio::time::timeout(quiet, events.recv()).await {
        panic!("d0 should stay registered across the restart, got {event:?}");
    }

    // A lost lease (revoked behind its back) is replaced: granting and
    // putting again needs a valid token, so a keep-alive still holding
    // the token from before the restart would never bring d0 back.
    let mut root = etcd_client::Client::connect(
        server.endpoints(),
        Some(etcd_client::ConnectOptions::new().with_user("root", "root-password")),
    )
    .await
    .expect("root client");
    root.lease_revoke(reg_d0.lease_id())
        .await
        .expect("revoke d0's lease");
    assert_eq!(
        next_event(&mut events, Duration::from_secs(20)).await,
        down("d0")
    );
    assert_eq!(
        next_event(&mut events, Duration::from_secs(20)).await,
        MembershipEvent::Up(d0.clone())
    );

    // The watcher (re-authenticated on resync) still follows changes.
    let d1 = record("d1", 5001);
    let reg_d1 = Registration::register(&config, CLUSTER, d1.clone(), ttl)
        .await
        .expect("register d1 after the restart");
    assert_eq!(
        next_event(&mut events, Duration::from_secs(20)).await,
        MembershipEvent::Up(d1)
    );
    reg_d1.deregister().await.expect("deregister d1");
    assert_eq!(
        next_event(&mut events, Duration::from_secs(20)).await,
        down("d1")
    );

    // d0's registration connected before the restart; leaving still works.
    reg_d0
        .deregister()
        .await
        .expect("deregister d0 after the restart");
    assert_eq!(
        next_event(&mut events, Duration::from_secs(20)).await,
        down("d0")
    );
    let (snapshot, _events) = watch(&config, CLUSTER).await.expect("a fresh watch");
    assert!(snapshot.is_empty(), "{snapshot:?}");
}
