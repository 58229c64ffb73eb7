//! The transfer state machines both built-in transports share.
//!
//! A transport is a carrier between two halves that do not depend on it:
//!
//! - [`ChannelSession`], the sender's [`Session`]: it validates writes,
//!   queues [`Command`]s on a bounded channel (the back-pressure) and tracks
//!   completions in [`Completions`]. The TCP transport drains the channel
//!   into a socket; the in-process one straight into a receiver task.
//! - [`ReceiverCore`], the receiver: per-transfer state over a [`KvSink`],
//!   which turns decoded writes/finishes/aborts into sink calls and into the
//!   one completion per transfer ([`Done`]) the carrier sends back.
//!
//! Completion protocol: the receiver sends exactly one `Done` per transfer —
//! `Err` as soon as it fails one (a refused block), otherwise `Ok`/`Err`
//! when the sender's finish arrives. The sender always ends a transfer with
//! a finish or an abort, so the receiver can forget a failed transfer only
//! then (late writes to it are skipped, not mistaken for a new transfer).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::{
    BlockWrite, KvLayoutDescriptor, KvSink, Session, TransferCounts, TransferError,
    TransferFailure, TransferId,
};

/// What a session asks its carrier to deliver, in order.
#[derive(Debug)]
pub(crate) enum Command {
    Write {
        transfer: TransferId,
        blocks: Vec<BlockWrite>,
    },
    Finish(TransferId),
    Abort(TransferId),
}

/// The receiver's verdict on one transfer, as the `DONE` frame carries it:
/// a [`TransferFailure`]'s message, since the sender only reports it (as
/// [`TransferError::Failed`]) and another build's variants may differ.
pub(crate) type Done = (TransferId, Result<(), String>);

/// Queued commands per session before `write` waits.
pub(crate) const COMMAND_QUEUE: usize = 64;

/// At most this many transfers may be open on one connection at the
/// receiver; more is a protocol error (it bounds the per-connection state a
/// peer can make us hold).
pub(crate) const MAX_OPEN_TRANSFERS: usize = 1 << 16;

/// One transport's live counts, shared by its sessions and receivers (see
/// [`TransferCounts`]). Each state machine adds the change in its own open
/// set, so the sums return to zero when every transfer has ended.
#[derive(Debug, Default)]
pub(crate) struct TransferCounters {
    receiving: AtomicI64,
    sending: AtomicI64,
    connections_lost: AtomicU64,
}

impl TransferCounters {
    fn add(counter: &AtomicI64, before: usize, after: usize) {
        let delta = after as i64 - before as i64;
        if delta != 0 {
            counter.fetch_add(delta, Ordering::Relaxed);
        }
    }

    /// What [`crate::Transport::counts`] reports.
    pub(crate) fn counts(&self) -> TransferCounts {
        let open = |c: &AtomicI64| u64::try_from(c.load(Ordering::Relaxed)).unwrap_or(0);
        TransferCounts {
            receiving: open(&self.receiving),
            sending: open(&self.sending),
            connections_lost: self.connections_lost.load(Ordering::Relaxed),
        }
    }
}

/// Aborts a task when dropped.
#[derive(Debug)]
pub(crate) struct AbortOnDrop(pub(crate) JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[derive(Debug, Default)]
struct CompletionState {
    /// Set once the connection is gone; every later call fails with it.
    dead: Option<TransferError>,
    /// Transfers written to and not yet finished or aborted.
    open: HashSet<TransferId>,
    /// `finish` calls waiting for their `Done`.
    waiters: HashMap<TransferId, oneshot::Sender<Result<(), TransferError>>>,
    /// Failures the receiver reported before the sender called `finish`.
    early: HashMap<TransferId, String>,
}

/// What `finish` should do next.
pub(crate) enum FinishStart {
    /// Send the finish and wait on this.
    Wait(oneshot::Receiver<Result<(), TransferError>>),
    /// The receiver already failed it: send the finish (so the receiver can
    /// forget it) and return this error.
    Failed(TransferError),
}

/// The sender's view of its transfers' completions, shared by the session
/// and the carrier's task that receives `Done`s.
#[derive(Debug)]
pub(crate) struct Completions {
    state: Mutex<CompletionState>,
    counters: Arc<TransferCounters>,
}

/// The state under its lock; on release, the change in open transfers goes
/// to the transport's counters.
struct Locked<'a> {
    state: MutexGuard<'a, CompletionState>,
    open_before: usize,
    counters: &'a TransferCounters,
}

