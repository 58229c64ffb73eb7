//! The router's side: a membership snapshot plus a stream of changes.
//!
//! [`watch`] reads every key under `/tandem/<cluster>/workers/` in one `get`
//! (the snapshot, at some store revision R) and then watches the prefix from
//! R + 1. etcd replays every change after R, so no registration or expiry
//! that happens between the snapshot and the watch is lost.
//!
//! # Events
//!
//! A PUT of a well-formed record is [`MembershipEvent::Up`] (an upsert: the
//! router replaces what it knew about that worker); a DELETE — deregister,
//! lease expiry or a manual `etcdctl del` — is [`MembershipEvent::Down`].
//! The watcher keeps the set it has reported, so events are consistent with
//! it: `Down` only for a worker that was reported, and no `Up` when a value
//! is rewritten unchanged (a worker re-registering after a lost lease).
//! A malformed value is logged and treated as that worker being absent (a
//! `Down` if it was present), because nothing can be routed to a record that
//! cannot be read.
//!
//! # Recovery
//!
//! When the watch stream breaks (etcd restarted, the connection dropped, a
//! compaction overtook the watch), the task waits (backoff 100 ms doubling to
//! 2 s), takes a fresh snapshot over a fresh client (which authenticates
//! again when etcd has a user configured: etcd forgets auth tokens when it
//! restarts, so the old client could never work again), emits `Up`/`Down`
//! for the differences from what it reported, and watches again from the new
//! snapshot's revision. It retries for as long as someone holds the
//! [`MembershipEvents`]; dropping that stops the task.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, WatchOptions};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::etcd::{call, connect, Backoff};
use crate::record::{check_name, decode_entry, parse_worker_key, workers_prefix};
use crate::{DiscoveryError, EtcdConfig, Role, WorkerRecord};

/// How many events may wait for the router before the watcher pauses.
const EVENT_BUFFER: usize = 256;

/// A change in cluster membership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MembershipEvent {
    /// The worker is present with this record (new, or its record changed).
    Up(WorkerRecord),
    /// The worker is gone (deregistered, expired or deleted).
    Down { role: Role, id: String },
}

/// The changes after a snapshot, from etcd or from a static list (which
/// never changes). Dropping it stops the etcd watch task.
#[derive(Debug)]
pub struct MembershipEvents {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    Etcd {
        rx: mpsc::Receiver<MembershipEvent>,
        task: JoinHandle<()>,
    },
    Never,
}

impl MembershipEvents {
    /// A stream that never yields (the static list's).
    pub fn never() -> MembershipEvents {
        MembershipEvents {
            inner: Inner::Never,
        }
    }

    /// The next change. Waits forever for a static list; for etcd it
    /// returns `None` only if the watch task ended, which it does not do
    /// while this value is alive.
    pub async fn recv(&mut self) -> Option<MembershipEvent> {
        match &mut self.inner {
            Inner::Etcd { rx, .. } => rx.recv().await,
            Inner::Never => std::future::pending().await,
        }
    }
}

impl futures_util::Stream for MembershipEvents {
    type Item = MembershipEvent;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<MembershipEvent>> {
        match &mut self.get_mut().inner {
            Inner::Etcd { rx, .. } => rx.poll_recv(cx),
            Inner::Never => Poll::Pending,
        }
    }
}

impl Drop for MembershipEvents {
    fn drop(&mut self) {
        if let Inner::Etcd { task, .. } = &self.inner {
            task.abort();
        }
    }
}

/// Reads the current membership of `cluster` and follows it (see the module
/// doc). The snapshot is sorted by role, then id. Fails only if the first
/// snapshot cannot be taken (etcd unreachable, bad endpoints or cluster
/// name); later failures are retried inside. Needs a tokio runtime.
pub async fn watch(
    config: &EtcdConfig,
    cluster: &str,
) -> Result<(Vec<WorkerRecord>, MembershipEvents), DiscoveryError> {
    check_name("cluster name", cluster)?;
    let mut client = connect(config).await?;
    let (known, revision) = snapshot(&mut client, config, cluster).await?;
    let records = known.values().cloned().collect();
    let (tx, rx) = mpsc::channel(EVENT_BUFFER);
    let watcher = Watcher {
        client,
        config: config.clone(),
        cluster: cluster.to_string(),
        known,
        revision,
        tx,
    };
    let task = tokio::spawn(watcher.run());
    Ok((
        records,
        MembershipEvents {
            inner: Inner::Etcd { rx, task },
        },
    ))
}

type Known = BTreeMap<(Role, String), WorkerRecord>;

