//! The serving engine: many concurrent requests over one model.
//!
//! * [`EngineCore`] is the synchronous heart: a [`Scheduler`](scheduler)
//!   picks each step's work under a token budget (decodes first, then
//!   prefill chunks, then new requests after a prefix-cache lookup), one
//!   [`Model::forward`](crate::Model::forward) call runs it all as one
//!   flattened batch, and every choice that completed its pending tokens
//!   samples one. Continuous batching and chunked prefill are the same
//!   mechanism: nothing waits for a batch to drain.
//! * [`EngineHandle`] runs a core on its own thread, fed by a command
//!   channel. Each request gets a [`RequestStream`] of [`RequestEvent`]s;
//!   dropping the stream aborts the request, which frees its blocks at once.
//!
//! Requests are validated before they reach the loop ([`request`]), so the
//! loop only sees work it can do; a request that could never fit the KV pool
//! is refused up front rather than left waiting.
//!
//! **Architecture Invariant:** nothing here knows about gRPC or the network:
//! servers turn their messages into a [`Request`] and consume events.

mod core;
mod handle;
mod output;
pub mod request;
mod scheduler;

pub use self::core::{EngineConfig, EngineCore, EngineStats, KvPoolSize};
pub use handle::{EngineHandle, RequestStream};
pub use request::{
    ChoiceSummary, Limits, Prompt, Request, RequestEvent, RequestSummary, Timings, TokenDelta,
    Usage, MAX_LOGPROBS,
};
