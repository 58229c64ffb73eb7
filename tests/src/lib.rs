//! Support code for the cross-crate integration tests in `tests/tests/`
//! (their fixtures live in `tests/fixtures/`).
//!
//! [`python`] builds a Python gRPC client environment (grpcio, stubs generated
//! from `proto/`) for end-to-end tests of `tandem serve`.

pub mod python;
