//! The worker plane's credential: proof of the cluster secret on every call
//! a router or a decode worker makes to a worker.
//!
//! Workers serve `Generate` and `Prefill` to the cluster only:
//! a client that learns a decode worker's address must not get tokens
//! around the router's API keys, nor a prefill worker's KV. Every member
//! holds the cluster token (the KV handshake proves it too), so the
//! credential is derived from it: HMAC-SHA256 of the token over a fixed
//! label, hex in the [`CLUSTER_AUTH_HEADER`] metadata. The token itself
//! never travels, and a credential says nothing about other uses of the
//! token (the KV handshake's challenge–response uses its own nonces).
//! Like any bearer value it can be replayed by whoever can read the
//! traffic, which is what `--tls` is for.
//!
//! With TLS on, the interceptor also checks the role in the caller's
//! certificate ([`ClusterAuthInterceptor::require_roles`], [`crate::roles`]):
//! the credential proves cluster membership, the role what the caller is,
//! so a person holding a `client` certificate (and, say, a leaked token)
//! still cannot call a worker.
//!
//! Health, reflection and the `Worker` service (`Info`, `Load`,
//! `KvEvents`) stay open, as `/metrics` does: probes and dashboards need
//! no secret. (`KvEvents` shows prefix hashes; guarding it is still owed.)

use std::task::{Context, Poll};

use tonic::codegen::{http, Service};
use tonic::metadata::MetadataValue;

use crate::roles::{describe, roles_in_certificate, PeerRole};

/// The metadata key the credential travels in.
pub const CLUSTER_AUTH_HEADER: &str = "x-tandem-cluster-auth";

/// What the HMAC signs: a label of this use, so the value is useless
/// anywhere else the token is used.
const LABEL: &[u8] = b"tandem worker plane v1";

/// The cluster token of a development cluster that names none (every
/// component falls back to it alike).
pub const DEV_CLUSTER_TOKEN: &str = "tandem-local";

/// The credential of one cluster token.
#[derive(Clone)]
pub struct ClusterCredential {
    hex: String,
}

impl Default for ClusterCredential {
    /// The credential of [`DEV_CLUSTER_TOKEN`].
    fn default() -> Self {
        Self::derive(DEV_CLUSTER_TOKEN)
    }
}

impl std::fmt::Debug for ClusterCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterCredential(..)")
    }
}

impl ClusterCredential {
    /// The credential every member of the cluster with `token` presents.
    pub fn derive(token: &str) -> Self {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
        let tag = ring::hmac::sign(&key, LABEL);
        let hex = tag.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        Self { hex }
    }

    /// Whether `presented` is this credential (constant time).
    pub fn accepts(&self, presented: Option<&[u8]>) -> bool {
        presented.is_some_and(|p| crate::api_keys::constant_time_eq(p, self.hex.as_bytes()))
    }

    /// A server-side interceptor refusing calls without the credential
    /// with `UNAUTHENTICATED`.
    pub fn interceptor(&self) -> ClusterAuthInterceptor {
        ClusterAuthInterceptor {
            credential: self.clone(),
            roles: None,
        }
    }

    /// `channel`, presenting this credential on every call.
    pub fn channel<C>(&self, channel: C) -> ClusterChannel<C> {
        ClusterChannel {
            inner: channel,
            // Hex digits are always a valid header value.
            value: http::HeaderValue::from_str(&self.hex).ok(),
        }
    }
}

/// Refuses calls that do not present the cluster credential and, when
/// configured, whose TLS certificate does not carry an allowed role.
#[derive(Clone, Debug)]
pub struct ClusterAuthInterceptor {
    credential: ClusterCredential,
    /// With TLS: the roles whose certificates may call.
    roles: Option<&'static [PeerRole]>,
}

impl ClusterAuthInterceptor {
    /// When `tls` is on, also require the caller's certificate to carry one
    /// of `roles` (`PERMISSION_DENIED` naming the roles otherwise). Without
    /// TLS there is no certificate to read and the credential alone decides.
    pub fn require_roles(mut self, tls: bool, roles: &'static [PeerRole]) -> Self {
        self.roles = tls.then_some(roles);
        self
    }

