//! The router's view of its workers: who they are, whether they are alive,
//! how loaded, and what they cache.
//!
//! Each worker gets two background tasks: a prober (`Info` until the worker
//! is known, then `Load` every `probe_interval`; a failed probe marks it
//! down at once, so a dead worker stops getting traffic within one interval)
//! and a KV-event follower (a dump, then live events; a broken stream, a
//! sequence number that skips or goes back, or a worker digest of its
//! cached blocks that differs from the index's clears that worker's index
//! entries and resubscribes: a [`Resync`]). A worker whose KV layout or
//! model differs from the cluster's is refused ([`Refusal`]) and logged,
//! never routed to. A worker that leaves is purged from the index at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use tandem_proto::worker::v1 as wv1;
use tandem_proto::worker::v1::worker_client::WorkerClient;
use tandem_security::{ClusterChannel, ClusterCredential};
use tonic::transport::Channel;

use crate::index::KvIndex;

/// Which pool a worker serves: membership's own type, so a record's role
/// needs no conversion on its way to the pool.
pub use tandem_discovery::Role;

/// One worker as the router sees it.
#[derive(Debug)]
pub struct Worker {
    /// Index in the cluster (stable; used by the KV index).
    pub slot: usize,
    pub role: Role,
    /// gRPC `host:port`.
    pub addr: String,
    /// A stable hash of `addr`: the same on every router replica (ties in
    /// routing are broken with it).
    pub identity: u64,
    pub channel: ClusterChannel<Channel>,
    pub info: Mutex<Option<wv1::WorkerInfo>>,
    healthy: AtomicBool,
    /// Why it was refused, if it was.
    refused: Mutex<Option<Refusal>>,
    /// Requests in flight through this router.
    pub active_requests: AtomicUsize,
    /// Blocks of the router's requests in flight (estimate).
    pub inflight_blocks: AtomicUsize,
    /// Blocks in use as the worker last reported, less this router's own
    /// requests in flight then: those are counted live in
    /// `inflight_blocks`, so a report that caught one of them mid-flight
    /// neither counts it twice nor keeps counting it once it has ended.
    pub reported_blocks: AtomicUsize,
    /// What it measured of its own speeds, as it last reported.
    measured: Mutex<Measured>,
    /// Requests routed here since start.
    pub routed: AtomicUsize,
    /// Set when the worker leaves; its tasks stop.
    gone: AtomicBool,
    /// Whether a probe has completed (either way).
    probed: AtomicBool,
}

/// A worker's own measurements (moving averages it keeps and reports in
/// every `LoadReport`); `None` where it has not measured yet.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measured {
    /// Seconds to compute one block of prompt.
    pub prefill_seconds_per_block: Option<f64>,
    /// Seconds for one block to come back from its disk tier.
    pub disk_seconds_per_block: Option<f64>,
    /// Seconds per block its remote prefills from each peer took.
    pub fetch_seconds_per_block: HashMap<String, f64>,
}

impl Measured {
    fn from_report(r: &wv1::LoadReport) -> Self {
        let known = |x: f64| (x > 0.0 && x.is_finite()).then_some(x);
        Self {
            prefill_seconds_per_block: known(r.prefill_seconds_per_block),
            disk_seconds_per_block: known(r.disk_seconds_per_block),
            fetch_seconds_per_block: r
                .peer_fetch_costs
                .iter()
                .filter_map(|p| Some((p.peer.clone(), known(p.seconds_per_block)?)))
                .collect(),
        }
    }
}

impl Worker {
    /// What a block read from its disk tier costs against computing it
    /// there, as the worker measured both; `None` until it has.
    pub fn disk_block_cost(&self) -> Option<f64> {
        let m = lock(&self.measured);
        Some(m.disk_seconds_per_block? / m.prefill_seconds_per_block?)
    }

    /// What it last reported of its own speeds.
    pub fn measured(&self) -> Measured {
        lock(&self.measured).clone()
    }

