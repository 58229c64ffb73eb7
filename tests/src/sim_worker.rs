//! A simulated decode worker: the real `tandem.worker.v1` gRPC services on
//! a loopback port, with no model behind them, so a test or a benchmark can
//! put a real router in front of hundreds of them and measure only the
//! router.
//!
//! It answers `Info` and `Load` like a worker, streams `KvEvents` (a dump,
//! live events, a digest every period) from a block cache it keeps per the
//! prompts it is sent (LRU, `capacity_blocks`), and answers `Generate` with
//! a fixed token stream. [`Fault`] makes its event stream lie on purpose:
//! drop a fraction of events, with or without the sequence numbers showing
//! it.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tandem_block_hash::{BlockHash, PrefixClosure, SetDigest, ROOT};
use tandem_proto::v1;
use tandem_proto::worker::v1 as wv1;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// What a simulated worker looks like.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The model name it reports (the router admits one model).
    pub model: String,
    pub block_size: u32,
    /// Blocks its cache holds before it evicts the least recently used.
    pub capacity_blocks: usize,
    /// Tokens each `Generate` streams back.
    pub output_tokens: u32,
    /// How often its event streams send a digest.
    pub digest_period: Duration,
    /// Whether a `Generate` caches its prompt (off: the cache changes only
    /// through [`SimWorker::cache_tokens`], for tests that hold it still).
    pub cache_on_generate: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            model: "sim".into(),
            block_size: 16,
            capacity_blocks: 1 << 16,
            output_tokens: 4,
            digest_period: Duration::from_millis(200),
            cache_on_generate: true,
        }
    }
}

/// How a worker's event stream misbehaves.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Fault {
    /// Fraction of live events dropped (0 keeps all).
    pub drop_fraction: f64,
    /// Number the events that are sent consecutively, so no gap shows
    /// (only the digest can reveal the loss).
    pub hide_gaps: bool,
}

/// The cache: blocks by hash, and their recency.
#[derive(Debug, Default)]
struct Cache {
    /// Hash → the tick it was last used.
    used: HashMap<BlockHash, u64>,
    /// (tick, hash), oldest first; stale pairs are skipped on eviction.
    order: VecDeque<(u64, BlockHash)>,
    tick: u64,
    seq: u64,
    digest: SetDigest,
    /// Whether every cached block's parent is cached (it evicts a prompt's
    /// tail first, as an engine does, so it stays closed).
    closure: PrefixClosure,
    /// Live followers, sent each event with the digest after it.
    followers: Vec<mpsc::Sender<Sent>>,
    /// xorshift state: which events a fault drops.
    rng: u64,
}

/// One live event on its way to a follower: the digest after it, and
/// what the fault in force when it happened does to it.
#[derive(Debug, Clone)]
struct Sent {
    event: wv1::KvEvent,
    digest: SetDigest,
    dropped: bool,
    hide_gaps: bool,
}

#[derive(Debug)]
struct Shared {
    config: SimConfig,
    cache: Mutex<Cache>,
    fault: Mutex<Fault>,
    /// `Generate` calls answered.
    served: AtomicUsize,
    addr: String,
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// Caches `hashes` (a prompt's chain), evicting beyond capacity, and
    /// tells the followers (the fault in force decides which events they
    /// miss, here, so a test that sets and clears it is not racing them).
    fn cache(&self, hashes: &[BlockHash]) {
        let fault = *lock(&self.fault);
        let mut c = lock(&self.cache);
        c.tick += 1;
        let tick = c.tick;
        let mut fresh = Vec::new();
        for (i, &h) in hashes.iter().enumerate() {
            if c.used.insert(h, tick).is_none() {
                c.digest.insert(h);
                let parent = if i == 0 { ROOT } else { hashes[i - 1] };
                c.closure.insert(h, parent);
                fresh.push(h);
            }
        }
        // The tail first: evicted before its parents.
        for &h in hashes.iter().rev() {
            c.order.push_back((tick, h));
        }
        let after_stored = c.digest;
        let mut evicted = Vec::new();
        while c.used.len() > self.config.capacity_blocks {
            let Some((t, h)) = c.order.pop_front() else {
                break;
            };
            if c.used.get(&h) == Some(&t) {
                c.used.remove(&h);
                c.digest.remove(h);
                c.closure.remove(h);
                evicted.push(h);
            }
        }
        let mut events = Vec::new();
        if !fresh.is_empty() {
            // One change per hash (tandem.worker.v1.KvEvent.seq).
            c.seq += fresh.len() as u64;
            let ev = wv1::KvEvent {
                seq: c.seq,
                kind: Some(wv1::kv_event::Kind::Stored(wv1::Stored {
                    parent: 0,
                    hashes: fresh,
                    tier: wv1::Tier::Pool.into(),
                })),
                pool_closed: false,
            };
            events.push((ev, after_stored));
        }
        if !evicted.is_empty() {
            c.seq += evicted.len() as u64;
            let ev = wv1::KvEvent {
                seq: c.seq,
                kind: Some(wv1::kv_event::Kind::Removed(wv1::Removed {
                    hashes: evicted,
                    tier: wv1::Tier::Pool.into(),
                })),
                pool_closed: false,
            };
            events.push((ev, c.digest));
        }
        if let Some((last, _)) = events.last_mut() {
            last.pool_closed = c.closure.is_closed();
        }
        let mut sent = Vec::with_capacity(events.len());
        for (event, digest) in events {
            if c.rng == 0 {
                c.rng = 0x9e37_79b9_7f4a_7c15;
            }
            let roll = (xorshift(&mut c.rng) >> 11) as f64 / (1u64 << 53) as f64;
            sent.push(Sent {
                event,
                digest,
                dropped: roll < fault.drop_fraction,
                hide_gaps: fault.hide_gaps,
            });
        }
        c.followers
            .retain(|f| sent.iter().all(|e| f.try_send(e.clone()).is_ok()));
    }
}

