//! How to reach etcd: [`EtcdConfig`] (endpoints, TLS, user and password).
//!
//! A plain development etcd needs only endpoints
//! (`EtcdConfig::new(["http://127.0.0.1:2379"])`). A production etcd
//! usually serves TLS, often mutual TLS, and may require a user:
//!
//! ```
//! use tandem_discovery::{EtcdConfig, EtcdTls};
//! # let (ca, cert, key) = (Vec::new(), Vec::new(), Vec::new());
//! let config = EtcdConfig::new(["https://etcd.db:2379"])
//!     .with_tls(EtcdTls::new(ca).with_identity(cert, key))
//!     .with_user("tandem", "secret");
//! assert!(!format!("{config:?}").contains("secret"));
//! ```
//!
//! # TLS and URL schemes
//!
//! With TLS every endpoint must be an `https://` URL (or a bare
//! `host:port`, which then means https); without TLS none may be. Both
//! mismatches are refused before any connection ([`EtcdConfig::check`]):
//! `http://` with TLS would send plaintext to a TLS port (etcd-client
//! refuses it with a terse "TLS options are only supported with HTTPS
//! URLs"), and `https://` without a CA would have nothing to verify etcd's
//! certificate against (this build trusts no system roots). The server's
//! certificate is checked against the CA and the endpoint's host (an IP
//! address needs an IP SAN); [`EtcdTls::with_domain_name`] overrides the
//! name checked, for certificates issued to a service name while the
//! endpoints are IPs.
//!
//! # User and password
//!
//! etcd-client authenticates once, when a client connects, and keeps the
//! token. etcd's default ("simple") tokens live in etcd's memory: they die
//! with an etcd restart and expire after `--auth-token-ttl` without use.
//! So the long-lived users of a client (the registration's keep-alive, the
//! watch) make a fresh client, which authenticates again, whenever a call
//! or a stream fails (`register`, `watch`).
//!
//! Secrets stay out of logs: `Debug` shows whether a password and a client
//! key are set, never their contents.

use std::fmt;

use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};

use crate::DiscoveryError;

/// Where etcd is and how to authenticate to it (see the module doc).
#[derive(Clone)]
pub struct EtcdConfig {
    endpoints: Vec<String>,
    tls: Option<EtcdTls>,
    user: Option<(String, String)>,
}

/// TLS settings for etcd: the CA that signed etcd's server certificate,
/// and optionally this client's certificate and key (mutual TLS, etcd's
/// `--client-cert-auth`). All PEM.
#[derive(Clone)]
pub struct EtcdTls {
    ca_pem: Vec<u8>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
    domain_name: Option<String>,
}

impl EtcdTls {
    /// Verifies etcd's certificate against `ca_pem` (one or more PEM
    /// certificates).
    pub fn new(ca_pem: impl Into<Vec<u8>>) -> EtcdTls {
        EtcdTls {
            ca_pem: ca_pem.into(),
            identity: None,
            domain_name: None,
        }
    }

    /// Presents this client certificate and private key (PEM) to etcd.
    pub fn with_identity(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.identity = Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// Checks etcd's certificate for this name instead of the endpoint's
    /// host.
    pub fn with_domain_name(mut self, name: impl Into<String>) -> Self {
        self.domain_name = Some(name.into());
        self
    }

    /// Whether a client certificate is presented.
    pub fn has_identity(&self) -> bool {
        self.identity.is_some()
    }

    fn options(&self) -> TlsOptions {
        let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(&self.ca_pem));
        if let Some((cert, key)) = &self.identity {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        if let Some(name) = &self.domain_name {
            tls = tls.domain_name(name.clone());
        }
        tls
    }
}

impl fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdTls")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field("client_identity", &self.identity.is_some())
            .field("domain_name", &self.domain_name)
            .finish()
    }
}

