//! The decode pool worker (not built yet).
//!
//! It will receive requests from the router, allocate KV blocks (reusing its
//! own prefix-cache hits), ask a prefill worker to fill the rest, and run the
//! continuous-batching decode loop, streaming tokens back to the router.
