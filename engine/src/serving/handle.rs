//! The engine thread and its handle.
//!
//! One OS thread owns the [`EngineCore`] (the model, the KV cache, every
//! sequence) and loops: take commands, run a step, repeat; it sleeps on the
//! command channel when idle. Clients hold a cloneable [`EngineHandle`]:
//! `submit` validates and tokenizes on the caller's thread, then hands the
//! request over. Each request's events come back on its own unbounded
//! channel, usable from async code (`next().await`) or plain threads
//! (`blocking_next`). Dropping a [`RequestStream`] before its end aborts the
//! request: a client that disconnects stops costing compute and blocks.
//!
//! The admission queue is bounded (`EngineConfig::max_queued_requests`):
//! `submit` counts requests on their way to the engine thread plus those
//! waiting there (published after every batch of commands and every step,
//! before the in-flight count drops, so the count errs high) and refuses
//! with [`EngineError::Overloaded`] once the bound is reached, rather than
//! queueing without end.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::error::{EngineError, Result};
use crate::lora::LoraRegistry;
use crate::tokenizer::Tokenizer;

use super::constrained::Grammars;
use super::core::{EngineCore, EngineStats};
use super::kv_feed::{KvFeed, KvFeedSlots, KvSubscription, TooManyKvSubscribers};
use super::remote::{PrefillGuard, RemotePrefiller};
use super::request::{validate, Limits, PrefillMode, Request, RequestEvent, ValidRequest};

enum Command {
    Add {
        id: u64,
        /// Boxed: the other commands are small.
        req: Box<ValidRequest>,
        sink: UnboundedSender<RequestEvent>,
    },
    Abort(u64),
    WriteKv {
        transfer: u64,
        layer: usize,
        block: u32,
        k: Vec<f32>,
        v: Vec<f32>,
    },
    FinishRemote {
        transfer: u64,
        outcome: std::result::Result<(), super::RemotePrefillError>,
    },
    RemotePromptLogprobs {
        transfer: u64,
        logprobs: Vec<crate::sampling::TokenLogprob>,
    },
    SubscribeKv(tokio::sync::mpsc::Sender<KvFeed>),
    HandOver,
}

#[derive(Debug)]
struct Shared {
    limits: Limits,
    tokenizer: Option<Arc<Tokenizer>>,
    grammars: Option<Arc<Grammars>>,
    lora: Option<Arc<LoraRegistry>>,
    stats: Mutex<EngineStats>,
    next_id: AtomicU64,
    kv_pool_bytes: usize,
    /// The admission queue's bound ...
    max_queued: Option<usize>,
    /// ... `Add` commands sent but not yet handled ...
    in_flight: AtomicUsize,
    /// ... and the engine's waiting requests, as last published.
    waiting: AtomicUsize,
    /// Open prefix-cache feeds, against their limit.
    kv_feed_slots: KvFeedSlots,
    /// The disk tier's counters, read live by [`EngineHandle::stats`].
    disk: Option<tandem_kv_disk::DiskStatsReader>,
    /// Why the engine stopped, once its backend failed for good.
    failure: Mutex<Option<String>>,
    /// Who starts remote prefills (a decode worker's); without one, a
    /// request placed remotely is prefilled here.
    prefiller: Mutex<Option<Arc<dyn RemotePrefiller>>>,
}

/// The retry hint of a refused request: about how long a full queue takes
/// to move (a few steps of admissions), without promising anything.
pub const OVERLOAD_RETRY_AFTER: Duration = Duration::from_secs(1);

/// How many times `max_queued_requests` a resumed request may find queued
/// and still be taken (a migration from a failed or draining worker).
pub const RESUMED_HEADROOM: usize = 2;

/// A cloneable handle to an engine thread. The thread exits when every
/// handle and stream is gone.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    commands: Sender<Command>,
    shared: Arc<Shared>,
    thread: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Add { id, .. } => write!(f, "Add({id})"),
            Self::Abort(id) => write!(f, "Abort({id})"),
            Self::HandOver => write!(f, "HandOver"),
            Self::WriteKv {
                transfer,
                layer,
                block,
                ..
            } => write!(f, "WriteKv({transfer}, layer {layer}, block {block})"),
            Self::FinishRemote { transfer, outcome } => {
                write!(f, "FinishRemote({transfer}, {outcome:?})")
            }
            Self::RemotePromptLogprobs { transfer, logprobs } => {
                write!(
                    f,
                    "RemotePromptLogprobs({transfer}, {} scores)",
                    logprobs.len()
                )
            }
            Self::SubscribeKv(_) => write!(f, "SubscribeKv"),
        }
    }
}

