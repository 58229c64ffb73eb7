//! LoRA adapters through real processes: `tandem up` with a prefill and a
//! decode worker against `tandem serve`, the router's placement by adapter,
//! and the HTTP API's `model`, `/v1/models` and admin routes.
//!
//! The model and adapters are the golden fixtures (`tests/golden/`): a
//! tiny Llama and PEFT adapters made for it (parity with peft itself is
//! `tests/tests/lora.rs`).

use std::path::{Path, PathBuf};

use tandem_proto::v1;
use tandem_tests::cluster::{all_blocks_free, call, Outcome, Started};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn model() -> String {
    fixtures()
        .join("golden/llama_gqa_f32")
        .display()
        .to_string()
}

fn adapter(name: &str) -> String {
    let dir = fixtures().join("lora/llama_gqa_f32").join(name);
    format!("{name}={}", dir.display())
}

fn start(args: &[&str]) -> Started {
    tandem_tests::cluster::start(Path::new(env!("CARGO_BIN_EXE_tandem")), args)
}

/// A greedy request of `max_tokens` under `lora` ("" for the base model).
fn request(prompt: Vec<u32>, max_tokens: u32, lora: &str) -> v1::GenerateRequest {
    v1::GenerateRequest {
        lora: lora.to_string(),
        ..tandem_tests::cluster::greedy_request(prompt, max_tokens)
    }
}

/// A greedy 8-token completion of a fixed prompt by `model` over HTTP:
/// the status, and the text (200) or the body (otherwise).
fn complete(http: &str, auth: Option<&str>, model: &str) -> (u16, String) {
    let body = serde_json::json!({
        "model": model, "prompt": "the quick brown fox jumps over the lazy dog",
        "max_tokens": 8, "temperature": 0,
    });
    let (status, body) =
        tandem_tests::cluster::http(http, "POST", "/v1/completions", auth, &body.to_string());
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    match status {
        200 => (
            status,
            v["choices"][0]["text"].as_str().unwrap_or("").to_string(),
        ),
        _ => (status, body),
    }
}

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| (i * 7 + seed * 31 + 3) % 128).collect()
}

#[test]
fn remote_prefill_under_an_adapter_equals_local_and_routing_follows_adapters() {
    let (model, r8, r4) = (model(), adapter("r8_all"), adapter("r4_attn"));
    let serve = start(&[
        "serve",
        "--model",
        &model,
        "--addr",
        "127.0.0.1:0",
        "--num-kv-blocks",
        "512",
        "--batch-invariant",
        "--lora",
        &r8,
        "--lora",
        &r4,
    ]);
    // Decode worker 0 serves both adapters, the prefill worker only r8: a
    // long r4 prompt must not be prefilled there.
    let cluster = start(&[
        "up",
        "--model",
        &model,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--addr",
        "127.0.0.1:0",
        "--kv-cache-memory",
        "16MiB",
        "--remote-prefill-threshold",
        "32",
        "--no-http",
        "--worker-arg=--batch-invariant",
        "--lora",
        &r8,
        "--decode-arg",
        &format!("--lora={r4}"),
    ]);
    let rt = tandem_tests::cluster::runtime();
    let run = |addr: &str, req: v1::GenerateRequest| -> Outcome {
        rt.block_on(call(addr, req)).expect("call")
    };
    let mut outputs = Vec::new();
    for (i, lora) in ["r8_all", "r4_attn", ""].into_iter().enumerate() {
        let p = prompt(i as u32, 120);
        let want = run(&serve.addr, request(p.clone(), 16, lora));
        let got = run(&cluster.addr, request(p.clone(), 16, lora));
        assert_eq!(got.tokens, want.tokens, "adapter `{lora}`");
        match lora {
            "r4_attn" => assert_eq!(got.prefill, None, "only r8 is on the prefill worker"),
            _ => assert!(got.prefill.is_some(), "`{lora}` was prefilled remotely"),
        }
        // Under the adapter the model answers differently than without.
        let base = run(&serve.addr, request(p, 16, ""));
        assert_eq!(
            base.tokens == want.tokens,
            lora.is_empty(),
            "`{lora}` changes the output"
        );
        outputs.push(got.tokens);
    }
    // The same prompt under the two adapters: each its own tokens, no
    // block shared (the second is computed whole again).
    let p = prompt(9, 80);
    let a = run(&cluster.addr, request(p.clone(), 8, "r8_all"));
    let b = run(&cluster.addr, request(p.clone(), 8, "r4_attn"));
    assert_ne!(a.tokens, b.tokens);
    assert_eq!(b.tokens, run(&serve.addr, request(p, 8, "r4_attn")).tokens);
    // An adapter no worker serves is the caller's error, by name.
    let err = rt
        .block_on(call(&cluster.addr, request(prompt(1, 10), 4, "nope")))
        .expect_err("unknown adapter");
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("lora") && err.message().contains("nope"),
        "{err:?}"
    );
    rt.block_on(all_blocks_free(&cluster));
    // Per-adapter counters on the decode worker: r8 ran twice, r4 twice.
    let metrics = cluster
        .metrics_addr("decode-worker", &cluster.decode[0])
        .expect("decode metrics");
    let s = tandem_tests::prometheus::scrape(metrics);
    for name in ["r8_all", "r4_attn"] {
        let labels = [("adapter", name)];
        assert_eq!(
            s.value("tandem_lora_requests_total", &labels),
            Some(2.0),
            "{name}"
        );
        let tokens = s.value("tandem_lora_generation_tokens_total", &labels);
        assert_eq!(tokens, Some(24.0), "{name}");
    }
    let resident = s.value("tandem_lora_adapters", &[("state", "resident")]);
    assert_eq!(resident, Some(2.0));
}

