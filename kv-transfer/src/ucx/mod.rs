//! KV transfer over UCX: RMA puts, or active-message rendezvous, into a
//! registered receive region.
//!
//! UCX picks the wire from `UCX_TLS` and the other `UCX_*` variables (read
//! by `ucp_config_read`): RDMA verbs in production, `tcp` or shared memory
//! (`posix`, `cma`, `sm`) on any machine, so this same code path is tested
//! without RDMA hardware.
//!
//! # Design
//!
//! **Control connection.** Every session keeps one TCP connection to the
//! listener's `ip:port` endpoint. It carries the usual handshake (magic
//! `TDMKVXU1`, version, cluster token, layout — a TCP-transport peer is
//! refused at the magic), then the receiver's *offer*: a connection id, the
//! receive region's address and remote key (`ucp_rkey_pack`), its slot
//! geometry and the receiver's UCX worker address. Afterwards it carries
//! receiver → sender `DONE`, `CLOSE` and `CREDIT` frames, and its end of
//! stream is how either side learns that the other died: the kernel closes
//! a killed process's sockets, so a peer killed mid-transfer fails every
//! open transfer on both sides at once (well within 5 s), whatever UCX
//! transport is in use and whether or not it detects peer failure itself.
//!
//! **Data.** The receiver registers (`ucp_mem_map`, UCX-allocated so
//! shared-memory transports can map it) one *receive region* per
//! connection: a ring of slots, each holding one block of one layer (K then
//! V, `2 × block_layer_bytes`). This is the "registered receive region"
//! design, not a put straight into the engine's KV pool: the engine does
//! not expose its pool memory, so the receiver's sink still copies each
//! block from its slot into the pool (one memory copy on the receiving
//! host, as with TCP). Putting straight into the pool needs the engine to
//! hand out (and register) its pool, and is left for later.
//!
//! The sender owns the ring's cursor. For a batch of up to
//! [`MAX_NOTICE_BLOCKS`] blocks it takes that many *credits* (free slots,
//! consecutive in ring order) and moves K and V of each block into its slot
//! by one of two data paths ([`UcxDataPath`]), then the receiver gets an
//! active message — the *notice* `WRITE(transfer, [(layer, block, slot)])`
//! — that it turns into [`KvSink::write`] calls from the slots, after which
//! it returns the slots with a `CREDIT` frame:
//!
//! - **Put** (where the wire does RMA natively: RDMA verbs, shared memory):
//!   `ucp_put_nbx` of K and V into their slots — one put per run where
//!   both the source and the slots are contiguous, so a batch exported
//!   back to back is one put, or two where the ring wraps — a flush of the
//!   endpoint (`ucp_ep_flush_nbx`: the data is now in the receiver's
//!   memory), then the notice, eager, with no data.
//! - **Rendezvous** (where UCX would emulate RMA over active messages, as
//!   on `tcp`): the notice carries the blocks as its data — `K₀ V₀ K₁ V₁ …`
//!   as one contiguous buffer (copied into one if the blocks are not back to
//!   back: UCX 1.13 moves a scatter-gather list over tcp several times
//!   slower), sent eagerly when small and by UCX's rendezvous protocol
//!   otherwise — and the receiver's handler receives it straight into the
//!   slots the header names (`ucp_am_recv_data_nbx` into one region range,
//!   or a list of two where the ring wraps), queuing the notice once it has
//!   landed.
//!
//! `FINISH` and `ABORT` are active messages too. Every message carries a
//! per-connection sequence number and the receiver applies them in that
//! order (rendezvous receives complete in any order), so a notice is never
//! overtaken by the `FINISH` after it.
//!
//! **Progress.** One UCX worker per transport, owned by a dedicated
//! progress thread that sleeps on the worker's event fd and an eventfd
//! (see the `rt` module); tokio tasks hand it operations and await
//! oneshot replies.
//!
//! **Memory safety.** Registered memory is RAII (`rt::Region`, unmapped
//! when its last reference goes: the connection's, or a rendezvous receive
//! still landing in it); buffers a put or send reads from are owned by the
//! in-flight operation until UCX completes it. A receiver that
//! closes a connection on a protocol error waits (bounded) for the sender
//! to close its side before unmapping the region, so a well-behaved sender
//! never puts into freed memory; a hostile sender on a transport without
//! remote-key revocation (CMA) could, as with any RMA design.

mod rt;

pub use rt::{tuning_env, TUNING as UCX_TUNING};

use std::collections::BTreeMap;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch, Semaphore};

