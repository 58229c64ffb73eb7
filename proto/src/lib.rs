//! Protocol definitions for tandem (not built yet).
//!
//! This crate will own the `.proto` files and the tonic/prost code generated
//! from them: the public `Generate` API that users call on the router, and the
//! worker-internal APIs (decode-to-prefill control, KV-event streams, load
//! reports, the KV layout descriptor exchanged before any transfer).
//!
//! It is empty on purpose until the serving engine (issue "Serving engine")
//! gives the API something real to call; nothing here is a stand-in.
