//! The APIs agents call, on a real local cluster (`tandem up`: router,
//! prefill and decode workers) serving a random model with a Qwen-style
//! tool-calling template (`tests/fixtures/chat_templates/qwen_tools.jinja`),
//! driven by the official `openai` and `anthropic` Python SDKs
//! (`tests/python/agent_client.py`): constrained tool calls that always
//! validate, streamed calls equal to unstreamed ones, tool results fed
//! back, reasoning split out, Anthropic's Messages API with its stream,
//! stop sequences and token counts, and bad input refused with the field
//! named; then the same over gRPC (`tandem.v1.Chat`, `grpc_chat`).

#[path = "agents/grpc_chat.rs"]
mod grpc_chat;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use tandem_tests::cluster::{all_blocks_free, Started};

fn template() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/chat_templates/qwen_tools.jinja")
        .canonicalize()
        .expect("the fixture template")
}

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
            "agent",
            "--kv-cache-memory",
            "64MiB",
            "--remote-prefill-threshold",
            "8",
            "--worker-arg=--batch-invariant",
            &format!("--router-arg=--chat-template={}", template().display()),
        ],
    )
}

fn case<'a>(results: &'a [Value], name: &str) -> &'a Value {
    results
        .iter()
        .find(|r| r["case"] == name)
        .unwrap_or_else(|| panic!("no case {name} in {results:?}"))
}

fn cases<'a>(results: &'a [Value], name: &'a str) -> impl Iterator<Item = &'a Value> {
    results.iter().filter(move |r| r["case"] == name)
}

