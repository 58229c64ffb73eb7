//! One HTTP/1.1 request at a time, on a fresh connection, with a deadline
//! and a cap on the answer: what the planner needs to scrape `/metrics` and
//! to call the Kubernetes API (HTTPS with the service account's CA and
//! bearer token, or plain HTTP through `kubectl proxy`).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use thiserror::Error;
use tokio_rustls::rustls;

/// An answer larger than this is refused.
pub const MAX_RESPONSE_BYTES: usize = 8 << 20;

#[derive(Debug, Error)]
pub enum HttpError {
    #[error("bad URL {0:?}: want http://HOST:PORT/PATH or https://...")]
    Url(String),
    #[error("connecting to {0}: {1}")]
    Connect(String, std::io::Error),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("{0}")]
    Protocol(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("reading {0}: {1}")]
    File(String, std::io::Error),
}

/// An answer: status and body.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub body: Bytes,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A request's method, body and headers.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    pub method: hyper::Method,
    pub url: &'a str,
    /// `(content type, body)`.
    pub body: Option<(&'a str, Vec<u8>)>,
}

/// Sends requests with a deadline, optionally over TLS and with a bearer
/// token.
#[derive(Clone)]
pub struct HttpClient {
    tls: Option<Arc<rustls::ClientConfig>>,
    bearer: Option<String>,
    timeout: Duration,
}

impl std::fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpClient")
            .field("tls", &self.tls.is_some())
            .field("bearer", &self.bearer.as_ref().map(|_| "<redacted>"))
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl HttpClient {
    /// Plain HTTP only.
    pub fn plain(timeout: Duration) -> Self {
        Self {
            tls: None,
            bearer: None,
            timeout,
        }
    }

    /// HTTPS trusting the CA certificates in `ca_pem`, plain HTTP too.
    pub fn with_ca(mut self, ca_pem: &Path) -> Result<Self, HttpError> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::CertificateDer;
        let mut roots = rustls::RootCertStore::empty();
        let certs = CertificateDer::pem_file_iter(ca_pem)
            .map_err(|e| HttpError::Tls(format!("{}: {e}", ca_pem.display())))?;
        for cert in certs {
            let cert = cert.map_err(|e| HttpError::Tls(format!("{}: {e}", ca_pem.display())))?;
            roots
                .add(cert)
                .map_err(|e| HttpError::Tls(format!("{}: {e}", ca_pem.display())))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| HttpError::Tls(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        self.tls = Some(Arc::new(config));
        Ok(self)
    }

    /// Sends `Authorization: Bearer TOKEN` with every request.
    pub fn with_bearer(mut self, token: String) -> Self {
        self.bearer = Some(token);
        self
    }

    pub async fn get(&self, url: &str) -> Result<Response, HttpError> {
        self.send(Request {
            method: hyper::Method::GET,
            url,
            body: None,
        })
        .await
    }

    /// Sends `request` and reads the answer, all within the deadline.
    pub async fn send(&self, request: Request<'_>) -> Result<Response, HttpError> {
        tokio::time::timeout(self.timeout, self.send_now(request))
            .await
            .map_err(|_| HttpError::Timeout(self.timeout))?
    }

    async fn send_now(&self, request: Request<'_>) -> Result<Response, HttpError> {
        let uri: hyper::Uri = request
            .url
            .parse()
            .map_err(|_| HttpError::Url(request.url.to_string()))?;
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(HttpError::Url(request.url.to_string())),
        };
        let authority = uri
            .authority()
            .ok_or_else(|| HttpError::Url(request.url.to_string()))?
            .clone();
        let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
        let address = format!("{}:{port}", authority.host());
        let tcp = tokio::net::TcpStream::connect(&address)
            .await
            .map_err(|e| HttpError::Connect(address.clone(), e))?;
        let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
        let mut builder = hyper::Request::builder()
            .method(request.method)
            .uri(path)
            .header(hyper::header::HOST, authority.as_str());
        if let Some(token) = &self.bearer {
            builder = builder.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let body = match request.body {
            Some((content_type, body)) => {
                builder = builder.header(hyper::header::CONTENT_TYPE, content_type);
                Bytes::from(body)
            }
            None => Bytes::new(),
        };
        let req = builder
            .body(Full::new(body))
            .map_err(|e| HttpError::Protocol(e.to_string()))?;
        match https {
            false => exchange(TokioIo::new(tcp), req).await,
            true => {
                let tls = self
                    .tls
                    .clone()
                    .ok_or_else(|| HttpError::Tls("https without a CA (--k8s-ca)".into()))?;
                let name = rustls_pki_types::ServerName::try_from(authority.host().to_string())
                    .map_err(|e| HttpError::Tls(e.to_string()))?;
                let stream = tokio_rustls::TlsConnector::from(tls)
                    .connect(name, tcp)
                    .await
                    .map_err(|e| HttpError::Tls(e.to_string()))?;
                exchange(TokioIo::new(stream), req).await
            }
        }
    }
}

async fn exchange<T>(
    io: TokioIo<T>,
    req: hyper::Request<Full<Bytes>>,
) -> Result<Response, HttpError>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| HttpError::Protocol(e.to_string()))?;
    let driver = tokio::spawn(connection);
    let answer = async {
        let response = sender
            .send_request(req)
            .await
            .map_err(|e| HttpError::Protocol(e.to_string()))?;
        let status = response.status().as_u16();
        let body = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
            .collect()
            .await
            .map_err(|e| HttpError::Protocol(format!("reading the answer: {e}")))?
            .to_bytes();
        Ok(Response { status, body })
    }
    .await;
    driver.abort();
    answer
}

/// Reads a small file (a token, a namespace), trimmed.
pub fn read_trimmed(path: &Path) -> Result<String, HttpError> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|e| HttpError::File(path.display().to_string(), e))
}
