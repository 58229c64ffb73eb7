//! The public front of a tandem cluster.
//!
//! It serves the same `tandem.v1.Generation` API as `tandem serve`. For each
//! call it tokenizes the prompt (when it has the model's tokenizer), hashes
//! it into chained block hashes, asks the KV index which decode worker
//! already holds how much of it, and picks a decode worker with the decode
//! policy. If the prompt's uncached part at that worker reaches the
//! remote-prefill threshold and a prefill worker is up, it also picks one
//! with the prefill policy and names it in the call's metadata. The decode
//! worker does the rest (decode-first, push). The chosen workers come back
//! in the response metadata.
//!
//! Membership comes from etcd (or a static list): each worker is probed
//! (`Info`, then `Load`), and one that stops answering stops getting
//! traffic within one probe interval. A request whose decode worker fails
//! mid-stream migrates to another one with the tokens generated so far
//! (`proxy.rs`), so its stream continues. In-flight load is counted by RAII guards that live in the
//! response stream, so no error path leaks it.
//!
//! Observability: each call is a `generate` span (its `routing` child
//! records the candidates' scores, the picks and the reasons) whose W3C
//! context goes to the decode worker in the call's metadata;
//! [`RouterMetrics`] counts outcomes, decisions and placements.
//!
//! **Architecture Invariant:** the router never runs the model; it shares
//! only the block-hash function (and the tokenizer) with the engine.

pub mod adapters;
pub mod index;
pub mod metrics;
pub mod peer;
pub mod policy;
pub mod pool;
pub mod prompt;
mod proxy;
mod service;

pub use metrics::{register_cluster, RouterMetrics};
pub use policy::{
    Candidate, Decision, KvPolicy, PolicyKind, PromptFacts, RoutingPolicy, UnknownPolicy,
};
pub use pool::{BadWorkerAddress, Cluster, InFlight, Refusal, Resync, Role, Worker};
pub use proxy::MAX_MIGRATIONS;
pub use service::{RouterService, DEFAULT_WORKER_WAIT};
