//! The public front of a tandem cluster (not built yet).
//!
//! It will take `Generate` calls over gRPC (and OpenAI-style HTTP), track
//! worker membership through etcd, and pick a prefill and a decode worker by
//! prefix affinity and load (after NVIDIA Dynamo's cost function with an
//! SGLang-style balance guard).
//!
//! **Architecture Invariant:** the router never runs the model; it shares only
//! the block-hash function with the engine.
