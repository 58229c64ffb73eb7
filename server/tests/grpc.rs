//! The gRPC service end to end over loopback: a real tonic server on a real
//! engine thread, called by the generated client.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_engine::serving::{EngineConfig, EngineCore, EngineHandle};
use tandem_engine::{synth, Checkpoint, DType};
use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tonic::Code;

struct Server {
    _tmp: tempfile::TempDir,
    handle: EngineHandle,
    url: String,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start() -> Server {
    start_with(synth::preset("tiny").expect("preset")).await
}

async fn start_with(model: synth::SynthConfig) -> Server {
    start_config(model, &EngineConfig::default()).await
}

async fn start_config(model: synth::SynthConfig, config: &EngineConfig) -> Server {
    let tmp = tempfile::tempdir().expect("tempdir");
    model.write(tmp.path(), 5, DType::F32).expect("write");
    let ck = Checkpoint::open(tmp.path()).expect("open");
    let core = EngineCore::new(
        ck.model,
        ck.tokenizer.map(Arc::new),
        ck.eos_token_ids,
        config,
    )
    .expect("core");
    let handle = EngineHandle::spawn(core).expect("spawn");
    let bound = tandem_server::Bound::bind("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind");
    let url = format!("http://{}", bound.local_addr());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let engine = handle.clone();
    tokio::spawn(async move {
        let _ = tandem_server::serve(bound, engine, async {
            let _ = stopped.await;
        })
        .await;
    });
    Server {
        _tmp: tmp,
        handle,
        url,
        _stop: stop,
    }
}

fn tokens(ids: Vec<u32>, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds { ids })),
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..Default::default()
    }
}

async fn client(url: &str) -> GenerationClient<tonic::transport::Channel> {
    GenerationClient::connect(url.to_string())
        .await
        .expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_tokens_then_one_finished_message() {
    let s = start().await;
    let mut c = client(&s.url).await;
    let mut req = tokens(vec![1, 2, 3, 4], 6);
    req.request_id = "abc".into();
    req.logprobs = Some(2);
    let mut stream = c.generate(req).await.expect("call").into_inner();
    let mut ids = Vec::new();
    let mut finished = None;
    while let Some(msg) = stream.message().await.expect("message") {
        assert_eq!(msg.request_id, "abc");
        match msg.event.expect("event") {
            v1::generate_response::Event::Delta(d) => {
                assert_eq!(d.logprobs.len(), d.token_ids.len());
                assert!(d.logprobs.iter().all(|l| l.top.len() == 2));
                ids.extend(d.token_ids);
            }
            v1::generate_response::Event::Finished(f) => finished = Some(f),
            v1::generate_response::Event::PromptLogprobs(_) => panic!("no prompt scores asked"),
        }
    }
    let f = finished.expect("a Finished message");
    assert_eq!(ids.len(), 6);
    let usage = f.usage.expect("usage");
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (4, 6));
    assert_eq!(f.choices[0].finish_reason, v1::FinishReason::Length as i32);
    let t = f.timings.expect("timings");
    assert!(t.ttft_s > 0.0 && t.e2e_s >= t.ttft_s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_parameters_are_invalid_argument_naming_the_field() {
    let s = start().await;
    let mut c = client(&s.url).await;
    let with_sampling = |f: fn(&mut v1::SamplingParams)| {
        let mut r = tokens(vec![1, 2], 4);
        let mut sp = r.sampling.take().unwrap_or_default();
        f(&mut sp);
        r.sampling = Some(sp);
        r
    };
    let cases: Vec<(v1::GenerateRequest, &str)> = vec![
        (with_sampling(|s| s.temperature = Some(-0.5)), "temperature"),
        (with_sampling(|s| s.top_p = Some(0.0)), "top_p"),
        (with_sampling(|s| s.top_p = Some(1.01)), "top_p"),
        (tokens(vec![1, 2], 0), "max_tokens"),
        (tokens(vec![], 4), "prompt"),
        (
            v1::GenerateRequest {
                prompt: Some(v1::generate_request::Prompt::Text(String::new())),
                ..tokens(vec![], 4)
            },
            "prompt",
        ),
        (
            v1::GenerateRequest {
                prompt: None,
                ..tokens(vec![], 4)
            },
            "prompt",
        ),
        (tokens(vec![7; 600], 4), "prompt"),
        (tokens(vec![1, 100_000], 4), "token_ids"),
    ];
    for (req, field) in cases {
        let err = match c.generate(req.clone()).await {
            Ok(_) => panic!("{req:?} was accepted"),
            Err(e) => e,
        };
        assert_eq!(err.code(), Code::InvalidArgument, "{req:?}: {err:?}");
        assert!(
            err.message().contains(field),
            "{:?} should name {field}",
            err.message()
        );
    }
    // The server is still fine.
    let mut ok = c
        .generate(tokens(vec![1, 2], 2))
        .await
        .expect("valid")
        .into_inner();
    while ok.message().await.expect("message").is_some() {}
}

fn constrained(format: v1::response_format::Format, seed: u64) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::Text("Answer:".into())),
        sampling: Some(v1::SamplingParams {
            temperature: Some(1.0),
            seed: Some(seed),
            ..Default::default()
        }),
        max_tokens: Some(300),
        n: 2,
        response_format: Some(v1::ResponseFormat {
            format: Some(format),
        }),
        ..Default::default()
    }
}

