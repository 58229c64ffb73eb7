//! A request resumed on a fresh engine from the tokens its choices had
//! emitted (what the router sends when a decode worker dies) goes on exactly
//! as the uninterrupted request did: the same tokens, the same text (stop
//! strings' held-back text included), the same logprobs, the same finish
//! reasons and the whole request's usage — for stop strings, penalties,
//! seeded sampling at temperature 1, a JSON-schema grammar, `n = 3` and
//! logprobs.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tandem_engine::serving::{
    EngineConfig, EngineCore, Prompt, Request, RequestEvent, RequestSummary, ResponseFormat,
    Resume, ResumedChoice,
};
use tandem_engine::{synth, Checkpoint, DType, FinishReason, SamplingParams, TokenLogprob};
use tokio::sync::mpsc::unbounded_channel;

fn checkpoint() -> (tempfile::TempDir, Checkpoint) {
    let tmp = tempfile::tempdir().expect("tempdir");
    synth::preset("tiny")
        .expect("preset")
        .write(tmp.path(), 9, DType::F32)
        .expect("write");
    let ck = Checkpoint::open(tmp.path()).expect("open");
    (tmp, ck)
}

/// A fresh engine: a resumed request lands on another worker.
fn core(ck: &Checkpoint) -> EngineCore {
    let model = tandem_engine::Model::load(&ck.dir).expect("load");
    let tok = tandem_engine::tokenizer::Tokenizer::from_file(&ck.dir.join("tokenizer.json"))
        .expect("tokenizer");
    let config = EngineConfig {
        block_size: 4,
        ..EngineConfig::default()
    };
    EngineCore::new(
        model,
        Some(Arc::new(tok)),
        ck.eos_token_ids.clone(),
        &config,
    )
    .expect("core")
}

/// One choice as its client saw it: each delta's tokens and text.
#[derive(Debug, Default, Clone)]
struct Choice {
    deltas: Vec<(Vec<u32>, String)>,
    logprobs: Vec<TokenLogprob>,
    finish: Option<FinishReason>,
}

impl Choice {
    fn tokens(&self) -> Vec<u32> {
        self.deltas.iter().flat_map(|d| d.0.clone()).collect()
    }

    fn text(&self) -> String {
        self.deltas.iter().map(|d| d.1.as_str()).collect()
    }

    /// The first `k` tokens and the text their deltas carried.
    fn first(&self, k: usize) -> (Vec<u32>, String) {
        let mut tokens = Vec::new();
        let mut text = String::new();
        for d in &self.deltas {
            if tokens.len() >= k {
                break;
            }
            tokens.extend(&d.0);
            text.push_str(&d.1);
        }
        (tokens, text)
    }
}

/// Runs `req` alone on `core` to the end.
fn run(ck: &Checkpoint, req: Request) -> (BTreeMap<u32, Choice>, RequestSummary) {
    let mut core = core(ck);
    let (tx, mut rx) = unbounded_channel();
    core.add_request(0, req, tx).expect("valid request");
    let mut choices: BTreeMap<u32, Choice> = BTreeMap::new();
    let mut summary = None;
    for _ in 0..10_000 {
        while let Ok(ev) = rx.try_recv() {
            match ev {
                RequestEvent::Delta(d) => {
                    let c = choices.entry(d.index).or_default();
                    c.deltas.push((d.token_ids, d.text));
                    c.logprobs.extend(d.logprobs);
                    c.finish = c.finish.or(d.finish_reason);
                }
                RequestEvent::Finished(s) => summary = Some(s),
                RequestEvent::Error(e) => panic!("request failed: {}", e.message),
                RequestEvent::RemotePrefill(_) | RequestEvent::PromptLogprobs(_) => {}
            }
        }
        if !core.has_work() {
            break;
        }
        core.step();
        core.check_accounting().expect("block books");
    }
    let s = core.stats();
    assert_eq!(s.free_blocks, s.num_blocks, "blocks leaked");
    (choices, summary.expect("finished"))
}

