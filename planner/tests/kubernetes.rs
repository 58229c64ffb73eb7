//! The Kubernetes actuator's requests, as a stand-in API server on loopback
//! receives them (plain HTTP, as through `kubectl proxy`). The body it sends
//! must equal `fixtures/scale-patch.json`, which CI validates against the
//! Kubernetes 1.37 schema with `kubernetes-validate --strict`.

use std::sync::{Arc, Mutex};

use tandem_discovery::Role;
use tandem_planner::actuator::{apply, Actuator, ActuatorError};
use tandem_planner::http::HttpClient;
use tandem_planner::kubernetes::{Kubernetes, KubernetesConfig, API_TIMEOUT, MERGE_PATCH};
use tandem_planner::{Action, Sizes};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// One request as the server read it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: String,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Serves `replicas` for GETs of a scale and `status` for PATCHes,
/// recording every request.
async fn api_server(patch_status: u16) -> (String, Arc<Mutex<Vec<Seen>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let log = log.clone();
            tokio::spawn(async move {
                let mut reader = BufReader::new(stream);
                let mut line = String::new();
                reader.read_line(&mut line).await.expect("request line");
                let mut parts = line.split_whitespace();
                let (method, path) = (
                    parts.next().unwrap_or("").to_string(),
                    parts.next().unwrap_or("").to_string(),
                );
                let mut headers = Vec::new();
                loop {
                    let mut h = String::new();
                    reader.read_line(&mut h).await.expect("header");
                    let h = h.trim_end();
                    if h.is_empty() {
                        break;
                    }
                    if let Some((k, v)) = h.split_once(':') {
                        headers.push((k.trim().to_string(), v.trim().to_string()));
                    }
                }
                let length = headers
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                    .map_or(0, |(_, v)| v.parse().expect("length"));
                let mut body = vec![0; length];
                reader.read_exact(&mut body).await.expect("body");
                let seen = Seen {
                    method,
                    path,
                    headers,
                    body: String::from_utf8(body).expect("utf-8"),
                };
                let (status, answer) = match seen.method.as_str() {
                    "GET" if seen.path.contains("/prefill-worker/") => {
                        (200, r#"{"spec":{"replicas":1}}"#.to_string())
                    }
                    "GET" => (200, r#"{"spec":{"replicas":2}}"#.to_string()),
                    _ if patch_status == 200 => (200, seen.body.clone()),
                    _ => (
                        patch_status,
                        r#"{"kind":"Status","message":"forbidden"}"#.to_string(),
                    ),
                };
                log.lock().expect("log").push(seen);
                let response = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
                    answer.len()
                );
                let mut stream = reader.into_inner();
                stream.write_all(response.as_bytes()).await.expect("write");
            });
        }
    });
    (format!("http://{addr}"), seen)
}

fn actuator(api: String) -> Kubernetes {
    Kubernetes::new(
        KubernetesConfig {
            api,
            namespace: "tandem".into(),
            prefill_deployment: "prefill-worker".into(),
            decode_deployment: "decode-worker".into(),
        },
        HttpClient::plain(API_TIMEOUT).with_bearer("sa-token".into()),
    )
}

#[tokio::test]
async fn scaling_patches_the_deployments_scale_subresource() {
    let (api, seen) = api_server(200).await;
    let k8s = actuator(api);
    let sizes = k8s.sizes().await.expect("sizes");
    assert_eq!(
        sizes,
        Sizes {
            prefill: 1,
            decode: 2
        }
    );
    assert!(!k8s.can_switch());
    // The planner's actions: one more decode worker.
    let reached = apply(&k8s, sizes, &[Action::Start(Role::Decode)])
        .await
        .expect("applied");
    assert_eq!(reached.decode, 3);
    let seen = seen.lock().expect("log").clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert_eq!(seen[0].method, "GET");
    assert_eq!(
        seen[0].path,
        "/apis/apps/v1/namespaces/tandem/deployments/prefill-worker/scale"
    );
    let patch = &seen[2];
    assert_eq!(patch.method, "PATCH");
    assert_eq!(
        patch.path,
        "/apis/apps/v1/namespaces/tandem/deployments/decode-worker/scale"
    );
    assert_eq!(patch.header("content-type"), Some(MERGE_PATCH));
    assert_eq!(patch.header("authorization"), Some("Bearer sa-token"));
    let body: serde_json::Value = serde_json::from_str(&patch.body).expect("json body");
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/scale-patch.json")).expect("fixture");
    assert_eq!(body, fixture);
}