impl EngineHandle {
    /// Starts the engine thread over `core`.
    pub fn spawn(core: EngineCore) -> Result<Self> {
        let shared = Arc::new(Shared {
            limits: core.limits(),
            tokenizer: core.tokenizer().cloned(),
            grammars: core.grammars(),
            lora: core.lora().cloned(),
            stats: Mutex::new(core.stats()),
            disk: core.disk_stats_reader(),
            next_id: AtomicU64::new(0),
            kv_pool_bytes: core.kv_pool_bytes(),
            max_queued: core.max_queued_requests(),
            in_flight: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            kv_feed_slots: KvFeedSlots::default(),
            failure: Mutex::new(None),
            prefiller: Mutex::new(None),
        });
        let (tx, rx) = mpsc::channel();
        let loop_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("tandem-engine".into())
            .spawn(move || run(core, rx, &loop_shared))
            .map_err(|e| EngineError::InvalidRequest(format!("cannot start engine thread: {e}")))?;
        Ok(Self {
            commands: tx,
            shared,
            thread: Arc::new(Mutex::new(Some(thread))),
        })
    }

    /// What requests must fit.
    pub fn limits(&self) -> Limits {
        self.shared.limits
    }

    /// The model's tokenizer, if any.
    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.shared.tokenizer.as_ref()
    }

    /// The engine's LoRA adapters (`None`: its backend runs none).
    pub fn lora(&self) -> Option<&Arc<LoraRegistry>> {
        self.shared.lora.as_ref()
    }

    /// Bytes of the KV pool.
    pub fn kv_pool_bytes(&self) -> usize {
        self.shared.kv_pool_bytes
    }

    /// The engine's counters as of its last step.
    pub fn stats(&self) -> EngineStats {
        let mut s = self
            .shared
            .stats
            .lock()
            .map_or_else(|e| e.into_inner().clone(), |s| s.clone());
        // The disk tier's counters move between steps (its threads write
        // and load): read them now, not as of the last step.
        if let (Some(d), Some(reader)) = (s.disk.as_mut(), &self.shared.disk) {
            d.tier = reader.stats();
        }
        s
    }

    /// Why the engine stopped, once its backend failed for good (a lost
    /// tensor-parallel rank, a dead device): every request has failed and
    /// new ones are refused. A server should then leave the cluster.
    pub fn failure(&self) -> Option<String> {
        self.shared.failure.lock().ok().and_then(|f| f.clone())
    }

    /// Validates a request and queues it. Errors name the field at fault;
    /// a full queue is [`EngineError::Overloaded`] (resumed requests get
    /// [`RESUMED_HEADROOM`] times the room).
    pub fn submit(&self, mut req: Request) -> Result<RequestStream> {
        if let Some(why) = self.failure() {
            return Err(EngineError::Stopped(why));
        }
        // Compiles the response format here, on the caller's thread.
        let remote = self.remote_call(&mut req);
        let valid = validate(
            req,
            self.shared.tokenizer.as_deref(),
            self.shared.grammars.as_deref(),
            self.shared.lora.as_deref(),
            &self.shared.limits,
        )?;
        let queued = self.shared.in_flight.fetch_add(1, Ordering::AcqRel)
            + self.shared.waiting.load(Ordering::Acquire);
        // A resumed request (its worker failed or handed it over while
        // draining) was admitted by the cluster already: refusing it would
        // fail a request a client is being served, where the limit is for
        // new work. It may queue up to `RESUMED_HEADROOM` times the limit.
        let limit = self.shared.max_queued.map(|l| match valid.resume {
            Some(_) => l.saturating_mul(RESUMED_HEADROOM),
            None => l,
        });
        if let Some(limit) = limit.filter(|&l| queued >= l) {
            self.shared.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(EngineError::Overloaded {
                queued,
                limit,
                retry_after: OVERLOAD_RETRY_AFTER,
            });
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (sink, events) = unbounded_channel();
        if self
            .commands
            .send(Command::Add {
                id,
                req: Box::new(valid),
                sink,
            })
            .is_err()
        {
            self.shared.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(EngineError::InvalidRequest("the engine has stopped".into()));
        }
        Ok(RequestStream {
            id,
            events,
            commands: self.commands.clone(),
            done: false,
            remote,
        })
    }

    /// Hands one received block of one layer to remote prefill `transfer`
    /// (applied in order with everything else sent to the engine).
    pub fn write_kv(&self, transfer: u64, layer: usize, block: u32, k: Vec<f32>, v: Vec<f32>) {
        let _ = self.commands.send(Command::WriteKv {
            transfer,
            layer,
            block,
            k,
            v,
        });
    }

    /// Starts every later request placed on another worker
    /// ([`PrefillMode::Remote`]) through `prefiller`. Without one such
    /// requests are prefilled here.
    pub fn set_remote_prefiller(&self, prefiller: Arc<dyn RemotePrefiller>) {
        if let Ok(mut p) = self.shared.prefiller.lock() {
            *p = Some(prefiller);
        }
    }

    /// The prefill call of a request placed remotely, when this engine has
    /// a prefiller; otherwise the request is made local.
    fn remote_call(&self, req: &mut Request) -> Option<RemoteCall> {
        let PrefillMode::Remote(placement) = &req.prefill else {
            return None;
        };
        let prefiller = self.shared.prefiller.lock().ok().and_then(|p| p.clone());
        let Some(prefiller) = prefiller else {
            tracing::debug!(worker = %placement.worker, "no remote prefiller: prefilling here");
            req.prefill = PrefillMode::Local;
            return None;
        };
        Some(RemoteCall {
            prefiller,
            engine: self.clone(),
            request_id: req.request_id.clone(),
            worker: placement.worker.clone(),
            span: req.span.clone(),
            guards: Vec::new(),
        })
    }

    /// Ends remote prefill `transfer` (after all its `write_kv` calls).
    pub fn finish_remote_prefill(
        &self,
        transfer: u64,
        outcome: std::result::Result<(), super::RemotePrefillError>,
    ) {
        let _ = self
            .commands
            .send(Command::FinishRemote { transfer, outcome });
    }

    /// A prefill worker's prompt scores for remote prefill `transfer` (a
    /// request with `prompt_logprobs`), before it is finished.
    pub fn remote_prompt_logprobs(
        &self,
        transfer: u64,
        logprobs: Vec<crate::sampling::TokenLogprob>,
    ) {
        let _ = self
            .commands
            .send(Command::RemotePromptLogprobs { transfer, logprobs });
    }

    /// Ends every request being generated with a
    /// [`FailureScope::HandedOver`](super::FailureScope::HandedOver)
    /// failure, keeping their computed blocks in the prefix cache: a
    /// draining worker's requests go on elsewhere (the router resumes them
    /// and the new worker pulls their KV from here). Prefill-only exports
    /// run on, so such pulls are served.
    pub fn hand_over(&self) {
        let _ = self.commands.send(Command::HandOver);
    }

    /// Follows the prefix cache: a snapshot first, then numbered changes;
    /// refused past [`MAX_KV_SUBSCRIBERS`](super::MAX_KV_SUBSCRIBERS) at
    /// once (see `kv_feed`).
    pub fn kv_events(&self) -> std::result::Result<KvSubscription, TooManyKvSubscribers> {
        let (tx, subscription) = self.shared.kv_feed_slots.take()?;
        let _ = self.commands.send(Command::SubscribeKv(tx));
        Ok(subscription)
    }

    /// Waits for the engine thread to exit (after every handle but this one
    /// and every stream are dropped).
    pub fn join(self) {
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        drop(self.commands);
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// One request's events. Dropping it before the end aborts the request
/// (and cancels its remote prefill).
#[derive(Debug)]
pub struct RequestStream {
    id: u64,
    events: UnboundedReceiver<RequestEvent>,
    commands: Sender<Command>,
    done: bool,
    /// A request placed on another worker, with a prefiller to ask it.
    remote: Option<RemoteCall>,
}

/// What a remotely placed request's stream needs to start its prefill.
#[derive(Debug)]
struct RemoteCall {
    prefiller: Arc<dyn RemotePrefiller>,
    engine: EngineHandle,
    request_id: String,
    worker: String,
    span: tracing::Span,
    /// The prefills started (one; again after a preemption).
    guards: Vec<PrefillGuard>,
}

impl RequestStream {
    /// The event to hand out, or `None` when it was consumed here (a
    /// remote prefill, started through the prefiller).
    fn note(&mut self, ev: Option<RequestEvent>) -> Option<Option<RequestEvent>> {
        let ev = match (ev, self.remote.as_mut()) {
            (Some(RequestEvent::RemotePrefill(prefill)), Some(r)) => {
                let guard =
                    r.prefiller
                        .start(&r.request_id, &r.worker, prefill, r.engine.clone(), &r.span);
                r.guards.push(guard);
                return None;
            }
            (ev, _) => ev,
        };
        match &ev {
            None | Some(RequestEvent::Error(_)) => self.done = true,
            Some(RequestEvent::Finished(_)) => {
                self.done = true;
                if let Some(r) = self.remote.as_mut() {
                    r.guards.drain(..).for_each(PrefillGuard::detach);
                }
            }
            _ => {}
        }
        Some(ev)
    }

    /// The next event; `None` after the last.
    pub async fn next(&mut self) -> Option<RequestEvent> {
        while !self.done {
            let ev = self.events.recv().await;
            if let Some(ev) = self.note(ev) {
                return ev;
            }
        }
        None
    }

    /// The next event, blocking this thread (not for async contexts).
    pub fn blocking_next(&mut self) -> Option<RequestEvent> {
        while !self.done {
            let ev = self.events.blocking_recv();
            if let Some(ev) = self.note(ev) {
                return ev;
            }
        }
        None
    }

    /// Cancels the request now.
    pub fn abort(&mut self) {
        if !self.done {
            let _ = self.commands.send(Command::Abort(self.id));
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        self.abort();
    }
}

/// Applies one command; returns whether it added a request.
fn handle(core: &mut EngineCore, cmd: Command) -> bool {
    let added = matches!(cmd, Command::Add { .. });
    match cmd {
        Command::Add { id, req, sink } => core.add_valid(id, *req, sink),
        Command::Abort(id) => core.abort(id),
        Command::WriteKv {
            transfer,
            layer,
            block,
            k,
            v,
        } => {
            if let Err(e) = core.write_kv(transfer, layer, block, &k, &v) {
                tracing::warn!(transfer, layer, block, error = %e, "dropped a KV block");
            }
        }
        Command::FinishRemote { transfer, outcome } => {
            core.finish_remote_prefill(transfer, outcome)
        }
        Command::RemotePromptLogprobs { transfer, logprobs } => {
            core.remote_prompt_logprobs(transfer, logprobs)
        }
        Command::SubscribeKv(sink) => core.subscribe_kv_events(sink),
        Command::HandOver => core.hand_over(),
    }
    added
}

/// Publishes the waiting count, then retires the adds it now includes (in
/// that order, so `submit` never undercounts).
fn publish_queue(core: &EngineCore, shared: &Shared, added: usize) {
    shared.waiting.store(core.num_waiting(), Ordering::Release);
    if added > 0 {
        shared.in_flight.fetch_sub(added, Ordering::AcqRel);
    }
}

fn run(mut core: EngineCore, commands: Receiver<Command>, shared: &Shared) {
    loop {
        let mut added = 0;
        if !core.has_work() {
            // Idle: sleep until a command comes or every handle is gone.
            match commands.recv() {
                Ok(cmd) => added += usize::from(handle(&mut core, cmd)),
                Err(_) => return,
            }
        }
        loop {
            match commands.try_recv() {
                Ok(cmd) => added += usize::from(handle(&mut core, cmd)),
                Err(TryRecvError::Empty) => break,
                // Nobody can read the results any more.
                Err(TryRecvError::Disconnected) => return,
            }
        }
        publish_queue(&core, shared, added);
        core.step();
        publish_queue(&core, shared, 0);
        if let Ok(mut s) = shared.stats.lock() {
            *s = core.stats();
        }
        if let Some(why) = core.failure() {
            if let Ok(mut f) = shared.failure.lock() {
                f.get_or_insert_with(|| why.to_string());
            }
        }
    }
}