#[test]
fn the_http_api_serves_lists_loads_and_unloads_adapters() {
    use tandem_engine::lora::{write_random_adapter, LoraTarget};
    let tmp = tempfile::tempdir().expect("tempdir");
    let model_dir = tmp.path().join("model");
    tandem_tests::cluster::gen_model(Path::new(env!("CARGO_BIN_EXE_tandem")), &model_dir, "tiny");
    let config = tandem_engine::ModelConfig::from_dir(&model_dir).expect("config");
    let dirs: Vec<PathBuf> = (0..3).map(|i| tmp.path().join(format!("a{i}"))).collect();
    for (i, d) in dirs.iter().enumerate() {
        write_random_adapter(d, &config, 8, &LoraTarget::ALL, i as u64).expect("adapter");
    }
    let first = format!("a0={}", dirs[0].display());
    let serve = start(&[
        "serve",
        "--model",
        model_dir.to_str().expect("utf8"),
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--served-model-name",
        "tiny",
        "--lora",
        &first,
        "--max-loras",
        "2",
        "--api-key",
        "sekrit",
    ]);
    let http = serve.http.clone().expect("http");
    let auth = Some("Bearer sekrit");
    let api = |method: &str, path: &str, body: &str| {
        tandem_tests::cluster::http(&http, method, path, auth, body)
    };
    let models = || -> Vec<String> {
        let (status, body) = api("GET", "/v1/models", "");
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        let data = v["data"].as_array().expect("data");
        data.iter()
            .map(|m| m["id"].as_str().unwrap_or("").to_string())
            .collect()
    };
    let complete = |model: &str| complete(&http, auth, model);
    assert_eq!(models(), ["tiny", "a0"]);
    // Responses name the adapter as their model, as vLLM's do.
    let body = r#"{"model": "a0", "prompt": "hi", "max_tokens": 2}"#;
    let (status, body) = api("POST", "/v1/completions", body);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["model"], "a0");
    let (ok, base) = complete("tiny");
    let (ok0, under_a0) = complete("a0");
    assert_eq!((ok, ok0), (200, 200));
    assert_ne!(base, under_a0, "the adapter changes the completion");
    let (status, body) = complete("a1");
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("model_not_found"), "{body}");

    // The admin routes want the key like every /v1 route.
    let load = |name: &str, dir: &Path| {
        serde_json::json!({"lora_name": name, "lora_path": dir.display().to_string()}).to_string()
    };
    let (status, _) = tandem_tests::cluster::http(
        &http,
        "POST",
        "/v1/load_lora_adapter",
        None,
        &load("a1", &dirs[1]),
    );
    assert_eq!(status, 401);
    let (status, body) = api("POST", "/v1/load_lora_adapter", &load("a1", &dirs[1]));
    assert_eq!(status, 200, "{body}");
    assert_eq!(models(), ["tiny", "a0", "a1"]);
    let (ok1, under_a1) = complete("a1");
    assert_eq!(ok1, 200);
    assert_ne!(under_a1, under_a0);
    // A third adapter evicts the least recently used idle one (a0); asking
    // for a0 again loads it back, with the same output.
    let (status, body) = api("POST", "/v1/load_lora_adapter", &load("a2", &dirs[2]));
    assert_eq!(status, 200, "{body}");
    assert_eq!(complete("a0"), (200, under_a0.clone()));
    // Bad adapters are refused by field.
    let (status, body) = api(
        "POST",
        "/v1/load_lora_adapter",
        &load("bad", &tmp.path().join("none")),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("lora_path") && body.contains("adapter_config.json"),
        "{body}"
    );
    let (status, body) = api("POST", "/v1/load_lora_adapter", &load("tiny", &dirs[1]));
    assert_eq!(status, 400, "{body}");
    // Unloaded: no longer listed or served.
    let (status, body) = api("POST", "/v1/unload_lora_adapter", r#"{"lora_name": "a1"}"#);
    assert_eq!(status, 200, "{body}");
    assert_eq!(models(), ["tiny", "a0", "a2"]);
    assert_eq!(complete("a1").0, 404);
    let (status, body) = api("POST", "/v1/unload_lora_adapter", r#"{"lora_name": "a1"}"#);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("lora_name"), "{body}");
}

#[test]
fn an_adapters_prefix_goes_back_to_the_worker_that_cached_it() {
    let (model, r8) = (model(), adapter("r8_all"));
    let cluster = start(&[
        "up",
        "--model",
        &model,
        "--prefill",
        "0",
        "--decode",
        "2",
        "--addr",
        "127.0.0.1:0",
        "--no-http",
        "--kv-cache-memory",
        "16MiB",
        "--lora",
        &r8,
    ]);
    let rt = tandem_tests::cluster::runtime();
    let with = |p: u32, s: u32| {
        let mut v = prompt(p, 160);
        v.extend([s, s + 1, s + 2]);
        v
    };
    let route = |p: u32, s: u32| -> String {
        let req = request(with(p, s), 2, "r8_all");
        let o = rt.block_on(call(&cluster.addr, req)).expect("call");
        o.decode.expect("routed")
    };
    // The router hashes an adapter's prompts from the adapter's root, as
    // the workers do: new prefixes spread, and each comes back home once
    // the KV-event feed has reached the router. Ties go by rendezvous hash
    // of the prompt's first block with each worker's address, so whether
    // two given prefixes share a worker depends on the ports: 16 prefixes
    // all landing on one of two workers is a 1-in-32,768 chance (6 were 1
    // in 32, and failed a CI run).
    let homes: Vec<String> = (0..16).map(|p| route(p, 1)).collect();
    assert!(
        homes.iter().any(|h| h != &homes[0]),
        "new prefixes all went to one worker: {homes:?}"
    );
    std::thread::sleep(std::time::Duration::from_millis(500));
    for (p, home) in homes.iter().enumerate().rev() {
        assert_eq!(&route(p as u32, 9), home, "prefix {p} left its worker");
    }
}

#[test]
fn the_router_loads_and_unloads_adapters_on_every_worker() {
    use tandem_engine::lora::{write_random_adapter, LoraTarget};
    let tmp = tempfile::tempdir().expect("tempdir");
    let model_dir = tmp.path().join("model");
    let tandem = Path::new(env!("CARGO_BIN_EXE_tandem"));
    tandem_tests::cluster::gen_model(tandem, &model_dir, "tiny");
    let config = tandem_engine::ModelConfig::from_dir(&model_dir).expect("config");
    let dir = tmp.path().join("a0");
    write_random_adapter(&dir, &config, 8, &LoraTarget::ALL, 7).expect("adapter");
    let model = model_dir.to_str().expect("utf8");
    let serve = start(&[
        "serve",
        "--model",
        model,
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--served-model-name",
        "tiny",
        "--batch-invariant",
        "--lora",
        &format!("a0={}", dir.display()),
    ]);
    let cluster = start(&[
        "up",
        "--model",
        model,
        "--prefill",
        "1",
        "--decode",
        "2",
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--served-model-name",
        "tiny",
        "--kv-cache-memory",
        "16MiB",
        "--remote-prefill-threshold",
        "8",
        "--worker-arg=--batch-invariant",
        "--api-key",
        "sekrit",
    ]);
    let auth = Some("Bearer sekrit");
    let http = cluster.http.clone().expect("router http");
    let admin = |path: &str, body: serde_json::Value| {
        tandem_tests::cluster::http(&http, "POST", path, auth, &body.to_string())
    };
    assert_eq!(complete(&http, auth, "a0").0, 404, "not loaded yet");
    let (status, body) = admin(
        "/v1/load_lora_adapter",
        serde_json::json!({"lora_name": "a0", "lora_path": dir.display().to_string()}),
    );
    assert_eq!(status, 200, "{body}");
    // Every worker has it: the answer is the colocated server's, through
    // remote prefill, whichever decode worker takes it.
    let serve_http = serve.http.as_deref().expect("serve http");
    let want = complete(serve_http, None, "a0");
    // A server without API keys never opens its admin routes.
    let body = serde_json::json!({"lora_name": "b", "lora_path": dir.display().to_string()});
    let (status, body) = tandem_tests::cluster::http(
        serve_http,
        "POST",
        "/v1/load_lora_adapter",
        None,
        &body.to_string(),
    );
    assert_eq!(status, 403, "{body}");
    for _ in 0..3 {
        assert_eq!(complete(&http, auth, "a0"), want);
    }
    let (status, body) = admin(
        "/v1/load_lora_adapter",
        serde_json::json!({"lora_name": "bad", "lora_path": "/nonexistent"}),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("lora_path") && body.contains("adapter_config.json"),
        "{body}"
    );
    let (status, body) = admin(
        "/v1/unload_lora_adapter",
        serde_json::json!({"lora_name": "a0"}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(complete(&http, auth, "a0").0, 404, "unloaded everywhere");
    let (status, _) = admin(
        "/v1/unload_lora_adapter",
        serde_json::json!({"lora_name": "a0"}),
    );
    assert_eq!(status, 400);
}