#[tokio::test]
async fn a_refused_patch_is_an_error_naming_the_status() {
    let (api, _) = api_server(403).await;
    let k8s = actuator(api);
    let err = k8s.scale(Role::Prefill, 0).await.expect_err("refused");
    assert!(
        matches!(err, ActuatorError::Api { status: 403, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("forbidden"), "{err}");
    assert!(matches!(
        k8s.switch(Role::Decode).await,
        Err(ActuatorError::Unsupported(_))
    ));
}

#[tokio::test]
async fn an_api_that_never_answers_times_out() {
    // Accepts and then says nothing.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let _held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    let client = HttpClient::plain(std::time::Duration::from_millis(300));
    let err = client
        .get(&format!("http://{addr}/metrics"))
        .await
        .expect_err("times out");
    assert!(
        matches!(err, tandem_planner::http::HttpError::Timeout(_)),
        "{err}"
    );
}

/// A one-answer HTTPS server with `dir`'s router certificate (signed by
/// `dir`'s CA): it sends back the request's `authorization` header.
async fn https_server(dir: &std::path::Path) -> String {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    use tokio_rustls::rustls;
    let files = tandem_security::TlsConfig::in_dir(dir, tandem_security::PeerRole::Router);
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .expect("cert")
        .map(|c| c.expect("cert"))
        .collect();
    let key = PrivateKeyDer::from_pem_file(&files.key).expect("key");
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let Ok(tls) = acceptor.accept(tcp).await else {
                continue;
            };
            let mut reader = BufReader::new(tls);
            let mut auth = String::new();
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).await.unwrap_or(0) == 0 || h.trim().is_empty() {
                    break;
                }
                if let Some(v) = h.to_ascii_lowercase().strip_prefix("authorization:") {
                    auth = v.trim().to_string();
                }
            }
            let body = format!(r#"{{"spec":{{"replicas":4}},"auth":"{auth}"}}"#);
            let response = format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let _ = reader.into_inner().write_all(response.as_bytes()).await;
        }
    });
    format!("https://127.0.0.1:{}", addr.port())
}

#[tokio::test]
async fn https_with_the_service_accounts_ca_and_token_and_no_other_ca() {
    let ours = tempfile::tempdir().expect("tempdir");
    let theirs = tempfile::tempdir().expect("tempdir");
    tandem_security::write_dev_certs(ours.path(), &[]).expect("certs");
    tandem_security::write_dev_certs(theirs.path(), &[]).expect("certs");
    let api = https_server(ours.path()).await;
    let url = format!("{api}/apis/apps/v1/namespaces/tandem/deployments/decode-worker/scale");
    let client = HttpClient::plain(API_TIMEOUT)
        .with_ca(&ours.path().join("ca.pem"))
        .expect("CA")
        .with_bearer("sa-token".into());
    let answer = client.get(&url).await.expect("HTTPS answer");
    assert_eq!(answer.status, 200);
    assert!(
        answer.text().contains(r#""auth":"bearer sa-token""#),
        "{}",
        answer.text()
    );
    // The actuator reads the replicas through the same client.
    let k8s = Kubernetes::new(
        KubernetesConfig {
            api: api.clone(),
            namespace: "tandem".into(),
            prefill_deployment: "prefill-worker".into(),
            decode_deployment: "decode-worker".into(),
        },
        client,
    );
    assert_eq!(k8s.sizes().await.expect("sizes").decode, 4);
    // A server whose certificate another CA signed is refused.
    let stranger = HttpClient::plain(API_TIMEOUT)
        .with_ca(&theirs.path().join("ca.pem"))
        .expect("CA");
    let err = stranger.get(&url).await.expect_err("untrusted");
    assert!(
        matches!(err, tandem_planner::http::HttpError::Tls(_)),
        "{err}"
    );
    // And https without a CA at all is an error, not a plaintext call.
    let err = HttpClient::plain(API_TIMEOUT)
        .get(&url)
        .await
        .expect_err("no CA");
    assert!(err.to_string().contains("without a CA"), "{err}");
}
