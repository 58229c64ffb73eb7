//! The prefill pool worker (not built yet).
//!
//! It will run prompts (chunked, reusing its own prefix cache), push each
//! layer's K/V for the new blocks straight into the decode worker's blocks
//! through `tandem-kv-transfer`, and return the first sampled token with a
//! completion notice.
