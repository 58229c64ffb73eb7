//! Moving KV-cache blocks between workers.
//!
//! A prefill worker computes a prompt's KV cache and pushes it, block by
//! block and layer by layer, into blocks the decode worker has allocated for
//! the sequence. This crate is the pipe: the [`Transport`] trait and its
//! implementations, [`tcp::TcpTransport`] (tokio, works everywhere),
//! `ucx::UcxTransport` (cargo feature `ucx`: RMA puts over UCX — RDMA,
//! TCP or shared memory as `UCX_TLS` says) and [`inproc::InProcTransport`]
//! (unit tests). [`TransportKind`] and [`transport`] pick one from
//! configuration. An NCCL implementation would sit behind the same trait.
//!
//! **Architecture Invariant:** this crate knows block ids, layers and the
//! [`KvLayoutDescriptor`], never the model, the scheduler or the engine; it
//! does not depend on `tandem-engine`. A block is opaque bytes whose length
//! the layout fixes; the workers translate between engine blocks and
//! [`BlockWrite`]s / [`KvSink`] calls.
//!
//! # The model
//!
//! - The **receiver** (decode worker) "registers its memory region" by
//!   calling [`Transport::listen`] with its layout and a [`KvSink`]: the sink
//!   is told how many blocks it has ([`KvSink::num_blocks`]) and is handed
//!   every incoming block ([`KvSink::write`]), then exactly one
//!   [`KvSink::finish`] per transfer. The returned [`Listener`] names the
//!   endpoint peers connect to and stops everything when dropped.
//! - The **sender** (prefill worker) calls [`Transport::connect`] and gets a
//!   [`Session`]. It copies its source blocks out into [`BlockWrite`]s
//!   (layer, destination block, K bytes, V bytes; the source block id is its
//!   own business), [`Session::write`]s them under a [`TransferId`] (one per
//!   request), and [`Session::finish`]es the transfer, which resolves once
//!   the receiver has delivered every block of it and called
//!   `finish(Ok)` — one acknowledgement per transfer, never per block.
//!   [`Session::abort`] gives up a transfer.
//! - Before the first block both sides exchange the layout descriptor and
//!   prove to each other that they hold the cluster token (an HMAC-SHA256
//!   challenge–response over fresh nonces from both sides: the token never
//!   travels and a recorded handshake cannot be replayed); any difference is
//!   refused on both sides with an error naming it
//!   ([`TransferError::LayoutMismatch`], [`TransferError::BadToken`]), never
//!   silent corruption. A peer that cannot prove the token never reaches the
//!   sink (TCP) or the receive region's rkey (UCX), and a listener that
//!   cannot prove it is never sent a block. Which transfers a proven peer
//!   may write is the receiver's business: the decode worker accepts only
//!   transfer ids it handed out (see `tandem-decode-worker`).
//!
//! # Guarantees every implementation keeps
//!
//! - The writes of one transfer reach the sink in the order they were
//!   written, and its `finish` comes after all of them. Many transfers may
//!   interleave on one session.
//! - `KvSink::finish` is called exactly once for every transfer the sink has
//!   seen: `Ok` when the sender finished it, `Err` when the sender aborted
//!   it, a block was refused, or the connection dropped while it was open.
//! - A lost connection fails every open transfer on both sides: the sink's
//!   `finish(Err)`, and the sender's pending and later calls return
//!   [`TransferError::ConnectionLost`]. Nothing waits forever.
//! - Bad input from a peer (wrong sizes, a block id past the sink's pool,
//!   garbage bytes, absurd length prefixes) is an error for that transfer or
//!   that connection, never a panic, a hang or an unbounded allocation; the
//!   listener keeps serving its other connections.
//!
//! # Why `async-trait` and `&self`
//!
//! The worker picks its transport from configuration at run time (TCP, UCX,
//! NCCL), so it holds an `Arc<dyn Transport>` and a `Box<dyn Session>`;
//! native `async fn` in traits is not object safe, so the traits use
//! `async-trait` (one boxed future per call, negligible next to a transfer).
//! Session methods take `&self` so one session (one connection to one decode
//! worker) can be shared by many request tasks, each driving its own
//! transfer and awaiting its own `finish` concurrently.

pub mod error;
mod handshake;
pub mod inproc;
pub mod layout;
mod protocol;
mod session;
pub mod tcp;
#[cfg(feature = "ucx")]
pub mod ucx;

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

