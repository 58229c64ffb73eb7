//! [`DiscoveryError`]: every way membership can fail, worded so the reader
//! knows what to fix.

use std::time::Duration;

/// Why a registration or a watch failed.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// No etcd endpoint was given.
    #[error(
        "no etcd endpoints given: pass at least one client URL such as \
         http://127.0.0.1:2379, or use the static worker list instead"
    )]
    NoEndpoints,
    /// The endpoint list could not be used (a malformed URL).
    #[error("cannot use etcd endpoints {endpoints}: {source} (give client URLs like http://127.0.0.1:2379)")]
    BadEndpoints {
        endpoints: String,
        source: etcd_client::Error,
    },
    /// etcd did not answer in time (not running, wrong address, partitioned).
    #[error(
        "cannot reach etcd at {endpoints}: {what} got no answer within {after:?} \
         (is etcd running there, and is the address right?)"
    )]
    Unreachable {
        endpoints: String,
        what: &'static str,
        after: Duration,
    },
    /// The connection to etcd failed (refused, reset, DNS): gRPC
    /// `UNAVAILABLE`.
    #[error(
        "cannot reach etcd at {endpoints} ({what}): {source} (is etcd running there, \
         and is the address right?)"
    )]
    Unavailable {
        endpoints: String,
        what: &'static str,
        source: etcd_client::Error,
    },
    /// etcd answered with an error.
    #[error("etcd at {endpoints} failed {what}: {source}")]
    Request {
        endpoints: String,
        what: &'static str,
        source: etcd_client::Error,
    },
    /// etcd granted a lease with a nonsensical TTL or refused the grant.
    #[error("etcd at {endpoints} did not grant a lease: {reason}")]
    Lease { endpoints: String, reason: String },
    /// A cluster name, worker id or address cannot form a key.
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidName {
        what: &'static str,
        value: String,
        reason: &'static str,
    },
    /// A role string is neither `prefill` nor `decode`.
    #[error("unknown worker role {0:?}: expected \"prefill\" or \"decode\"")]
    UnknownRole(String),
    /// A stored key or value is not a worker record.
    #[error("bad worker record: {0}")]
    Encoding(String),
    /// A static worker list names the same worker twice.
    #[error("the static worker list names {role} worker {addr} twice; list each worker once")]
    DuplicateStaticWorker { role: crate::Role, addr: String },
}