impl std::ops::Deref for Locked<'_> {
    type Target = CompletionState;
    fn deref(&self) -> &CompletionState {
        &self.state
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut CompletionState {
        &mut self.state
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        TransferCounters::add(
            &self.counters.sending,
            self.open_before,
            self.state.open.len(),
        );
    }
}

impl Drop for Completions {
    fn drop(&mut self) {
        // Whatever is still open is no longer anyone's.
        let mut state = self.lock();
        state.open.clear();
    }
}

impl Completions {
    pub(crate) fn new(counters: Arc<TransferCounters>) -> Self {
        Self {
            state: Mutex::new(CompletionState::default()),
            counters,
        }
    }

    fn lock(&self) -> Locked<'_> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        Locked {
            open_before: state.open.len(),
            state,
            counters: &self.counters,
        }
    }

    /// The error every call gets once the connection is gone.
    pub(crate) fn dead_error(&self) -> TransferError {
        self.lock().dead.clone().unwrap_or_else(|| {
            TransferError::ConnectionLost("the transport's task has stopped".into())
        })
    }

    pub(crate) fn note_write(&self, transfer: TransferId) -> Result<(), TransferError> {
        let mut s = self.lock();
        if let Some(err) = &s.dead {
            return Err(err.clone());
        }
        s.open.insert(transfer);
        Ok(())
    }

    pub(crate) fn start_finish(&self, transfer: TransferId) -> Result<FinishStart, TransferError> {
        let mut s = self.lock();
        if let Some(err) = &s.dead {
            return Err(err.clone());
        }
        if let Some(reason) = s.early.remove(&transfer) {
            s.open.remove(&transfer);
            return Ok(FinishStart::Failed(TransferError::Failed {
                transfer,
                reason,
            }));
        }
        if s.waiters.get(&transfer).is_some_and(|w| !w.is_closed()) {
            return Err(TransferError::AlreadyFinishing(transfer));
        }
        let (tx, rx) = oneshot::channel();
        s.waiters.insert(transfer, tx);
        Ok(FinishStart::Wait(rx))
    }

    /// Forgets a finish that could not be sent.
    pub(crate) fn cancel_finish(&self, transfer: TransferId) {
        self.lock().waiters.remove(&transfer);
    }

    /// The sender aborted `transfer`: a pending `finish` returns `Aborted`.
    pub(crate) fn abort(&self, transfer: TransferId) -> Result<(), TransferError> {
        let mut s = self.lock();
        s.open.remove(&transfer);
        s.early.remove(&transfer);
        if let Some(waiter) = s.waiters.remove(&transfer) {
            let _ = waiter.send(Err(TransferError::Aborted(transfer)));
        }
        match &s.dead {
            Some(err) => Err(err.clone()),
            None => Ok(()),
        }
    }

    /// The receiver's verdict arrived. Returns an error when the peer
    /// reported on a transfer this session never opened (a broken peer).
    pub(crate) fn on_done(&self, (transfer, result): Done) -> Result<(), TransferError> {
        let mut s = self.lock();
        if let Some(waiter) = s.waiters.remove(&transfer) {
            s.open.remove(&transfer);
            let _ =
                waiter.send(result.map_err(|reason| TransferError::Failed { transfer, reason }));
            return Ok(());
        }
        match result {
            Err(reason) if s.open.contains(&transfer) => {
                s.early.insert(transfer, reason);
                Ok(())
            }
            // A transfer aborted meanwhile: its verdict no longer matters.
            _ if !s.open.contains(&transfer) => Ok(()),
            Ok(()) => Err(TransferError::Protocol(format!(
                "the receiver completed transfer {transfer} before it was finished"
            ))),
            Err(_) => Ok(()),
        }
    }

    /// The connection is gone: fail every pending and later call with `err`.
    pub(crate) fn fail_all(&self, err: TransferError) {
        let mut s = self.lock();
        if s.dead.is_none() {
            s.dead = Some(err.clone());
            self.counters
                .connections_lost
                .fetch_add(1, Ordering::Relaxed);
        }
        let err = s.dead.clone().unwrap_or(err);
        for (_, waiter) in s.waiters.drain() {
            let _ = waiter.send(Err(err.clone()));
        }
        s.open.clear();
        s.early.clear();
    }
}