pub use error::{TransferError, TransferFailure, WriteRefused};
pub use layout::{KvDtype, KvLayoutDescriptor, KvRows, MAX_BLOCK_LAYER_BYTES};

/// Names one transfer (typically one request's prompt) on a session. The
/// sender chooses it; it must be unique among the session's open transfers
/// and may be reused once the previous one finished or was aborted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(pub u64);

impl std::fmt::Display for TransferId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// One block of one layer to write into the receiver's cache.
///
/// `k` must be exactly [`KvLayoutDescriptor::block_layer_bytes`] long and
/// `v` [`KvLayoutDescriptor::value_bytes`] (empty for a latent layout), in
/// the engine's in-block
/// order `[kv_head][slot][head_dim]`. [`Bytes`] lets a sender hand over a
/// `Vec<u8>` without a copy (`Bytes::from(vec)`) and lets the TCP transport
/// write the payload straight from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockWrite {
    /// Layer index, below the layout's `num_layers`.
    pub layer: u32,
    /// Destination block id in the receiver's pool, below its
    /// [`KvSink::num_blocks`].
    pub dst_block: u32,
    /// K bytes of this block in this layer.
    pub k: Bytes,
    /// V bytes of this block in this layer.
    pub v: Bytes,
}

/// Where incoming blocks land: the receiver's side of a transfer.
///
/// The decode worker implements it by forwarding to its engine thread, which
/// copies the bytes into its KV cache. Calls for one connection come from one
/// task, in order; calls from different connections may be concurrent. The
/// methods are synchronous and run on the transport's task, so they should
/// be quick (copy the bytes or hand them to a channel) and never block on
/// the network.
pub trait KvSink: Send + Sync {
    /// The number of blocks in the receiver's pool; a write to a block at or
    /// past this fails its transfer.
    fn num_blocks(&self) -> u32;

    /// Stores K and V of `block` in `layer` for `transfer`. `k` is exactly
    /// `block_layer_bytes` long, `v` `value_bytes`. An `Err` fails the transfer: the
    /// sink then gets `finish(Err)` and no more writes for it.
    fn write(
        &self,
        transfer: TransferId,
        layer: u32,
        block: u32,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), WriteRefused>;

    /// Called exactly once per transfer the sink has seen: `Ok` after all its
    /// writes were delivered, `Err` if it was aborted, refused or cut off.
    fn finish(&self, transfer: TransferId, outcome: Result<(), TransferFailure>);

    /// Told about every connection-level failure on the receiving side: a
    /// refused handshake (wrong token, layout mismatch), a protocol error.
    /// `peer` names the remote end. Does nothing by default; the transport
    /// also logs these with `tracing`.
    fn peer_error(&self, peer: &str, error: &TransferError) {
        let _ = (peer, error);
    }
}

/// A listening endpoint: incoming sessions deliver into its sink while it
/// lives. Dropping it stops accepting and closes every connection it
/// accepted (their open transfers finish with `Err`).
pub struct Listener {
    endpoint: String,
    _guard: Box<dyn Send + Sync>,
}

impl Listener {
    /// For implementations: a listener reachable at `endpoint` that serves
    /// until `guard` is dropped.
    pub fn new(endpoint: String, guard: Box<dyn Send + Sync>) -> Self {
        Self {
            endpoint,
            _guard: guard,
        }
    }

    /// The string peers pass to [`Transport::connect`] (for TCP the bound
    /// `ip:port`, with the real port when bound to port 0).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

/// What a transport holds right now, over all its connections: what an
/// operator watches to see that cancelled and failed transfers leave
/// nothing behind (exported as `tandem_kv_transfer_open_transfers` and
/// `tandem_kv_transfer_connections_lost_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferCounts {
    /// Transfers open at this process's receivers (per-connection state:
    /// begun and not yet finished, aborted or closed).
    pub receiving: u64,
    /// Transfers this process's sessions have written to and not yet
    /// finished or aborted.
    pub sending: u64,
    /// Sessions whose connection failed (every call on them then fails).
    pub connections_lost: u64,
}

/// A way to move KV blocks between workers.
#[async_trait]
pub trait Transport: Send + Sync + std::fmt::Debug {
    /// The transport's live counts, summed over its sessions and listeners.
    fn counts(&self) -> TransferCounts;