use crate::protocol;
use crate::session::{
    AbortOnDrop, ChannelSession, Command, Completions, ReceiverCore, TransferCounters,
};
use crate::tcp::{
    client_handshake, frame_len, linger_close, lost, read_header, send_done, server_handshake,
    timeout_error, TcpConfig,
};
use crate::{
    BlockWrite, KvLayoutDescriptor, KvSink, Listener, Session, TransferCounts, TransferError,
    TransferId, Transport,
};

/// The most blocks one notice names (keeps notices eager-sized, ~3 KiB;
/// fewer where the worker's largest message header is smaller).
pub const MAX_NOTICE_BLOCKS: usize = 256;
/// Batches a sender keeps in flight (put/flush/notice) at once.
const WINDOW: usize = 8;
/// Messages a receiver connection queues before the peer is cut off.
const MESSAGE_QUEUE: usize = 4096;
/// The largest worker address or remote key accepted in an offer.
const MAX_BLOB: usize = 64 << 10;
/// How long a receiver waits for the sender to close after an error before
/// unmapping the region.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

const FRAME_CREDIT: u8 = 0x83;
const FRAME_OFFER: u8 = 0x84;
const OFFER_FIXED: usize = 32;

const MSG_WRITE: u8 = 1;
const MSG_FINISH: u8 = 2;
const MSG_ABORT: u8 = 3;
const NOTICE_FIXED: usize = 13;
const NOTICE_ENTRY: usize = 12;

/// How a sender moves block data (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UcxDataPath {
    /// Put where the endpoint's transports do RMA natively, rendezvous
    /// where UCX would emulate it (decided per connection).
    #[default]
    Auto,
    /// RMA puts into the receive region, a flush, then the notice.
    Put,
    /// The blocks as the notice's data, received into the region.
    Rendezvous,
}

/// Settings of a [`UcxTransport`].
#[derive(Debug, Clone)]
pub struct UcxConfig {
    /// Cluster token and control-connection timeouts, as for TCP.
    pub tcp: TcpConfig,
    /// Bytes of the receive region a listener registers per connection
    /// (rounded down to whole slots, at least one; at most the sink's whole
    /// pool).
    pub region_bytes: usize,
    /// UCX settings applied on top of the `UCX_*` environment, names
    /// without the prefix (`("TLS", "tcp")`); empty in production, where
    /// the environment decides.
    pub ucx_settings: Vec<(String, String)>,
    /// How this transport's sessions move block data.
    pub data_path: UcxDataPath,
    /// Payload bytes a sender puts in one batch (one notice), at most half
    /// the peer's region (at least one block).
    pub batch_bytes: usize,
}

impl UcxConfig {
    /// Defaults (5 s timeouts, an 8 MiB region per connection, 4 MiB
    /// batches, the automatic data path) with
    /// `cluster_token`.
    pub fn new(cluster_token: impl Into<String>) -> Self {
        Self {
            tcp: TcpConfig::new(cluster_token),
            // Small enough to stay in the receiver's last-level cache, so
            // the copy out of a slot reads cached data: on shared memory
            // 8 MiB moved 4 MiB batches at 29 GB/s where 64 MiB managed 13
            // (bench/RESULTS.md, KV transfer).
            region_bytes: 8 << 20,
            ucx_settings: Vec::new(),
            data_path: UcxDataPath::Auto,
            batch_bytes: 4 << 20,
        }
    }

    /// Slots of `slot_bytes` in the receive region a listener with these
    /// settings registers per connection (at least one; the sink's pool
    /// may cap it further).
    pub fn region_slots(&self, slot_bytes: usize) -> usize {
        (self.region_bytes / slot_bytes.max(1)).max(1)
    }
}

/// Blocks a sender puts in one batch (one notice): `batch_bytes` worth of
/// slots, at least one, at most `max_batch` (what a notice may name) and
/// at most half the peer's `slots`, so two batches fit the ring at once.
pub fn batch_slots(batch_bytes: usize, slot_bytes: usize, max_batch: usize, slots: usize) -> usize {
    (batch_bytes / slot_bytes.max(1))
        .clamp(1, max_batch.max(1))
        .min((slots / 2).max(1))
}

/// The UCX [`Transport`]. Endpoints are the control connection's
/// `"ip:port"`.
#[derive(Debug, Clone)]
pub struct UcxTransport {
    config: Arc<UcxConfig>,
    rt: Arc<rt::Runtime>,
    counters: Arc<TransferCounters>,
}

impl UcxTransport {
    /// A transport with default settings and `cluster_token`; starts the UCX
    /// context, worker and progress thread (an error when UCX finds no
    /// usable transport for `UCX_TLS`).
    pub fn new(cluster_token: impl Into<String>) -> Result<Self, TransferError> {
        Self::with_config(UcxConfig::new(cluster_token))
    }

