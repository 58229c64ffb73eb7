//! A GGUF model served by a real local cluster (`tandem up`: router,
//! prefill and decode workers): the file is made by llama.cpp's converter
//! and `llama-quantize` (`tests/golden/make_gguf.py`) from a tiny random
//! Llama with the built-in model's vocabulary and chat template.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tandem_engine::{generate, Checkpoint, GenerateOptions, GenerateRequest, SamplingParams};
use tandem_openai::chat::Message;
use tandem_openai::ChatTemplate;
use tandem_tests::cluster::{http, start};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The router renders the chat with the template embedded in the GGUF file
/// and tokenizes it with the file's vocabulary: its prompt is the one the
/// source checkpoint's own template and `tokenizer.json` make, and its
/// answer is the in-process greedy answer to that prompt.
#[test]
fn a_gguf_model_chats_through_the_router_with_its_embedded_template() {
    let model = repo().join("tests/fixtures/gguf/shakespeare_chat_q8_0.gguf");
    let cluster = start(
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
            "--kv-cache-memory",
            "32MiB",
            "--remote-prefill-threshold",
            "8",
            "--worker-arg=--batch-invariant",
        ],
    );
    let addr = cluster.http.as_deref().expect("the HTTP API is served");
    let (code, models) = http(addr, "GET", "/v1/models", None, "");
    assert_eq!(code, 200, "{models}");
    assert!(models.contains("\"shakespeare_chat_q8_0\""), "{models}");

    let messages = [
        Message::text("system", "Thou art a player."),
        Message::text("user", "Speak the speech, I pray you."),
    ];
    let source = repo().join("models/shakespeare-target");
    let template = ChatTemplate::from_model_dir(&source)
        .expect("template loads")
        .expect("the checkpoint has a template");
    let tokenizer = tandem_engine::tokenizer::Tokenizer::from_file(&source.join("tokenizer.json"))
        .expect("tokenizer.json");
    let prompt = tokenizer
        .encode_plain(&template.render(&messages, true).expect("renders"))
        .expect("encodes");

    let body = json!({
        "model": "shakespeare_chat_q8_0",
        "messages": messages.iter().map(|m| json!({"role": m.role, "content": m.content})).collect::<Vec<_>>(),
        "max_tokens": 12,
        "temperature": 0,
    });
    let (code, text) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        None,
        &body.to_string(),
    );
    assert_eq!(code, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(
        answer["usage"]["prompt_tokens"].as_u64(),
        Some(prompt.len() as u64),
        "{text}"
    );

    let ckpt = Checkpoint::open(&model).expect("the file loads here too");
    let req = GenerateRequest {
        prompt_ids: prompt,
        max_tokens: 12,
        sampling: SamplingParams::default(),
        stop_token_ids: vec![],
        ignore_eos: false,
    };
    let local = generate(
        &ckpt.model,
        &ckpt.eos_token_ids,
        &req,
        GenerateOptions::default(),
        |_| Ok(()),
    )
    .expect("generates");
    let want = tokenizer.decode(&local.output_ids).expect("decodes");
    assert_eq!(
        answer["choices"][0]["message"]["content"].as_str(),
        Some(want.as_str()),
        "{text}"
    );
    assert_eq!(
        answer["usage"]["completion_tokens"].as_u64(),
        Some(local.output_ids.len() as u64)
    );
}
