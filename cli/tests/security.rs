//! Cluster security on real processes: `tandem up --tls` (mutual TLS on
//! every hop, with a development CA) and API keys on the router's gRPC and
//! HTTP APIs; `tandem serve` for the request size limits.

use std::path::Path;
use std::time::Duration;

use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tandem_proto::worker::ROUTED_PREFILL_HEADER;
use tandem_security::{LoadedTls, PeerRole, TlsConfig};
use tandem_tests::cluster::Started;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

const KEY: &str = "sk-test-7f3a";
/// The key `serve_refuses_oversized_requests_and_missing_keys` passes on
/// its command line: not `KEY`, which the mTLS test checks no command line
/// holds while the two run side by side.
const ARGV_KEY: &str = "sk-argv-2b9d";

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

/// A prompt of 40 tokens: past the remote-prefill threshold (8), so the
/// call crosses router → decode → prefill and a KV transfer.
fn prompt() -> Vec<u32> {
    (0..40).map(|i| 3 + (i * 7) % 200).collect()
}

fn request() -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
            ids: prompt(),
        })),
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        max_tokens: Some(8),
        ignore_eos: true,
        ..Default::default()
    }
}

/// What a call produced: its tokens and the prefill worker it crossed.
#[derive(Debug)]
struct Served {
    tokens: Vec<u32>,
    prefill: Option<String>,
}

/// One `Generate` call through `endpoint` with `key` (if any); connection
/// and TLS failures are `Err` as well as refused calls.
async fn call(endpoint: Endpoint, key: Option<&str>) -> Result<Served, tonic::Status> {
    let channel = endpoint
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(format!("connect: {e:?}")))?;
    let mut client = GenerationClient::new(channel);
    let mut req = tonic::Request::new(request());
    if let Some(k) = key {
        req.metadata_mut().insert(
            "authorization",
            format!("Bearer {k}").parse().expect("ascii"),
        );
    }
    let resp = client.generate(req).await?;
    let prefill = resp
        .metadata()
        .get(ROUTED_PREFILL_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut stream = resp.into_inner();
    let mut tokens = Vec::new();
    while let Some(msg) = stream.message().await? {
        if let Some(v1::generate_response::Event::Delta(d)) = msg.event {
            tokens.extend(d.token_ids);
        }
    }
    Ok(Served { tokens, prefill })
}

/// A raw HTTP/1.1 exchange: the status code and the body.
fn http(addr: &str, method: &str, path: &str, auth: Option<&str>, body: &str) -> (u16, String) {
    tandem_tests::cluster::http(addr, method, path, auth, body)
}

/// `tandem up --tls` with the API key in the environment (never argv), and
/// without `--debug-routing-headers` (spawned here, not by the test
/// helpers that add it): what a real deployment tells its clients.
fn up_tls(model: &Path, certs: &Path) -> Started {
    let args = [
        "up",
        "--model",
        model.to_str().expect("utf8"),
        "--prefill",
        "1",
        "--decode",
        "1",
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--kv-cache-memory",
        "32MiB",
        "--remote-prefill-threshold",
        "8",
        "--no-etcd",
        "--tls",
        "--tls-dir",
        certs.to_str().expect("utf8"),
    ];
    let child = std::process::Command::new(tandem())
        .args(args)
        .env("TANDEM_API_KEYS", KEY)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("tandem up starts");
    tandem_tests::cluster::started(child, &args)
}

/// The value of `name` in process `pid`'s environment.
fn environ_var(pid: u32, name: &str) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    environ.split(|&b| b == 0).find_map(|entry| {
        let entry = String::from_utf8_lossy(entry);
        entry
            .strip_prefix(name)
            .and_then(|rest| rest.strip_prefix('='))
            .map(str::to_string)
    })
}

