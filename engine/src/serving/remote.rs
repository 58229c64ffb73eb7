//! How a remote prefill can go wrong, as the engine is told.
//!
//! A decode worker's remote prefill ends in one
//! [`EngineHandle::finish_remote_prefill`](super::EngineHandle::finish_remote_prefill):
//! `Ok` when the transport delivered every block, or one of these. Any
//! failure has one remedy, the same for all: the engine prefills the prompt
//! locally. The variants exist so that logs, metrics and tests can say which
//! step failed without parsing a message.

use crate::kv_cache::BlockId;

/// Why a remote prefill did not deliver the prompt's KV.
#[derive(Debug, thiserror::Error)]
pub enum RemotePrefillError {
    /// No prefill worker to ask (the request named none, or this worker
    /// has no way to reach one).
    #[error("no prefill worker")]
    NoPrefillWorker,
    /// The call to the prefill worker could not start.
    #[error("not started: {0}")]
    NotStarted(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The prefill worker refused or failed the call (its gRPC message).
    #[error("prefill worker: {0}")]
    PrefillWorker(String),
    /// The prefill worker replied, but the transport never finished the
    /// transfer.
    #[error("the prefill worker replied without finishing the transfer")]
    Unfinished,
    /// The transport failed the transfer (refused, aborted, cut off).
    #[error("KV transfer: {0}")]
    Transfer(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The sender said done with block-layers it owed never written.
    #[error("the transfer ended with {0} block-layers never written")]
    Incomplete(usize),
}

/// Why a received block was not written (the block is dropped; the
/// transfer then ends [`RemotePrefillError::Incomplete`]).
#[derive(Debug, thiserror::Error)]
pub enum KvWriteError {
    /// No parked request has this transfer (aborted, or already finished).
    #[error("no remote prefill {0} is waiting for blocks")]
    NotParked(u64),
    /// The block is not one of the transfer's destinations for this layer.
    #[error("block {block} is not a destination of layer {layer} in remote prefill {transfer}")]
    NotADestination {
        transfer: u64,
        layer: usize,
        block: BlockId,
    },
    /// The compute backend could not store it.
    #[error("writing the block: {0}")]
    Backend(#[source] crate::EngineError),
}
