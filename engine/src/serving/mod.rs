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
//! Disaggregation hooks, all without networking: a request placed on
//! another worker ([`PrefillMode::Remote`]) parks, and its stream hands the
//! [`RemotePrefill`] naming the blocks to fill to the handle's
//! [`RemotePrefiller`] (the decode worker's); received blocks come back
//! through `write_kv` and the transfer ends with `finish_remote_prefill`
//! ([`remote`]). A prefill worker runs [`PrefillMode::Export`] requests
//! whose [`KvExport`] sink sees each layer's blocks as soon as the layer is
//! computed.
//!
//! Routers follow each engine's prefix cache through a bounded feed
//! ([`KvFeed`], at most [`MAX_KV_SUBSCRIBERS`] at once, each dropped when
//! it falls [`KV_FEED_BACKLOG`] messages behind).
//!
//! Requests are validated before they reach the loop ([`request`]), so the
//! loop only sees work it can do; a request that could never fit the KV pool
//! is refused up front rather than left waiting.
//!
//! **Architecture Invariant:** nothing here knows about gRPC or the network:
//! servers turn their messages into a [`Request`] and consume events.

mod constrained;
mod core;
mod handle;
mod kv_feed;
mod output;
pub mod remote;
pub mod request;
mod resume;
mod scheduler;
mod stop;

pub use self::core::{
    BadStepTimeLimit, DiskTierStats, EngineConfig, EngineCore, EngineStats, KvPoolSize,
    StepTimeLimit, LOAD_HOLD,
};
pub use handle::{EngineHandle, RequestStream, RESUMED_HEADROOM};
pub use kv_feed::{
    KvFeed, KvSubscription, TooManyKvSubscribers, KV_FEED_BACKLOG, MAX_KV_SUBSCRIBERS,
};
pub use remote::{KvWriteError, PrefillGuard, RemotePrefillError, RemotePrefiller};
pub use request::{
    BeamSearch, ChoiceSummary, CollectedExport, EarlyStopping, ExportedBlock, FailureScope,
    KvExport, Limits, LoraRef, OwnedBlock, PrefillMode, PrefillPlacement, Prompt, PromptLogprobs,
    RemotePrefill, Request, RequestEvent, RequestFailure, RequestSummary, Timings, TokenDelta,
    Usage, MAX_LOGPROBS,
};
pub use resume::{ReplayError, Resume, ResumedChoice};
pub use stop::{MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES, MAX_STOP_TOKEN_IDS};
pub use tandem_kv_disk::format::HEADER_BYTES as DISK_HEADER_BYTES;
pub use tandem_kv_disk::{
    fingerprint as disk_fingerprint, DiskStats, DiskStatsReader, DiskTier, DiskTierConfig,
};
pub use tandem_structured::ResponseFormat;