/// A running simulated worker; it stops when dropped.
#[derive(Debug)]
pub struct SimWorker {
    shared: Arc<Shared>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl SimWorker {
    /// Starts one on a free loopback port (within a tokio runtime).
    pub async fn start(config: SimConfig) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?.to_string();
        let shared = Arc::new(Shared {
            config,
            cache: Mutex::default(),
            fault: Mutex::default(),
            served: AtomicUsize::new(0),
            addr,
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let incoming = tokio_stream::StreamExt::map(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            |s| {
                // Small writes must not wait on Nagle (see tandem_server).
                s.inspect(|s| {
                    let _ = s.set_nodelay(true);
                })
            },
        );
        let server = tonic::transport::Server::builder()
            .add_service(wv1::worker_server::WorkerServer::new(Service(
                shared.clone(),
            )))
            .add_service(wv1::decode_server::DecodeServer::new(Service(
                shared.clone(),
            )))
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            });
        tokio::spawn(server);
        Ok(Self {
            shared,
            _stop: stop,
        })
    }

    /// Its gRPC address.
    pub fn addr(&self) -> &str {
        &self.shared.addr
    }

    /// Caches `tokens`' full blocks, as if it had computed them.
    pub fn cache_tokens(&self, tokens: &[u32]) {
        let bs = self.shared.config.block_size as usize;
        self.shared
            .cache(&tandem_block_hash::block_hashes(tokens, bs));
    }

    /// The blocks it caches now.
    pub fn cached(&self) -> Vec<BlockHash> {
        lock(&self.shared.cache).used.keys().copied().collect()
    }

    /// Makes its event streams (live events, not dumps) misbehave.
    pub fn set_fault(&self, fault: Fault) {
        *lock(&self.shared.fault) = fault;
    }

    /// `Generate` calls it answered.
    pub fn served(&self) -> usize {
        self.shared.served.load(Ordering::Relaxed)
    }
}

#[derive(Debug, Clone)]
struct Service(Arc<Shared>);

