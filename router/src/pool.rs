//! The router's view of its workers: who they are, whether they are alive,
//! how loaded, and what they cache.
//!
//! Each worker gets two background tasks: a prober (`Info` until the worker
//! is known, then `Load` every `probe_interval`; a failed probe marks it
//! down at once, so a dead worker stops getting traffic within one interval)
//! and a KV-event follower (a dump, then live events; a broken stream or a
//! gap in sequence numbers clears the worker's index entries and
//! resubscribes). A worker whose KV layout or model differs from the
//! cluster's is refused and logged, never routed to.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use tandem_proto::worker::v1 as wv1;
use tandem_proto::worker::v1::worker_client::WorkerClient;
use tandem_security::{ClusterChannel, ClusterCredential};
use tonic::transport::Channel;

use crate::index::KvIndex;

/// Which pool a worker serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Prefill,
    Decode,
}

/// One worker as the router sees it.
#[derive(Debug)]
pub struct Worker {
    /// Index in the cluster (stable; used by the KV index).
    pub slot: usize,
    pub role: Role,
    /// gRPC `host:port`.
    pub addr: String,
    pub channel: ClusterChannel<Channel>,
    pub info: Mutex<Option<wv1::WorkerInfo>>,
    healthy: AtomicBool,
    /// Why it was refused, if it was.
    refused: Mutex<Option<String>>,
    /// Requests in flight through this router.
    pub active_requests: AtomicUsize,
    /// Blocks of the router's requests in flight (estimate).
    pub inflight_blocks: AtomicUsize,
    /// Blocks in use as the worker last reported.
    pub reported_blocks: AtomicUsize,
    /// Requests routed here since start.
    pub routed: AtomicUsize,
    /// Set when the worker leaves; its tasks stop.
    gone: AtomicBool,
    /// Whether a probe has completed (either way).
    probed: AtomicBool,
}

impl Worker {
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

    pub fn refusal(&self) -> Option<String> {
        lock(&self.refused).clone()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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

/// What every worker of the cluster must agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub layout: wv1::KvLayout,
    pub model: String,
}

/// All workers, the KV index and the cluster's expected layout.
#[derive(Debug, Default)]
pub struct Cluster {
    workers: RwLock<Vec<Arc<Worker>>>,
    pub index: Mutex<KvIndex>,
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

    /// Adds a worker at `addr` and starts watching it. Adding a known
    /// address again does nothing.
    pub fn add(self: &Arc<Self>, role: Role, addr: &str) -> Result<(), String> {
        let mut workers = self.workers.write().map_err(|_| "worker list poisoned")?;
        if workers
            .iter()
            .any(|w| w.addr == addr && !w.gone.load(Ordering::Relaxed))
        {
            return Ok(());
        }
        let channel = tandem_security::tls::endpoint(self.tls.as_ref(), addr)
            .map_err(|e| format!("worker {addr}: {e}"))?
            .connect_lazy();
        let channel = self.credential.channel(channel);
        let w = Arc::new(Worker {
            slot: workers.len(),
            role,
            addr: addr.to_string(),
            channel,
            info: Mutex::new(None),
            healthy: AtomicBool::new(false),
            refused: Mutex::new(None),
            active_requests: AtomicUsize::new(0),
            inflight_blocks: AtomicUsize::new(0),
            reported_blocks: AtomicUsize::new(0),
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

    /// Stops routing to the worker at `addr` (it left the membership).
    pub fn remove(&self, addr: &str) {
        for w in self.all() {
            if w.addr == addr {
                w.gone.store(true, Ordering::Relaxed);
                lock(&self.index).clear(w.slot);
            }
        }
    }

    /// Checks a worker's info against the cluster's; the first one sets it.
    fn admit(&self, info: &wv1::WorkerInfo) -> Result<(), String> {
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
            Some(e) if e.layout != layout => Err(format!(
                "KV layout {layout:?} differs from the cluster's {:?}",
                e.layout
            )),
            Some(e) if e.model != info.model => Err(format!(
                "model {:?} differs from the cluster's {:?}",
                info.model, e.model
            )),
            Some(_) => Ok(()),
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
    while !w.gone.load(Ordering::Relaxed) {
        let known = lock(&w.info).is_some();
        let ok = if known {
            match client.load(probe_request(wv1::LoadRequest {})).await {
                Ok(r) => {
                    let r = r.into_inner();
                    if let Some(info) = lock(&w.info).as_mut() {
                        info.adapters = r.adapters;
                    }
                    let used = r.num_blocks.saturating_sub(r.free_blocks) as usize;
                    w.reported_blocks.store(used, Ordering::Relaxed);
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
        tokio::time::sleep(cluster.interval()).await;
    }
}

async fn follow_kv_events(cluster: Arc<Cluster>, w: Arc<Worker>) {
    let mut client = WorkerClient::new(w.channel.clone());
    while !w.gone.load(Ordering::Relaxed) {
        if w.refusal().is_some() || lock(&w.info).is_none() {
            tokio::time::sleep(cluster.interval()).await;
            continue;
        }
        let stream = client.kv_events(wv1::KvEventsRequest { dump: true }).await;
        if let Ok(stream) = stream {
            let mut stream = stream.into_inner();
            let mut last: Option<u64> = None;
            loop {
                let ev = match stream.message().await {
                    Ok(Some(ev)) => ev,
                    _ => break,
                };
                let mut index = lock(&cluster.index);
                match ev.kind {
                    Some(wv1::kv_event::Kind::Cleared(_)) => {
                        index.clear(w.slot);
                        last = Some(ev.seq);
                        continue;
                    }
                    _ if last.is_some_and(|l| ev.seq > l + 1) => {
                        tracing::warn!(worker = %w.addr, "KV event gap; resubscribing");
                        break;
                    }
                    Some(wv1::kv_event::Kind::Stored(s)) => {
                        for h in s.hashes {
                            index.stored(w.slot, h);
                        }
                    }
                    Some(wv1::kv_event::Kind::Removed(r)) => {
                        for h in r.hashes {
                            index.removed(w.slot, h);
                        }
                    }
                    None => {}
                }
                last = Some(last.map_or(ev.seq, |l| l.max(ev.seq)));
            }
        }
        lock(&cluster.index).clear(w.slot);
        tokio::time::sleep(cluster.interval()).await;
    }
}