/// The pids of processes whose command line contains `secret`.
fn command_lines_containing(secret: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if std::fs::read(entry.path().join("cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains(secret))
        {
            found.push(pid);
        }
    }
    found
}

/// Neither the cluster token `up` drew nor the API key is on any command
/// line (`ps` shows those to every local user): both travel in the
/// environment. The KV push of the test above proves the workers got it.
fn assert_no_secret_on_a_command_line(cluster: &Started) {
    let decode_pid = cluster.pids[&cluster.decode[0]];
    let prefill_pid = cluster.pids[&cluster.prefill[0]];
    let token = environ_var(decode_pid, "TANDEM_CLUSTER_TOKEN")
        .expect("the decode worker has the cluster token in its environment");
    assert_eq!(
        environ_var(prefill_pid, "TANDEM_CLUSTER_TOKEN").as_deref(),
        Some(token.as_str()),
        "both workers share the token"
    );
    assert!(token.len() >= 16, "a drawn token, got {token:?}");
    for secret in [token.as_str(), KEY] {
        let on_argv = command_lines_containing(secret);
        assert!(
            on_argv.is_empty(),
            "a secret is on the command line of {on_argv:?}"
        );
    }
}

/// Role-bearing certificates: the `client` certificate comes from the
/// cluster CA, and even with the cluster credential (read here from the
/// worker's environment, as a leaked token) it cannot call a decode
/// worker's `Decode`/`Generate` or a prefill worker's `Prefill`:
/// PERMISSION_DENIED naming the role those take. The router's certificate
/// with the same credential is served by the decode worker.
fn assert_worker_calls_need_a_worker_role(cluster: &Started, certs: &Path) {
    use tandem_proto::worker::v1 as wv1;
    let decode = cluster.decode[0].clone();
    let prefill = cluster.prefill[0].clone();
    let token = environ_var(cluster.pids[&decode], "TANDEM_CLUSTER_TOKEN").expect("token");
    let credential = tandem_security::ClusterCredential::derive(&token);
    let channel = |role: PeerRole, addr: &str| {
        let tls = TlsConfig::in_dir(certs, role).load().expect("cert");
        let endpoint = tandem_security::tls::endpoint(Some(&tls), addr).expect("endpoint");
        credential.channel(endpoint.connect_lazy())
    };
    let routed = || wv1::RoutedGenerateRequest {
        request: Some(request()),
        prefill: None,
        resume: None,
    };
    tandem_tests::cluster::runtime().block_on(async {
        let mut as_client =
            wv1::decode_client::DecodeClient::new(channel(PeerRole::Client, &decode));
        let denied = as_client.generate(routed()).await.expect_err("client role");
        assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");
        assert!(
            denied.message().contains("router certificates"),
            "{denied:?}"
        );
        assert!(denied.message().contains("holds client"), "{denied:?}");
        let mut public = GenerationClient::new(channel(PeerRole::Client, &decode));
        let denied = public.generate(request()).await.expect_err("client role");
        assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");

        let mut prefill_client =
            wv1::prefill_client::PrefillClient::new(channel(PeerRole::Client, &prefill));
        let denied = prefill_client
            .prefill(wv1::PrefillRequest::default())
            .await
            .expect_err("client role");
        assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");
        assert!(
            denied.message().contains("decode certificates"),
            "{denied:?}"
        );

        let mut as_router =
            wv1::decode_client::DecodeClient::new(channel(PeerRole::Router, &decode));
        let mut stream = as_router
            .generate(routed())
            .await
            .expect("the router's certificate is served")
            .into_inner();
        let mut tokens = 0;
        while let Some(msg) = stream.message().await.expect("stream") {
            if let Some(v1::generate_response::Event::Delta(d)) = msg.event {
                tokens += d.token_ids.len();
            }
        }
        assert_eq!(tokens, 8);
    });
}

/// The acceptance test of mTLS and API keys: a client with a certificate
/// from the cluster CA and a valid key is served (over router → decode →
/// prefill, every hop mTLS); without a certificate, with one from another
/// CA, over plain HTTP/2, or without / with a wrong API key it is refused.
/// The HTTP API wants the key too; `/health` stays open.
#[test]
fn mtls_cluster_refuses_clients_without_a_cluster_certificate_or_api_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let certs = dir.path().join("certs");
    let cluster = up_tls(&model, &certs);
    let addr = cluster.addr.clone();
    let ours = TlsConfig::in_dir(&certs, PeerRole::Client)
        .load()
        .expect("client cert");
    let ca = std::fs::read(certs.join("ca.pem")).expect("ca");
    // Another CA's client certificate, presented to a server it trusts.
    let other_dir = dir.path().join("other-ca");
    tandem_security::write_dev_certs(&other_dir, &[]).expect("other CA");
    let other = TlsConfig::in_dir(&other_dir, PeerRole::Client)
        .load()
        .expect("other");
    let foreign = LoadedTls::from_pem(
        std::fs::read(other_dir.join("client.pem")).expect("pem"),
        std::fs::read(other_dir.join("client.key")).expect("key"),
        ca.clone(),
    );
    drop(other);

    tandem_tests::cluster::runtime().block_on(async {
        // Served: cluster certificate and key; the call crossed a prefill
        // worker, so decode → prefill and the KV push ran too.
        let served = call(ours.endpoint(&addr).expect("endpoint"), Some(KEY))
            .await
            .expect("a client with a cluster certificate and a key is served");
        assert_eq!(served.tokens.len(), 8, "{served:?}");
        // (Remote prefill is checked on the decode worker's metrics below.)
        assert!(
            served.prefill.is_none(),
            "the router told a client a worker address: {served:?}"
        );
    });
    assert_no_secret_on_a_command_line(&cluster);
    assert_worker_calls_need_a_worker_role(&cluster, &certs);
    // The KV push under its ticket succeeded (not a fallback to local
    // prefill): the decode worker counts an ok remote prefill and blocks.
    let decode = &cluster.decode[0];
    let metrics = cluster
        .metrics_addr("decode-worker", decode)
        .expect("decode metrics");
    // (The prefill call's reply may land just after the stream ends.)
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let scrape = loop {
        let scrape = tandem_tests::prometheus::scrape(metrics);
        let ok = scrape.value("tandem_remote_prefills_total", &[("outcome", "ok")]);
        if ok == Some(1.0) || std::time::Instant::now() > deadline {
            break scrape;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        scrape.value("tandem_remote_prefills_total", &[("outcome", "ok")]),
        Some(1.0),
        "the remote prefill did not succeed"
    );
    assert!(scrape.sum("tandem_kv_transfer_received_block_layers_total", &[]) > 0.0);

    tandem_tests::cluster::runtime().block_on(async {
        // Refused: no client certificate.
        let no_cert = Endpoint::from_shared(format!("https://{addr}"))
            .expect("uri")
            .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&ca)))
            .expect("tls");
        let refused = call(no_cert, Some(KEY)).await.expect_err("no client cert");
        assert_ne!(refused.code(), tonic::Code::Ok);

        // Refused: a certificate from another CA.
        let refused = call(foreign.endpoint(&addr).expect("endpoint"), Some(KEY))
            .await
            .expect_err("foreign client cert");
        assert_ne!(refused.code(), tonic::Code::Ok);

        // Refused: plaintext HTTP/2.
        let plain = Endpoint::from_shared(format!("http://{addr}")).expect("uri");
        call(plain, Some(KEY)).await.expect_err("plaintext");

        // Refused with UNAUTHENTICATED: a valid certificate, no or a wrong key.
        for key in [None, Some("sk-wrong")] {
            let refused = call(ours.endpoint(&addr).expect("endpoint"), key)
                .await
                .expect_err("no valid key");
            assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
            assert!(refused.message().contains("API key"), "{refused:?}");
        }
    });

    // The CLI's own client: `generate --router` with the client certificate
    // and the key is served; without the key it is refused.
    let generate = |key: Option<&str>| {
        let mut cmd = std::process::Command::new(tandem());
        cmd.args([
            "generate",
            "--router",
            &addr,
            "--prompt-ids",
            "5,6,7,8",
            "--max-tokens",
            "3",
            "--json",
        ])
        .arg("--tls-cert")
        .arg(certs.join("client.pem"))
        .arg("--tls-key")
        .arg(certs.join("client.key"))
        .arg("--tls-ca")
        .arg(certs.join("ca.pem"))
        .env_remove("TANDEM_API_KEY");
        if let Some(k) = key {
            cmd.args(["--api-key", k]);
        }
        cmd.output().expect("tandem generate runs")
    };
    let out = generate(Some(KEY));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(
        json["output_ids"].as_array().map(Vec::len),
        Some(3),
        "{json}"
    );
    let out = generate(None);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("API key"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let http_addr = cluster.http.clone().expect("http API");
    let body = r#"{"prompt": "hello there", "max_tokens": 4}"#;
    for auth in [None, Some("Bearer sk-wrong"), Some("Basic abc")] {
        let (status, text) = http(&http_addr, "POST", "/v1/completions", auth, body);
        assert_eq!(status, 401, "{auth:?}: {text}");
        let json: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(json["error"]["code"], "invalid_api_key", "{text}");
        assert_eq!(json["error"]["type"], "authentication_error", "{text}");
    }
    for (method, path, body) in [
        ("GET", "/v1/models", ""),
        ("GET", "/v1/models/tiny", ""),
        ("POST", "/tokenize", r#"{"prompt": "hello"}"#),
        ("POST", "/detokenize", r#"{"tokens": [1]}"#),
    ] {
        let (status, text) = http(&http_addr, method, path, None, body);
        assert_eq!(status, 401, "{path}: {text}");
    }
    let bearer = format!("Bearer {KEY}");
    // With the key, a bad tokenize or detokenize call is a 400 naming its field.
    for (path, body, param) in [
        ("/detokenize", r#"{"tokens": [4000000000]}"#, "tokens"),
        (
            "/tokenize",
            r#"{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}"#,
            "prompt",
        ),
        ("/tokenize", r#"{"add_special_tokens": true}"#, "prompt"),
    ] {
        let (status, text) = http(&http_addr, "POST", path, Some(&bearer), body);
        assert_eq!(status, 400, "{path}: {text}");
        let json: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(json["error"]["param"], param, "{text}");
    }
    let (status, text) = http(&http_addr, "POST", "/v1/completions", Some(&bearer), body);
    assert_eq!(status, 200, "{text}");
    let json: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert!(json["choices"][0]["text"].is_string(), "{text}");
    let (status, _) = http(&http_addr, "GET", "/health", None, "");
    assert_eq!(status, 200);
}

/// `tandem serve` with a key: the gRPC and HTTP APIs enforce their size
/// limits with clear errors (a gRPC message over 4 MiB: OUT_OF_RANGE; a
/// prompt past the context: INVALID_ARGUMENT naming it; an HTTP body over
/// 1 MiB: 413 in OpenAI's shape) — and keys work without TLS.
#[test]
fn serve_refuses_oversized_requests_and_missing_keys() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let server = tandem_tests::cluster::start(
        tandem(),
        &[
            "serve",
            "--model",
            model.to_str().expect("utf8"),
            "--addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
            "--num-kv-blocks",
            "256",
            "--api-key",
            ARGV_KEY,
        ],
    );
    let addr = server.addr.clone();
    tandem_tests::cluster::runtime().block_on(async {
        let endpoint = || Endpoint::from_shared(format!("http://{addr}")).expect("uri");
        let served = call(endpoint(), Some(ARGV_KEY)).await.expect("served");
        assert_eq!(served.tokens.len(), 8);
        let refused = call(endpoint(), None).await.expect_err("no key");
        assert_eq!(refused.code(), tonic::Code::Unauthenticated);

        // 5 MiB of text: over the message limit, refused before parsing.
        let mut client = GenerationClient::new(endpoint().connect().await.expect("connects"));
        let mut req = tonic::Request::new(v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::Text("a".repeat(5 << 20))),
            max_tokens: Some(1),
            ..Default::default()
        });
        req.metadata_mut().insert(
            "authorization",
            format!("Bearer {ARGV_KEY}").parse().expect("ascii"),
        );
        let refused = client.generate(req).await.expect_err("too large");
        assert_eq!(refused.code(), tonic::Code::OutOfRange, "{refused:?}");
        assert!(refused.message().contains("too large"), "{refused:?}");

        // Under the message limit but over the context: the prompt's token
        // count is refused by name.
        let mut req = tonic::Request::new(v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
                ids: vec![5; 100_000],
            })),
            max_tokens: Some(1),
            ..Default::default()
        });
        req.metadata_mut().insert(
            "authorization",
            format!("Bearer {ARGV_KEY}").parse().expect("ascii"),
        );
        let refused = client.generate(req).await.expect_err("too long");
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains("max_model_len"), "{refused:?}");
    });
    let http_addr = server.http.clone().expect("http API");
    let bearer = format!("Bearer {ARGV_KEY}");
    let huge = format!(
        r#"{{"prompt": "{}", "max_tokens": 1}}"#,
        "a".repeat(2 << 20)
    );
    let (status, text) = http(&http_addr, "POST", "/v1/completions", Some(&bearer), &huge);
    assert_eq!(status, 413, "{text}");
    let json: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(json["error"]["code"], "request_too_large", "{text}");

    // Prompts × n fan out to that many sequences: 20 prompts × n=10 is
    // refused naming the field, 16 × 8 (the limit, 128) is served.
    let fan_out = |prompts: usize, n: u32| {
        let list: Vec<String> = (0..prompts).map(|i| format!("\"story {i}\"")).collect();
        format!(
            r#"{{"prompt": [{}], "n": {n}, "max_tokens": 1}}"#,
            list.join(",")
        )
    };
    let (status, text) = http(
        &http_addr,
        "POST",
        "/v1/completions",
        Some(&bearer),
        &fan_out(20, 10),
    );
    assert_eq!(status, 400, "{text}");
    let json: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(json["error"]["param"], "prompt", "{text}");
    assert!(text.contains("200 choices"), "{text}");
    let (status, text) = http(
        &http_addr,
        "POST",
        "/v1/completions",
        Some(&bearer),
        &fan_out(16, 8),
    );
    assert_eq!(status, 200, "{text}");
    let json: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(
        json["choices"].as_array().map(Vec::len),
        Some(128),
        "{text}"
    );
}