    /// A transport with explicit settings.
    pub fn with_config(config: UcxConfig) -> Result<Self, TransferError> {
        if config.tcp.cluster_token.len() > protocol::MAX_TOKEN_BYTES {
            return Err(TransferError::Config(format!(
                "the cluster token is {} bytes; at most {} are allowed",
                config.tcp.cluster_token.len(),
                protocol::MAX_TOKEN_BYTES
            )));
        }
        Ok(Self {
            rt: Arc::new(rt::Runtime::start(&config.ucx_settings)?),
            config: Arc::new(config),
            counters: Arc::default(),
        })
    }
}

/// What the receiver offers after an accepted handshake.
#[derive(Debug)]
struct Offer {
    conn: u64,
    region_addr: u64,
    slot_bytes: u32,
    slots: u32,
    worker: Vec<u8>,
    rkey: Vec<u8>,
}

fn encode_offer(offer: &Offer) -> Vec<u8> {
    let body = OFFER_FIXED + offer.worker.len() + offer.rkey.len();
    let mut out = Vec::with_capacity(protocol::FRAME_HEADER + body);
    out.put_u8(FRAME_OFFER);
    out.put_u32_le(body as u32);
    out.put_u64_le(offer.conn);
    out.put_u64_le(offer.region_addr);
    out.put_u32_le(offer.slot_bytes);
    out.put_u32_le(offer.slots);
    out.put_u32_le(offer.worker.len() as u32);
    out.put_u32_le(offer.rkey.len() as u32);
    out.extend_from_slice(&offer.worker);
    out.extend_from_slice(&offer.rkey);
    out
}

fn decode_offer(body: &[u8]) -> Result<Offer, TransferError> {
    let bad = |why: &str| TransferError::Protocol(format!("malformed UCX offer: {why}"));
    if body.len() < OFFER_FIXED {
        return Err(bad("too short"));
    }
    let mut b = body;
    let conn = b.get_u64_le();
    let region_addr = b.get_u64_le();
    let slot_bytes = b.get_u32_le();
    let slots = b.get_u32_le();
    let worker_len = b.get_u32_le() as usize;
    let rkey_len = b.get_u32_le() as usize;
    if worker_len == 0 || rkey_len == 0 || worker_len > MAX_BLOB || rkey_len > MAX_BLOB {
        return Err(bad("address or key length out of range"));
    }
    if b.len() != worker_len + rkey_len {
        return Err(bad("length does not match its parts"));
    }
    Ok(Offer {
        conn,
        region_addr,
        slot_bytes,
        slots,
        worker: b[..worker_len].to_vec(),
        rkey: b[worker_len..].to_vec(),
    })
}

fn control_message(kind: u8, transfer: TransferId) -> Vec<u8> {
    let mut out = Vec::with_capacity(9);
    out.put_u8(kind);
    out.put_u64_le(transfer.0);
    out
}

/// Reads one frame (header and body, at most `max` bytes).
async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    max: usize,
    peer: &str,
) -> Result<Option<(u8, Vec<u8>)>, TransferError> {
    let mut header = [0u8; protocol::FRAME_HEADER];
    if !read_header(reader, &mut header)
        .await
        .map_err(|e| lost(peer, &e))?
    {
        return Ok(None);
    }
    let len = frame_len(&header);
    if len > max {
        return Err(TransferError::Protocol(format!(
            "{peer} sent a frame of {len} bytes; at most {max} expected here"
        )));
    }
    let mut body = vec![0u8; len];
    reader
        .read_exact(&mut body)
        .await
        .map_err(|e| lost(peer, &e))?;
    Ok(Some((header[0], body)))
}

#[async_trait]
impl Transport for UcxTransport {
    fn counts(&self) -> TransferCounts {
        self.counters.counts()
    }

    async fn listen(
        &self,
        bind: &str,
        layout: KvLayoutDescriptor,
        sink: Arc<dyn KvSink>,
    ) -> Result<Listener, TransferError> {
        layout.validate()?;
        let slot_bytes = layout.block_payload_bytes();
        let pool_slots = u64::from(sink.num_blocks()) * u64::from(layout.num_layers);
        let slots = self.config.region_slots(slot_bytes) as u64;
        let slots = u32::try_from(slots.min(pool_slots.max(1))).unwrap_or(u32::MAX);
        let listener = TcpListener::bind(bind)
            .await
            .map_err(|e| TransferError::BadEndpoint {
                endpoint: bind.to_string(),
                reason: format!("cannot listen: {e}"),
            })?;
        let endpoint = listener
            .local_addr()
            .map_err(|e| TransferError::io("reading the listener's address", &e))?
            .to_string();
        let ctx = Arc::new(ListenCtx {
            layout,
            sink,
            config: self.config.clone(),
            rt: self.rt.clone(),
            slots,
            slot_bytes,
            next_conn: AtomicU64::new(1),
            counters: self.counters.clone(),
        });
        let task = tokio::spawn(crate::tcp::accept_loop(
            listener,
            ctx,
            self.config.tcp.max_connections,
            "ucx",
            serve_connection,
        ));
        Ok(Listener::new(endpoint, Box::new(AbortOnDrop(task))))
    }