    fn check_role(&self, request: &tonic::Request<()>) -> Result<(), tonic::Status> {
        let Some(allowed) = self.roles else {
            return Ok(());
        };
        let held = request
            .peer_certs()
            .and_then(|certs| {
                certs
                    .first()
                    .map(|leaf| roles_in_certificate(leaf.as_ref()))
            })
            .unwrap_or_default();
        if held.iter().any(|r| allowed.contains(r)) {
            return Ok(());
        }
        Err(tonic::Status::permission_denied(format!(
            "worker plane: this call is for {} certificates; the caller's certificate \
             holds {}",
            describe(allowed),
            describe(&held)
        )))
    }
}

impl tonic::service::Interceptor for ClusterAuthInterceptor {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let presented = request
            .metadata()
            .get(CLUSTER_AUTH_HEADER)
            .map(MetadataValue::as_bytes);
        if !self.credential.accepts(presented) {
            return Err(tonic::Status::unauthenticated(
                "worker plane: only members of the cluster may call this worker; \
                 clients call the router",
            ));
        }
        self.check_role(&request)?;
        Ok(request)
    }
}

/// A channel that adds the cluster credential to every request: what the
/// router's and decode workers' clients of workers run over.
#[derive(Clone, Debug)]
pub struct ClusterChannel<C> {
    inner: C,
    value: Option<http::HeaderValue>,
}

impl<C, B> Service<http::Request<B>> for ClusterChannel<C>
where
    C: Service<http::Request<B>>,
{
    type Response = C::Response;
    type Error = C::Error;
    type Future = C::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        if let Some(v) = &self.value {
            request.headers_mut().insert(
                http::HeaderName::from_static(CLUSTER_AUTH_HEADER),
                v.clone(),
            );
        }
        self.inner.call(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Interceptor;

    #[test]
    fn only_the_same_tokens_credential_passes() {
        let ours = ClusterCredential::derive("secret-a");
        let theirs = ClusterCredential::derive("secret-b");
        assert_eq!(ours.hex.len(), 64);
        assert!(ours.accepts(Some(ClusterCredential::derive("secret-a").hex.as_bytes())));
        assert!(!ours.accepts(Some(theirs.hex.as_bytes())));
        assert!(
            !ours.accepts(Some(b"secret-a")),
            "the token itself is not the credential"
        );
        assert!(!ours.accepts(None));
        assert!(!format!("{ours:?}").contains(&ours.hex));
        let mut check = ours.interceptor();
        let mut request = tonic::Request::new(());
        request
            .metadata_mut()
            .insert(CLUSTER_AUTH_HEADER, theirs.hex.parse().expect("ascii"));
        let refused = check.call(request).expect_err("wrong cluster");
        assert_eq!(refused.code(), tonic::Code::Unauthenticated);
        assert!(check.call(tonic::Request::new(())).is_err());
    }

    #[test]
    fn with_tls_a_call_without_an_allowed_role_is_denied() {
        let ours = ClusterCredential::derive("secret-a");
        let request = || {
            let mut r = tonic::Request::new(());
            r.metadata_mut()
                .insert(CLUSTER_AUTH_HEADER, ours.hex.parse().expect("ascii"));
            r
        };
        // Without TLS the credential decides alone.
        let mut plain = ours.interceptor().require_roles(false, &[PeerRole::Router]);
        assert!(plain.call(request()).is_ok());
        // With TLS a caller whose certificate holds no allowed role (here:
        // none at all) is refused, and told which roles may call.
        let mut tls = ours.interceptor().require_roles(true, &[PeerRole::Router]);
        let denied = tls.call(request()).expect_err("no role");
        assert_eq!(denied.code(), tonic::Code::PermissionDenied);
        assert!(
            denied.message().contains("router certificates"),
            "{denied:?}"
        );
        assert!(denied.message().contains("holds no role"), "{denied:?}");
    }
}
