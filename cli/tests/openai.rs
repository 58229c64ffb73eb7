//! The router's OpenAI-compatible HTTP API on a real local cluster
//! (`tandem up`: router, prefill and decode workers), driven by the official
//! `openai` Python SDK and by raw HTTP for cancellation.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tandem_tests::cluster::{all_blocks_free, load, Started};

const PROMPT: &str = "The quick brown fox jumps over the lazy dog, and then";
const USER_MESSAGE: &str = "Tell me a story about a fox and a dog, please.";
const MAX_TOKENS: u32 = 16;

fn gen_model(dir: &Path, preset: &str) {
    tandem_tests::cluster::gen_model(Path::new(env!("CARGO_BIN_EXE_tandem")), dir, preset);
}

/// One prefill and one decode worker; prompts from 8 uncached tokens are
/// prefilled remotely, so the test prompts cross both workers.
fn up(model: &Path) -> Started {
    tandem_tests::cluster::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &[
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
            "--served-model-name",
            "tiny",
            "--kv-cache-memory",
            "32MiB",
            "--remote-prefill-threshold",
            "8",
            "--worker-arg=--batch-invariant",
        ],
    )
}

fn rt() -> tokio::runtime::Runtime {
    tandem_tests::cluster::runtime()
}

/// The greedy text of `prompt` over gRPC (the reference path).
async fn grpc_greedy(addr: &str, prompt: v1::generate_request::Prompt) -> String {
    let mut c = GenerationClient::connect(format!("http://{addr}"))
        .await
        .expect("connects");
    let mut stream = c
        .generate(v1::GenerateRequest {
            prompt: Some(prompt),
            sampling: Some(v1::SamplingParams {
                temperature: Some(0.0),
                ..Default::default()
            }),
            max_tokens: Some(MAX_TOKENS),
            ..Default::default()
        })
        .await
        .expect("generate")
        .into_inner();
    let mut text = String::new();
    while let Some(msg) = stream.message().await.expect("message") {
        if let Some(v1::generate_response::Event::Delta(d)) = msg.event {
            text.push_str(&d.text);
        }
    }
    text
}

/// The texts of the 2 best of 3 beams for `prompt` over gRPC.
async fn grpc_beams(addr: &str, prompt: &str) -> Vec<String> {
    let mut c = GenerationClient::connect(format!("http://{addr}"))
        .await
        .expect("connects");
    let mut stream = c
        .generate(v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::Text(prompt.into())),
            max_tokens: Some(6),
            n: 2,
            ignore_eos: true,
            beam_search: Some(v1::BeamSearch {
                width: 3,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("generate")
        .into_inner();
    let mut texts = vec![String::new(); 2];
    while let Some(msg) = stream.message().await.expect("message") {
        if let Some(v1::generate_response::Event::Delta(d)) = msg.event {
            texts[d.index as usize].push_str(&d.text);
        }
    }
    texts
}

fn case<'a>(results: &'a [Value], name: &str) -> &'a Value {
    results
        .iter()
        .find(|r| r["case"] == name)
        .unwrap_or_else(|| panic!("no case {name} in {results:?}"))
}