    async fn connect(
        &self,
        endpoint: &str,
        layout: KvLayoutDescriptor,
    ) -> Result<Box<dyn Session>, TransferError> {
        layout.validate()?;
        let config = &self.config.tcp;
        let stream = tokio::time::timeout(config.connect_timeout, TcpStream::connect(endpoint))
            .await
            .map_err(|_| timeout_error("connecting", config.connect_timeout))?
            .map_err(|e| TransferError::BadEndpoint {
                endpoint: endpoint.to_string(),
                reason: format!("cannot connect: {e}"),
            })?;
        stream
            .set_nodelay(true)
            .map_err(|e| TransferError::io("setting TCP_NODELAY", &e))?;
        let (mut reader, mut writer) = stream.into_split();
        let limit = config.handshake_timeout;
        let (num_blocks, offer, connected) = tokio::time::timeout(limit, async {
            let num_blocks = client_handshake(
                protocol::MAGIC_UCX,
                &mut reader,
                &mut writer,
                &layout,
                config,
                endpoint,
            )
            .await?;
            let offer = match read_frame(&mut reader, OFFER_FIXED + 2 * MAX_BLOB, endpoint).await? {
                Some((FRAME_OFFER, body)) => decode_offer(&body)?,
                Some((protocol::FRAME_CLOSE, body)) => {
                    return Err(TransferError::ConnectionLost(format!(
                        "{endpoint} refused the UCX session: {}",
                        protocol::decode_close(&body)?
                    )))
                }
                Some((other, _)) => {
                    return Err(TransferError::Protocol(format!(
                        "{endpoint} sent frame {other:#04x} instead of its UCX offer"
                    )))
                }
                None => {
                    return Err(TransferError::ConnectionLost(format!(
                        "{endpoint} closed the connection before its UCX offer"
                    )))
                }
            };
            if offer.slot_bytes as usize != layout.block_payload_bytes() || offer.slots == 0 {
                return Err(TransferError::Protocol(format!(
                    "{endpoint} offered {} slots of {} bytes; the layout needs slots of {}",
                    offer.slots,
                    offer.slot_bytes,
                    layout.block_payload_bytes()
                )));
            }
            let connected = self
                .rt
                .connect(offer.worker.clone(), offer.rkey.clone())
                .await?;
            Ok::<_, TransferError>((num_blocks, offer, connected))
        })
        .await
        .map_err(|_| timeout_error("setting up the UCX session", limit))??;

        let completions = Arc::new(Completions::new(self.counters.clone()));
        let (commands, queue) = mpsc::channel(crate::session::COMMAND_QUEUE);
        let credits = Arc::new(Semaphore::new(offer.slots as usize));
        let (dead_tx, dead_rx) = watch::channel(false);
        let rendezvous = match self.config.data_path {
            UcxDataPath::Auto => !connected.native_rma,
            UcxDataPath::Put => false,
            UcxDataPath::Rendezvous => true,
        };
        tracing::debug!(%endpoint, rendezvous, "UCX KV session open");
        let header_room = self
            .rt
            .max_am_header()
            .saturating_sub(rt::AM_HEADER + NOTICE_FIXED)
            / NOTICE_ENTRY;
        let plan = SlotPlan {
            conn: offer.conn,
            rendezvous,
            max_batch: MAX_NOTICE_BLOCKS.min(header_room).max(1),
            batch_bytes: self.config.batch_bytes,
            region_addr: offer.region_addr,
            slots: offer.slots,
            slot_bytes: offer.slot_bytes as usize,
            block_layer_bytes: layout.block_layer_bytes(),
        };
        tokio::spawn(write_loop(WriteCtx {
            queue,
            rt: self.rt.clone(),
            ep: connected.ep,
            writer,
            plan,
            credits: credits.clone(),
            completions: completions.clone(),
            dead: dead_rx,
        }));
        let acks = tokio::spawn(ack_loop(
            reader,
            completions.clone(),
            credits,
            offer.slots as usize,
            dead_tx,
            endpoint.to_string(),
        ));
        Ok(Box::new(ChannelSession {
            endpoint: endpoint.to_string(),
            layout,
            peer_num_blocks: num_blocks,
            commands,
            completions,
            _tasks: vec![AbortOnDrop(acks)],
        }))
    }
}

