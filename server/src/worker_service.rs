//! `tandem.worker.v1.Worker`: what a worker tells the router about itself —
//! identity and KV layout, load, and a live feed of its prefix cache.

use std::collections::VecDeque;
use std::pin::Pin;
use std::time::Duration;

use futures_util::Stream;
use tandem_block_hash::SetDigest;
use tandem_engine::serving::{EngineHandle, KvFeed, KvSubscription};
use tandem_engine::CacheEvent;
use tandem_proto::worker::v1 as wv1;
use tonic::{Request, Response, Status};

/// How often a KV-event feed (with a dump) sends the digest of the cached
/// set, when it changed: the longest a follower's index stays wrong after
/// a lost event no sequence number reveals. 24 bytes a second per router.
pub const KV_DIGEST_PERIOD: Duration = Duration::from_secs(1);

/// Serves `Worker` for one engine.
#[derive(Debug, Clone)]
pub struct WorkerService {
    engine: EngineHandle,
    info: wv1::WorkerInfo,
    digest_period: Duration,
    feeds_end: Option<FeedsEnd>,
    peer_costs: Option<crate::PeerFetchCosts>,
}

/// Ends a worker's KV-event feeds once its shutdown begins. A feed never
/// ends on its own (a router follows it for as long as the worker lives),
/// and a graceful shutdown waits for every open stream: without this a
/// worker that a router follows never finished draining after SIGTERM.
#[derive(Debug, Clone)]
pub struct FeedsEnd(tokio::sync::watch::Receiver<bool>);

impl FeedsEnd {
    /// Waits until the shutdown began (or its future was dropped).
    async fn wait(mut self) {
        let _ = self.0.wait_for(|&ended| ended).await;
    }
}

