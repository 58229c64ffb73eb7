//! Moving KV-cache blocks between workers (not built yet).
//!
//! This crate will own the `Transport` trait (register a memory region, write
//! a list of `(layer, source block, destination block)` to a peer, notify
//! completion) and its implementations: TCP on tokio, UCX (RDMA-ready, through
//! a bindgen sys crate against the system libucx), NCCL (GPU only, through
//! cudarc) and an in-process one for unit tests.
//!
//! **Architecture Invariant:** this crate knows the KV layout descriptor and
//! block ids, never the model or the scheduler.
