//! Roles in certificates: which kind of component a TLS peer is.
//!
//! One cluster CA signs every certificate, so "signed by the CA" says only
//! that a peer belongs to the cluster, not what it may do: a person's
//! `client` certificate must not let them call a decode worker's `Generate`
//! around the router, nor a prefill worker's `Prefill`. Each certificate
//! therefore names its role in a URI subject alternative name shaped like a
//! SPIFFE ID, `spiffe://<trust-domain>/tandem/<role>` ([`PeerRole::uri`]
//! gives the development CA's, trust domain `tandem.local`); any trust
//! domain is accepted, since the CA check has already said which cluster the
//! peer is in. Certificates from an operator's PKI (cert-manager, SPIRE)
//! carry the same URI.
//!
//! Servers check roles in [`crate::ClusterAuthInterceptor`]: with TLS on, a
//! decode worker serves only `router` certificates and a prefill worker's
//! `Prefill` only `decode` ones. A certificate without a role URI holds no
//! role, so it can call the router (which serves clients) but no worker.

use std::fmt;

/// The development CA's SPIFFE trust domain.
pub const DEV_TRUST_DOMAIN: &str = "tandem.local";

/// What a certificate's holder is in the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerRole {
    /// Fronts the workers; calls decode workers' `Generate` and every
    /// worker's `Worker` service.
    Router,
    /// Computes prompts for decode workers.
    Prefill,
    /// Decodes; calls prefill workers' `Prefill`.
    Decode,
    /// A person or program calling the router.
    Client,
}

impl PeerRole {
    /// Every role.
    pub const ALL: [PeerRole; 4] = [
        PeerRole::Router,
        PeerRole::Prefill,
        PeerRole::Decode,
        PeerRole::Client,
    ];

    /// The role's name: its URI's last segment and the development CA's
    /// file stem (`router.pem`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            PeerRole::Router => "router",
            PeerRole::Prefill => "prefill",
            PeerRole::Decode => "decode",
            PeerRole::Client => "client",
        }
    }

    /// The role named `name`, if it is one.
    pub fn from_name(name: &str) -> Option<PeerRole> {
        PeerRole::ALL.into_iter().find(|r| r.as_str() == name)
    }

    /// The URI SAN the development CA puts in this role's certificate.
    pub fn uri(self) -> String {
        format!("spiffe://{DEV_TRUST_DOMAIN}/tandem/{}", self.as_str())
    }

    /// The role a URI SAN names: `spiffe://<any trust domain>/tandem/<role>`.
    pub fn from_uri(uri: &str) -> Option<PeerRole> {
        let rest = uri.strip_prefix("spiffe://")?;
        let (domain, path) = rest.split_once('/')?;
        if domain.is_empty() {
            return None;
        }
        PeerRole::from_name(path.strip_prefix("tandem/")?)
    }
}

impl fmt::Display for PeerRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The roles the leaf certificate `der` names in its URI SANs (none when it
/// names none, or does not parse: a certificate we cannot read holds no
/// role).
pub fn roles_in_certificate(der: &[u8]) -> Vec<PeerRole> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::URI(uri) => PeerRole::from_uri(uri),
            _ => None,
        })
        .collect()
}

/// A list of roles as words, for error messages: `router or decode`.
pub(crate) fn describe(roles: &[PeerRole]) -> String {
    if roles.is_empty() {
        return "no role".to_string();
    }
    roles
        .iter()
        .map(|r| r.as_str())
        .collect::<Vec<_>>()
        .join(" or ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_uris_round_trip_and_strangers_hold_none() {
        for role in PeerRole::ALL {
            assert_eq!(PeerRole::from_uri(&role.uri()), Some(role));
        }
        assert_eq!(
            PeerRole::from_uri("spiffe://prod.example/tandem/decode"),
            Some(PeerRole::Decode)
        );
        for stranger in [
            "spiffe:///tandem/decode",
            "spiffe://x/tandem/admin",
            "spiffe://x/other/decode",
            "https://x/tandem/decode",
            "spiffe://x/tandem/decode/extra",
        ] {
            assert_eq!(PeerRole::from_uri(stranger), None, "{stranger}");
        }
        assert_eq!(describe(&[]), "no role");
        assert_eq!(
            describe(&[PeerRole::Router, PeerRole::Decode]),
            "router or decode"
        );
    }

    #[test]
    fn garbage_is_no_certificate_and_holds_no_role() {
        assert!(roles_in_certificate(b"not a certificate").is_empty());
    }
}