/// The acceptance test of KV-transfer peer authentication, on a real decode
/// worker: a prompt's blocks sit in its prefix cache; a forged peer without
/// the cluster secret is refused at the handshake, and a peer *with* the
/// secret that was never handed a transfer ticket (a compromised host that
/// is no prefill worker of this request) has every block it writes, to
/// every block id of the pool, refused. The same prompt then reads the
/// cached blocks (cached_tokens > 0) and generates the same greedy tokens:
/// the pool is untouched.
#[test]
fn forged_kv_peer_cannot_write_into_a_decode_workers_pool() {
    use tandem_kv_transfer::tcp::TcpTransport;
    use tandem_kv_transfer::{BlockWrite, TransferError, TransferId, Transport};
    use tandem_proto::worker::v1 as wv1;

    const SECRET: &str = "e2e-cluster-secret-91b2";
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let worker = tandem_tests::cluster::start_with_env(
        tandem(),
        &[
            "decode-worker",
            "--model",
            model.to_str().expect("utf8"),
            "--addr",
            "127.0.0.1:0",
            "--num-kv-blocks",
            "64",
            "--batch-invariant",
        ],
        &[("TANDEM_CLUSTER_TOKEN", SECRET)],
    );
    let addr = worker.addr.clone();
    tandem_tests::cluster::runtime().block_on(async {
        let mut info_client = wv1::worker_client::WorkerClient::connect(format!("http://{addr}"))
            .await
            .expect("worker");
        let info = info_client
            .info(wv1::InfoRequest {})
            .await
            .expect("info")
            .into_inner();
        let layout =
            tandem_server::layout::from_proto(&info.layout.expect("layout")).expect("layout");
        let endpoint = info.transfer_endpoint.clone();

        // Generate on a worker is the router's call: it presents the
        // cluster credential.
        let greedy = |addr: String| async move {
            let channel = Endpoint::from_shared(format!("http://{addr}"))
                .expect("endpoint")
                .connect()
                .await
                .expect("connects");
            let mut c = GenerationClient::new(
                tandem_security::ClusterCredential::derive(SECRET).channel(channel),
            );
            let mut stream = c.generate(request()).await.expect("generate").into_inner();
            let (mut tokens, mut cached) = (Vec::new(), 0);
            while let Some(msg) = stream.message().await.expect("message") {
                match msg.event {
                    Some(v1::generate_response::Event::Delta(d)) => tokens.extend(d.token_ids),
                    Some(v1::generate_response::Event::Finished(f)) => {
                        cached = f.usage.map_or(0, |u| u.cached_tokens);
                    }
                    _ => {}
                }
            }
            (tokens, cached)
        };
        let (before, _) = greedy(addr.clone()).await;
        assert_eq!(before.len(), 8);

        // No secret: refused at the handshake.
        let err = TcpTransport::new("guessed-secret")
            .connect(&endpoint, layout)
            .await
            .expect_err("a peer without the secret");
        assert_eq!(err, TransferError::BadToken);

        // The secret but no ticket: every write refused, whatever the id.
        let session = TcpTransport::new(SECRET)
            .connect(&endpoint, layout)
            .await
            .expect("the handshake alone admits a holder of the secret");
        let garbage = bytes::Bytes::from(vec![0x7f; layout.block_layer_bytes()]);
        for t in (0..8).chain([u64::MAX, 0x9e37_79b9_7f4a_7c15]) {
            let blocks: Vec<BlockWrite> = (0..layout.num_layers)
                .flat_map(|layer| (0..64).map(move |dst| (layer, dst)))
                .map(|(layer, dst_block)| BlockWrite {
                    layer,
                    dst_block,
                    k: garbage.clone(),
                    v: garbage.clone(),
                })
                .collect();
            session.write(TransferId(t), blocks).await.expect("queued");
            let refused = session
                .finish(TransferId(t))
                .await
                .expect_err("a transfer this worker never opened");
            assert!(
                refused.to_string().contains("not opened by this receiver"),
                "{refused}"
            );
        }
        drop(session);

        let (after, cached) = greedy(addr.clone()).await;
        assert!(cached > 0, "the second call must read the cached blocks");
        assert_eq!(after, before, "the pool was written into");
    });
}

/// `tandem certs` writes the CA and every component's certificate and key,
/// names them on stdout, and a certificate it wrote loads as TLS material.
#[test]
fn certs_writes_a_ca_and_component_certificates() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("certs");
    let run = std::process::Command::new(tandem())
        .args(["certs", "--out"])
        .arg(&out)
        .args(["--hosts", "router.internal,10.1.2.3"])
        .output()
        .expect("tandem certs runs");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(stdout.starts_with("ca "), "{stdout}");
    for role in PeerRole::ALL {
        assert!(stdout.contains(&format!("\n{role} ")), "{stdout}");
        TlsConfig::in_dir(&out, role).load().expect("loads");
    }
    assert!(String::from_utf8_lossy(&run.stderr).contains("router.internal"));
    assert!(!out.join("ca.key").exists(), "the CA key is not kept");
}
