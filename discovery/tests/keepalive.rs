//! An idle watch and an idle lease keep-alive stay connected to an etcd
//! with its default keep-alive enforcement (`--grpc-keepalive-min-time`
//! 5 s, no pings without streams). Pinging more often than that makes etcd
//! send `GOAWAY` ("too many pings") after three strikes: with 3-s pings
//! every idle watch broke and resynchronised about every 12 s. The symptom
//! is the warning the watcher and the keeper log, so this test (its own
//! binary: it installs the global subscriber) captures warnings.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_discovery::{watch, EtcdConfig, Registration, Role, WorkerRecord, DEFAULT_TTL};
use tandem_tests::etcd::EtcdServer;

/// Collects everything logged, for the assertion.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_watch_and_lease_stay_connected_under_etcds_ping_policy() {
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");

    let server = EtcdServer::start().unwrap_or_else(|e| panic!("{e}"));
    let eps = EtcdConfig::new(server.endpoints());
    let record = WorkerRecord {
        role: Role::Decode,
        id: "d0".into(),
        addr: "127.0.0.1:5000".into(),
        payload: b"idle".to_vec(),
    };
    let _registration = Registration::register(&eps, "idle", record, DEFAULT_TTL)
        .await
        .expect("register");
    let (snapshot, _events) = watch(&eps, "idle").await.expect("watch");
    assert_eq!(snapshot.len(), 1);
    // Longer than three pings at any interval under etcd's 5-s minimum.
    tokio::time::sleep(Duration::from_secs(16)).await;
    let text = String::from_utf8_lossy(
        &logs
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    )
    .into_owned();
    assert!(
        !text.contains("watch broke") && !text.contains("keep-alive failed"),
        "an idle connection to etcd broke:\n{text}"
    );
}
