//! The collective and failure suites over shared-memory links (all ranks share this host).

const SHARED_MEMORY: bool = true;

#[path = "suites/collectives.rs"]
mod collectives;
mod common;
#[path = "suites/failure.rs"]
mod failure;
