//! `tandem.v1.Chat` on the same cluster: the gRPC path must give what the
//! SDKs got over HTTP for the same requests (the Python suite's cases), and
//! refuse bad input with `INVALID_ARGUMENT` naming the field.

use serde_json::Value;
use tandem_proto::v1;
use tandem_proto::v1::chat_client::ChatClient;

/// `agent_client.py`'s `WEATHER` and `TIME`, as JSON text in its key order.
const WEATHER: &str = r#"{"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit", "days"], "additionalProperties": false}"#;
const TIME: &str = r#"{"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}}, "required": ["tz"], "additionalProperties": false}"#;
const ASK: &str = "What is the weather in Oslo for the next 3 days?";

fn tools() -> Vec<v1::Tool> {
    vec![
        v1::Tool {
            name: "get_weather".into(),
            description: "Weather forecast".into(),
            parameters: WEATHER.into(),
        },
        v1::Tool {
            name: "get_time".into(),
            description: "The time now".into(),
            parameters: TIME.into(),
        },
    ]
}

fn user(text: &str) -> v1::ChatMessage {
    v1::ChatMessage {
        role: "user".into(),
        content: text.into(),
        ..Default::default()
    }
}

fn sampled(seed: u64, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        sampling: Some(v1::SamplingParams {
            temperature: Some(1.0),
            seed: Some(seed),
            ..Default::default()
        }),
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}

fn required() -> Option<v1::ToolChoice> {
    Some(v1::ToolChoice {
        choice: Some(v1::tool_choice::Choice::Mode(
            v1::tool_choice::Mode::Required as i32,
        )),
    })
}

/// A reply, reassembled from its deltas.
#[derive(Debug, Default)]
struct Reply {
    content: String,
    reasoning: String,
    /// (id, name, arguments) per call.
    calls: Vec<(String, String, String)>,
    fragments: usize,
    tool_calls_finish: bool,
    prompt_tokens: u32,
}

async fn chat(addr: &str, req: v1::ChatRequest) -> Result<Reply, tonic::Status> {
    let mut client = ChatClient::connect(format!("http://{addr}"))
        .await
        .expect("connects");
    let mut stream = client.chat(req).await?.into_inner();
    let mut reply = Reply::default();
    while let Some(msg) = stream.message().await? {
        match msg.event {
            Some(v1::chat_response::Event::Delta(d)) => {
                reply.content.push_str(&d.content);
                reply.reasoning.push_str(&d.reasoning_content);
                for c in d.tool_calls {
                    let i = c.index as usize;
                    if reply.calls.len() <= i {
                        reply.calls.resize(i + 1, Default::default());
                    }
                    let call = &mut reply.calls[i];
                    call.0.push_str(&c.id);
                    call.1.push_str(&c.name);
                    if !c.arguments.is_empty() {
                        call.2.push_str(&c.arguments);
                        reply.fragments += 1;
                    }
                }
                reply.tool_calls_finish |= d.tool_calls_finish;
            }
            Some(v1::chat_response::Event::Finished(f)) => {
                reply.prompt_tokens = f.usage.map_or(0, |u| u.prompt_tokens);
            }
            _ => {}
        }
    }
    Ok(reply)
}