    /// The hash root of LoRA adapter `name` if this worker serves it (as
    /// it last said: at registration, then in every load report).
    pub fn adapter_root(&self, name: &str) -> Option<u64> {
        let info = lock(&self.info);
        let adapters = &info.as_ref()?.adapters;
        adapters
            .iter()
            .find(|a| a.name == name)
            .map(|a| a.hash_root)
    }

    /// Whether LoRA adapter `name` is in its memory now (else it serves it
    /// from disk, or not at all).
    pub fn adapter_resident(&self, name: &str) -> bool {
        let info = lock(&self.info);
        let adapters = info
            .as_ref()
            .map(|i| i.adapters.as_slice())
            .unwrap_or_default();
        adapters.iter().any(|a| a.name == name && a.resident)
    }

    /// Records that it now serves `adapter` (it said so loading it).
    pub fn note_adapter(&self, adapter: wv1::Adapter) {
        if let Some(info) = lock(&self.info).as_mut() {
            info.adapters.retain(|a| a.name != adapter.name);
            info.adapters.push(adapter);
        }
    }

    /// Records that it no longer serves adapter `name`.
    pub fn forget_adapter(&self, name: &str) {
        if let Some(info) = lock(&self.info).as_mut() {
            info.adapters.retain(|a| a.name != name);
        }
    }

    /// The LoRA adapters it serves, as it last said.
    pub fn adapter_names(&self) -> Vec<String> {
        let info = lock(&self.info);
        let adapters = info
            .as_ref()
            .map(|i| i.adapters.as_slice())
            .unwrap_or_default();
        adapters.iter().map(|a| a.name.clone()).collect()
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed) && !self.gone.load(Ordering::Relaxed)
    }

    /// Marks the worker down until the next successful probe.
    pub fn mark_down(&self) {
        self.healthy.store(false, Ordering::Relaxed);
    }

    pub fn refusal(&self) -> Option<Refusal> {
        lock(&self.refused).clone()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A stable hash of a worker's address (FNV-1a): equal on every replica.
fn identity_of(addr: &str) -> u64 {
    addr.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Counts one request against a worker while it lives.
#[derive(Debug)]
pub struct InFlight {
    worker: Arc<Worker>,
    blocks: usize,
}

impl InFlight {
    pub fn new(worker: Arc<Worker>, blocks: usize) -> Self {
        worker.active_requests.fetch_add(1, Ordering::Relaxed);
        worker.inflight_blocks.fetch_add(blocks, Ordering::Relaxed);
        worker.routed.fetch_add(1, Ordering::Relaxed);
        Self { worker, blocks }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.worker.active_requests.fetch_sub(1, Ordering::Relaxed);
        self.worker
            .inflight_blocks
            .fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

/// Why a worker was refused: it differs from the cluster in what every
/// worker must agree on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Refusal {
    #[error("KV layout {theirs:?} differs from the cluster's {cluster:?}")]
    Layout {
        theirs: Box<wv1::KvLayout>,
        cluster: Box<wv1::KvLayout>,
    },
    #[error("model {theirs:?} differs from the cluster's {cluster:?}")]
    Model { theirs: String, cluster: String },
}

/// A worker address the router cannot call.
#[derive(Debug, thiserror::Error)]
#[error("worker {addr}: {source}")]
pub struct BadWorkerAddress {
    pub addr: String,
    #[source]
    pub source: tandem_security::TlsError,
}

/// What every worker of the cluster must agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub layout: wv1::KvLayout,
    pub model: String,
}

/// Why the router dropped a worker's index entries and asked it for a
/// fresh dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resync {
    /// A sequence number was skipped or went back: events were lost or
    /// reordered on the way.
    Gap,
    /// The worker's digest of its cached blocks differs from the router's
    /// digest of the events it applied.
    Digest,
    /// The event stream ended or failed.
    StreamEnded,
}

impl Resync {
    pub const ALL: [Self; 3] = [Self::Gap, Self::Digest, Self::StreamEnded];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Gap => "gap",
            Self::Digest => "digest",
            Self::StreamEnded => "stream_ended",
        }
    }
}