/// Where the sender puts blocks in the receiver's region.
#[derive(Debug, Clone, Copy)]
struct SlotPlan {
    conn: u64,
    /// Blocks travel as the notice's data, not as puts.
    rendezvous: bool,
    /// The most blocks one notice may name.
    max_batch: usize,
    /// The payload bytes a batch aims at.
    batch_bytes: usize,
    region_addr: u64,
    slots: u32,
    slot_bytes: usize,
    block_layer_bytes: usize,
}

struct WriteCtx {
    queue: mpsc::Receiver<Command>,
    rt: Arc<rt::Runtime>,
    ep: rt::EpId,
    writer: OwnedWriteHalf,
    plan: SlotPlan,
    credits: Arc<Semaphore>,
    completions: Arc<Completions>,
    dead: watch::Receiver<bool>,
}

type Reply = oneshot::Receiver<Result<(), TransferError>>;

/// Waits for `reply` unless the connection dies first.
async fn await_reply(
    reply: Reply,
    dead: &mut watch::Receiver<bool>,
    completions: &Completions,
) -> Result<(), TransferError> {
    tokio::select! {
        biased;
        r = reply => r.map_err(|_| completions.dead_error())?,
        _ = dead.wait_for(|d| *d) => Err(completions.dead_error()),
    }
}

/// One message for the progress thread: its payload, where that lands
/// (first slot, slots; none for puts and control messages) and its body.
struct Message {
    payload: rt::Payload,
    landing: (u32, u32),
    body: Vec<u8>,
}

impl Message {
    fn control(body: Vec<u8>) -> Self {
        Self {
            payload: rt::Payload::Put(Vec::new()),
            landing: (0, 0),
            body,
        }
    }
}

/// `buffers` as one contiguous range: as they are when they lie back to back
/// in memory (a prefill worker exports a layer's blocks in one buffer),
/// else copied into one. A memory copy costs far less than UCX 1.13's
/// rendezvous of a scatter-gather list over tcp (see `rt::Payload::Send`).
fn contiguous(buffers: Vec<Bytes>) -> Vec<Bytes> {
    if rt::contiguous_ranges(&buffers).len() <= 1 {
        return buffers;
    }
    let mut one = BytesMut::with_capacity(buffers.iter().map(Bytes::len).sum());
    for b in &buffers {
        one.extend_from_slice(b);
    }
    vec![one.freeze()]
}

/// The sender's writer: turns commands into batches and messages.
async fn write_loop(mut ctx: WriteCtx) {
    let plan = ctx.plan;
    let per_batch = batch_slots(
        plan.batch_bytes,
        plan.slot_bytes,
        plan.max_batch,
        plan.slots as usize,
    );
    let mut seq = 0u64;
    let mut cursor = 0u32;
    let mut inflight: VecDeque<Reply> = VecDeque::new();
    let outcome: Result<(), TransferError> = async {
        while let Some(command) = ctx.queue.recv().await {
            let mut messages: Vec<Message> = Vec::new();
            match command {
                Command::Write { transfer, blocks } => {
                    let mut blocks = blocks.into_iter().peekable();
                    while blocks.peek().is_some() {
                        let batch: Vec<BlockWrite> = blocks.by_ref().take(per_batch).collect();
                        let n = batch.len();
                        tokio::select! {
                            biased;
                            permit = ctx.credits.acquire_many(n as u32) => match permit {
                                Ok(p) => p.forget(),
                                Err(_) => return Err(ctx.completions.dead_error()),
                            },
                            _ = ctx.dead.wait_for(|d| *d) => return Err(ctx.completions.dead_error()),
                        }
                        let first = cursor;
                        let mut puts = Vec::with_capacity(2 * n);
                        let mut body = Vec::with_capacity(NOTICE_FIXED + n * NOTICE_ENTRY);
                        body.put_u8(MSG_WRITE);
                        body.put_u64_le(transfer.0);
                        body.put_u32_le(n as u32);
                        for block in batch {
                            body.put_u32_le(block.layer);
                            body.put_u32_le(block.dst_block);
                            body.put_u32_le(cursor);
                            let slot_addr =
                                plan.region_addr + cursor as u64 * plan.slot_bytes as u64;
                            puts.push(rt::Put {
                                bytes: block.k,
                                remote_addr: slot_addr,
                            });
                            // A latent layout has no V.
                            if !block.v.is_empty() {
                                puts.push(rt::Put {
                                    bytes: block.v,
                                    remote_addr: slot_addr + plan.block_layer_bytes as u64,
                                });
                            }
                            cursor = (cursor + 1) % plan.slots;
                        }
                        messages.push(if plan.rendezvous {
                            // The same bytes in the same order, as the data.
                            let buffers = puts.into_iter().map(|p| p.bytes).collect();
                            Message {
                                payload: rt::Payload::Send(contiguous(buffers)),
                                landing: (first, n as u32),
                                body,
                            }
                        } else {
                            Message {
                                payload: rt::Payload::Put(puts),
                                landing: (0, 0),
                                body,
                            }
                        });
                        send_messages(&mut ctx, &mut messages, &mut seq, &mut inflight).await?;
                    }
                }
                Command::Finish(t) => messages.push(Message::control(control_message(MSG_FINISH, t))),
                Command::Abort(t) => messages.push(Message::control(control_message(MSG_ABORT, t))),
            }
            send_messages(&mut ctx, &mut messages, &mut seq, &mut inflight).await?;
        }
        // The session was dropped: let what it wrote go out (bounded), then
        // tell the receiver how many messages to expect before the end.
        tokio::time::timeout(CLOSE_WAIT, async {
            while let Some(reply) = inflight.pop_front() {
                match reply.await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(e),
                    Err(_) => return Err(ctx.completions.dead_error()),
                }
            }
            Ok(())
        })
        .await
        .map_err(|_| timeout_error("sending the last UCX messages", CLOSE_WAIT))??;
        ctx.writer
            .write_all(&seq.to_le_bytes())
            .await
            .map_err(|e| TransferError::io("closing the UCX control connection", &e))
    }
    .await;
    if let Err(e) = outcome {
        ctx.completions.fail_all(e);
    }
    ctx.rt.close(ctx.ep);
    let _ = ctx.writer.shutdown().await;
}