#[test]
fn openai_and_anthropic_sdks_call_tools_through_a_cluster() {
    let py = tandem_tests::python::grpc_python().expect("python env");
    let tmp = tempfile::tempdir().expect("tmp");
    tandem_tests::cluster::gen_model(Path::new(env!("CARGO_BIN_EXE_tandem")), tmp.path(), "small");
    let cluster = up(tmp.path());
    let http = cluster.http.clone().expect("the router serves HTTP");
    let results = py
        .run_script_json(
            &py.scripts.join("agent_client.py"),
            [
                "--base-url",
                &format!("http://{http}"),
                "--model",
                "agent",
                "--runs",
                "50",
            ],
            Duration::from_secs(900),
        )
        .expect("the SDK suite runs");

    // tool_choice required: every one of 50 sampled calls validates.
    let c = case(&results, "openai_required");
    assert_eq!(
        (c["runs"].as_u64(), c["valid"].as_u64()),
        (Some(50), Some(50)),
        "{c}"
    );
    assert_eq!(c["finish_reasons"], json!(["tool_calls"]), "{c}");
    assert_eq!(c["names"], json!(["get_time", "get_weather"]), "{c}");
    let c = case(&results, "openai_named");
    assert_eq!(
        (c["name"].as_str(), c["valid"].as_bool()),
        (Some("get_time"), Some(true)),
        "{c}"
    );

    // Streamed deltas reassemble byte-exactly into the unstreamed calls,
    // the arguments in several fragments.
    for c in cases(&results, "openai_stream") {
        assert_eq!(c["streamed"], c["whole"], "{c}");
        assert!(!c["whole"].as_array().is_some_and(Vec::is_empty), "{c}");
        assert!(c["fragments"].as_u64() > Some(1), "{c}");
        assert_eq!(c["finish"], c["whole_finish"], "{c}");
        assert_eq!(c["content"], "", "{c}");
        assert_eq!(c["ids_ok"], true, "{c}");
    }
    assert_eq!(cases(&results, "openai_stream").count(), 2);

    let c = case(&results, "openai_round_trip");
    assert!(c["content"].is_string() && c["calls"].is_null(), "{c}");
    assert!(
        c["prompt_tokens"].as_u64() > c["first_prompt_tokens"].as_u64(),
        "the call and its result are in the prompt: {c}"
    );

    let c = case(&results, "openai_reasoning");
    let (reasoning, content) = (
        c["reasoning"].as_str().unwrap_or(""),
        c["content"].as_str().unwrap_or(""),
    );
    assert!((3..=16).contains(&reasoning.len()), "{c}");
    assert!(
        reasoning
            .chars()
            .all(|ch| ch.is_ascii_lowercase() || ch == ' '),
        "{c}"
    );
    assert!(
        (3..=16).contains(&content.len()) && !content.contains('<'),
        "{c}"
    );
    assert_eq!(
        (&c["stream_reasoning"], &c["stream_content"]),
        (&c["reasoning"], &c["content"]),
        "{c}"
    );

    for (name, param) in [
        ("openai_bad_schema", "tools[0].function.parameters"),
        ("openai_unknown_choice", "tool_choice"),
        ("openai_unknown_tool_call_id", "messages[1].tool_call_id"),
        ("openai_tools_and_format", "response_format"),
    ] {
        let c = case(&results, name);
        assert_eq!(c["status"], 400, "{c}");
        assert_eq!(c["error"]["param"], param, "{c}");
        assert_eq!(c["error"]["type"], "invalid_request_error", "{c}");
    }

    // Responses: function_call items that validate, streams whose deltas
    // reassemble and whose final response equals the unstreamed one.
    let c = case(&results, "responses_required");
    assert_eq!(c["valid"], c["runs"], "{c}");
    for name in ["responses_text", "responses_tools"] {
        let c = case(&results, name);
        assert_eq!(c["streamed"], c["whole"], "{c}");
        assert_eq!(c["stream_status"], c["status"], "{c}");
        for tokens in ["input_tokens", "output_tokens"] {
            assert_eq!(c["stream_usage"][tokens], c["usage"][tokens], "{c}");
        }
        assert!(
            c["reassembled"]
                .as_array()
                .is_some_and(|r| !r.is_empty() && r.iter().all(|x| x == true)),
            "{c}"
        );
        let events = c["events"].as_array().expect("events");
        assert_eq!(events.first(), Some(&json!("response.created")), "{c}");
    }
    let c = case(&results, "responses_text");
    assert_eq!(c["status"], "incomplete", "24 tokens run out: {c}");
    assert!(
        c["output_text"].as_str().is_some_and(|t| !t.is_empty()),
        "{c}"
    );
    let c = case(&results, "responses_tools");
    assert_eq!(c["status"], "completed", "{c}");
    assert_eq!(c["whole"][0]["type"], "function_call", "{c}");
    let c = case(&results, "responses_round_trip");
    assert!(
        c["input_tokens"].as_u64() > c["first_input_tokens"].as_u64(),
        "{c}"
    );
    for (name, param) in [
        ("responses_stored", "previous_response_id"),
        ("responses_orphan_output", "input[0].call_id"),
    ] {
        let c = case(&results, name);
        assert_eq!(
            (c["status"].as_u64(), c["error"]["param"].as_str()),
            (Some(400), Some(param)),
            "{c}"
        );
    }

    // Anthropic: tool_use blocks that validate, the stream equal to the
    // unstreamed answer, a tool_result round trip.
    let c = case(&results, "anthropic_tools");
    assert_eq!(c["valid"], c["runs"], "{c}");
    assert_eq!(c["stop_reasons"], json!(["tool_use"]), "{c}");
    let c = case(&results, "anthropic_stream");
    assert_eq!(c["streamed"], c["whole"], "{c}");
    assert_eq!(c["ids_ok"], true, "{c}");
    assert_eq!(
        (&c["whole_stop"], &c["stream_stop"]),
        (&json!("tool_use"), &json!("tool_use"))
    );
    assert_eq!(
        c["usage"]["output_tokens"], c["stream_usage"]["output_tokens"],
        "{c}"
    );
    let events: Vec<&str> = c["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(events.first(), Some(&"message_start"), "{c}");
    assert_eq!(events.last(), Some(&"message_stop"), "{c}");
    for needed in [
        "content_block_start",
        "input_json",
        "content_block_stop",
        "message_delta",
    ] {
        assert!(
            events.iter().any(|e| e.starts_with(needed)),
            "{needed}: {c}"
        );
    }
    let c = case(&results, "anthropic_round_trip");
    assert!(
        c["input_tokens"].as_u64() > c["first_input_tokens"].as_u64(),
        "{c}"
    );
    assert!(
        ["end_turn", "max_tokens"].contains(&c["stop_reason"].as_str().unwrap_or("")),
        "{c}"
    );

    let c = case(&results, "anthropic_text");
    assert_eq!(c["streamed"], c["text"], "{c}");
    assert_eq!(c["stop_reason"], "max_tokens", "{c}");
    let (full, stop) = (
        c["text"].as_str().unwrap_or(""),
        c["stop"].as_str().unwrap_or(""),
    );
    assert!(!stop.is_empty(), "{c}");
    assert_eq!(
        c["cut"].as_str(),
        full.find(stop).map(|at| &full[..at]),
        "{c}"
    );
    assert_eq!(
        (c["cut_reason"].as_str(), c["cut_sequence"].as_str()),
        (Some("stop_sequence"), Some(stop)),
        "{c}"
    );
    assert_eq!(c["counted"], c["input_tokens"], "{c}");

    for (name, status, field) in [
        (
            "anthropic_unknown_tool_use_id",
            400,
            "messages.0.content.0.tool_use_id",
        ),
        (
            "anthropic_tool_use_in_user_turn",
            400,
            "messages.0.content.1.type",
        ),
        ("anthropic_bad_schema", 400, "tools.0.input_schema"),
        ("anthropic_unknown_model", 404, "model"),
    ] {
        let c = case(&results, name);
        assert_eq!(c["status"], status, "{c}");
        assert_eq!(c["error"]["type"], "error", "{c}");
        let kind = if status == 400 {
            "invalid_request_error"
        } else {
            "not_found_error"
        };
        assert_eq!(c["error"]["error"]["type"], kind, "{c}");
        let message = c["error"]["error"]["message"].as_str().unwrap_or("");
        assert!(message.starts_with(field), "{field}: {c}");
    }

    let rt = tandem_tests::cluster::runtime();
    rt.block_on(grpc_chat::check(&cluster.addr, &results));
    rt.block_on(all_blocks_free(&cluster));
}