/// All workers, the KV index and the cluster's expected layout.
#[derive(Debug, Default)]
pub struct Cluster {
    workers: RwLock<Vec<Arc<Worker>>>,
    /// Which worker caches which prefix in its KV pool (internally locked) ...
    pub index: KvIndex,
    /// ... and which holds which in its disk tier (`--kv-disk`).
    pub disk_index: KvIndex,
    /// Resyncs by [`Resync`] (in `Resync::ALL` order).
    resyncs: [AtomicU64; 3],
    /// Block hashes applied from event streams (stored and removed).
    events_applied: AtomicU64,
    /// Worker digests that matched the index's.
    digests_matched: AtomicU64,
    /// Set by the first worker that answers `Info` (or by configuration).
    expected: Mutex<Option<Expected>>,
    probe_interval_ms: AtomicUsize,
    /// mTLS to the workers (probes and calls), when the cluster runs TLS.
    tls: Option<tandem_security::LoadedTls>,
    /// Presented on every call to a worker (the worker plane's check).
    credential: ClusterCredential,
}

impl Cluster {
    pub fn new(probe_interval: Duration) -> Arc<Self> {
        Self::with_tls(probe_interval, None, ClusterCredential::default())
    }

    /// A cluster whose workers are called over mTLS with `tls` (plain gRPC
    /// when `None`), presenting `credential`.
    pub fn with_tls(
        probe_interval: Duration,
        tls: Option<tandem_security::LoadedTls>,
        credential: ClusterCredential,
    ) -> Arc<Self> {
        let c = Self {
            tls,
            credential,
            disk_index: KvIndex::with_digest_salt(tandem_block_hash::DISK_TIER_SALT),
            ..Self::default()
        };
        c.probe_interval_ms
            .store(probe_interval.as_millis() as usize, Ordering::Relaxed);
        Arc::new(c)
    }

    /// The block size all workers share, once one is known.
    pub fn block_size(&self) -> Option<usize> {
        lock(&self.expected)
            .as_ref()
            .map(|e| e.layout.block_size as usize)
    }

    /// Workers of `role` that may get traffic.
    pub fn healthy(&self, role: Role) -> Vec<Arc<Worker>> {
        self.all()
            .into_iter()
            .filter(|w| w.role == role && w.is_healthy())
            .collect()
    }

    /// The least-loaded healthy worker of `role` other than `failed`: where
    /// a call goes when its worker failed it (before or while streaming).
    pub fn replacement(&self, role: Role, failed: &str, lora: &str) -> Option<Arc<Worker>> {
        self.healthy(role)
            .into_iter()
            .filter(|w| w.addr != failed && (lora.is_empty() || w.adapter_root(lora).is_some()))
            .min_by_key(|w| w.active_requests.load(Ordering::Relaxed))
    }