    /// Starts receiving blocks of `layout` into `sink` at `bind` (TCP:
    /// `"ip:port"`, port 0 for any; in-process: `"inproc://name"` or
    /// `"inproc://"` for a fresh name).
    async fn listen(
        &self,
        bind: &str,
        layout: KvLayoutDescriptor,
        sink: Arc<dyn KvSink>,
    ) -> Result<Listener, TransferError>;

    /// Opens a session to a listener's endpoint; fails unless the handshake
    /// (protocol version, cluster token, layout) agrees.
    async fn connect(
        &self,
        endpoint: &str,
        layout: KvLayoutDescriptor,
    ) -> Result<Box<dyn Session>, TransferError>;
}

/// The sending side of a connection to one receiver.
#[async_trait]
pub trait Session: Send + Sync + std::fmt::Debug {
    /// The endpoint this session is connected to.
    fn endpoint(&self) -> &str;

    /// The layout both sides agreed on.
    fn layout(&self) -> &KvLayoutDescriptor;

    /// The receiver's pool size, as its sink reported at the handshake.
    fn peer_num_blocks(&self) -> u32;

    /// Queues `blocks` for `transfer`. Returns once they are handed to the
    /// transport (with back-pressure when it is behind), not when they
    /// arrive; there is no per-block round trip. Blocks with a wrong layer,
    /// block id or payload length are refused here with
    /// [`TransferError::InvalidBlock`] before anything is sent.
    async fn write(
        &self,
        transfer: TransferId,
        blocks: Vec<BlockWrite>,
    ) -> Result<(), TransferError>;

    /// Ends `transfer` and waits until the receiver has delivered every block
    /// written for it and finished it; an error when the receiver failed it
    /// or the connection was lost first.
    async fn finish(&self, transfer: TransferId) -> Result<(), TransferError>;

    /// Gives up `transfer`: the receiver finishes it with `Err` and a pending
    /// [`finish`](Session::finish) returns [`TransferError::Aborted`].
    async fn abort(&self, transfer: TransferId) -> Result<(), TransferError>;
}

/// Which transport a worker moves KV blocks with (`--kv-transport`). Both
/// ends of a transfer must use the same one; a mismatch is refused at the
/// handshake with an error naming both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum TransportKind {
    /// [`tcp::TcpTransport`].
    #[default]
    Tcp,
    /// `ucx::UcxTransport` (needs the `ucx` cargo feature).
    Ucx,
}

impl TransportKind {
    /// The name used on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Ucx => "ucx",
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for TransportKind {
    type Err = TransferError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "tcp" => Ok(TransportKind::Tcp),
            "ucx" => Ok(TransportKind::Ucx),
            other => Err(TransferError::Config(format!(
                "unknown KV transport {other:?}; expected tcp or ucx"
            ))),
        }
    }
}

/// Builds the transport `kind` names with `cluster_token`. UCX reads its
/// own settings (`UCX_TLS`, ...) from the environment. An error when `kind`
/// is UCX and this build lacks the `ucx` feature, or UCX cannot start.
pub fn transport(
    kind: TransportKind,
    cluster_token: &str,
) -> Result<Arc<dyn Transport>, TransferError> {
    match kind {
        TransportKind::Tcp => Ok(Arc::new(tcp::TcpTransport::new(cluster_token))),
        #[cfg(feature = "ucx")]
        TransportKind::Ucx => Ok(Arc::new(ucx::UcxTransport::new(cluster_token)?)),
        #[cfg(not(feature = "ucx"))]
        TransportKind::Ucx => Err(TransferError::Config(
            "this build has no UCX transport (rebuild with the `ucx` feature)".into(),
        )),
    }
}

/// Constant-time equality for the cluster token: the time taken depends on
/// the lengths only, not on where the first differing byte is.
pub(crate) fn token_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= usize::from(x ^ y);
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_eq_compares_whole_strings() {
        assert!(token_eq(b"secret", b"secret"));
        assert!(!token_eq(b"secret", b"secreT"));
        assert!(!token_eq(b"secret", b"secret2"));
        assert!(!token_eq(b"", b"x"));
        assert!(token_eq(b"", b""));
    }

    #[test]
    fn transport_kind_parses_and_refuses_unknown_names() {
        for kind in [TransportKind::Tcp, TransportKind::Ucx] {
            assert_eq!(kind.as_str().parse::<TransportKind>(), Ok(kind));
        }
        let err = "rdma".parse::<TransportKind>();
        assert!(
            matches!(&err, Err(TransferError::Config(m)) if m.contains("tcp or ucx")),
            "{err:?}"
        );
    }
}