async fn send_messages(
    ctx: &mut WriteCtx,
    messages: &mut Vec<Message>,
    seq: &mut u64,
    inflight: &mut VecDeque<Reply>,
) -> Result<(), TransferError> {
    for message in messages.drain(..) {
        let (first, count) = message.landing;
        let header = rt::am_header(ctx.plan.conn, *seq, first, count, &message.body);
        let reply = ctx.rt.batch(ctx.ep, message.payload, header)?;
        *seq += 1;
        inflight.push_back(reply);
        while inflight.len() > WINDOW {
            if let Some(reply) = inflight.pop_front() {
                await_reply(reply, &mut ctx.dead, &ctx.completions).await?;
            }
        }
        // Reap what already completed, so errors surface early.
        while let Some(front) = inflight.front_mut() {
            match front.try_recv() {
                Ok(result) => {
                    result?;
                    inflight.pop_front();
                }
                Err(oneshot::error::TryRecvError::Empty) => break,
                Err(oneshot::error::TryRecvError::Closed) => {
                    return Err(ctx.completions.dead_error())
                }
            }
        }
    }
    Ok(())
}

/// Reads `DONE`/`CREDIT`/`CLOSE` from the receiver until the control
/// connection ends, then fails everything still pending.
async fn ack_loop(
    reader: OwnedReadHalf,
    completions: Arc<Completions>,
    credits: Arc<Semaphore>,
    slots: usize,
    dead: watch::Sender<bool>,
    endpoint: String,
) {
    let mut reader = BufReader::new(reader);
    let max_body = 11 + protocol::MAX_MESSAGE_BYTES;
    let err = loop {
        let (kind, body) = match read_frame(&mut reader, max_body, &endpoint).await {
            Ok(Some(frame)) => frame,
            Ok(None) => {
                break TransferError::ConnectionLost(format!("{endpoint} closed the connection"))
            }
            Err(e) => break e,
        };
        let outcome = match kind {
            protocol::FRAME_DONE => {
                protocol::decode_done(&body).and_then(|done| completions.on_done(done))
            }
            FRAME_CREDIT if body.len() == 4 => {
                let n = u32::from_le_bytes([body[0], body[1], body[2], body[3]]) as usize;
                if credits.available_permits() + n > slots {
                    Err(TransferError::Protocol(format!(
                        "{endpoint} returned more slots than it lent"
                    )))
                } else {
                    credits.add_permits(n);
                    Ok(())
                }
            }
            protocol::FRAME_CLOSE => Err(protocol::closed_by_peer(&endpoint, &body)),
            other => Err(TransferError::Protocol(format!(
                "{endpoint} sent an unexpected frame type {other:#04x}"
            ))),
        };
        if let Err(e) = outcome {
            break e;
        }
    };
    completions.fail_all(err);
    credits.close();
    let _ = dead.send(true);
}

/// What every connection of one listener needs.
struct ListenCtx {
    layout: KvLayoutDescriptor,
    sink: Arc<dyn KvSink>,
    config: Arc<UcxConfig>,
    rt: Arc<rt::Runtime>,
    slots: u32,
    slot_bytes: usize,
    next_conn: AtomicU64,
    counters: Arc<TransferCounters>,
}

