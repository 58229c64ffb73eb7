//! A real, throwaway `etcd` server for membership tests.
//!
//! [`EtcdServer::start`] runs the `etcd` binary (Debian/Ubuntu package
//! `etcd-server`, 3.4 or newer) as a single-member cluster on two free
//! loopback ports, with its data in a fresh temporary directory, and returns
//! once it answers. Dropping the value kills the process and removes the
//! directory.
//!
//! Tests do not skip when `etcd` is missing: [`EtcdServer::start`] fails with
//! an error that says to install it, because a membership test that silently
//! passes without etcd tests nothing.
//!
//! # How readiness is decided
//!
//! etcd serves `GET /health` over plain HTTP/1.1 on its client URL and
//! answers `{"health":"true"}` once the member has a leader and can serve
//! requests. The harness polls that with a std `TcpStream` (no async runtime,
//! no etcd client here) every 50 ms for up to [`START_TIMEOUT`]. If the
//! process exits meanwhile, its log is in the error; when the reason was a
//! port taken between choosing it and etcd binding it, the start is retried
//! on fresh ports (at most three tries).
//!
//! # TLS
//!
//! [`EtcdServer::start_tls`] serves clients over mutual TLS instead:
//! `https://127.0.0.1:<port>`, a server certificate and client certificates
//! from a fresh development CA (`tandem_security::write_dev_certs`, SANs
//! `localhost` and `127.0.0.1`), and `--client-cert-auth`, so a client
//! without a certificate from that CA is refused. The files are in
//! [`EtcdServer::tls`]. The health probe then goes to a third, plain-HTTP
//! port (`--listen-metrics-urls`, which serves `/health` too), since the
//! client port wants a TLS handshake and a client certificate.
//!
//! # Restarts
//!
//! [`EtcdServer::stop`] kills the process but keeps the ports and the data
//! directory; [`EtcdServer::restart`] starts it again on both, which is what
//! an etcd crash and recovery looks like to clients: the same endpoint, the
//! same keys and leases, a broken connection in between.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long [`EtcdServer::start`] waits for etcd to answer `/health`.
pub const START_TIMEOUT: Duration = Duration::from_secs(10);

/// How many times [`EtcdServer::start`] picks fresh ports when etcd lost a
/// port to another process between picking and binding.
const START_ATTEMPTS: u32 = 3;

/// The etcd program, overridable with `$TANDEM_ETCD`.
fn etcd_program() -> String {
    std::env::var("TANDEM_ETCD").unwrap_or_else(|_| "etcd".to_string())
}

/// Why an etcd server could not be started.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// The binary could not be run at all.
    #[error(
        "could not run {program}: {source}; install etcd (Debian/Ubuntu: `apt-get install \
         etcd-server`) or set $TANDEM_ETCD to the etcd binary"
    )]
    NotInstalled {
        program: String,
        source: std::io::Error,
    },
    /// A filesystem or socket operation failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    /// etcd exited before it became ready.
    #[error("etcd exited during start-up ({status}); its log:\n{log}")]
    Exited {
        status: std::process::ExitStatus,
        log: String,
    },
    /// The test certificates could not be written.
    #[error("writing etcd's test certificates: {0}")]
    Certs(String),
    /// etcd did not answer `/health` in time.
    #[error("etcd at {endpoint} was not healthy within {timeout:?}; its log:\n{log}")]
    NotReady {
        endpoint: String,
        timeout: Duration,
        log: String,
    },
}

/// The PEM files of a TLS etcd ([`EtcdServer::start_tls`]).
#[derive(Debug, Clone)]
pub struct EtcdTlsFiles {
    /// The CA that signed etcd's certificate and the client certificate.
    pub ca: PathBuf,
    /// A client certificate etcd accepts, and its key.
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// etcd's own certificate and key.
    server_cert: PathBuf,
    server_key: PathBuf,
}

