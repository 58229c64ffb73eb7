//! The collective and failure suites over TCP links only.

const SHARED_MEMORY: bool = false;

#[path = "suites/collectives.rs"]
mod collectives;
mod common;
#[path = "suites/failure.rs"]
mod failure;
