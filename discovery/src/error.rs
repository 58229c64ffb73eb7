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
    /// An endpoint's URL scheme contradicts the TLS setting (`http://`
    /// with TLS, `https://` without).
    #[error("cannot use etcd endpoint {endpoint}: {reason}")]
    SchemeMismatch {
        endpoint: String,
        reason: &'static str,
    },
    /// etcd did not answer in time (not running, wrong address, partitioned,
    /// or a TLS handshake that never completes).
    #[error("cannot reach etcd at {endpoints}: {what} got no answer within {after:?} ({hint})")]
    Unreachable {
        endpoints: String,
        what: &'static str,
        after: Duration,
        hint: &'static str,
    },
    /// The connection to etcd failed (refused, reset, DNS, a TLS handshake
    /// refused by either side): gRPC `UNAVAILABLE`.
    #[error("cannot reach etcd at {endpoints} ({what}): {source} ({hint})")]
    Unavailable {
        endpoints: String,
        what: &'static str,
        source: etcd_client::Error,
        hint: &'static str,
    },
    /// etcd refused the user name and password (or has auth disabled).
    #[error(
        "etcd at {endpoints} refused to authenticate user {user:?}: {source} \
         (is the user name and password right, and is auth enabled in etcd?)"
    )]
    Auth {
        endpoints: String,
        user: String,
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