/// Runs `make()` whole, then again resumed on a fresh engine after
/// `cut[i]` tokens of choice `i`, and checks the two agree.
fn resumes_exactly(ck: &Checkpoint, make: impl Fn() -> Request, cut: &[usize]) {
    let (whole, whole_summary) = run(ck, make());
    let mut resume = Resume {
        elapsed: Duration::from_millis(300),
        first_token_after: Some(Duration::from_millis(100)),
        ..Resume::default()
    };
    let mut before = BTreeMap::new();
    for (&index, c) in &whole {
        let (tokens, text) = c.first(cut[index as usize]);
        resume.choices.push(ResumedChoice {
            index,
            tokens: tokens.clone(),
        });
        before.insert(index, (tokens, text));
    }
    let mut req = make();
    req.resume = Some(resume);
    let (rest, summary) = run(ck, req);
    for (index, c) in &whole {
        let (tokens, text) = &before[index];
        let after = rest.get(index).cloned().unwrap_or_default();
        let mut joined = tokens.clone();
        joined.extend(after.tokens());
        assert_eq!(joined, c.tokens(), "choice {index}'s tokens");
        assert_eq!(
            text.clone() + &after.text(),
            c.text(),
            "choice {index}'s text"
        );
        let finish = after
            .finish
            .or(c.finish.filter(|_| after.deltas.is_empty()));
        assert_eq!(finish, c.finish, "choice {index}'s finish");
        let lp = &c.logprobs[c.logprobs.len() - after.logprobs.len()..];
        for (a, b) in after.logprobs.iter().zip(lp) {
            assert_eq!(a.token, b.token);
            assert!((a.logprob - b.logprob).abs() < 1e-4, "{a:?} vs {b:?}");
            let top = |t: &TokenLogprob| t.top.iter().map(|x| x.0).collect::<Vec<_>>();
            assert_eq!(top(a), top(b));
        }
    }
    assert_eq!(
        summary.usage.prompt_tokens,
        whole_summary.usage.prompt_tokens
    );
    assert_eq!(
        summary.usage.completion_tokens,
        whole_summary.usage.completion_tokens
    );
    let reasons = |s: &RequestSummary| {
        s.choices
            .iter()
            .map(|c| {
                (
                    c.index,
                    c.finish_reason,
                    c.matched_stop.clone(),
                    c.completion_tokens,
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(reasons(&summary), reasons(&whole_summary));
    assert!(
        summary.timings.e2e >= Duration::from_millis(300),
        "timings count from arrival"
    );
    assert!(summary.timings.ttft == Some(Duration::from_millis(100)));
}

fn request(max_tokens: usize) -> Request {
    let mut r = Request::new(Prompt::Text("The quick brown fox".into()), max_tokens);
    r.ignore_eos = true;
    r
}

#[test]
fn greedy_with_stop_strings_resumes_with_the_held_back_text() {
    let (_tmp, ck) = checkpoint();
    // A stop string from the middle of the unstopped text: at the cut the
    // matcher holds back a partial match.
    let (whole, _) = run(&ck, request(40));
    let c = &whole[&0];
    let stop: String = c.deltas[14..19].iter().map(|d| d.1.as_str()).collect();
    assert!(!stop.is_empty(), "the tokens have text");
    for cut in [3, 15, 16, 17] {
        resumes_exactly(
            &ck,
            || {
                let mut r = request(40);
                r.stop = vec![stop.clone()];
                r
            },
            &[cut],
        );
    }
}

#[test]
fn seeded_sampling_with_penalties_and_three_choices_resumes_exactly() {
    let (_tmp, ck) = checkpoint();
    let make = || {
        let mut r = request(30);
        r.n = 3;
        r.sampling = SamplingParams {
            temperature: 1.0,
            seed: Some(42),
            presence_penalty: 0.7,
            frequency_penalty: 0.4,
            repetition_penalty: 1.3,
            logprobs: Some(3),
            ..SamplingParams::default()
        };
        r
    };
    resumes_exactly(&ck, make, &[20, 7, 0]);
    // A choice that had already ended is summarised, not generated again.
    resumes_exactly(&ck, make, &[30, 12, 29]);
}

#[test]
fn a_json_schema_grammar_resumes_where_its_matcher_stood() {
    let (_tmp, ck) = checkpoint();
    let schema = r#"{"type":"object","properties":{"name":{"type":"string","minLength":20,"maxLength":30}},"required":["name"]}"#;
    let make = || {
        let mut r = request(150);
        r.sampling = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..SamplingParams::default()
        };
        r.response_format = Some(ResponseFormat::JsonSchema(schema.into()));
        r
    };
    let (whole, _) = run(&ck, make());
    let text = whole[&0].text();
    serde_json::from_str::<serde_json::Value>(&text).expect("valid JSON");
    resumes_exactly(&ck, make, &[20]);
}

#[test]
fn a_resume_that_does_not_fit_its_request_fails_it() {
    let (_tmp, ck) = checkpoint();
    let mut core = core(&ck);
    let mut r = request(10);
    r.resume = Some(Resume {
        choices: vec![ResumedChoice {
            index: 1,
            tokens: vec![1],
        }],
        ..Resume::default()
    });
    let (tx, _rx) = unbounded_channel();
    let err = core.add_request(0, r, tx).expect_err("choice 1 of n = 1");
    assert!(err.to_string().contains("resume.choices[0].index"), "{err}");
    // A grammar refuses what it never allowed: the request fails, with
    // nothing held.
    let mut r = request(10);
    r.response_format = Some(ResponseFormat::Regex("[0-9]+".into()));
    let letter = tandem_engine::tokenizer::Tokenizer::from_file(&ck.dir.join("tokenizer.json"))
        .expect("tokenizer")
        .encode("x")
        .expect("encode");
    r.resume = Some(Resume {
        choices: vec![ResumedChoice {
            index: 0,
            tokens: letter,
        }],
        ..Resume::default()
    });
    let (tx, mut rx) = unbounded_channel();
    core.add_request(1, r, tx).expect("validated");
    match rx.try_recv() {
        Ok(RequestEvent::Error(e)) => assert!(e.message.contains("resume: choice 0"), "{e:?}"),
        other => panic!("expected a failure, got {other:?}"),
    }
    assert!(!core.has_work());
}

#[test]
fn a_handed_over_request_ends_quietly_and_leaves_its_kv_cached() {
    let (_tmp, ck) = checkpoint();
    let mut core = core(&ck);
    let prompt = tandem_engine::tokenizer::Tokenizer::from_file(&ck.dir.join("tokenizer.json"))
        .expect("tokenizer")
        .encode("The quick brown fox jumps over")
        .expect("encode");
    let (tx, mut rx) = unbounded_channel();
    let mut req = Request::new(Prompt::Tokens(prompt.clone()), 40);
    req.ignore_eos = true;
    core.add_request(0, req, tx).expect("valid request");
    let mut generated = Vec::new();
    for _ in 0..100 {
        if generated.len() >= 12 {
            break;
        }
        core.step();
        while let Ok(ev) = rx.try_recv() {
            if let RequestEvent::Delta(d) = ev {
                generated.extend(d.token_ids);
            }
        }
    }
    assert!(generated.len() >= 12, "the request got going");
    core.hand_over();
    match rx.try_recv() {
        Ok(RequestEvent::Error(e)) => {
            assert_eq!(e.scope, tandem_engine::serving::FailureScope::HandedOver)
        }
        other => panic!("expected the hand-over, got {other:?}"),
    }
    assert!(rx.try_recv().is_err(), "nothing follows the hand-over");
    assert!(!core.has_work());
    let s = core.stats();
    assert_eq!(s.free_blocks, s.num_blocks, "its blocks are free ...");
    // ... and cached: what the next worker pulls is computed already.
    let mut tokens = prompt;
    tokens.extend(&generated);
    let (tx, mut rx) = unbounded_channel();
    core.add_request(1, Request::new(Prompt::Tokens(tokens.clone()), 1), tx)
        .expect("valid request");
    while core.has_work() {
        core.step();
    }
    let mut cached = None;
    while let Ok(ev) = rx.try_recv() {
        if let RequestEvent::Finished(s) = ev {
            cached = Some(s.usage.cached_tokens);
        }
    }
    let full_blocks = (tokens.len() - 1) / 4 * 4;
    assert_eq!(cached, Some(full_blocks), "every full block was cached");
}

#[test]
fn a_resumed_request_is_taken_past_the_queue_limit_up_to_its_headroom() {
    use tandem_engine::serving::{EngineHandle, RESUMED_HEADROOM};
    use tandem_engine::EngineError;
    // A slow model and one sequence at a time: the first request runs for
    // seconds while the others wait.
    let tmp = tempfile::tempdir().expect("tempdir");
    synth::SynthConfig {
        hidden_size: 256,
        intermediate_size: 512,
        num_layers: 4,
        max_position_embeddings: 4096,
        ..synth::preset("tiny").expect("preset")
    }
    .write(tmp.path(), 9, DType::F32)
    .expect("write");
    let model = tandem_engine::Model::load(tmp.path()).expect("load");
    let limit = 2;
    let config = EngineConfig {
        max_num_seqs: 1,
        max_queued_requests: Some(limit),
        ..EngineConfig::default()
    };
    let core = EngineCore::new(model, None, vec![], &config).expect("core");
    let engine = EngineHandle::spawn(core).expect("spawn");
    let long = |resumed: bool| {
        let mut r = Request::new(Prompt::Tokens(vec![1, 2, 3]), 3000);
        r.ignore_eos = true;
        r.resume = resumed.then(|| Resume {
            choices: vec![ResumedChoice {
                index: 0,
                tokens: vec![4],
            }],
            ..Resume::default()
        });
        r
    };
    let mut held = Vec::new();
    let refused = loop {
        assert!(held.len() < 2 * limit + 2, "new requests never refused");
        match engine.submit(long(false)) {
            Ok(s) => held.push(s),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(refused, EngineError::Overloaded { .. }),
        "{refused}"
    );
    // The queue is full for new work; resumed requests still get in, up
    // to the headroom, and then they are refused too.
    let mut resumed = 0;
    let refused = loop {
        assert!(
            resumed <= limit * RESUMED_HEADROOM,
            "resumed requests never refused"
        );
        match engine.submit(long(true)) {
            Ok(s) => {
                held.push(s);
                resumed += 1;
            }
            Err(e) => break e,
        }
    };
    assert!(resumed >= 1, "no resumed request taken at a full queue");
    assert!(
        matches!(refused, EngineError::Overloaded { limit: l, .. } if l == limit * RESUMED_HEADROOM),
        "{refused}"
    );
}