/// Every well-formed record under the prefix, and the store revision.
async fn snapshot(
    client: &mut Client,
    config: &EtcdConfig,
    cluster: &str,
) -> Result<(Known, i64), DiscoveryError> {
    let prefix = workers_prefix(cluster);
    let resp = call(
        config,
        "reading the worker list",
        client.get(prefix, Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
    let mut known = Known::new();
    for kv in resp.kvs() {
        match decode_entry(cluster, kv.key(), kv.value()) {
            Ok(record) => {
                known.insert((record.role, record.id.clone()), record);
            }
            Err(e) => tracing::warn!(error = %e, "ignoring a malformed worker record"),
        }
    }
    Ok((known, revision))
}

/// The watch task's state.
struct Watcher {
    /// Replaced on every resync (see the module doc).
    client: Client,
    config: EtcdConfig,
    cluster: String,
    /// What the receiver has been told.
    known: Known,
    /// Every change up to this revision has been applied to `known`.
    revision: i64,
    tx: mpsc::Sender<MembershipEvent>,
}

/// The receiver is gone: stop.
struct Closed;

impl Watcher {
    async fn run(mut self) {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        loop {
            let reason = match self.follow(&mut backoff).await {
                Ok(reason) => reason,
                Err(Closed) => return,
            };
            tracing::warn!(%reason, "etcd membership watch broke; resynchronising");
            loop {
                tokio::time::sleep(backoff.next_delay()).await;
                match self.resync().await {
                    Ok(()) => break,
                    Err(ResyncError::Closed) => return,
                    Err(ResyncError::Etcd(e)) => {
                        tracing::warn!(error = %e, "etcd membership resync failed; retrying");
                    }
                }
            }
        }
    }

    /// Watches from `revision + 1` until the stream breaks; returns why.
    async fn follow(&mut self, backoff: &mut Backoff) -> Result<String, Closed> {
        let options = WatchOptions::new()
            .with_prefix()
            .with_prev_key()
            .with_start_revision(self.revision + 1);
        let opened = call(
            &self.config,
            "opening the membership watch",
            self.client
                .watch(workers_prefix(&self.cluster), Some(options)),
        )
        .await;
        // `_watcher` holds the request side open for as long as we read.
        let (_watcher, mut stream) = match opened {
            Ok(pair) => pair,
            Err(e) => return Ok(e.to_string()),
        };
        loop {
            let message = tokio::select! {
                () = self.tx.closed() => return Err(Closed),
                message = stream.message() => message,
            };
            let resp = match message {
                Ok(Some(resp)) => resp,
                Ok(None) => return Ok("etcd closed the watch stream".to_string()),
                Err(e) => return Ok(format!("watch stream error: {e}")),
            };
            if resp.compact_revision() > 0 {
                return Ok(format!(
                    "history compacted past revision {}",
                    resp.compact_revision()
                ));
            }
            if resp.canceled() {
                return Ok(format!("watch canceled: {}", resp.cancel_reason()));
            }
            backoff.reset();
            for event in resp.events() {
                let Some(kv) = event.kv() else { continue };
                let change = match event.event_type() {
                    EventType::Put => match decode_entry(&self.cluster, kv.key(), kv.value()) {
                        Ok(record) => Change::Present(record),
                        Err(e) => {
                            tracing::warn!(error = %e, "a worker record became unreadable");
                            match parse_worker_key(&self.cluster, kv.key()) {
                                Ok((role, id)) => Change::Absent(role, id),
                                Err(_) => continue,
                            }
                        }
                    },
                    EventType::Delete => match parse_worker_key(&self.cluster, kv.key()) {
                        Ok((role, id)) => Change::Absent(role, id),
                        Err(_) => continue,
                    },
                };
                self.apply(change).await?;
                self.revision = self.revision.max(kv.mod_revision());
            }
            if let Some(header) = resp.header() {
                self.revision = self.revision.max(header.revision());
            }
        }
    }

    /// A fresh connection and snapshot; reports the differences.
    async fn resync(&mut self) -> Result<(), ResyncError> {
        if self.tx.is_closed() {
            return Err(ResyncError::Closed);
        }
        let mut client = connect(&self.config).await.map_err(ResyncError::Etcd)?;
        let (fresh, revision) = snapshot(&mut client, &self.config, &self.cluster)
            .await
            .map_err(ResyncError::Etcd)?;
        self.client = client;
        let gone: Vec<_> = self
            .known
            .keys()
            .filter(|k| !fresh.contains_key(k))
            .cloned()
            .collect();
        for (role, id) in gone {
            self.apply(Change::Absent(role, id))
                .await
                .map_err(|Closed| ResyncError::Closed)?;
        }
        for record in fresh.into_values() {
            self.apply(Change::Present(record))
                .await
                .map_err(|Closed| ResyncError::Closed)?;
        }
        self.revision = revision;
        tracing::info!(
            revision,
            workers = self.known.len(),
            "etcd membership resynchronised"
        );
        Ok(())
    }

    /// Updates `known` and tells the receiver if anything changed.
    async fn apply(&mut self, change: Change) -> Result<(), Closed> {
        let event = match change {
            Change::Present(record) => {
                let key = (record.role, record.id.clone());
                if self.known.get(&key) == Some(&record) {
                    return Ok(());
                }
                self.known.insert(key, record.clone());
                MembershipEvent::Up(record)
            }
            Change::Absent(role, id) => {
                if self.known.remove(&(role, id.clone())).is_none() {
                    return Ok(());
                }
                MembershipEvent::Down { role, id }
            }
        };
        self.tx.send(event).await.map_err(|_| Closed)
    }
}

enum Change {
    Present(WorkerRecord),
    Absent(Role, String),
}

enum ResyncError {
    Closed,
    Etcd(DiscoveryError),
}
