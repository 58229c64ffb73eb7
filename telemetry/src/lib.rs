//! Observability for every tandem process: logs, traces and metrics.
//!
//! * [`setup`]: one [`TelemetryConfig`] → the global `tracing` subscriber
//!   (text or JSON logs; OTLP span export when an endpoint is given).
//! * [`propagation`]: W3C `traceparent` in gRPC metadata, so one trace
//!   covers router → decode worker → prefill worker.
//! * [`metrics`]: a small Prometheus registry (counters, gauges, histograms,
//!   scrape-time collectors) and its text format; [`http`] serves it at
//!   `/metrics`.
//!
//! Components create their spans with plain `tracing` macros and their
//! instruments on a [`Registry`] handed to them; they never depend on
//! OpenTelemetry themselves beyond [`propagation`]. With export off, a span
//! costs what a `tracing` span costs with the log layer alone.
//!
//! **Architecture Invariant:** knows `tracing`, OpenTelemetry, Prometheus
//! text and gRPC metadata; nothing of engines, workers or the router.

pub mod http;
pub mod metrics;
pub mod propagation;
pub mod setup;

pub use metrics::Registry;
pub use setup::{flush, init, LogFormat, Telemetry, TelemetryConfig, TelemetryError};
