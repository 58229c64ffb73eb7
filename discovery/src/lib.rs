//! Cluster membership: which prefill and decode workers exist right now.
//!
//! Workers announce themselves in etcd and the router follows along
//! (`../shared/DESIGN.md`, "Router"):
//!
//! * each worker holds one key, `/tandem/<cluster>/workers/<role>/<id>`,
//!   whose value is its [`WorkerRecord`], under a lease ([`DEFAULT_TTL`],
//!   10 s) that a background task keeps alive ([`Registration`]);
//! * the router reads the prefix once and then watches it ([`watch`]):
//!   a snapshot plus [`MembershipEvent`]s, `Up` on a put and `Down` on a
//!   delete, whether the worker drained (the lease is revoked, the key goes
//!   at once), crashed (the lease expires one TTL later) or was partitioned
//!   (same, and it re-registers on its own when it can reach etcd again);
//! * without etcd a [`StaticMembership`] gives the same snapshot and an event
//!   stream that never yields, so the router has one code path.
//!
//! etcd is the single source of truth, and the lease is the liveness signal:
//! there is no separate heartbeat protocol, and nothing here decides a
//! worker is dead except etcd deleting its key.
//!
//! **Architecture Invariant:** discovery knows worker records as opaque
//! bytes plus role, id and address; it knows nothing of models, engines or
//! gRPC services. Callers put their own description (the workers' protobuf
//! `WorkerInfo`) in [`WorkerRecord::payload`] and decode it themselves.
//!
//! **Architecture Invariant:** every etcd call is bounded in time
//! ([`etcd::REQUEST_TIMEOUT`]) and every retry loop backs off, so an
//! unreachable etcd produces errors and log lines, never a hang or a spin.
//!
//! How etcd is reached is one value, [`EtcdConfig`]: the endpoints, and
//! optionally TLS ([`EtcdTls`]: a CA, and a client certificate for mutual
//! TLS) and a user and password (etcd's RBAC auth). etcd-client
//! authenticates once per client and etcd forgets tokens when it restarts
//! or they expire, so every long-lived task here (the keep-alive, the watch)
//! replaces its client after a failure instead of retrying on the old one.
//!
//! Modules: [`record`] (roles, records, keys, the value encoding), `config`
//! ([`EtcdConfig`], [`EtcdTls`]), [`etcd`] (connection, bounded calls,
//! backoff), `register` ([`Registration`]),
//! `watch` ([`watch`], [`MembershipEvents`]), `static_list`
//! ([`StaticMembership`]), `error` ([`DiscoveryError`]).

mod config;
mod error;
pub mod etcd;
pub mod record;
mod register;
mod static_list;
mod watch;

pub use config::{EtcdConfig, EtcdTls};
pub use error::DiscoveryError;
pub use record::{worker_key, workers_prefix, Role, WorkerRecord};
pub use register::{Registration, DEFAULT_TTL};
pub use static_list::StaticMembership;
pub use watch::{watch, MembershipEvent, MembershipEvents};