/// Each choice's text and finish reason.
async fn texts(
    c: &mut GenerationClient<tonic::transport::Channel>,
    req: v1::GenerateRequest,
) -> Vec<(String, i32)> {
    let mut stream = c.generate(req).await.expect("call").into_inner();
    let mut out = vec![(String::new(), 0); 2];
    while let Some(msg) = stream.message().await.expect("message") {
        if let Some(v1::generate_response::Event::Delta(d)) = msg.event {
            let (text, finish) = &mut out[d.index as usize];
            text.push_str(&d.text);
            if d.finish_reason != 0 {
                *finish = d.finish_reason;
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_formats_constrain_the_output() {
    use v1::response_format::Format;
    let s = start().await;
    let mut c = client(&s.url).await;
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 6},
            "rank": {"type": "integer", "minimum": 1, "maximum": 9}
        },
        "required": ["city", "rank"],
        "additionalProperties": false
    });
    let validator = jsonschema::validator_for(&schema).expect("schema");
    for seed in 0..3 {
        for (text, finish) in texts(
            &mut c,
            constrained(Format::JsonSchema(schema.to_string()), seed),
        )
        .await
        {
            assert_eq!(finish, v1::FinishReason::Stop as i32, "{text:?}");
            let v: serde_json::Value = serde_json::from_str(&text).expect(&text);
            assert!(validator.is_valid(&v), "{text:?}");
        }
    }
    let choices = vec!["alpha".to_string(), "beta".into()];
    let req = constrained(
        Format::Choice(v1::Choice {
            choices: choices.clone(),
        }),
        7,
    );
    for (text, finish) in texts(&mut c, req).await {
        assert_eq!(finish, v1::FinishReason::Stop as i32);
        assert!(choices.contains(&text), "{text:?}");
    }
    let stats = s.handle.stats();
    assert!(stats.mask_steps > 0, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_response_formats_are_invalid_argument_with_the_engine_message() {
    use v1::response_format::Format;
    let s = start().await;
    let mut c = client(&s.url).await;
    for (format, field) in [
        (
            Format::JsonSchema("{".into()),
            "response_format.json_schema",
        ),
        (
            Format::JsonSchema(r#"{"type": "string", "minLength": 5, "maxLength": 2}"#.into()),
            "response_format.json_schema",
        ),
        (Format::Regex("[a-".into()), "response_format.regex"),
        (
            Format::Grammar("start: nowhere".into()),
            "response_format.grammar",
        ),
        (
            Format::Choice(v1::Choice { choices: vec![] }),
            "response_format.choice",
        ),
    ] {
        let err = match c.generate(constrained(format.clone(), 0)).await {
            Ok(_) => panic!("{format:?} was accepted"),
            Err(e) => e,
        };
        assert_eq!(err.code(), Code::InvalidArgument, "{format:?}: {err:?}");
        assert!(
            err.message().starts_with(field) && err.message().len() > field.len() + 2,
            "{:?} should name {field} and say why",
            err.message()
        );
    }
    let mut empty = constrained(Format::Regex("a".into()), 0);
    empty.response_format = Some(v1::ResponseFormat { format: None });
    let err = c.generate(empty).await.expect_err("refused");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().starts_with("response_format"),
        "{}",
        err.message()
    );
    let st = s.handle.stats();
    assert_eq!(st.free_blocks, st.num_blocks, "nothing was admitted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_frees_its_blocks() {
    // Big enough that the request cannot finish on its own during the test.
    let s = start_with(synth::SynthConfig {
        hidden_size: 256,
        intermediate_size: 512,
        num_layers: 4,
        max_position_embeddings: 4096,
        ..synth::preset("tiny").expect("preset")
    })
    .await;
    let mut c = client(&s.url).await;
    let (prompt, max_tokens) = (200, 3000);
    let mut stream = c
        .generate(tokens((0..prompt).collect(), max_tokens))
        .await
        .expect("call")
        .into_inner();
    for _ in 0..3 {
        stream.message().await.expect("message").expect("a delta");
    }
    let busy = s.handle.stats();
    assert!(
        busy.free_blocks < busy.num_blocks,
        "the request holds blocks"
    );
    drop(stream);
    drop(c);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let st = s.handle.stats();
        if st.running == 0 && st.waiting == 0 && st.free_blocks == st.num_blocks {
            break;
        }
        assert!(Instant::now() < deadline, "request not aborted: {st:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let computed = s.handle.stats().computed_tokens;
    assert!(
        computed < u64::from(prompt + max_tokens) / 2,
        "the request ran on after its client left ({computed} tokens computed)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_stream_by_index() {
    let s = start().await;
    let mut c = client(&s.url).await;
    let mut req = tokens(vec![5, 6, 7], 5);
    req.n = 3;
    req.sampling = Some(v1::SamplingParams {
        temperature: Some(0.8),
        seed: Some(1),
        ..Default::default()
    });
    let mut stream = c.generate(req).await.expect("call").into_inner();
    let mut per_choice = [0usize; 3];
    let mut finished = None;
    while let Some(msg) = stream.message().await.expect("message") {
        match msg.event.expect("event") {
            v1::generate_response::Event::Delta(d) => {
                per_choice[d.index as usize] += d.token_ids.len()
            }
            v1::generate_response::Event::Finished(f) => finished = Some(f),
            v1::generate_response::Event::PromptLogprobs(_) => panic!("no prompt scores asked"),
        }
    }
    assert_eq!(per_choice, [5, 5, 5]);
    let f = finished.expect("finished");
    assert_eq!(f.choices.len(), 3);
    assert_eq!(f.usage.expect("usage").completion_tokens, 15);
}

/// A model slow enough that a long request is still running while the
/// test looks at it.
fn slow_model() -> synth::SynthConfig {
    synth::SynthConfig {
        hidden_size: 256,
        intermediate_size: 512,
        num_layers: 4,
        max_position_embeddings: 4096,
        ..synth::preset("tiny").expect("preset")
    }
}

async fn wait_until_idle(handle: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let st = handle.stats();
        if st.running == 0 && st.waiting == 0 && st.free_blocks == st.num_blocks {
            return;
        }
        assert!(Instant::now() < deadline, "requests not aborted: {st:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_resource_exhausted_with_a_retry_hint() {
    let config = EngineConfig {
        max_num_seqs: 1,
        max_queued_requests: Some(2),
        ..EngineConfig::default()
    };
    let s = start_config(slow_model(), &config).await;
    let mut c = client(&s.url).await;
    // One runs, two wait: the fourth (or, while the first is still on its
    // way in, the third) is refused.
    let mut accepted = Vec::new();
    let refused = loop {
        assert!(accepted.len() < 6, "never refused");
        match c.generate(tokens(vec![1, 2, 3], 3000)).await {
            Ok(r) => accepted.push(r.into_inner()),
            Err(status) => break status,
        }
    };
    assert!((2..=3).contains(&accepted.len()), "{}", accepted.len());
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(
        refused.message().contains("queued"),
        "{}",
        refused.message()
    );
    let hint = refused
        .metadata()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    assert_eq!(hint, Some(1));
    // Freed queue slots take requests again: the aborts reach the engine
    // thread asynchronously, so retry within a bound.
    drop(accepted);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut ok = loop {
        match c.generate(tokens(vec![1, 2, 3], 2)).await {
            Ok(r) => break r.into_inner(),
            Err(status) if status.code() == Code::ResourceExhausted => {
                assert!(Instant::now() < deadline, "the queue never drained");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    };
    while ok.message().await.expect("message").is_some() {}
    wait_until_idle(&s.handle).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passed_deadline_ends_the_stream_and_frees_the_blocks() {
    let s = start_with(slow_model()).await;
    let mut c = client(&s.url).await;
    let mut req = tonic::Request::new(tokens((0..200).collect(), 3000));
    req.set_timeout(Duration::from_millis(300));
    let started = Instant::now();
    let mut stream = c.generate(req).await.expect("call").into_inner();
    let status = loop {
        match stream.message().await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("3000 tokens ended before a 300 ms deadline"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    wait_until_idle(&s.handle).await;
    let computed = s.handle.stats().computed_tokens;
    assert!(
        computed < 200 + 3000 / 2,
        "ran on after the deadline: {computed}"
    );
}
