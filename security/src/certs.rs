//! The development CA (`tandem certs`, `tandem up --tls`).
//!
//! [`write_dev_certs`] makes a fresh CA and one certificate per component
//! (one per [`PeerRole`]: the router, the prefill and decode workers, and a
//! client for people and tests), each signed by the CA, and writes them as PEM:
//! `ca.pem`, and `NAME.pem` + `NAME.key` per component. Every component
//! certificate is valid for both TLS server and client authentication
//! (workers are both: a decode worker serves the router and calls prefill
//! workers), with subject alternative names `localhost`, `127.0.0.1` and
//! `::1` plus the hosts given (IP literals become IP SANs, anything else a
//! DNS name), and its role as a URI SAN ([`crate::roles`]): the `client`
//! certificate is from the same CA but cannot act as a worker or router.
//!
//! The CA's private key is never written: it signs this set and is dropped,
//! so nothing on disk can mint another certificate the cluster trusts.
//! Re-run `tandem certs` to re-issue the whole set. Private keys are
//! written owner-only (mode 0600). This is a development CA; production
//! clusters bring certificates from their own PKI (cert-manager, ...),
//! which work the same through `--tls-cert/--tls-key/--tls-ca`.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use crate::roles::PeerRole;

/// Errors writing the dev certificates.
#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    #[error("generating {what}: {source}")]
    Generate {
        what: String,
        #[source]
        source: rcgen::Error,
    },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What [`write_dev_certs`] wrote.
#[derive(Debug, Clone)]
pub struct DevCerts {
    pub dir: PathBuf,
    /// The CA certificate (`ca.pem`).
    pub ca: PathBuf,
    /// The subject alternative names of every component certificate.
    pub hosts: Vec<String>,
}

impl DevCerts {
    /// The TLS settings of the component holding `role`.
    pub fn config(&self, role: PeerRole) -> crate::TlsConfig {
        crate::TlsConfig::in_dir(&self.dir, role)
    }
}

/// The default subject alternative names: loopback by name and address.
pub const DEFAULT_HOSTS: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// Writes a fresh CA and every component's certificate and key into `dir`
/// (created if missing), valid for the loopback names and `extra_hosts`.
pub fn write_dev_certs(dir: &Path, extra_hosts: &[String]) -> Result<DevCerts, CertsError> {
    std::fs::create_dir_all(dir).map_err(|source| CertsError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let generate = |what: &str| {
        let what = what.to_string();
        move |source: rcgen::Error| CertsError::Generate { what, source }
    };
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(generate("CA"))?;
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "tandem development CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate().map_err(generate("CA key"))?;
    let ca_cert = ca_params.self_signed(&ca_key).map_err(generate("CA"))?;
    let issuer = Issuer::new(ca_params, ca_key);
    let ca_path = dir.join("ca.pem");
    write(&ca_path, ca_cert.pem().as_bytes(), false)?;

    let mut hosts: Vec<String> = DEFAULT_HOSTS.iter().map(|h| h.to_string()).collect();
    for h in extra_hosts {
        if !hosts.contains(h) {
            hosts.push(h.clone());
        }
    }
    for role in PeerRole::ALL {
        let component = role.as_str();
        let mut params = CertificateParams::new(hosts.clone())
            .map_err(generate(&format!("{component} SANs")))?;
        let uri = role
            .uri()
            .try_into()
            .map_err(generate(&format!("{component} role URI")))?;
        params.subject_alt_names.push(SanType::URI(uri));
        params
            .distinguished_name
            .push(DnType::CommonName, format!("tandem {component}"));
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().map_err(generate(&format!("{component} key")))?;
        let cert = params
            .signed_by(&key, &issuer)
            .map_err(generate(&format!("{component} certificate")))?;
        write(
            &dir.join(format!("{component}.pem")),
            cert.pem().as_bytes(),
            false,
        )?;
        write(
            &dir.join(format!("{component}.key")),
            key.serialize_pem().as_bytes(),
            true,
        )?;
    }
    Ok(DevCerts {
        dir: dir.to_path_buf(),
        ca: ca_path,
        hosts,
    })
}

/// Writes `bytes` to `path`; a private file is created owner-only.
fn write(path: &Path, bytes: &[u8], private: bool) -> Result<(), CertsError> {
    use std::io::Write;
    let err = |source| CertsError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = private;
    let mut file = options.open(path).map_err(err)?;
    file.write_all(bytes).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_ca_and_every_component() {
        let dir = tempfile::tempdir().expect("tempdir");
        let certs = write_dev_certs(dir.path(), &["worker-0.tandem".to_string()]).expect("certs");
        assert!(certs.hosts.contains(&"worker-0.tandem".to_string()));
        for role in PeerRole::ALL {
            let pem = std::fs::read(dir.path().join(format!("{role}.pem"))).expect("pem");
            let der = pem_to_der(&pem);
            assert_eq!(
                crate::roles::roles_in_certificate(&der),
                vec![role],
                "{role}"
            );
            let loaded = certs.config(role).load().expect("loads");
            // Both roles' settings build from the material.
            let _ = loaded.server();
            let _ = loaded.endpoint("127.0.0.1:1").expect("endpoint");
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join("router.key"))
                .expect("key")
                .permissions()
                .mode();
            assert_eq!(mode & 0o077, 0, "keys are owner-only: {mode:o}");
        }
        assert!(!dir.path().join("ca.key").exists());
    }

    /// The first certificate of a PEM file, as DER.
    fn pem_to_der(pem: &[u8]) -> Vec<u8> {
        let (_, parsed) = x509_parser::pem::parse_x509_pem(pem).expect("pem");
        parsed.contents
    }
}
