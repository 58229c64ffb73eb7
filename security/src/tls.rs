//! TLS settings shared by every component: one certificate and key per
//! process and the cluster CA, all PEM files.
//!
//! [`TlsConfig`] is the configuration (paths; `--tls-cert`, `--tls-key`,
//! `--tls-ca`); [`TlsConfig::load`] reads the files once at start-up into a
//! [`LoadedTls`], so a missing or unreadable file is a start-up error, not a
//! failed request later. A [`LoadedTls`] gives:
//!
//! - [`LoadedTls::server`]: the server's settings. The CA is always given as
//!   the client root, so a client without a certificate signed by the
//!   cluster CA is refused in the TLS handshake (mutual TLS).
//! - [`LoadedTls::endpoint`]: a tonic `Endpoint` for `host:port` over
//!   `https`, verifying the server against the CA (its certificate must name
//!   the host dialled, IP or DNS name) and presenting this process's
//!   certificate.
//!
//! Without TLS, [`plain_endpoint`] gives the same endpoint over `http`, so
//! callers hold an `Option<LoadedTls>` and call [`endpoint`].

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// Errors of TLS configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading the TLS {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a PEM {what} (no `-----BEGIN` line)")]
    NotPem { what: &'static str, path: PathBuf },
    #[error("TLS needs --tls-cert, --tls-key and --tls-ca together; missing {0}")]
    Incomplete(&'static str),
    #[error("bad address {addr}: {message}")]
    Address { addr: String, message: String },
}

/// Where a process's TLS material lives: its certificate (chain) and private
/// key, and the cluster CA that signs every peer's certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// Builds a [`TlsConfig`] from optional parts (as flags arrive).
#[derive(Debug, Clone, Default)]
pub struct TlsConfigBuilder {
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    ca: Option<PathBuf>,
}

impl TlsConfigBuilder {
    /// This process's certificate (PEM, leaf first).
    pub fn cert(mut self, path: impl Into<PathBuf>) -> Self {
        self.cert = Some(path.into());
        self
    }

    /// This process's private key (PEM).
    pub fn key(mut self, path: impl Into<PathBuf>) -> Self {
        self.key = Some(path.into());
        self
    }

    /// The cluster CA certificate (PEM).
    pub fn ca(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca = Some(path.into());
        self
    }

    /// `Ok(None)` when nothing was given (TLS off), the config when all
    /// three were, an error naming what is missing otherwise.
    pub fn build(self) -> Result<Option<TlsConfig>, TlsError> {
        match (self.cert, self.key, self.ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Ok(Some(TlsConfig { cert, key, ca })),
            (None, _, _) => Err(TlsError::Incomplete("--tls-cert")),
            (_, None, _) => Err(TlsError::Incomplete("--tls-key")),
            (_, _, None) => Err(TlsError::Incomplete("--tls-ca")),
        }
    }
}

impl TlsConfig {
    /// A builder; all three paths are required.
    pub fn builder() -> TlsConfigBuilder {
        TlsConfigBuilder::default()
    }

    /// The files of the component holding `role` under a directory
    /// written by [`write_dev_certs`](crate::write_dev_certs): `ROLE.pem`,
    /// `ROLE.key` and `ca.pem`.
    pub fn in_dir(dir: &Path, role: crate::PeerRole) -> Self {
        Self {
            cert: dir.join(format!("{role}.pem")),
            key: dir.join(format!("{role}.key")),
            ca: dir.join("ca.pem"),
        }
    }

    /// Reads the three files.
    pub fn load(&self) -> Result<LoadedTls, TlsError> {
        Ok(LoadedTls {
            cert: read_pem("certificate", &self.cert)?,
            key: read_pem("private key", &self.key)?,
            ca: read_pem("CA certificate", &self.ca)?,
        })
    }
}

fn read_pem(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    if !bytes.windows(10).any(|w| w == b"-----BEGIN") {
        return Err(TlsError::NotPem {
            what,
            path: path.to_path_buf(),
        });
    }
    Ok(bytes)
}

/// TLS material read into memory.
#[derive(Clone)]
pub struct LoadedTls {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Vec<u8>,
}

impl std::fmt::Debug for LoadedTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedTls").finish_non_exhaustive()
    }
}

impl LoadedTls {
    /// From PEM bytes (tests and callers that hold the material already).
    pub fn from_pem(cert: Vec<u8>, key: Vec<u8>, ca: Vec<u8>) -> Self {
        Self { cert, key, ca }
    }

    fn identity(&self) -> Identity {
        Identity::from_pem(&self.cert, &self.key)
    }

    /// Server settings: this identity, and client certificates signed by the
    /// CA required.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity())
            .client_ca_root(Certificate::from_pem(&self.ca))
            .timeout(TLS_HANDSHAKE_TIMEOUT)
    }

    /// Client settings: trust only the CA, present this identity.
    pub fn client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca))
            .identity(self.identity())
    }

    /// An `https` endpoint for `addr` (`host:port`) with [`Self::client`].
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint, TlsError> {
        let bad = |e: &dyn std::fmt::Display| TlsError::Address {
            addr: addr.to_string(),
            message: e.to_string(),
        };
        Endpoint::from_shared(format!("https://{addr}"))
            .map_err(|e| bad(&e))?
            .tls_config(self.client())
            .map_err(|e| bad(&e))
    }
}

/// An `http` endpoint for `addr` (`host:port`).
pub fn plain_endpoint(addr: &str) -> Result<Endpoint, TlsError> {
    Endpoint::from_shared(format!("http://{addr}")).map_err(|e| TlsError::Address {
        addr: addr.to_string(),
        message: e.to_string(),
    })
}

/// HTTP/2 keep-alive on every channel between components: a ping this
/// often while calls are open...
pub const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);
/// ...and the connection is dropped when one goes unanswered this long. A
/// peer that is stopped or partitioned still has its kernel ACK TCP, so
/// without pings a call to it would wait forever; with them its streams
/// fail within 15 s, whatever their own deadlines.
pub const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// A server drops a connection whose TLS handshake has not completed in
/// this long (before any certificate is checked: pre-auth state is bounded
/// in time as well as by the listener's connection cap).
pub const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// Connecting to a peer gives up after this long.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// The endpoint for `addr`: over TLS when `tls` is given, plain otherwise,
/// with the keep-alive and connect timeout every internal channel uses.
pub fn endpoint(tls: Option<&LoadedTls>, addr: &str) -> Result<Endpoint, TlsError> {
    let endpoint = match tls {
        Some(t) => t.endpoint(addr),
        None => plain_endpoint(addr),
    }?;
    Ok(endpoint
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_wants_all_or_nothing() {
        assert_eq!(TlsConfig::builder().build().expect("ok"), None);
        let err = TlsConfig::builder()
            .cert("c.pem")
            .ca("ca.pem")
            .build()
            .expect_err("no key");
        assert!(err.to_string().contains("--tls-key"), "{err}");
        let full = TlsConfig::builder()
            .cert("c.pem")
            .key("c.key")
            .ca("ca.pem")
            .build()
            .expect("ok");
        assert!(full.is_some());
    }

    #[test]
    fn load_names_the_missing_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = TlsConfig::in_dir(dir.path(), crate::PeerRole::Router)
            .load()
            .expect_err("no files");
        assert!(err.to_string().contains("router.pem"), "{err}");
        std::fs::write(dir.path().join("router.pem"), "not pem").expect("write");
        let err = TlsConfig::in_dir(dir.path(), crate::PeerRole::Router)
            .load()
            .expect_err("not pem");
        assert!(matches!(err, TlsError::NotPem { .. }), "{err}");
    }
}