/// The [`Session`] of the built-in transports: validation, a bounded command
/// queue to the carrier, and [`Completions`].
pub(crate) struct ChannelSession {
    pub(crate) endpoint: String,
    pub(crate) layout: KvLayoutDescriptor,
    pub(crate) peer_num_blocks: u32,
    pub(crate) commands: mpsc::Sender<Command>,
    pub(crate) completions: Arc<Completions>,
    /// Tasks that only serve this session (the TCP ack reader).
    pub(crate) _tasks: Vec<AbortOnDrop>,
}

impl ChannelSession {
    /// The session over a connected carrier: `commands` feed its writer
    /// task, `acks` is its ack reader (aborted with the session).
    pub(crate) fn new(
        endpoint: &str,
        layout: KvLayoutDescriptor,
        peer_num_blocks: u32,
        commands: mpsc::Sender<Command>,
        completions: Arc<Completions>,
        acks: JoinHandle<()>,
    ) -> Self {
        Self {
            endpoint: endpoint.to_string(),
            layout,
            peer_num_blocks,
            commands,
            completions,
            _tasks: vec![AbortOnDrop(acks)],
        }
    }
}

impl std::fmt::Debug for ChannelSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("endpoint", &self.endpoint)
            .field("layout", &self.layout)
            .field("peer_num_blocks", &self.peer_num_blocks)
            .finish_non_exhaustive()
    }
}

/// Checks one write against the agreed layout and the receiver's pool.
pub(crate) fn validate_block(
    layout: &KvLayoutDescriptor,
    num_blocks: u32,
    block: &BlockWrite,
) -> Result<(), TransferError> {
    let (bytes, v_bytes) = (layout.block_layer_bytes(), layout.value_bytes());
    if block.layer >= layout.num_layers {
        return Err(TransferError::InvalidBlock(format!(
            "layer {} out of range: the layout has {} layers",
            block.layer, layout.num_layers
        )));
    }
    if block.dst_block >= num_blocks {
        return Err(TransferError::InvalidBlock(format!(
            "destination block {} out of range: the receiver has {num_blocks} blocks",
            block.dst_block
        )));
    }
    if block.k.len() != bytes || block.v.len() != v_bytes {
        return Err(TransferError::InvalidBlock(format!(
            "block {} layer {}: K is {} bytes and V {} bytes; the layout needs {bytes} and \
             {v_bytes}",
            block.dst_block,
            block.layer,
            block.k.len(),
            block.v.len()
        )));
    }
    Ok(())
}

impl ChannelSession {
    async fn send(&self, command: Command) -> Result<(), TransferError> {
        self.commands
            .send(command)
            .await
            .map_err(|_| self.completions.dead_error())
    }
}

#[async_trait]
impl Session for ChannelSession {
    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn layout(&self) -> &KvLayoutDescriptor {
        &self.layout
    }

    fn peer_num_blocks(&self) -> u32 {
        self.peer_num_blocks
    }

    async fn write(
        &self,
        transfer: TransferId,
        blocks: Vec<BlockWrite>,
    ) -> Result<(), TransferError> {
        for block in &blocks {
            validate_block(&self.layout, self.peer_num_blocks, block)?;
        }
        self.completions.note_write(transfer)?;
        if blocks.is_empty() {
            return Ok(());
        }
        self.send(Command::Write { transfer, blocks }).await
    }

    async fn finish(&self, transfer: TransferId) -> Result<(), TransferError> {
        match self.completions.start_finish(transfer)? {
            FinishStart::Failed(err) => {
                // Lets the receiver drop its record of the failed transfer;
                // if the connection is gone meanwhile, the error stands.
                let _ = self.send(Command::Finish(transfer)).await;
                Err(err)
            }
            FinishStart::Wait(done) => {
                if let Err(err) = self.send(Command::Finish(transfer)).await {
                    self.completions.cancel_finish(transfer);
                    return Err(err);
                }
                match done.await {
                    Ok(result) => result,
                    Err(_) => Err(self.completions.dead_error()),
                }
            }
        }
    }

    async fn abort(&self, transfer: TransferId) -> Result<(), TransferError> {
        self.completions.abort(transfer)?;
        self.send(Command::Abort(transfer)).await
    }
}

enum RxState {
    Open,
    /// Failed at the receiver; `finish(Err)` was called and the `Done` sent.
    Failed,
}