/// A running single-member etcd on 127.0.0.1 (see the module doc).
#[derive(Debug)]
pub struct EtcdServer {
    client_port: u16,
    peer_port: u16,
    /// Plain-HTTP `/health` (and metrics) port, with TLS.
    metrics_port: Option<u16>,
    tls: Option<EtcdTlsFiles>,
    /// Owns the temporary directory: removed on drop.
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl EtcdServer {
    /// Starts etcd on two free loopback ports with a fresh data directory
    /// and waits (at most [`START_TIMEOUT`]) until it is healthy.
    pub fn start() -> Result<EtcdServer, EtcdError> {
        EtcdServer::start_with(false)
    }

    /// Like [`EtcdServer::start`], but clients must use mutual TLS with
    /// certificates from a fresh CA (see the module doc and
    /// [`EtcdServer::tls`]).
    pub fn start_tls() -> Result<EtcdServer, EtcdError> {
        EtcdServer::start_with(true)
    }

    fn start_with(tls: bool) -> Result<EtcdServer, EtcdError> {
        // The ports are free when picked but another test may bind one
        // before etcd does: a start that lost that race is retried on
        // fresh ports, a bounded number of times.
        let mut attempt = 1;
        loop {
            match EtcdServer::start_once(tls) {
                Err(EtcdError::Exited { log, .. })
                    if attempt < START_ATTEMPTS && log.contains("address already in use") =>
                {
                    attempt += 1;
                }
                result => return result,
            }
        }
    }

    fn start_once(tls: bool) -> Result<EtcdServer, EtcdError> {
        let dir = tempfile::Builder::new()
            .prefix("tandem-etcd-")
            .tempdir()
            .map_err(|source| EtcdError::Io {
                what: "creating a temporary directory for etcd".to_string(),
                source,
            })?;
        let (client_port, peer_port) = (free_port()?, free_port()?);
        let (metrics_port, tls) = if tls {
            let certs = dir.path().join("certs");
            let written = tandem_security::write_dev_certs(&certs, &[])
                .map_err(|e| EtcdError::Certs(e.to_string()))?;
            let files = EtcdTlsFiles {
                ca: written.ca,
                client_cert: certs.join("client.pem"),
                client_key: certs.join("client.key"),
                server_cert: certs.join("router.pem"),
                server_key: certs.join("router.key"),
            };
            (Some(free_port()?), Some(files))
        } else {
            (None, None)
        };
        let mut server = EtcdServer {
            client_port,
            peer_port,
            metrics_port,
            tls,
            dir,
            child: None,
        };
        server.spawn_and_wait()?;
        Ok(server)
    }

    /// The client URL, `http://127.0.0.1:<port>` (`https://` with TLS).
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// The CA and a client certificate, when started with
    /// [`EtcdServer::start_tls`].
    pub fn tls(&self) -> Option<&EtcdTlsFiles> {
        self.tls.as_ref()
    }

    /// The client URL as a one-element list, the shape discovery takes.
    pub fn endpoints(&self) -> Vec<String> {
        vec![self.endpoint()]
    }

    /// The data directory (kept across [`EtcdServer::restart`]).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The etcd process's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills etcd (SIGKILL) and reaps it; keeps the ports and the data. A
    /// no-op when it is not running.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops etcd if it runs, then starts it again on the same ports and
    /// data directory and waits until it is healthy.
    pub fn restart(&mut self) -> Result<(), EtcdError> {
        self.stop();
        self.spawn_and_wait()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    fn spawn_and_wait(&mut self) -> Result<(), EtcdError> {
        let log_path = self.log_path();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|source| EtcdError::Io {
                what: format!("opening {}", log_path.display()),
                source,
            })?;
        let log_err = log.try_clone().map_err(|source| EtcdError::Io {
            what: format!("opening {}", log_path.display()),
            source,
        })?;
        let client_url = self.endpoint();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let program = etcd_program();
        let mut command = Command::new(&program);
        if let (Some(tls), Some(metrics_port)) = (&self.tls, self.metrics_port) {
            command
                .arg("--cert-file")
                .arg(&tls.server_cert)
                .arg("--key-file")
                .arg(&tls.server_key)
                .arg("--trusted-ca-file")
                .arg(&tls.ca)
                .arg("--client-cert-auth")
                .arg("--listen-metrics-urls")
                .arg(format!("http://127.0.0.1:{metrics_port}"));
        }
        let child = command
            .arg("--name")
            .arg("tandem-test")
            .arg("--data-dir")
            .arg(self.data_dir())
            .arg("--listen-client-urls")
            .arg(&client_url)
            .arg("--advertise-client-urls")
            .arg(&client_url)
            .arg("--listen-peer-urls")
            .arg(&peer_url)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer_url)
            .arg("--initial-cluster")
            .arg(format!("tandem-test={peer_url}"))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(|source| EtcdError::NotInstalled { program, source })?;
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        let health_port = self.metrics_port.unwrap_or(self.client_port);
        let addr = SocketAddr::from(([127, 0, 0, 1], health_port));
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(EtcdError::Exited {
                        status,
                        log: read_log(&log_path),
                    });
                }
            }
            if healthy(addr) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.stop();
                return Err(EtcdError::NotReady {
                    endpoint: self.endpoint(),
                    timeout: START_TIMEOUT,
                    log: read_log(&log_path),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A loopback port that was free a moment ago (bind to port 0, read, drop).
fn free_port() -> Result<u16, EtcdError> {
    let listener = TcpListener::bind(("127.0.0.1", 0)).map_err(|source| EtcdError::Io {
        what: "binding 127.0.0.1:0 to pick a free port".to_string(),
        source,
    })?;
    let port = listener
        .local_addr()
        .map_err(|source| EtcdError::Io {
            what: "reading the picked port".to_string(),
            source,
        })?
        .port();
    Ok(port)
}

/// One `GET /health` with short timeouts; true when etcd says healthy.
fn healthy(addr: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let _ = stream.set_write_timeout(Some(Duration::from_millis(500)));
    let request =
        format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAccept: */*\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut response = Vec::new();
    // Bounded: the read timeout ends a stalled read, and the response is
    // capped at 64 KiB.
    let _ = stream.take(64 * 1024).read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response);
    text.starts_with("HTTP/1.1 200") && text.replace(' ', "").contains("\"health\":\"true\"")
}

fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| format!("(could not read the log: {e})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_loopback_ports() {
        let port = free_port().expect("a free port");
        assert_ne!(port, 0);
        TcpListener::bind(("127.0.0.1", port)).expect("the port is free again");
    }

    #[test]
    fn health_is_false_when_nothing_listens() {
        let port = free_port().expect("a free port");
        assert!(!healthy(SocketAddr::from(([127, 0, 0, 1], port))));
    }

    #[test]
    fn a_tls_etcd_serves_https_and_its_client_port_refuses_plain_http() {
        let server = EtcdServer::start_tls().unwrap_or_else(|e| panic!("{e}"));
        assert!(server.endpoint().starts_with("https://127.0.0.1:"));
        let files = server.tls().expect("TLS files");
        for file in [&files.ca, &files.client_cert, &files.client_key] {
            assert!(file.is_file(), "{}", file.display());
        }
        // Healthy on the metrics port (start_tls waited for that), but the
        // client port wants TLS: plain HTTP gets no healthy answer there.
        let client = SocketAddr::from(([127, 0, 0, 1], server.client_port));
        assert!(!healthy(client));
        let metrics = server.metrics_port.expect("a metrics port");
        assert!(healthy(SocketAddr::from(([127, 0, 0, 1], metrics))));
    }

    #[test]
    fn a_missing_binary_says_what_to_install() {
        let err = EtcdError::NotInstalled {
            program: "etcd".to_string(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        assert!(err.to_string().contains("etcd-server"), "{err}");
    }
}
