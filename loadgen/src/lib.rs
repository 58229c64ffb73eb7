//! The serving load generator behind `tandem bench serve`.
//!
//! A [`workload`] says what to send (prompt and output lengths drawn from
//! distributions, shared-prefix groups, or a JSONL file); an [`arrival`]
//! process says when (Poisson or gamma at a rate, or a fixed concurrency);
//! [`client::run`] sends it over gRPC and records each request's TTFT, token
//! gaps and end-to-end time; [`metrics::summarize`] turns the records into
//! percentiles, throughput and goodput at given SLOs.
//!
//! **Architecture Invariant:** the load generator knows only the public
//! `tandem.v1.Generation` API; it measures a router and a colocated server
//! the same way.

pub mod arrival;
pub mod client;
pub mod metrics;
pub mod plot;
pub mod rng;
pub mod sweep;
pub mod workload;

pub use arrival::Arrival;
pub use client::{connect, run, RunObserver, RunOptions};
pub use metrics::{summarize, RequestRecord, Slo, Stats, Summary};
pub use workload::{LengthDist, SharedPrefix, WorkItem, WorkloadSpec};

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum LoadgenError {
    #[error("workload: {0}")]
    Spec(String),
    #[error("connecting to {0}")]
    Connect(String),
}