/// The receiving state machine of one connection.
///
/// Dropping it (connection closed, listener shut down, task aborted) fails
/// every open transfer, so `KvSink::finish` runs exactly once per transfer
/// on every path.
pub(crate) struct ReceiverCore {
    sink: Arc<dyn KvSink>,
    num_layers: u32,
    num_blocks: u32,
    transfers: HashMap<TransferId, RxState>,
    counters: Arc<TransferCounters>,
}

impl ReceiverCore {
    pub(crate) fn new(
        sink: Arc<dyn KvSink>,
        layout: &KvLayoutDescriptor,
        counters: Arc<TransferCounters>,
    ) -> Self {
        let num_blocks = sink.num_blocks();
        Self {
            sink,
            num_layers: layout.num_layers,
            num_blocks,
            transfers: HashMap::new(),
            counters,
        }
    }

    /// Forgets `transfer`'s record; its state, if it had one.
    fn forget(&mut self, transfer: TransferId) -> Option<RxState> {
        let state = self.transfers.remove(&transfer);
        if state.is_some() {
            self.counters.receiving.fetch_sub(1, Ordering::Relaxed);
        }
        state
    }

    /// Opens `transfer` if new. A peer keeping too many open is an error.
    pub(crate) fn begin(&mut self, transfer: TransferId) -> Result<(), TransferError> {
        if !self.transfers.contains_key(&transfer) {
            if self.transfers.len() >= MAX_OPEN_TRANSFERS {
                return Err(TransferError::Protocol(format!(
                    "more than {MAX_OPEN_TRANSFERS} transfers open on one connection"
                )));
            }
            self.transfers.insert(transfer, RxState::Open);
            self.counters.receiving.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn fail(&mut self, transfer: TransferId, failure: TransferFailure) -> Option<Done> {
        self.transfers.insert(transfer, RxState::Failed);
        let reason = failure.to_string();
        self.sink.finish(transfer, Err(failure));
        Some((transfer, Err(reason)))
    }

    /// Delivers one block of an open transfer (call [`begin`](Self::begin)
    /// first). `k` and `v` have the layout's length (the carrier checked).
    /// Returns the `Done` to send when this block failed the transfer.
    pub(crate) fn block(
        &mut self,
        transfer: TransferId,
        layer: u32,
        block: u32,
        k: &[u8],
        v: &[u8],
    ) -> Option<Done> {
        if !matches!(self.transfers.get(&transfer), Some(RxState::Open)) {
            return None;
        }
        if layer >= self.num_layers {
            let layers = self.num_layers;
            return self.fail(transfer, TransferFailure::LayerOutOfRange { layer, layers });
        }
        if block >= self.num_blocks {
            let blocks = self.num_blocks;
            return self.fail(transfer, TransferFailure::BlockOutOfRange { block, blocks });
        }
        match self.sink.write(transfer, layer, block, k, v) {
            Ok(()) => None,
            Err(refused) => self.fail(transfer, refused.into()),
        }
    }

    /// The sender finished `transfer`.
    pub(crate) fn finish(&mut self, transfer: TransferId) -> Option<Done> {
        match self.forget(transfer) {
            Some(RxState::Failed) => None,
            Some(RxState::Open) | None => {
                self.sink.finish(transfer, Ok(()));
                Some((transfer, Ok(())))
            }
        }
    }

    /// The sender aborted `transfer`.
    pub(crate) fn abort(&mut self, transfer: TransferId) {
        if let Some(RxState::Open) = self.forget(transfer) {
            self.sink.finish(transfer, Err(TransferFailure::Aborted));
        }
    }

    /// The connection ended: fails every open transfer with `reason`.
    pub(crate) fn close(&mut self, reason: &str) {
        let open = self.transfers.len() as i64;
        self.counters.receiving.fetch_sub(open, Ordering::Relaxed);
        for (transfer, state) in self.transfers.drain() {
            if let RxState::Open = state {
                self.sink.finish(
                    transfer,
                    Err(TransferFailure::ConnectionLost(reason.to_string())),
                );
            }
        }
    }
}

impl Drop for ReceiverCore {
    fn drop(&mut self) {
        self.close("the connection closed before the transfer finished");
    }
}

impl std::fmt::Debug for ReceiverCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceiverCore")
            .field("num_blocks", &self.num_blocks)
            .field("open_transfers", &self.transfers.len())
            .finish_non_exhaustive()
    }
}
