//! Cluster security shared by every tandem process: TLS settings for every
//! gRPC hop ([`tls`]), the development CA behind `tandem certs` ([`certs`])
//! and API keys on the public APIs ([`api_keys`]).
//!
//! # The model
//!
//! - **mTLS everywhere, one cluster CA.** Every gRPC server (router, prefill
//!   and decode workers, `tandem serve`) presents a certificate signed by the
//!   cluster CA and, when TLS is on, *requires* its clients to present one
//!   signed by the same CA; every gRPC client (router → workers, decode →
//!   prefill, the test and CLI clients) verifies the server against that CA
//!   and presents its own certificate. A peer without a certificate from the
//!   CA does not get past the TLS handshake. Certificates name their
//!   holder's role ([`roles`]); workers serve only the roles that call them
//!   (a decode worker the router, a prefill worker's `Prefill` decode
//!   workers), so a client certificate cannot act as a worker. [`TlsConfig`] names the three
//!   PEM files (certificate, key, CA); [`TlsConfig::load`] reads them once
//!   into a [`LoadedTls`], which makes tonic's server and client settings.
//!   TLS is rustls with the `ring` provider (tonic's `tls-ring`), the only
//!   TLS stack in the workspace.
//! - **API keys on the public APIs.** The router's `tandem.v1.Generation`
//!   (gRPC `authorization: Bearer KEY`) and the OpenAI HTTP API check the
//!   caller's key against [`ApiKeys`], in constant time. Health, reflection
//!   and metrics stay open. Keys authenticate *callers*; certificates
//!   authenticate *machines*: with both on, a public client needs both.
//! - **KV transfer peers** are not TLS peers (the UCX data path is RMA); they
//!   prove the cluster secret by challenge–response in `tandem-kv-transfer`.

pub mod api_keys;
pub mod certs;
pub mod cluster_auth;
pub mod roles;
pub mod tls;

pub use api_keys::{ApiKeyError, ApiKeyInterceptor, ApiKeys};
pub use certs::{write_dev_certs, DevCerts};
pub use cluster_auth::{
    ClusterAuthInterceptor, ClusterChannel, ClusterCredential, CLUSTER_AUTH_HEADER,
    DEV_CLUSTER_TOKEN,
};
pub use roles::PeerRole;
pub use tls::{LoadedTls, TlsConfig, TlsError};