fn report(ctx: &ListenCtx, peer: &str, err: &TransferError) {
    tracing::warn!(%peer, error = %err, "UCX KV transfer connection refused or failed");
    ctx.sink.peer_error(peer, err);
}

/// Removes a connection's route when dropped.
struct RouteGuard {
    rt: Arc<rt::Runtime>,
    conn: u64,
}

impl Drop for RouteGuard {
    fn drop(&mut self) {
        self.rt
            .routes()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.conn);
    }
}

async fn serve_connection(stream: TcpStream, peer: String, ctx: Arc<ListenCtx>) {
    let _ = stream.set_nodelay(true);
    let (reader, mut writer) = stream.into_split();
    let mut reader = BufReader::new(reader);
    let limit = ctx.config.tcp.handshake_timeout;
    let handshake = tokio::time::timeout(
        limit,
        server_handshake(
            protocol::MAGIC_UCX,
            &mut reader,
            &mut writer,
            &ctx.layout,
            &ctx.config.tcp,
            ctx.sink.num_blocks(),
        ),
    )
    .await
    .unwrap_or_else(|_| Err(timeout_error("waiting for the sender's hello", limit)));
    if let Err(e) = handshake {
        report(&ctx, &peer, &e);
        linger_close(&mut reader, &mut writer).await;
        return;
    }
    // The region and its rkey exist only for a peer that proved the
    // cluster secret: nobody else can address an RMA put to this pool.
    let region = match rt::Region::new(
        ctx.rt.context().clone(),
        ctx.slots as usize * ctx.slot_bytes,
    )
    .and_then(|r| r.pack_rkey().map(|k| (r, k)))
    {
        Ok(r) => r,
        Err(e) => {
            report(&ctx, &peer, &e);
            let close = protocol::encode_close(&e.to_string());
            let _ = tokio::time::timeout(Duration::from_secs(1), writer.write_all(&close)).await;
            return;
        }
    };
    let (region, rkey) = region;
    let region = Arc::new(region);
    let conn = ctx.next_conn.fetch_add(1, Ordering::Relaxed);
    let (tx, mut messages) = mpsc::channel(MESSAGE_QUEUE);
    ctx.rt
        .routes()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(
            conn,
            rt::Route {
                queue: tx,
                region: region.clone(),
                slot_bytes: ctx.slot_bytes,
                slots: ctx.slots,
            },
        );
    let _route = RouteGuard {
        rt: ctx.rt.clone(),
        conn,
    };
    let offer = encode_offer(&Offer {
        conn,
        region_addr: region.remote_addr(),
        slot_bytes: ctx.slot_bytes as u32,
        slots: ctx.slots,
        worker: ctx.rt.address().to_vec(),
        rkey,
    });
    if let Err(e) = writer.write_all(&offer).await {
        report(&ctx, &peer, &TransferError::io("sending the UCX offer", &e));
        return;
    }
    let mut rx = Receiver {
        core: ReceiverCore::new(ctx.sink.clone(), &ctx.layout, ctx.counters.clone()),
        region: &region,
        ctx: &ctx,
        next_seq: 0,
        pending: BTreeMap::new(),
    };
    let result = async {
        // After the handshake the sender sends one thing on the control
        // connection: when it closes gracefully, the number of messages it
        // sent (u64), so the ones still in flight are applied first.
        let mut tail = [0u8; 9];
        let mut got = 0;
        let total = loop {
            tokio::select! {
                msg = messages.recv() => match msg {
                    Some(msg) => rx.accept(msg, &mut writer, &peer).await?,
                    None => return Err(overrun()),
                },
                read = reader.read(&mut tail[got..]) => match read {
                    Ok(0) if got == 8 => {
                        let mut n = [0u8; 8];
                        n.copy_from_slice(&tail[..8]);
                        break u64::from_le_bytes(n);
                    }
                    // Gone without a goodbye (killed): fail what is open now.
                    Ok(0) if got == 0 => return Ok(()),
                    Ok(0) => return Err(TransferError::Protocol(
                        "truncated goodbye on the control connection".into(),
                    )),
                    Ok(n) if got + n <= 8 => got += n,
                    Ok(_) => return Err(TransferError::Protocol(
                        "unexpected bytes from the sender on the control connection".into(),
                    )),
                    Err(e) => return Err(lost(&peer, &e)),
                },
            }
        };
        tokio::time::timeout(CLOSE_WAIT, async {
            while rx.next_seq < total {
                match messages.recv().await {
                    Some(msg) => rx.accept(msg, &mut writer, &peer).await?,
                    None => return Err(overrun()),
                }
            }
            Ok(())
        })
        .await
        .map_err(|_| timeout_error("waiting for the sender's last messages", CLOSE_WAIT))?
    }
    .await;
    match result {
        Ok(()) => rx
            .core
            .close("the sender closed the connection with the transfer open"),
        Err(e) => {
            let message = e.to_string();
            rx.core.close(&message);
            report(&ctx, &peer, &e);
            let close = protocol::encode_close(&message);
            let _ = tokio::time::timeout(Duration::from_secs(1), writer.write_all(&close)).await;
            // Keep the region mapped until the sender has stopped (closed
            // its side), within a bound.
            let _ = tokio::time::timeout(CLOSE_WAIT, async {
                let mut sink = [0u8; 256];
                while matches!(reader.read(&mut sink).await, Ok(n) if n > 0) {}
            })
            .await;
        }
    }
    drop(rx);
    drop(region);
}