type Events = Pin<Box<dyn Stream<Item = Result<wv1::KvEvent, Status>> + Send>>;
type Tokens = Pin<Box<dyn Stream<Item = Result<v1::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl wv1::worker_server::Worker for Service {
    async fn info(
        &self,
        _: Request<wv1::InfoRequest>,
    ) -> Result<Response<wv1::WorkerInfo>, Status> {
        let c = &self.0.config;
        Ok(Response::new(wv1::WorkerInfo {
            id: self.0.addr.clone(),
            role: wv1::Role::Decode as i32,
            address: self.0.addr.clone(),
            model: c.model.clone(),
            layout: Some(wv1::KvLayout {
                num_layers: 1,
                num_kv_heads: 1,
                head_dim: 64,
                block_size: c.block_size,
                dtype: "f32".into(),
                ..wv1::KvLayout::default()
            }),
            num_blocks: u32::try_from(c.capacity_blocks).unwrap_or(u32::MAX),
            max_model_len: 1 << 20,
            ..wv1::WorkerInfo::default()
        }))
    }

    async fn load(
        &self,
        _: Request<wv1::LoadRequest>,
    ) -> Result<Response<wv1::LoadReport>, Status> {
        // Its calls end as they start, so nothing holds a block: cached
        // blocks are evictable, hence free, as in an engine's pool.
        let total = u32::try_from(self.0.config.capacity_blocks).unwrap_or(u32::MAX);
        Ok(Response::new(wv1::LoadReport {
            free_blocks: total,
            num_blocks: total,
            ..wv1::LoadReport::default()
        }))
    }

    type KvEventsStream = Events;

    async fn kv_events(
        &self,
        request: Request<wv1::KvEventsRequest>,
    ) -> Result<Response<Events>, Status> {
        let dump = request.into_inner().dump;
        let (tx, mut rx) = mpsc::channel(4096);
        let mut first = Vec::new();
        let (seq, digest) = {
            let mut c = lock(&self.0.cache);
            if dump {
                first.push(wv1::KvEvent {
                    seq: c.seq,
                    kind: Some(wv1::kv_event::Kind::Cleared(wv1::Cleared {})),
                    pool_closed: false,
                });
                first.push(wv1::KvEvent {
                    seq: c.seq,
                    kind: Some(wv1::kv_event::Kind::Stored(wv1::Stored {
                        parent: 0,
                        hashes: c.used.keys().copied().collect(),
                        tier: wv1::Tier::Pool.into(),
                    })),
                    pool_closed: c.closure.is_closed(),
                });
            }
            c.followers.push(tx);
            (c.seq, c.digest)
        };
        let shared = self.0.clone();
        let (out_tx, out_rx) = mpsc::channel::<Result<wv1::KvEvent, Status>>(4096);
        tokio::spawn(async move {
            for ev in first {
                if out_tx.send(Ok(ev)).await.is_err() {
                    return;
                }
            }
            let mut follower = Follower {
                wire_seq: seq,
                digest,
            };
            let mut ticks = tokio::time::interval(shared.config.digest_period);
            loop {
                let ev = tokio::select! {
                    ev = rx.recv() => match ev {
                        Some(sent) => follower.pass(sent),
                        None => return,
                    },
                    _ = ticks.tick() => Some(follower.digest_event()),
                };
                if let Some(ev) = ev {
                    if out_tx.send(Ok(ev)).await.is_err() {
                        return;
                    }
                }
            }
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(out_rx);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn load_adapter(
        &self,
        _: Request<wv1::LoadAdapterRequest>,
    ) -> Result<Response<wv1::Adapter>, Status> {
        Err(Status::failed_precondition(
            "a simulated worker serves no adapters",
        ))
    }

    async fn unload_adapter(
        &self,
        _: Request<wv1::UnloadAdapterRequest>,
    ) -> Result<Response<wv1::UnloadAdapterReply>, Status> {
        Err(Status::failed_precondition(
            "a simulated worker serves no adapters",
        ))
    }
}

/// One event stream's numbering, and what its follower has been told.
struct Follower {
    /// The last sequence number sent.
    wire_seq: u64,
    /// The worker's true digest as of the last event passed.
    digest: SetDigest,
}

impl Follower {
    /// The event as sent (renumbered when gaps are hidden), or `None` when
    /// the fault drops it.
    fn pass(&mut self, sent: Sent) -> Option<wv1::KvEvent> {
        let Sent {
            mut event,
            digest,
            dropped,
            hide_gaps,
        } = sent;
        self.digest = digest;
        if dropped {
            if !hide_gaps {
                self.wire_seq = event.seq;
            }
            return None;
        }
        let changes = match &event.kind {
            Some(wv1::kv_event::Kind::Stored(s)) => s.hashes.len(),
            Some(wv1::kv_event::Kind::Removed(r)) => r.hashes.len(),
            _ => 0,
        } as u64;
        self.wire_seq = if hide_gaps {
            self.wire_seq + changes
        } else {
            event.seq
        };
        event.seq = self.wire_seq;
        Some(event)
    }

    /// The worker's true digest, numbered after the last event sent.
    fn digest_event(&self) -> wv1::KvEvent {
        wv1::KvEvent {
            seq: self.wire_seq,
            kind: Some(wv1::kv_event::Kind::Digest(wv1::Digest {
                blocks: self.digest.blocks,
                xor: self.digest.xor,
            })),
            pool_closed: false,
        }
    }
}

#[tonic::async_trait]
impl wv1::decode_server::Decode for Service {
    type GenerateStream = Tokens;

    async fn generate(
        &self,
        request: Request<wv1::RoutedGenerateRequest>,
    ) -> Result<Response<Tokens>, Status> {
        let routed = request.into_inner();
        let req = routed
            .request
            .ok_or_else(|| Status::invalid_argument("request: missing"))?;
        let Some(v1::generate_request::Prompt::TokenIds(ids)) = req.prompt else {
            return Err(Status::invalid_argument(
                "prompt: a simulated worker takes token ids",
            ));
        };
        let bs = self.0.config.block_size as usize;
        self.0.cache(&tandem_block_hash::block_hashes(&ids.ids, bs));
        self.0.served.fetch_add(1, Ordering::Relaxed);
        let n = self.0.config.output_tokens;
        let id = req.request_id;
        let items = vec![
            Ok(v1::GenerateResponse {
                request_id: id.clone(),
                event: Some(v1::generate_response::Event::Delta(v1::TokenDelta {
                    index: 0,
                    token_ids: (0..n).collect(),
                    ..v1::TokenDelta::default()
                })),
            }),
            Ok(v1::GenerateResponse {
                request_id: id,
                event: Some(v1::generate_response::Event::Finished(v1::Finished {
                    choices: vec![v1::ChoiceSummary {
                        index: 0,
                        finish_reason: v1::FinishReason::Length as i32,
                        completion_tokens: n,
                        ..v1::ChoiceSummary::default()
                    }],
                    usage: Some(v1::Usage {
                        prompt_tokens: u32::try_from(ids.ids.len()).unwrap_or(u32::MAX),
                        completion_tokens: n,
                        ..v1::Usage::default()
                    }),
                    ..v1::Finished::default()
                })),
            }),
        ];
        Ok(Response::new(Box::pin(tokio_stream::iter(items))))
    }
}