/// Checks the gRPC chat against the Python suite's `results`.
pub async fn check(addr: &str, results: &[Value]) {
    // Tool calls: the HTTP streamed cases' calls, byte for byte.
    for c in super::cases(results, "openai_stream") {
        let parallel = c["parallel"].as_bool().expect("parallel");
        let reply = chat(
            addr,
            v1::ChatRequest {
                messages: vec![user(ASK)],
                tools: tools(),
                tool_choice: required(),
                parallel_tool_calls: Some(parallel),
                generation: Some(sampled(11, 320)),
                ..Default::default()
            },
        )
        .await
        .expect("chat");
        let calls: Vec<Value> = reply
            .calls
            .iter()
            .map(|(_, name, args)| serde_json::json!([name, args]))
            .collect();
        assert_eq!(
            Value::Array(calls),
            c["whole"],
            "parallel {parallel}: {reply:?}"
        );
        assert!(reply.tool_calls_finish, "{reply:?}");
        assert!(reply.fragments > 1 && reply.content.is_empty(), "{reply:?}");
        assert!(reply.calls.iter().all(|(id, _, _)| id.starts_with("call_")));
    }

    // Reasoning split out as over HTTP.
    let c = super::case(results, "openai_reasoning");
    let mut think = sampled(5, 64);
    think.response_format = Some(v1::ResponseFormat {
        format: Some(v1::response_format::Format::Regex(
            "<think>[a-z ]{3,16}</think>\n\n[a-z ]{3,16}".into(),
        )),
    });
    let reply = chat(
        addr,
        v1::ChatRequest {
            messages: vec![user(ASK)],
            generation: Some(think),
            ..Default::default()
        },
    )
    .await
    .expect("chat");
    assert_eq!(
        (reply.reasoning.as_str(), reply.content.as_str()),
        (
            c["reasoning"].as_str().unwrap_or_default(),
            c["content"].as_str().unwrap_or_default()
        ),
        "{reply:?}"
    );

    // A tool result continues the conversation.
    let first = chat(
        addr,
        v1::ChatRequest {
            messages: vec![user(ASK)],
            tools: tools(),
            tool_choice: required(),
            parallel_tool_calls: Some(false),
            generation: Some(sampled(1, 160)),
            ..Default::default()
        },
    )
    .await
    .expect("chat");
    let (id, name, arguments) = first.calls.first().cloned().expect("a call");
    let history = vec![
        user(ASK),
        v1::ChatMessage {
            role: "assistant".into(),
            tool_calls: vec![v1::ToolCall {
                id: id.clone(),
                name,
                arguments,
            }],
            ..Default::default()
        },
        v1::ChatMessage {
            role: "tool".into(),
            content: r#"{"temp_c": -3}"#.into(),
            tool_call_id: id,
            ..Default::default()
        },
    ];
    let again = chat(
        addr,
        v1::ChatRequest {
            messages: history.clone(),
            tools: tools(),
            generation: Some(sampled(2, 8)),
            tool_choice: Some(v1::ToolChoice {
                choice: Some(v1::tool_choice::Choice::Mode(
                    v1::tool_choice::Mode::None as i32,
                )),
            }),
            ..Default::default()
        },
    )
    .await
    .expect("chat");
    assert!(
        again.calls.is_empty() && !again.content.is_empty(),
        "{again:?}"
    );
    assert!(again.prompt_tokens > first.prompt_tokens, "{again:?}");

    // The call's deadline reaches the backend: a long reply is cut off.
    let mut client = ChatClient::connect(format!("http://{addr}"))
        .await
        .expect("connects");
    let mut call = tonic::Request::new(v1::ChatRequest {
        messages: vec![user(ASK)],
        generation: Some(v1::GenerateRequest {
            max_tokens: Some(1500),
            ignore_eos: true,
            ..sampled(3, 1500)
        }),
        ..Default::default()
    });
    call.set_timeout(std::time::Duration::from_millis(300));
    let outcome = match client.chat(call).await {
        Ok(resp) => {
            let mut stream = resp.into_inner();
            loop {
                match stream.message().await {
                    Ok(Some(_)) => {}
                    Ok(None) => break Ok(()),
                    Err(status) => break Err(status),
                }
            }
        }
        Err(status) => Err(status),
    };
    let err = outcome.expect_err("1500 tokens take longer than 300 ms");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");

    // Bad input: INVALID_ARGUMENT, the field first.
    let mut unknown_id = history;
    unknown_id[2].tool_call_id = "call_nobody".into();
    let bad_schema = vec![v1::Tool {
        name: "f".into(),
        parameters: r#"{"type": "object", "properties": {"x": {"type": 7}}}"#.into(),
        ..Default::default()
    }];
    let not_json = vec![v1::Tool {
        name: "f".into(),
        parameters: "{".into(),
        ..Default::default()
    }];
    let cases = [
        (
            "tool_choice",
            v1::ChatRequest {
                tools: tools(),
                tool_choice: Some(v1::ToolChoice {
                    choice: Some(v1::tool_choice::Choice::Function("launch_rocket".into())),
                }),
                ..Default::default()
            },
        ),
        (
            "tools[0].function.parameters",
            v1::ChatRequest {
                tools: bad_schema,
                ..Default::default()
            },
        ),
        (
            "tools[0].parameters",
            v1::ChatRequest {
                tools: not_json,
                ..Default::default()
            },
        ),
        (
            "messages[2].tool_call_id",
            v1::ChatRequest {
                messages: unknown_id,
                ..Default::default()
            },
        ),
        (
            "generation.prompt",
            v1::ChatRequest {
                generation: Some(v1::GenerateRequest {
                    prompt: Some(v1::generate_request::Prompt::Text("x".into())),
                    ..Default::default()
                }),
                ..Default::default()
            },
        ),
    ];
    for (field, mut req) in cases {
        if req.messages.is_empty() {
            req.messages = vec![user(ASK)];
        }
        let err = chat(addr, req).await.expect_err(field);
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{field}: {err:?}");
        assert!(err.message().starts_with(field), "{field}: {err:?}");
    }
}