/// `shutdown`, which on completing also ends the feeds of every
/// [`WorkerService`] given the returned [`FeedsEnd`].
pub fn shutdown_ending_feeds(
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> (impl std::future::Future<Output = ()> + Send, FeedsEnd) {
    let (tx, rx) = tokio::sync::watch::channel(false);
    let fire = async move {
        shutdown.await;
        let _ = tx.send(true);
    };
    (fire, FeedsEnd(rx))
}

impl WorkerService {
    pub fn new(engine: EngineHandle, info: wv1::WorkerInfo) -> Self {
        Self {
            engine,
            info,
            digest_period: KV_DIGEST_PERIOD,
            feeds_end: None,
            peer_costs: None,
        }
    }

    /// Reports what fetching from each peer has cost (a decode worker's
    /// remote prefills) in every load report.
    pub fn with_peer_costs(mut self, costs: crate::PeerFetchCosts) -> Self {
        self.peer_costs = Some(costs);
        self
    }

    /// Ends this service's KV-event feeds when `end` fires.
    pub fn with_feeds_end(mut self, end: FeedsEnd) -> Self {
        self.feeds_end = Some(end);
        self
    }

    /// Sends feeds' digests every `period` instead of [`KV_DIGEST_PERIOD`].
    pub fn with_digest_period(mut self, period: Duration) -> Self {
        self.digest_period = period.max(Duration::from_millis(10));
        self
    }

    fn registry(&self) -> Result<std::sync::Arc<tandem_engine::lora::LoraRegistry>, Status> {
        let none = || Status::failed_precondition("lora: this worker's engine runs no adapters");
        self.engine.lora().cloned().ok_or_else(none)
    }
}

/// Who a worker is, as its `Worker.Info` tells the router.
#[derive(Debug, Clone)]
pub struct WorkerIdentity {
    pub id: String,
    pub role: wv1::Role,
    /// The model it serves, by name.
    pub model: String,
    /// Where peers reach its gRPC server ([`crate::advertised_addr`]).
    pub address: String,
    /// Where it receives KV blocks (decode workers; empty otherwise).
    pub transfer_endpoint: String,
}

impl WorkerIdentity {
    /// Its `WorkerInfo`: the identity, the KV layout, and the engine's
    /// limits and adapters now.
    pub fn info(
        self,
        engine: &EngineHandle,
        layout: &tandem_kv_transfer::KvLayoutDescriptor,
    ) -> wv1::WorkerInfo {
        let limits = engine.limits();
        wv1::WorkerInfo {
            id: self.id,
            role: self.role as i32,
            address: self.address,
            model: self.model,
            layout: Some(crate::layout::to_proto(layout)),
            transfer_endpoint: self.transfer_endpoint,
            num_blocks: u32::try_from(limits.num_blocks).unwrap_or(u32::MAX),
            max_model_len: u32::try_from(limits.max_model_len).unwrap_or(u32::MAX),
            adapters: adapters(engine),
        }
    }
}

/// The LoRA adapters an engine serves now, as the router sees them.
pub fn adapters(engine: &EngineHandle) -> Vec<wv1::Adapter> {
    let Some(reg) = engine.lora() else {
        return Vec::new();
    };
    reg.list()
        .into_iter()
        .map(|a| wv1::Adapter {
            name: a.name,
            hash_root: a.hash_root,
            resident: a.resident,
        })
        .collect()
}

/// Appends change `e`, numbered `seq`, to `out`: into the last wire event
/// when it continues it (a `Stored` whose parent is that event's last hash,
/// a `Removed` after a `Removed`, of the same tier), else as a new one. An
/// event's number is its last change's, and it carries one change per
/// hash, so a follower expects `seq == previous + hashes`.
fn push_change(out: &mut Vec<wv1::KvEvent>, seq: u64, e: CacheEvent) {
    use wv1::kv_event::Kind;
    let (tier, stored) = match e {
        CacheEvent::Stored { parent, hash } => (wv1::Tier::Pool, Some((parent, hash))),
        CacheEvent::DiskStored { parent, hash } => (wv1::Tier::Disk, Some((parent, hash))),
        CacheEvent::Removed { .. } => (wv1::Tier::Pool, None),
        CacheEvent::DiskRemoved { .. } => (wv1::Tier::Disk, None),
    };
    let hash = match e {
        CacheEvent::Stored { hash, .. }
        | CacheEvent::DiskStored { hash, .. }
        | CacheEvent::Removed { hash }
        | CacheEvent::DiskRemoved { hash } => hash,
    };
    if let Some(last) = out.last_mut() {
        let merged = match (&mut last.kind, stored) {
            (Some(Kind::Stored(s)), Some((parent, _)))
                if s.tier() == tier && s.hashes.last() == Some(&parent) =>
            {
                s.hashes.push(hash);
                true
            }
            (Some(Kind::Removed(r)), None) if r.tier() == tier => {
                r.hashes.push(hash);
                true
            }
            _ => false,
        };
        if merged {
            last.seq = seq;
            return;
        }
    }
    let kind = match stored {
        Some((parent, _)) => Kind::Stored(wv1::Stored {
            parent,
            hashes: vec![hash],
            tier: tier.into(),
        }),
        None => Kind::Removed(wv1::Removed {
            hashes: vec![hash],
            tier: tier.into(),
        }),
    };
    out.push(wv1::KvEvent {
        seq,
        kind: Some(kind),
        pool_closed: false,
    });
}

/// A feed message as wire events, runs of changes coalesced. A snapshot is
/// a `Cleared` followed by its `Stored` events, all numbered with the
/// snapshot's sequence number (they are state, not changes); live events
/// continue from the next number. Only the last event says whether the
/// pool's set is closed: it is the message's state, and a follower between
/// two of its events holds a set the engine never had.
fn feed_to_proto(feed: KvFeed, dump: bool) -> Vec<wv1::KvEvent> {
    let (mut out, pool_closed) = match feed {
        KvFeed::Snapshot {
            seq,
            events,
            pool_closed,
            ..
        } if dump => {
            let mut out = vec![wv1::KvEvent {
                seq,
                kind: Some(wv1::kv_event::Kind::Cleared(wv1::Cleared {})),
                pool_closed: false,
            }];
            for e in events {
                push_change(&mut out, seq, e);
            }
            (out, pool_closed)
        }
        KvFeed::Snapshot { .. } => (Vec::new(), false),
        KvFeed::Events {
            events,
            pool_closed,
            ..
        } => {
            let mut out = Vec::new();
            for (seq, e) in events {
                push_change(&mut out, seq, e);
            }
            (out, pool_closed)
        }
    };
    if let Some(last) = out.last_mut() {
        last.pool_closed = pool_closed;
    }
    out
}

type EventStream = Pin<Box<dyn Stream<Item = Result<wv1::KvEvent, Status>> + Send>>;

/// One follower's feed: engine messages turned into wire events, and a
/// digest each period when the set changed since the last one sent.
struct FeedState {
    feed: KvSubscription,
    dump: bool,
    pending: VecDeque<wv1::KvEvent>,
    /// The last message's (sequence number, digest).
    latest: Option<(u64, SetDigest)>,
    sent: Option<(u64, SetDigest)>,
    ticks: tokio::time::Interval,
    /// Fires when the worker shuts down: the feed ends.
    end: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
}

impl FeedState {
    async fn next(&mut self) -> Option<wv1::KvEvent> {
        loop {
            if let Some(ev) = self.pending.pop_front() {
                return Some(ev);
            }
            tokio::select! {
                () = &mut self.end => return None,
                msg = self.feed.recv() => {
                    let msg = msg?;
                    // Without the dump the follower's set is not the
                    // engine's, so a digest would mean nothing to it.
                    if self.dump {
                        self.latest = Some(msg.digest());
                    }
                    self.pending.extend(feed_to_proto(msg, self.dump));
                }
                _ = self.ticks.tick() => {
                    if self.latest != self.sent {
                        self.sent = self.latest;
                        if let Some((seq, d)) = self.latest {
                            return Some(digest_event(seq, d));
                        }
                    }
                }
            }
        }
    }
}

fn digest_event(seq: u64, d: SetDigest) -> wv1::KvEvent {
    wv1::KvEvent {
        seq,
        kind: Some(wv1::kv_event::Kind::Digest(wv1::Digest {
            blocks: d.blocks,
            xor: d.xor,
        })),
        pool_closed: false,
    }
}

#[tonic::async_trait]
impl wv1::worker_server::Worker for WorkerService {
    async fn info(
        &self,
        _: Request<wv1::InfoRequest>,
    ) -> Result<Response<wv1::WorkerInfo>, Status> {
        let mut info = self.info.clone();
        info.adapters = adapters(&self.engine);
        Ok(Response::new(info))
    }

    async fn load(
        &self,
        _: Request<wv1::LoadRequest>,
    ) -> Result<Response<wv1::LoadReport>, Status> {
        let s = self.engine.stats();
        let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
        Ok(Response::new(wv1::LoadReport {
            running: n(s.running),
            waiting: n(s.waiting),
            parked: n(s.parked),
            free_blocks: n(s.free_blocks),
            num_blocks: n(s.num_blocks),
            computed_tokens: s.computed_tokens,
            preemptions: s.preemptions,
            adapters: adapters(&self.engine),
            prefill_seconds_per_block: s.prefill_seconds_per_block,
            disk_seconds_per_block: s.disk.map_or(0.0, |d| d.seconds_per_block),
            peer_fetch_costs: self
                .peer_costs
                .as_ref()
                .map(crate::PeerFetchCosts::to_proto)
                .unwrap_or_default(),
        }))
    }

    async fn load_adapter(
        &self,
        request: Request<wv1::LoadAdapterRequest>,
    ) -> Result<Response<wv1::Adapter>, Status> {
        let r = request.into_inner();
        let reg = self.registry()?;
        // Reading the files takes milliseconds: on the blocking pool.
        let loaded =
            tokio::task::spawn_blocking(move || reg.load(&r.name, std::path::Path::new(&r.path)))
                .await
                .map_err(|e| Status::internal(format!("loading the adapter failed: {e}")))?;
        // Everything but a full registry is the adapter's fault.
        let a = loaded.map_err(|e| match e {
            tandem_engine::EngineError::Overloaded { .. } => crate::status_from_engine(e),
            other => Status::invalid_argument(other.to_string()),
        })?;
        Ok(Response::new(wv1::Adapter {
            name: a.name,
            hash_root: a.hash_root,
            resident: a.resident,
        }))
    }

    async fn unload_adapter(
        &self,
        request: Request<wv1::UnloadAdapterRequest>,
    ) -> Result<Response<wv1::UnloadAdapterReply>, Status> {
        let name = request.into_inner().name;
        self.registry()?
            .unload(&name)
            .map_err(crate::status_from_engine)?;
        Ok(Response::new(wv1::UnloadAdapterReply {}))
    }

    type KvEventsStream = EventStream;

    async fn kv_events(
        &self,
        request: Request<wv1::KvEventsRequest>,
    ) -> Result<Response<Self::KvEventsStream>, Status> {
        let dump = request.into_inner().dump;
        let feed = self
            .engine
            .kv_events()
            .map_err(|e| Status::resource_exhausted(e.to_string()))?;
        let mut ticks = tokio::time::interval(self.digest_period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let state = FeedState {
            feed,
            dump,
            pending: VecDeque::new(),
            latest: None,
            sent: None,
            ticks,
            end: match self.feeds_end.clone() {
                Some(end) => Box::pin(end.wait()),
                None => Box::pin(std::future::pending()),
            },
        };
        let stream = futures_util::stream::unfold(state, |mut st| async move {
            let ev = st.next().await?;
            Some((Ok(ev), st))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_block_hash::SetDigest;

    #[test]
    fn runs_of_changes_become_one_event_numbered_by_its_last() {
        let stored = |parent, hash| CacheEvent::Stored { parent, hash };
        let removed = |hash| CacheEvent::Removed { hash };
        let events = vec![
            (5, stored(0, 1)),
            (6, stored(1, 2)),
            (7, stored(2, 3)),
            (8, stored(0, 9)),
            (9, removed(3)),
            (10, removed(2)),
            (11, stored(1, 4)),
        ];
        let wire = feed_to_proto(
            KvFeed::Events {
                events,
                digest: SetDigest::default(),
                pool_closed: true,
            },
            true,
        );
        // The message's closure rides on its last wire event alone.
        let closed: Vec<bool> = wire.iter().map(|e| e.pool_closed).collect();
        assert_eq!(closed, [false, false, false, true]);
        use wv1::kv_event::Kind;
        let shape: Vec<(u64, usize)> = wire
            .iter()
            .map(|e| match &e.kind {
                Some(Kind::Stored(s)) => (e.seq, s.hashes.len()),
                Some(Kind::Removed(r)) => (e.seq, r.hashes.len()),
                _ => (e.seq, 0),
            })
            .collect();
        // 1-2-3 chain, then 9 starts a new chain, two removals, and 4,
        // whose parent 1 is not the last hash sent.
        assert_eq!(shape, [(7, 3), (8, 1), (10, 2), (11, 1)]);
        // Each event's number is the previous one's plus its hashes.
        for pair in shape.windows(2) {
            assert_eq!(pair[1].0, pair[0].0 + pair[1].1 as u64);
        }
    }

    #[test]
    fn the_tiers_never_share_a_wire_event() {
        let events = vec![
            (1, CacheEvent::Stored { parent: 0, hash: 1 }),
            (2, CacheEvent::DiskStored { parent: 1, hash: 2 }),
            (3, CacheEvent::DiskStored { parent: 2, hash: 3 }),
            (4, CacheEvent::Removed { hash: 1 }),
            (5, CacheEvent::DiskRemoved { hash: 2 }),
            (6, CacheEvent::DiskRemoved { hash: 3 }),
        ];
        let wire = feed_to_proto(
            KvFeed::Events {
                events,
                digest: SetDigest::default(),
                pool_closed: false,
            },
            true,
        );
        assert!(wire.iter().all(|e| !e.pool_closed));
        use wv1::kv_event::Kind;
        let shape: Vec<(u64, bool, wv1::Tier, Vec<u64>)> = wire
            .iter()
            .map(|e| match &e.kind {
                Some(Kind::Stored(s)) => (e.seq, true, s.tier(), s.hashes.clone()),
                Some(Kind::Removed(r)) => (e.seq, false, r.tier(), r.hashes.clone()),
                other => panic!("{other:?}"),
            })
            .collect();
        use wv1::Tier::{Disk, Pool};
        assert_eq!(
            shape,
            [
                (1, true, Pool, vec![1]),
                (3, true, Disk, vec![2, 3]),
                (4, false, Pool, vec![1]),
                (6, false, Disk, vec![2, 3]),
            ]
        );
    }
}
