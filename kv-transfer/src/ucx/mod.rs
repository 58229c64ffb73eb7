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

mod receive;
mod rt;
mod send;

use receive::{serve_connection, ListenCtx};
use send::{ack_loop, write_loop, SlotPlan, WriteCtx};

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
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch, Semaphore};

use crate::handshake::{client_handshake, server_handshake};
use crate::protocol;
use crate::session::{
    AbortOnDrop, ChannelSession, Command, Completions, ReceiverCore, TransferCounters,
};
use crate::tcp::{frame_len, linger_close, lost, read_header, send_done, timeout_error, TcpConfig};
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
        let (listener, endpoint) = crate::tcp::bind_listener(bind).await?;
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
        let (mut reader, mut writer) = crate::tcp::dial(endpoint, config).await?;
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
        Ok(Box::new(ChannelSession::new(
            endpoint,
            layout,
            num_blocks,
            commands,
            completions,
            acks,
        )))
    }
}

#[cfg(test)]
mod tests;
