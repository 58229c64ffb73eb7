//! Remote prefill's seam: who starts one, and how one can fail.
//!
//! A request placed on another worker ([`PrefillMode::Remote`](super::PrefillMode::Remote))
//! is parked by the engine with its destination blocks allocated. Its
//! [`RequestStream`](super::RequestStream) then hands the
//! [`RemotePrefill`] to the [`RemotePrefiller`] its handle was given (the
//! decode worker's, which calls the placed worker over gRPC), and keeps the
//! returned [`PrefillGuard`]: a stream dropped before its end (a client
//! that went away) cancels the prefill as well as the request. The server
//! in front only translates the router's placement into the request; it
//! never sees the prefill.
//!
//! The prefill ends in one
//! [`EngineHandle::finish_remote_prefill`](super::EngineHandle::finish_remote_prefill):
//! `Ok` when the transport delivered every block, or a
//! [`RemotePrefillError`]. Every failure has the same remedy: the engine
//! prefills the prompt locally. The variants exist so that logs, metrics
//! and tests can say which step failed without parsing a message.

use crate::kv_cache::BlockId;

use super::{EngineHandle, RemotePrefill};

/// Starts remote prefills for an engine ([`EngineHandle::set_remote_prefiller`]).
pub trait RemotePrefiller: Send + Sync + std::fmt::Debug + 'static {
    /// Asks `worker` to fill `prefill`'s blocks for request `request_id`.
    /// It must end with `engine.finish_remote_prefill(prefill.transfer, ..)`
    /// (directly or through the transport); dropping the guard cancels it.
    /// `span` is the request's: the prefill's own span is its child. Called
    /// from the stream's `next` (inside the runtime the stream is polled on).
    fn start(
        &self,
        request_id: &str,
        worker: &str,
        prefill: RemotePrefill,
        engine: EngineHandle,
        span: &tracing::Span,
    ) -> PrefillGuard;
}

/// Cancels a remote prefill when dropped.
#[derive(Default)]
pub struct PrefillGuard(Option<Box<dyn FnOnce() + Send>>);

impl PrefillGuard {
    /// Runs `cancel` when dropped (e.g. aborts the task making the call).
    pub fn on_drop(cancel: impl FnOnce() + Send + 'static) -> Self {
        Self(Some(Box::new(cancel)))
    }

    /// Lets the prefill run to its end instead of cancelling it (once the
    /// request is finished, its transfer is over and only the reply is
    /// still on its way).
    pub fn detach(mut self) {
        self.0 = None;
    }
}

impl Drop for PrefillGuard {
    fn drop(&mut self) {
        if let Some(cancel) = self.0.take() {
            cancel();
        }
    }
}

impl std::fmt::Debug for PrefillGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = if self.0.is_some() { "armed" } else { "inert" };
        f.debug_tuple("PrefillGuard").field(&state).finish()
    }
}

/// Why a remote prefill did not deliver the prompt's KV.
#[derive(Debug, thiserror::Error)]
pub enum RemotePrefillError {
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
