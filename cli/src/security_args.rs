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
    for role in tandem_security::PeerRole::ALL {
        let t = certs.config(role);
        println!("{role} {} {}", t.cert.display(), t.key.display());
    }
    eprintln!(
        "certificates for {} written to {} (the CA key is not kept; rerun to re-issue)",
        certs.hosts.join(", "),
        certs.dir.display()
    );
    Ok(())
}

/// The environment variable that carries the cluster token.
pub const CLUSTER_TOKEN_ENV: &str = "TANDEM_CLUSTER_TOKEN";

/// Where a component finds the cluster token: the shared secret of the KV
/// handshake and of the worker plane's credential.
#[derive(Args, Debug, Clone, Default)]
pub struct ClusterTokenArgs {
    /// A file whose first line is the cluster token. Without it the token
    /// comes from `TANDEM_CLUSTER_TOKEN`, else it is the development
    /// default `tandem-local`. There is no flag for the secret itself: a
    /// command line is readable by every local user (`ps`,
    /// `/proc/PID/cmdline`).
    #[arg(long, env = "TANDEM_CLUSTER_TOKEN_FILE")]
    cluster_token_file: Option<PathBuf>,
}

impl ClusterTokenArgs {
    /// The cluster token: `--cluster-token-file`, else
    /// [`CLUSTER_TOKEN_ENV`], else `tandem-local`.
    pub fn load(&self) -> Result<String> {
        Ok(self
            .given()?
            .unwrap_or_else(|| tandem_security::DEV_CLUSTER_TOKEN.to_string()))
    }

    /// The token the file or the environment gives, if either does.
    pub fn given(&self) -> Result<Option<String>> {
        self.given_with(std::env::var(CLUSTER_TOKEN_ENV).ok())
    }

    /// [`Self::given`] with the environment's value given.
    fn given_with(&self, env: Option<String>) -> Result<Option<String>> {
        if let Some(path) = &self.cluster_token_file {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading --cluster-token-file {}", path.display()))?;
            let token = text.lines().next().unwrap_or("").trim();
            if token.is_empty() {
                anyhow::bail!(
                    "--cluster-token-file {}: the first line is empty",
                    path.display()
                );
            }
            return Ok(Some(token.to_string()));
        }
        match env {
            Some(token) if token.is_empty() => {
                anyhow::bail!("{CLUSTER_TOKEN_ENV} is set but empty")
            }
            token => Ok(token),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Component {
        #[command(flatten)]
        token: ClusterTokenArgs,
    }

    #[test]
    fn the_cluster_token_comes_from_a_file_or_the_environment_never_a_flag() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("token");
        std::fs::write(&file, "from-file\n# rest ignored\n").expect("write");
        let file = file.display().to_string();
        let parse = |args: &[&str]| {
            let mut argv = vec!["t"];
            argv.extend_from_slice(args);
            Component::try_parse_from(argv).map(|c| c.token)
        };
        let from_file = parse(&["--cluster-token-file", &file]).expect("parses");
        assert_eq!(
            from_file
                .given_with(Some("env".into()))
                .expect("token")
                .as_deref(),
            Some("from-file")
        );
        let plain = parse(&[]).expect("parses");
        assert_eq!(
            plain
                .given_with(Some("env".into()))
                .expect("env")
                .as_deref(),
            Some("env")
        );
        assert_eq!(plain.given_with(None).expect("none"), None);
        let e = plain.given_with(Some(String::new())).expect_err("empty");
        assert!(format!("{e:#}").contains("TANDEM_CLUSTER_TOKEN"), "{e:#}");
        assert!(
            parse(&["--cluster-token", "on-argv"]).is_err(),
            "no flag takes the secret"
        );
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").expect("write");
        let e = parse(&["--cluster-token-file", &empty.display().to_string()])
            .expect("parses")
            .given_with(None)
            .expect_err("empty file");
        assert!(format!("{e:#}").contains("first line is empty"), "{e:#}");
    }
}
