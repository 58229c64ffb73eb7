//! Support code for the cross-crate integration tests in `tests/tests/`
//! (their fixtures live in `tests/fixtures/`).
//!
//! [`python`] builds a Python gRPC client environment (grpcio, stubs generated
//! from `proto/`) for end-to-end tests of `tandem serve`. [`etcd`] runs a real,
//! throwaway `etcd` server on loopback ports for membership tests (plain, or
//! mutual TLS with a fresh test CA).
//! [`cluster`] starts real `tandem` processes and reads their addresses.
//! [`otlp`] is an OTLP trace collector inside the test process;
//! [`prometheus`] parses (strictly) what `/metrics` endpoints serve.
//! [`sim_worker`] is a decode worker's gRPC surface without a model, for
//! router tests and `router-bench`.

pub mod cluster;
pub mod etcd;
pub mod otlp;
pub mod prometheus;
pub mod python;
pub mod sim_worker;
