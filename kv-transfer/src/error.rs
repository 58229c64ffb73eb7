//! The crate's error type.
//!
//! Every variant's message says what went wrong and, where it helps, what to
//! fix. Errors are `Clone` because one failure (a lost connection) must be
//! handed to every transfer waiting on it; I/O errors are therefore kept as
//! their message.

use crate::TransferId;

/// What can go wrong moving KV blocks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The two sides' KV layouts differ; blocks cannot be copied byte for byte.
    #[error("KV layout mismatch: {field} {here} here, {peer} at the peer")]
    LayoutMismatch {
        /// The first field that differs (`num_layers`, `num_kv_heads`,
        /// `head_dim`, `block_size`, `dtype`).
        field: &'static str,
        /// This side's value.
        here: String,
        /// The peer's value.
        peer: String,
    },
    /// The peer could not prove it holds our cluster token (the handshake's
    /// HMAC challenge–response failed, either way): another cluster, a
    /// misconfigured worker, or not a tandem worker at all.
    #[error(
        "cluster token mismatch: the peer could not prove it holds this cluster's token \
         (another cluster, a misconfigured worker, or not a tandem worker; check the \
         cluster token on both workers)"
    )]
    BadToken,
    /// The peer speaks another protocol version.
    #[error("KV transfer protocol version {peer} at the peer, {here} here")]
    VersionMismatch {
        /// Our version.
        here: u16,
        /// The peer's version.
        peer: u16,
    },
    /// A layout descriptor that cannot describe a real cache.
    #[error("invalid KV layout: {0}")]
    InvalidLayout(String),
    /// A block write the sender could not send (wrong layer, block id or
    /// payload length).
    #[error("invalid block write: {0}")]
    InvalidBlock(String),
    /// The peer sent bytes that break the protocol; the connection is closed.
    #[error("KV transfer protocol error: {0}")]
    Protocol(String),
    /// The connection (or in-process channel) is gone; every transfer open on
    /// it failed.
    #[error("KV transfer connection lost: {0}")]
    ConnectionLost(String),
    /// The transfer was aborted by the sender.
    #[error("transfer {0} was aborted")]
    Aborted(TransferId),
    /// The receiver failed the transfer (its sink refused a block, or a block
    /// was out of range).
    #[error("transfer {transfer} failed at the receiver: {reason}")]
    Failed {
        /// The transfer.
        transfer: TransferId,
        /// The receiver's reason.
        reason: String,
    },
    /// `finish` was called twice for one transfer while the first still waits.
    #[error("transfer {0} is already being finished")]
    AlreadyFinishing(TransferId),
    /// An endpoint string that this transport cannot parse or does not know.
    #[error("bad endpoint {endpoint:?}: {reason}")]
    BadEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// Why it is unusable.
        reason: String,
    },
    /// A transport configured with values it cannot use.
    #[error("bad KV transport configuration: {0}")]
    Config(String),
    /// A step took longer than its limit.
    #[error("timed out after {millis} ms while {during}")]
    Timeout {
        /// What was being waited for.
        during: &'static str,
        /// The limit in milliseconds.
        millis: u64,
    },
    /// An operating-system I/O error.
    #[error("I/O error while {context}: {message}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The OS error's message.
        message: String,
    },
}

impl TransferError {
    pub(crate) fn io(context: &'static str, err: &std::io::Error) -> Self {
        TransferError::Io {
            context,
            message: err.to_string(),
        }
    }
}

/// Why a [`KvSink`](crate::KvSink) refused a block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteRefused {
    /// No transfer of this id is open at the receiver: the sender was not
    /// the peer it was opened for.
    #[error("transfer {0} was not opened by this receiver")]
    UnknownTransfer(TransferId),
    /// The block is not one of the transfer's destinations.
    #[error("block {0} is not a destination of this transfer")]
    NotADestination(u32),
    /// The block's K or V has another length than the layout's.
    #[error("a block of {got} bytes where the layout has {want}")]
    WrongLength {
        /// The bytes received.
        got: usize,
        /// The bytes the layout says.
        want: usize,
    },
}

/// Why a transfer failed at the receiver: what its sink's `finish` is told
/// (the sender hears the same as the `DONE` frame's message).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferFailure {
    /// A block for a layer the layout does not have.
    #[error("layer {layer} out of range: the layout has {layers} layers")]
    LayerOutOfRange {
        /// The layer sent.
        layer: u32,
        /// The layout's layers.
        layers: u32,
    },
    /// A block past the receiver's pool.
    #[error("destination block {block} out of range: the receiver has {blocks} blocks")]
    BlockOutOfRange {
        /// The block sent.
        block: u32,
        /// The receiver's blocks.
        blocks: u32,
    },
    /// The sink refused a block.
    #[error(transparent)]
    Refused(#[from] WriteRefused),
    /// The sender aborted the transfer.
    #[error("aborted by the sender")]
    Aborted,
    /// The connection ended with the transfer open (why, as the transport
    /// or the sender's `CLOSE` frame says).
    #[error("{0}")]
    ConnectionLost(String),
}