fn overrun() -> TransferError {
    TransferError::Protocol(
        "the sender overran its message queue or sent data that does not fit the slots it named"
            .into(),
    )
}

/// The receiving side of one connection: in-order messages into the core.
struct Receiver<'a> {
    core: ReceiverCore,
    region: &'a rt::Region,
    ctx: &'a ListenCtx,
    next_seq: u64,
    pending: BTreeMap<u64, Vec<u8>>,
}

impl Receiver<'_> {
    async fn accept(
        &mut self,
        msg: rt::AmMsg,
        writer: &mut OwnedWriteHalf,
        peer: &str,
    ) -> Result<(), TransferError> {
        if msg.seq < self.next_seq || self.pending.contains_key(&msg.seq) {
            return Err(TransferError::Protocol(format!(
                "message {} arrived twice",
                msg.seq
            )));
        }
        if self.pending.len() >= MESSAGE_QUEUE {
            return Err(TransferError::Protocol(
                "too many messages out of order".into(),
            ));
        }
        self.pending.insert(msg.seq, msg.body);
        while let Some(body) = self.pending.remove(&self.next_seq) {
            self.next_seq += 1;
            self.handle(&body, writer, peer).await?;
        }
        Ok(())
    }

    async fn handle(
        &mut self,
        body: &[u8],
        writer: &mut OwnedWriteHalf,
        peer: &str,
    ) -> Result<(), TransferError> {
        let mut b = body;
        if b.len() < 9 {
            return Err(TransferError::Protocol(format!(
                "message of {} bytes",
                body.len()
            )));
        }
        let kind = b.get_u8();
        let transfer = TransferId(b.get_u64_le());
        match kind {
            MSG_WRITE => {
                if b.len() < 4 {
                    return Err(TransferError::Protocol("truncated WRITE notice".into()));
                }
                let count = b.get_u32_le() as usize;
                if count > MAX_NOTICE_BLOCKS || b.len() != count * NOTICE_ENTRY {
                    return Err(TransferError::Protocol(format!(
                        "WRITE notice for {count} blocks with {} bytes of entries",
                        b.len()
                    )));
                }
                self.core.begin(transfer)?;
                let half = self.ctx.layout.block_layer_bytes();
                let v_bytes = self.ctx.layout.value_bytes();
                for _ in 0..count {
                    let (layer, block, slot) = (b.get_u32_le(), b.get_u32_le(), b.get_u32_le());
                    if slot >= self.ctx.slots {
                        return Err(TransferError::Protocol(format!(
                            "slot {slot} out of range: the region has {}",
                            self.ctx.slots
                        )));
                    }
                    let at = slot as usize * self.ctx.slot_bytes;
                    let (Some(k), Some(v)) = (
                        self.region.read(at, half),
                        self.region.read(at + half, v_bytes),
                    ) else {
                        return Err(TransferError::Protocol(format!("slot {slot} out of range")));
                    };
                    if let Some(done) = self.core.block(transfer, layer, block, k, v) {
                        send_done(writer, done, peer).await?;
                    }
                }
                let mut credit = Vec::with_capacity(protocol::FRAME_HEADER + 4);
                credit.put_u8(FRAME_CREDIT);
                credit.put_u32_le(4);
                credit.put_u32_le(count as u32);
                writer.write_all(&credit).await.map_err(|e| {
                    TransferError::ConnectionLost(format!("returning slots to {peer}: {e}"))
                })?;
            }
            MSG_FINISH | MSG_ABORT if b.is_empty() => {
                if kind == MSG_ABORT {
                    self.core.abort(transfer);
                } else if let Some(done) = self.core.finish(transfer) {
                    send_done(writer, done, peer).await?;
                }
            }
            other => {
                return Err(TransferError::Protocol(format!(
                    "unknown message type {other} ({} bytes)",
                    body.len()
                )))
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