    /// Every worker ever added and not removed.
    pub fn all(&self) -> Vec<Arc<Worker>> {
        self.workers
            .read()
            .map(|w| w.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    /// The workers in the membership now: [`Self::all`] without those
    /// that left. A worker that leaves and comes back at the same address
    /// is a new entry, so `all` can hold an address twice; this cannot.
    pub fn present(&self) -> Vec<Arc<Worker>> {
        let mut all = self.all();
        all.retain(|w| !w.gone.load(Ordering::Relaxed));
        all
    }

    /// Adds a worker at `addr` and starts watching it. Adding a known
    /// address again does nothing.
    pub fn add(self: &Arc<Self>, role: Role, addr: &str) -> Result<(), BadWorkerAddress> {
        let mut workers = self.workers.write().unwrap_or_else(|e| e.into_inner());
        if workers
            .iter()
            .any(|w| w.addr == addr && !w.gone.load(Ordering::Relaxed))
        {
            return Ok(());
        }
        let channel = tandem_security::tls::endpoint(self.tls.as_ref(), addr)
            .map_err(|source| BadWorkerAddress {
                addr: addr.to_string(),
                source,
            })?
            .connect_lazy();
        let channel = self.credential.channel(channel);
        let w = Arc::new(Worker {
            slot: workers.len(),
            role,
            addr: addr.to_string(),
            identity: identity_of(addr),
            channel,
            info: Mutex::new(None),
            healthy: AtomicBool::new(false),
            refused: Mutex::new(None),
            active_requests: AtomicUsize::new(0),
            inflight_blocks: AtomicUsize::new(0),
            reported_blocks: AtomicUsize::new(0),
            measured: Mutex::default(),
            routed: AtomicUsize::new(0),
            gone: AtomicBool::new(false),
            probed: AtomicBool::new(false),
        });
        workers.push(w.clone());
        drop(workers);
        tokio::spawn(probe(self.clone(), w.clone()));
        tokio::spawn(follow_kv_events(self.clone(), w));
        Ok(())
    }

    /// Waits (at most `timeout`) until every worker has been probed once, so
    /// a router that has just started does not refuse its first requests.
    pub async fn wait_probed(&self, timeout: std::time::Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        while tokio::time::Instant::now() < deadline {
            if self.all().iter().all(|w| w.probed.load(Ordering::Relaxed)) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Stops routing to the worker at `addr` (it left the membership) and
    /// purges its index entries; events its feed still delivers are
    /// ignored.
    pub fn remove(&self, addr: &str) {
        for w in self.all() {
            if w.addr == addr {
                w.gone.store(true, Ordering::Relaxed);
                self.index.retire(w.slot);
                self.disk_index.retire(w.slot);
            }
        }
    }

    /// Resyncs so far for `reason`.
    pub fn resyncs(&self, reason: Resync) -> u64 {
        self.resyncs[reason as usize].load(Ordering::Relaxed)
    }

    /// Worker digests that matched the index's so far.
    pub fn digests_matched(&self) -> u64 {
        self.digests_matched.load(Ordering::Relaxed)
    }

    /// Block hashes applied from every worker's event stream so far.
    pub fn events_applied(&self) -> u64 {
        self.events_applied.load(Ordering::Relaxed)
    }

    /// Checks a worker's info against the cluster's; the first one sets it.
    fn admit(&self, info: &wv1::WorkerInfo) -> Result<(), Refusal> {
        let layout = info.layout.clone().unwrap_or_default();
        let mut expected = lock(&self.expected);
        match &*expected {
            None => {
                *expected = Some(Expected {
                    layout,
                    model: info.model.clone(),
                });
                Ok(())
            }
            Some(e) if e.layout != layout => Err(Refusal::Layout {
                theirs: Box::new(layout),
                cluster: Box::new(e.layout.clone()),
            }),
            Some(e) if e.model != info.model => Err(Refusal::Model {
                theirs: info.model.clone(),
                cluster: e.model.clone(),
            }),
            Some(_) => Ok(()),
        }
    }

    /// The index of one tier.
    fn tier(&self, tier: wv1::Tier) -> &KvIndex {
        match tier {
            wv1::Tier::Pool => &self.index,
            wv1::Tier::Disk => &self.disk_index,
        }
    }

    fn interval(&self) -> Duration {
        Duration::from_millis(self.probe_interval_ms.load(Ordering::Relaxed).max(10) as u64)
    }
}

/// A probe unanswered this long marks the worker down. A live worker
/// answers `Load` and `Info` from counters, off its engine thread, in
/// microseconds; a stopped or partitioned one never answers, and without
/// the bound its last "healthy" stood for good.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// A probe's request, carrying [`PROBE_TIMEOUT`] as its deadline: sent as
/// `grpc-timeout` and enforced by tonic's channel on this side, so an
/// unanswered probe fails instead of waiting.
fn probe_request<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(PROBE_TIMEOUT);
    request
}

async fn probe(cluster: Arc<Cluster>, w: Arc<Worker>) {
    let mut client = WorkerClient::new(w.channel.clone());
    let mut first = true;
    while !w.gone.load(Ordering::Relaxed) {
        let known = lock(&w.info).is_some();
        let ok = if known {
            match client.load(probe_request(wv1::LoadRequest {})).await {
                Ok(r) => {
                    let mut r = r.into_inner();
                    if let Some(info) = lock(&w.info).as_mut() {
                        info.adapters = std::mem::take(&mut r.adapters);
                    }
                    let used = r.num_blocks.saturating_sub(r.free_blocks) as usize;
                    let own = w.inflight_blocks.load(Ordering::Relaxed);
                    w.reported_blocks
                        .store(used.saturating_sub(own), Ordering::Relaxed);
                    *lock(&w.measured) = Measured::from_report(&r);
                    true
                }
                Err(_) => false,
            }
        } else {
            match client.info(probe_request(wv1::InfoRequest {})).await {
                Ok(r) => {
                    let info = r.into_inner();
                    match cluster.admit(&info) {
                        Ok(()) => {
                            *lock(&w.info) = Some(info);
                            *lock(&w.refused) = None;
                            true
                        }
                        Err(e) => {
                            let first = lock(&w.refused).replace(e.clone()).is_none();
                            if first {
                                tracing::error!(worker = %w.addr, error = %e, "worker refused");
                            }
                            false
                        }
                    }
                }
                Err(_) => false,
            }
        };
        let was = w.healthy.swap(ok, Ordering::Relaxed);
        w.probed.store(true, Ordering::Relaxed);
        if was != ok {
            tracing::info!(worker = %w.addr, healthy = ok, "worker state");
        }
        // Workers added together (a static list, an etcd snapshot) would
        // be probed together every interval: a burst of hundreds of calls
        // that shows in the p99 of requests routed meanwhile. After the
        // first probe each worker shifts by its own share of an interval.
        let mut pause = cluster.interval();
        if std::mem::take(&mut first) {
            pause += pause.mul_f64((w.identity % 1000) as f64 / 1000.0);
        }
        tokio::time::sleep(pause).await;
    }
}

/// Follows one worker's KV events into the index until it leaves: a dump,
/// then live events; after any [`Resync`] the worker's entries are dropped
/// and the feed is opened again (with a fresh dump).
async fn follow_kv_events(cluster: Arc<Cluster>, w: Arc<Worker>) {
    let mut client = WorkerClient::new(w.channel.clone());
    while !w.gone.load(Ordering::Relaxed) {
        if w.refusal().is_some() || lock(&w.info).is_none() {
            tokio::time::sleep(cluster.interval()).await;
            continue;
        }
        let reason = match client.kv_events(wv1::KvEventsRequest { dump: true }).await {
            Ok(stream) => apply_feed(&cluster, &w, stream.into_inner()).await,
            Err(_) => Resync::StreamEnded,
        };
        if w.gone.load(Ordering::Relaxed) {
            break;
        }
        if reason != Resync::StreamEnded {
            tracing::warn!(worker = %w.addr, reason = reason.label(), "KV index resync");
        }
        cluster.resyncs[reason as usize].fetch_add(1, Ordering::Relaxed);
        cluster.index.clear(w.slot);
        cluster.disk_index.clear(w.slot);
        // A digest or gap resync asks for the dump at once: the worker is
        // up, only its feed was wrong.
        if reason == Resync::StreamEnded {
            tokio::time::sleep(cluster.interval()).await;
        }
    }
}

/// Applies one subscription's events until it ends or must be resynced.
async fn apply_feed(
    cluster: &Cluster,
    w: &Worker,
    mut stream: tonic::Streaming<wv1::KvEvent>,
) -> Resync {
    let mut last: Option<u64> = None;
    // Whether the index holds the worker's pool set as certified closed
    // (`KvIndex::set_prefix_closed`): kept through a `Stored` or `Removed`
    // from one closed set to another (a decision in the middle sees a set
    // between the two, and its bisection lands between their matches, as
    // a walk's would); otherwise cleared before the change is applied and
    // set after it from the change's flag.
    let mut certified = false;
    loop {
        let ev = match stream.message().await {
            Ok(Some(ev)) => ev,
            _ => return Resync::StreamEnded,
        };
        if w.gone.load(Ordering::Relaxed) {
            return Resync::StreamEnded;
        }
        use wv1::kv_event::Kind;
        let changes = matches!(
            ev.kind,
            Some(Kind::Cleared(_) | Kind::Stored(_) | Kind::Removed(_))
        );
        let closed_to_closed =
            ev.pool_closed && matches!(ev.kind, Some(Kind::Stored(_) | Kind::Removed(_)));
        if changes && !closed_to_closed && std::mem::take(&mut certified) {
            cluster.index.set_prefix_closed(w.slot, false);
        }
        match ev.kind {
            Some(Kind::Cleared(_)) => {
                cluster.index.clear(w.slot);
                cluster.disk_index.clear(w.slot);
            }
            // A digest and a dump's events carry the number of the event
            // they follow; anything else must be the next number.
            Some(Kind::Digest(d)) => {
                if last != Some(ev.seq) {
                    return Resync::Gap;
                }
                let theirs = tandem_block_hash::SetDigest {
                    blocks: d.blocks,
                    xor: d.xor,
                };
                let ours = cluster
                    .index
                    .digest_of(w.slot)
                    .combined(cluster.disk_index.digest_of(w.slot));
                if ours != theirs {
                    return Resync::Digest;
                }
                cluster.digests_matched.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            // A live event carries one change per hash and the number of
            // its last; a dump's events repeat the dump's number.
            Some(Kind::Stored(wv1::Stored { ref hashes, .. }))
            | Some(Kind::Removed(wv1::Removed { ref hashes, .. }))
                if last.is_some_and(|l| ev.seq != l + hashes.len() as u64 && ev.seq != l) =>
            {
                return Resync::Gap
            }
            Some(Kind::Stored(s)) => {
                cluster.tier(s.tier()).stored(w.slot, &s.hashes);
                cluster
                    .events_applied
                    .fetch_add(s.hashes.len() as u64, Ordering::Relaxed);
            }
            Some(Kind::Removed(r)) => {
                cluster.tier(r.tier()).removed(w.slot, &r.hashes);
                cluster
                    .events_applied
                    .fetch_add(r.hashes.len() as u64, Ordering::Relaxed);
            }
            None => {}
        }
        if changes && ev.pool_closed && !certified {
            cluster.index.set_prefix_closed(w.slot, true);
            certified = true;
        }
        last = Some(ev.seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker that left and came back at the same address is two entries
    /// of the worker table (slots are never reused); its per-worker metric
    /// series must still appear once, as the exposition format requires.
    #[tokio::test]
    async fn a_rejoined_worker_is_present_once_and_one_series() {
        let cluster = Cluster::new(Duration::from_secs(60));
        cluster.add(Role::Decode, "127.0.0.1:9").expect("add");
        cluster.remove("127.0.0.1:9");
        cluster.add(Role::Decode, "127.0.0.1:9").expect("add again");
        assert_eq!(cluster.all().len(), 2, "the one that left keeps its slot");
        assert_eq!(cluster.present().len(), 1);
        for w in cluster.all() {
            lock(&w.measured)
                .fetch_seconds_per_block
                .insert("127.0.0.1:7".into(), 0.5);
        }
        let registry = tandem_telemetry::Registry::new();
        crate::register_cluster(&registry, cluster);
        let text = registry.render();
        let series = text
            .lines()
            .filter(|l| l.starts_with("tandem_router_peer_fetch_seconds_per_block{"))
            .count();
        assert_eq!(series, 1, "{text}");
    }
}