#[test]
fn the_openai_sdk_gets_the_grpc_paths_greedy_outputs_and_openai_errors() {
    let py = tandem_tests::python::grpc_python().expect("python env");
    let tmp = tempfile::tempdir().expect("tmp");
    gen_model(tmp.path(), "tiny");
    let cluster = up(tmp.path());
    let http = cluster.http.clone().expect("the router serves HTTP");
    let script = py.scripts.join("openai_client.py");
    let results = py
        .run_script_json(
            &script,
            [
                "--base-url",
                &format!("http://{http}/v1"),
                "--model",
                "tiny",
                "--prompt",
                PROMPT,
                "--user-message",
                USER_MESSAGE,
                "--max-tokens",
                &MAX_TOKENS.to_string(),
            ],
            Duration::from_secs(300),
        )
        .expect("the SDK suite runs");

    // The chat prompt as the API renders it: the model's template, no added
    // special tokens.
    let tokenizer =
        tandem_engine::tokenizer::Tokenizer::from_file(&tmp.path().join("tokenizer.json"))
            .expect("tokenizer");
    let template = tandem_openai::ChatTemplate::from_model_dir(tmp.path())
        .expect("loads")
        .expect("generated models have a chat template");
    let rendered = template
        .render(
            &[tandem_openai::chat::Message::text("user", USER_MESSAGE)],
            true,
        )
        .expect("renders");
    let chat_ids = tokenizer.encode_plain(&rendered).expect("encodes");

    let rt = rt();
    let completion_ref = rt.block_on(grpc_greedy(
        &cluster.addr,
        v1::generate_request::Prompt::Text(PROMPT.into()),
    ));
    let chat_ref = rt.block_on(grpc_greedy(
        &cluster.addr,
        v1::generate_request::Prompt::TokenIds(v1::TokenIds {
            ids: chat_ids.clone(),
        }),
    ));
    assert!(!completion_ref.is_empty() && !chat_ref.is_empty());

    assert_eq!(case(&results, "models")["ids"], serde_json::json!(["tiny"]));
    assert_eq!(case(&results, "model_retrieve")["id"], "tiny");
    let c = case(&results, "unknown_model_retrieve");
    assert_eq!(c["status"], 404, "{c}");
    assert_eq!(c["error"]["code"], "model_not_found", "{c}");
    // /tokenize: a prompt as completions encode it, a conversation as chat
    // renders and encodes it; /detokenize gives the ids' text back.
    let prompt_ids = tokenizer.encode(PROMPT).expect("encodes");
    let c = case(&results, "tokenize_prompt");
    assert_eq!(c["tokens"], serde_json::json!(prompt_ids), "{c}");
    assert_eq!(c["count"], prompt_ids.len(), "{c}");
    let strs: Vec<String> = prompt_ids
        .iter()
        .map(|&id| tokenizer.token_text(id).expect("token"))
        .collect();
    assert_eq!(c["token_strs"], serde_json::json!(strs), "{c}");
    let c = case(&results, "tokenize_chat");
    assert_eq!(c["tokens"], serde_json::json!(chat_ids), "{c}");
    assert_eq!(c["token_strs"], Value::Null, "{c}");
    let text = tokenizer.decode(&prompt_ids).expect("decodes");
    assert_eq!(case(&results, "detokenize")["prompt"], text.as_str());
    let c = case(&results, "completion");
    assert_eq!(c["text"], completion_ref.as_str());
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(c["usage"]["completion_tokens"], MAX_TOKENS);
    let c = case(&results, "completion_stream");
    assert_eq!(c["text"], completion_ref.as_str());
    assert_eq!(c["finish_reason"], "length");
    assert!(c["chunks"].as_u64().unwrap_or(0) > 1, "{c}");

    let c = case(&results, "chat");
    assert_eq!(c["text"], chat_ref.as_str());
    assert_eq!(c["role"], "assistant");
    assert_eq!(c["usage"]["prompt_tokens"], chat_ids.len());
    let c = case(&results, "chat_stream");
    assert_eq!(c["text"], chat_ref.as_str());
    assert_eq!(c["roles"], serde_json::json!(["assistant"]));
    assert_eq!(c["usage"]["completion_tokens"], MAX_TOKENS);
    assert_eq!(c["usage"]["prompt_tokens"], chat_ids.len());
    assert_eq!(c["last_choices"], 0, "the usage chunk has no choices");

    let c = case(&results, "n_seed");
    assert_eq!(c["indices"], serde_json::json!([0, 1, 2]));
    assert_eq!(c["same_again"], true, "a seed makes sampling reproducible");

    let c = case(&results, "completion_logprobs");
    assert_eq!(c["tokens"].as_array().map(Vec::len), Some(4));
    // Completions key the alternatives by token text, so two tokens with
    // the same text (e.g. two halves of UTF-8 characters) share an entry.
    for top in c["top"].as_array().expect("top") {
        assert!((1..=2).contains(&top.as_u64().unwrap_or(0)), "{c}");
    }
    for lp in c["token_logprobs"].as_array().expect("logprobs") {
        assert!(lp.as_f64().is_some_and(|x| x <= 0.0), "{lp}");
    }
    let c = case(&results, "chat_logprobs");
    assert_eq!(c["top"], serde_json::json!([3, 3, 3, 3]));

    // Echo: the prompt leads the text, its tokens the logprobs (the first
    // without one); prompt_logprobs: `null`, then one entry per prompt
    // token, naming that token.
    let prompt_ids = tokenizer.encode(PROMPT).expect("encodes");
    let c = case(&results, "echo");
    assert!(
        c["text"].as_str().is_some_and(|t| t.starts_with(PROMPT)),
        "{c}"
    );
    assert_eq!(
        c["tokens"].as_array().map(Vec::len),
        Some(prompt_ids.len() + 4),
        "{c}"
    );
    assert!(
        c["token_logprobs"][0].is_null() && c["top"][0].is_null(),
        "{c}"
    );
    assert!(
        c["token_logprobs"][1].as_f64().is_some_and(|x| x <= 0.0),
        "{c}"
    );
    let offsets: Vec<u64> = c["text_offset"]
        .as_array()
        .expect("offsets")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert!(
        offsets.windows(2).all(|w| w[0] <= w[1]) && offsets[0] == 0,
        "{c}"
    );
    let c = case(&results, "echo_stream");
    assert_eq!(c["first"], PROMPT, "{c}");
    assert!(
        c["text"]
            .as_str()
            .is_some_and(|t| t.starts_with(PROMPT) && t.len() > PROMPT.len()),
        "{c}"
    );
    let check_scores = |scores: &Value, ids: &[u32], top: usize| {
        let scores = scores.as_array().expect("a list");
        assert_eq!(scores.len(), ids.len(), "one per prompt token");
        assert!(scores[0].is_null());
        for (entry, id) in scores[1..].iter().zip(&ids[1..]) {
            let entry = entry.as_object().expect("an entry");
            let own = &entry[&id.to_string()];
            assert!(
                own["logprob"].as_f64().is_some_and(|x| x <= 0.0),
                "{entry:?}"
            );
            assert!((1..=top + 1).contains(&entry.len()), "{entry:?}");
        }
    };
    check_scores(&case(&results, "prompt_logprobs")["scores"], &prompt_ids, 1);
    let c = case(&results, "chat_prompt_logprobs");
    check_scores(&c["scores"], &chat_ids, 0);
    assert_eq!(
        c["streamed"], c["scores"],
        "streamed scores are the unstreamed ones"
    );

    let c = case(&results, "stop");
    let (full, stop) = (
        c["full"].as_str().expect("full"),
        c["stop"].as_str().expect("stop"),
    );
    let cut = full.find(stop).expect("the stop string is in the text");
    assert_eq!(c["text"], &full[..cut]);
    assert_eq!(c["finish_reason"], "stop");

    let c = case(&results, "json_schema");
    assert_eq!(c["finish_reason"], "stop", "{c}");
    let person: Value = serde_json::from_str(c["text"].as_str().expect("text"))
        .unwrap_or_else(|e| panic!("not JSON ({e}): {c}"));
    assert!(
        person["name"]
            .as_str()
            .is_some_and(|n| n.chars().count() <= 8),
        "{person}"
    );
    assert!(person["age"].as_u64().is_some_and(|a| a <= 120), "{person}");
    assert_eq!(person.as_object().map(|o| o.len()), Some(2), "{person}");
    let c = case(&results, "choice");
    assert!(
        ["red", "green", "blue"].contains(&c["text"].as_str().unwrap_or("")),
        "{c}"
    );
    assert_eq!(c["finish_reason"], "stop", "{c}");

    // Beam search: the gRPC path's hypotheses, best first, streamed or not.
    let want = rt.block_on(grpc_beams(&cluster.addr, PROMPT));
    let c = case(&results, "beams");
    assert_eq!(c["indices"], serde_json::json!([0, 1]), "{c}");
    assert_eq!(c["texts"], serde_json::json!(want), "{c}");
    assert_eq!(c["streamed"], c["texts"], "{c}");
    let sums: Vec<f64> = c["sums"]
        .as_array()
        .expect("sums")
        .iter()
        .filter_map(Value::as_f64)
        .collect();
    // Equal lengths: the better hypothesis has the larger summed logprob.
    assert!(sums.len() == 2 && sums[0] >= sums[1], "{c}");
    assert_eq!(case(&results, "bad_best_of")["error"]["param"], "best_of");
    assert!(case(&results, "beam_temperature")["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("temperature")));

    for (name, status) in [
        ("bad_best_of", 400),
        ("beam_temperature", 400),
        ("bad_schema", 400),
        ("unknown_model", 404),
        ("unknown_model_retrieve", 404),
        ("bad_temperature", 400),
        ("bad_max_tokens", 400),
        ("long_max_tokens", 400),
        ("long_messages", 400),
        ("long_completion_tokens", 400),
        ("bad_role", 400),
        ("malformed_json", 400),
    ] {
        let c = case(&results, name);
        assert_eq!(c["status"], status, "{c}");
        assert_eq!(c["error"]["type"], "invalid_request_error", "{c}");
        assert!(
            !c["error"]["message"].as_str().unwrap_or("").is_empty(),
            "{c}"
        );
    }
    assert_eq!(
        case(&results, "unknown_model")["error"]["code"],
        "model_not_found"
    );
    // The engine refuses these; the HTTP error names the endpoint's field.
    for (name, param) in [
        ("long_max_tokens", "max_tokens"),
        ("long_messages", "messages"),
        ("long_completion_tokens", "max_completion_tokens"),
    ] {
        let c = case(&results, name);
        assert_eq!(c["error"]["param"], param, "{c}");
    }
    rt.block_on(all_blocks_free(&cluster));
}

/// Sends a raw HTTP/1.1 POST and returns the open connection.
fn post(http: &str, path: &str, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(http).expect("connects");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {http}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("sends");
    s
}

/// Waits (bounded) until the decode worker runs something.
async fn wait_running(cluster: &Started) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let l = load(&cluster.decode[0]).await;
        if l.running > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "the request never ran: {l:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Tokens the decode worker has computed so far.
async fn computed(cluster: &Started) -> u64 {
    load(&cluster.decode[0]).await.computed_tokens
}

#[test]
fn a_client_that_disconnects_cancels_its_request() {
    let tmp = tempfile::tempdir().expect("tmp");
    // `small` decodes slowly enough that 1900 tokens take seconds.
    gen_model(tmp.path(), "small");
    let cluster = up(tmp.path());
    let http = cluster.http.clone().expect("the router serves HTTP");
    let rt = rt();
    const MAX: u64 = 1900;
    let long = format!(r#""max_tokens": {MAX}, "ignore_eos": true, "temperature": 0"#);

    // Streamed: read the first event, then hang up.
    let before = rt.block_on(computed(&cluster));
    let mut s = post(
        &http,
        "/v1/chat/completions",
        &format!(
            r#"{{"messages": [{{"role": "user", "content": "{USER_MESSAGE}"}}], "stream": true, {long}}}"#
        ),
    );
    let mut buf = [0u8; 4096];
    let mut seen = String::new();
    while !seen.contains("data: ") {
        let n = s.read(&mut buf).expect("reads");
        assert!(n > 0, "closed before the first event: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
    rt.block_on(wait_running(&cluster));
    drop(s);
    rt.block_on(all_blocks_free(&cluster));
    let spent = rt.block_on(computed(&cluster)) - before;
    assert!(spent < MAX, "the streamed request ran on: {spent} tokens");

    // Not streamed: hang up while the body is being generated.
    let before = rt.block_on(computed(&cluster));
    let s = post(
        &http,
        "/v1/completions",
        &format!(r#"{{"prompt": "{PROMPT}", {long}}}"#),
    );
    rt.block_on(wait_running(&cluster));
    drop(s);
    rt.block_on(all_blocks_free(&cluster));
    let spent = rt.block_on(computed(&cluster)) - before;
    assert!(
        spent < MAX,
        "the non-streamed request ran on: {spent} tokens"
    );
}