impl EtcdConfig {
    /// Plain etcd at `endpoints` (client URLs such as
    /// `http://127.0.0.1:2379`), no TLS, no user.
    pub fn new<I, S>(endpoints: I) -> EtcdConfig
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        EtcdConfig {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            tls: None,
            user: None,
        }
    }

    /// Talks TLS to etcd (the endpoints must then be `https://`).
    pub fn with_tls(mut self, tls: EtcdTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Authenticates as `name` with `password` (etcd's RBAC auth).
    pub fn with_user(mut self, name: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some((name.into(), password.into()));
        self
    }

    /// The endpoints as given.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The TLS settings, if any.
    pub fn tls(&self) -> Option<&EtcdTls> {
        self.tls.as_ref()
    }

    /// The user name, if any (the password is not readable back).
    pub fn user(&self) -> Option<&str> {
        self.user.as_ref().map(|(name, _)| name.as_str())
    }

    /// The endpoints, joined for error messages.
    pub(crate) fn shown(&self) -> String {
        self.endpoints.join(",")
    }

    /// Refuses a configuration that cannot work, before any network: no
    /// endpoints, or an endpoint whose scheme contradicts the TLS setting.
    pub fn check(&self) -> Result<(), DiscoveryError> {
        if self.endpoints.is_empty() {
            return Err(DiscoveryError::NoEndpoints);
        }
        for endpoint in &self.endpoints {
            let scheme = endpoint
                .split_once("://")
                .map(|(s, _)| s.to_ascii_lowercase());
            match (scheme.as_deref(), self.tls.is_some()) {
                (Some("http"), true) => {
                    return Err(DiscoveryError::SchemeMismatch {
                        endpoint: endpoint.clone(),
                        reason: "TLS is configured, so etcd endpoints must be https:// URLs",
                    })
                }
                (Some("https"), false) => {
                    return Err(DiscoveryError::SchemeMismatch {
                        endpoint: endpoint.clone(),
                        reason: "an https:// endpoint needs TLS settings (at least the CA \
                                 certificate that signed etcd's)",
                    })
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// etcd-client's options for this configuration, plus `base`.
    pub(crate) fn connect_options(&self, base: ConnectOptions) -> ConnectOptions {
        let mut options = base;
        if let Some(tls) = &self.tls {
            options = options.with_tls(tls.options());
        }
        if let Some((name, password)) = &self.user {
            options = options.with_user(name.clone(), password.clone());
        }
        options
    }
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("tls", &self.tls)
            .field("user", &self.user())
            .field("password", &self.user.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_neither_the_password_nor_the_key() {
        let config = EtcdConfig::new(["https://etcd:2379"])
            .with_tls(EtcdTls::new("CA-PEM").with_identity("CERT-PEM", "KEY-PEM-SECRET"))
            .with_user("tandem", "hunter2-secret");
        let shown = format!("{config:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(!shown.contains("KEY-PEM"), "{shown}");
        assert!(shown.contains("tandem"), "{shown}");
        assert!(shown.contains("https://etcd:2379"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }

    #[test]
    fn http_with_tls_and_https_without_are_refused() {
        let tls = EtcdTls::new("CA");
        let err = EtcdConfig::new(["http://127.0.0.1:2379"])
            .with_tls(tls.clone())
            .check()
            .expect_err("http with TLS");
        assert!(err.to_string().contains("https://"), "{err}");
        assert!(err.to_string().contains("http://127.0.0.1:2379"), "{err}");
        let err = EtcdConfig::new(["https://127.0.0.1:2379"])
            .check()
            .expect_err("https without TLS");
        assert!(err.to_string().contains("CA certificate"), "{err}");
        EtcdConfig::new(["https://127.0.0.1:2379"])
            .with_tls(tls.clone())
            .check()
            .expect("https with TLS");
        EtcdConfig::new(["127.0.0.1:2379"])
            .with_tls(tls)
            .check()
            .expect("a bare host:port takes the TLS setting");
        EtcdConfig::new(["http://127.0.0.1:2379"])
            .check()
            .expect("plain http");
    }

    #[test]
    fn no_endpoints_is_refused() {
        let err = EtcdConfig::new(Vec::<String>::new())
            .check()
            .expect_err("no endpoints");
        assert!(matches!(err, DiscoveryError::NoEndpoints), "{err}");
    }
}
