//! `tandem.worker.v1.Worker`: what a worker tells the router about itself —
//! identity and KV layout, load, and a live feed of its prefix cache.

use std::pin::Pin;

use futures_util::Stream;
use tandem_engine::serving::{EngineHandle, KvFeed};
use tandem_engine::CacheEvent;
use tandem_proto::worker::v1 as wv1;
use tonic::{Request, Response, Status};

/// Serves `Worker` for one engine.
#[derive(Debug, Clone)]
pub struct WorkerService {
    engine: EngineHandle,
    info: wv1::WorkerInfo,
}

impl WorkerService {
    pub fn new(engine: EngineHandle, info: wv1::WorkerInfo) -> Self {
        Self { engine, info }
    }

    fn registry(&self) -> Result<std::sync::Arc<tandem_engine::lora::LoraRegistry>, Status> {
        let none = || Status::failed_precondition("lora: this worker's engine runs no adapters");
        self.engine.lora().cloned().ok_or_else(none)
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

fn to_proto(seq: u64, e: CacheEvent) -> wv1::KvEvent {
    let kind = match e {
        CacheEvent::Stored { parent, hash } => wv1::kv_event::Kind::Stored(wv1::Stored {
            parent,
            hashes: vec![hash],
        }),
        CacheEvent::Removed { hash } => {
            wv1::kv_event::Kind::Removed(wv1::Removed { hashes: vec![hash] })
        }
    };
    wv1::KvEvent {
        seq,
        kind: Some(kind),
    }
}

/// A feed message as wire events. A snapshot is a `Cleared` followed by its
/// `Stored` events, all numbered with the snapshot's sequence number; live
/// events continue from the next number.
fn feed_to_proto(feed: KvFeed, dump: bool) -> Vec<wv1::KvEvent> {
    match feed {
        KvFeed::Snapshot { seq, events } if dump => {
            let mut out = vec![wv1::KvEvent {
                seq,
                kind: Some(wv1::kv_event::Kind::Cleared(wv1::Cleared {})),
            }];
            out.extend(events.into_iter().map(|e| to_proto(seq, e)));
            out
        }
        KvFeed::Snapshot { .. } => Vec::new(),
        KvFeed::Events(evs) => evs.into_iter().map(|(s, e)| to_proto(s, e)).collect(),
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<wv1::KvEvent, Status>> + Send>>;

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
        let stream = futures_util::stream::unfold(
            (feed, std::collections::VecDeque::new()),
            move |(mut feed, mut pending)| async move {
                loop {
                    if let Some(ev) = pending.pop_front() {
                        return Some((Ok(ev), (feed, pending)));
                    }
                    let msg = feed.recv().await?;
                    pending.extend(feed_to_proto(msg, dump));
                }
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }
}
