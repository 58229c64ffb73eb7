//! Security flags: mTLS (`--tls-cert/--tls-key/--tls-ca`) for every
//! serving process, API keys (`--api-key`, `--api-keys-file`) for the public
//! APIs, and `tandem certs`, which writes a development CA and certificates.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use tandem_security::{ApiKeys, LoadedTls, TlsConfig};

/// mTLS with the cluster CA: this process's certificate and key, and the CA
/// every peer's certificate must chain to. All three or none.
#[derive(Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// This process's TLS certificate (PEM). With --tls-key and --tls-ca,
    /// every gRPC server requires client certificates from the CA and every
    /// gRPC client verifies servers against it.
    #[arg(long, env = "TANDEM_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// This process's TLS private key (PEM).
    #[arg(long, env = "TANDEM_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The cluster CA certificate (PEM).
    #[arg(long, env = "TANDEM_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// The configuration, `None` when TLS is off.
    pub fn config(&self) -> Result<Option<TlsConfig>> {
        let mut b = TlsConfig::builder();
        if let Some(p) = &self.tls_cert {
            b = b.cert(p);
        }
        if let Some(p) = &self.tls_key {
            b = b.key(p);
        }
        if let Some(p) = &self.tls_ca {
            b = b.ca(p);
        }
        Ok(b.build()?)
    }

    /// The material read from disk, `None` when TLS is off.
    pub fn load(&self) -> Result<Option<LoadedTls>> {
        match self.config()? {
            Some(c) => Ok(Some(c.load()?)),
            None => Ok(None),
        }
    }

    /// The flags naming `config`, for a child process.
    pub fn to_args(config: &TlsConfig) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            config.cert.display().to_string(),
            "--tls-key".into(),
            config.key.display().to_string(),
            "--tls-ca".into(),
            config.ca.display().to_string(),
        ]
    }
}

/// The API keys public callers must present (`Authorization: Bearer KEY`
/// on HTTP, `authorization` metadata on gRPC). None given: the APIs are
/// open.
#[derive(Args, Debug, Clone, Default)]
pub struct ApiKeyArgs {
    /// An accepted API key (repeat the flag, or comma-separate in
    /// `TANDEM_API_KEYS`, for several).
    #[arg(long = "api-key", env = "TANDEM_API_KEYS", value_delimiter = ',')]
    pub api_keys: Vec<String>,
    /// A file of accepted API keys, one per line (`#` comments).
    #[arg(long, env = "TANDEM_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
}

impl ApiKeyArgs {
    /// Every key from the flags and the file.
    pub fn load(&self) -> Result<ApiKeys> {
        let mut keys = ApiKeys::new(&self.api_keys);
        if let Some(path) = &self.api_keys_file {
            keys = keys.merged(&ApiKeys::from_file(path)?);
        }
        Ok(keys)
    }
}

#[derive(Args, Debug)]
pub struct CertsArgs {
    /// Directory to write `ca.pem` and `NAME.pem`/`NAME.key` for the
    /// router, prefill, decode and client components.
    #[arg(long)]
    out: PathBuf,
    /// Extra host names or IPs the certificates are valid for (besides
    /// localhost, 127.0.0.1 and ::1), comma-separated or repeated.
    #[arg(long, value_delimiter = ',')]
    hosts: Vec<String>,
}

/// `tandem certs`: writes a development CA and per-component certificates.
pub fn run_certs(args: CertsArgs) -> Result<()> {
    let certs = tandem_security::write_dev_certs(&args.out, &args.hosts)
        .with_context(|| format!("writing certificates to {}", args.out.display()))?;
    println!("ca {}", certs.ca.display());
    for c in tandem_security::COMPONENTS {
        let t = certs.config(c);
        println!("{c} {} {}", t.cert.display(), t.key.display());
    }
    eprintln!(
        "certificates for {} written to {} (the CA key is not kept; rerun to re-issue)",
        certs.hosts.join(", "),
        certs.dir.display()
    );
    Ok(())
}
