//! Constrained decoding through the serving engine, on a random-weight
//! model sampled at temperature 1: every output must parse and validate
//! (JSON schemas with the `jsonschema` crate, regexes with `regex`) and end
//! with finish reason `stop`; the same requests without a constraint must
//! not (so the mask is what does the work). Also: choices, a Lark grammar,
//! greedy decoding, parallel samples, preemption, remote prefill, masked
//! logprobs, invalid formats refused at admission, and the mask timings.

use std::collections::HashMap;
use std::sync::Arc;

use tandem_engine::serving::{
    CollectedExport, EngineConfig, EngineCore, KvPoolSize, PrefillMode, PrefillPlacement, Prompt,
    Request, RequestEvent, RequestSummary, ResponseFormat,
};
use tandem_engine::{synth, Checkpoint, DType, EngineError, FinishReason, SamplingParams};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

fn checkpoint() -> (tempfile::TempDir, Checkpoint) {
    let tmp = tempfile::tempdir().expect("tempdir");
    synth::preset("tiny")
        .expect("preset")
        .write(tmp.path(), 5, DType::F32)
        .expect("write");
    let ck = Checkpoint::open(tmp.path()).expect("open");
    (tmp, ck)
}

fn core(ck: &Checkpoint, config: &EngineConfig) -> EngineCore {
    let model = tandem_engine::Model::load(&ck.dir).expect("load");
    let tok = tandem_engine::tokenizer::Tokenizer::from_file(&ck.dir.join("tokenizer.json"))
        .expect("tokenizer");
    EngineCore::new(model, Some(Arc::new(tok)), ck.eos_token_ids.clone(), config).expect("core")
}

/// One choice's result.
#[derive(Debug, Default, Clone)]
struct Choice {
    tokens: Vec<u32>,
    text: String,
    finish: Option<FinishReason>,
    logprobs: Vec<tandem_engine::TokenLogprob>,
}

#[derive(Debug, Default)]
struct Outcome {
    choices: HashMap<u32, Choice>,
    summary: Option<RequestSummary>,
    error: Option<String>,
}

struct Driver {
    core: EngineCore,
    streams: Vec<(u64, UnboundedReceiver<RequestEvent>)>,
    outcomes: HashMap<u64, Outcome>,
    next: u64,
}

impl Driver {
    fn new(core: EngineCore) -> Self {
        Self {
            core,
            streams: Vec::new(),
            outcomes: HashMap::new(),
            next: 0,
        }
    }

    fn try_add(&mut self, req: Request) -> Result<u64, EngineError> {
        let id = self.next;
        let (tx, rx) = unbounded_channel();
        self.core.add_request(id, req, tx)?;
        self.next += 1;
        self.streams.push((id, rx));
        Ok(id)
    }

    fn add(&mut self, req: Request) -> u64 {
        self.try_add(req).expect("valid request")
    }

    fn drain(&mut self) {
        for (id, rx) in &mut self.streams {
            while let Ok(ev) = rx.try_recv() {
                let o = self.outcomes.entry(*id).or_default();
                match ev {
                    RequestEvent::Delta(d) => {
                        let c = o.choices.entry(d.index).or_default();
                        c.tokens.extend(&d.token_ids);
                        c.text.push_str(&d.text);
                        c.logprobs.extend(d.logprobs);
                        if d.finish_reason.is_some() {
                            c.finish = d.finish_reason;
                        }
                    }
                    RequestEvent::Finished(s) => o.summary = Some(s),
                    RequestEvent::Error(e) => o.error = Some(e.message),
                    RequestEvent::RemotePrefill(_) | RequestEvent::PromptLogprobs(_) => {}
                }
            }
        }
    }

    fn run(&mut self) {
        for _ in 0..100_000 {
            if !self.core.has_work() {
                self.drain();
                let s = self.core.stats();
                assert_eq!(s.free_blocks, s.num_blocks, "blocks leaked");
                return;
            }
            self.core.step();
            self.core.check_accounting().expect("block books");
            self.drain();
        }
        panic!("engine did not finish");
    }

    /// Every choice of request `id`, which must have succeeded.
    fn choices(&self, id: u64) -> Vec<Choice> {
        let o = &self.outcomes[&id];
        assert!(o.error.is_none(), "request {id} failed: {:?}", o.error);
        let s = o.summary.as_ref().expect("finished");
        let mut v: Vec<(u32, Choice)> = o.choices.clone().into_iter().collect();
        v.sort_by_key(|c| c.0);
        assert_eq!(v.len(), s.choices.len());
        v.into_iter().map(|c| c.1).collect()
    }
}

fn sampled(prompt: &str, max_tokens: usize, seed: u64, format: Option<ResponseFormat>) -> Request {
    let mut r = Request::new(Prompt::Text(prompt.into()), max_tokens);
    r.sampling = SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    r.response_format = format;
    r
}

fn schemas() -> Vec<serde_json::Value> {
    use serde_json::json;
    vec![
        // Nested objects, booleans, required fields.
        json!({
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 8},
                        "age": {"type": "integer", "minimum": 0, "maximum": 150}
                    },
                    "required": ["name", "age"],
                    "additionalProperties": false
                },
                "active": {"type": "boolean"}
            },
            "required": ["user", "active"],
            "additionalProperties": false
        }),
        // An array with bounds on its length and its items.
        json!({
            "type": "array",
            "items": {"type": "integer", "minimum": -5, "maximum": 5},
            "minItems": 1,
            "maxItems": 4
        }),
        // Enums.
        json!({
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "size": {"type": "string", "enum": ["S", "M", "L"]}
            },
            "required": ["color", "size"],
            "additionalProperties": false
        }),
        // Numbers with bounds.
        json!({
            "type": "object",
            "properties": {
                "x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10}
            },
            "required": ["x", "n"],
            "additionalProperties": false
        }),
        // Optional fields, a pattern, an array of bounded strings.
        json!({
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[a-z]{2,4}$"},
                "note": {"type": "string", "maxLength": 5},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 3},
                    "maxItems": 2
                }
            },
            "required": ["id"],
            "additionalProperties": false
        }),
    ]
}

const REGEXES: [&str; 4] = [
    r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)",
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)( please)?",
    r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
];

/// Samples per format (8 requests × n = 4).
const REQUESTS: u64 = 8;
const N: usize = 4;

#[test]
fn json_schemas_and_regexes_always_validate_at_temperature_one() {
    let (_tmp, ck) = checkpoint();
    let mut d = Driver::new(core(&ck, &EngineConfig::default()));
    let schemas = schemas();
    let mut ids = Vec::new();
    for (i, schema) in schemas.iter().enumerate() {
        for k in 0..REQUESTS {
            let mut r = sampled(
                "Reply in JSON:",
                400,
                100 * i as u64 + k,
                Some(ResponseFormat::JsonSchema(schema.to_string())),
            );
            r.n = N;
            ids.push((d.add(r), Some(i), None));
        }
    }
    for (i, rx) in REGEXES.iter().enumerate() {
        for k in 0..REQUESTS {
            let mut r = sampled(
                "Your answer:",
                100,
                1000 + 100 * i as u64 + k,
                Some(ResponseFormat::Regex((*rx).into())),
            );
            r.n = N;
            ids.push((d.add(r), None, Some(i)));
        }
    }
    d.run();
    let validators: Vec<_> = schemas
        .iter()
        .map(|s| jsonschema::validator_for(s).expect("schema"))
        .collect();
    let regexes: Vec<_> = REGEXES
        .iter()
        .map(|r| regex::Regex::new(&format!("^(?:{r})$")).expect("regex"))
        .collect();
    let mut checked = 0;
    let mut distinct: HashMap<(Option<usize>, Option<usize>), std::collections::HashSet<String>> =
        HashMap::new();
    for (id, schema, rx) in ids {
        for c in d.choices(id) {
            distinct
                .entry((schema, rx))
                .or_default()
                .insert(c.text.clone());
            assert_eq!(c.finish, Some(FinishReason::Stop), "{:?}", c.text);
            if let Some(i) = schema {
                let v: serde_json::Value = serde_json::from_str(&c.text)
                    .unwrap_or_else(|e| panic!("schema {i}: {e}: {:?}", c.text));
                assert!(
                    validators[i].is_valid(&v),
                    "schema {i}: {:?} does not validate",
                    c.text
                );
            }
            if let Some(i) = rx {
                assert!(regexes[i].is_match(&c.text), "regex {i}: {:?}", c.text);
            }
            checked += 1;
        }
    }
    assert_eq!(
        checked,
        (schemas.len() + REGEXES.len()) * REQUESTS as usize * N
    );
    // Sampled, not forced: each format gets varied outputs.
    for (k, texts) in &distinct {
        assert!(texts.len() >= 4, "{k:?}: {texts:?}");
    }
    let s = d.core.stats();
    assert!(s.mask_steps > 0 && s.masks_computed > s.mask_steps, "{s:?}");
    assert!(s.mask_time > std::time::Duration::ZERO);
    assert!(s.mask_exposed <= s.mask_time);
}

#[test]
fn without_the_constraint_the_model_does_not_write_valid_json() {
    let (_tmp, ck) = checkpoint();
    let mut d = Driver::new(core(&ck, &EngineConfig::default()));
    let schema = &schemas()[0];
    let validator = jsonschema::validator_for(schema).expect("schema");
    let ids: Vec<u64> = (0..8)
        .map(|k| d.add(sampled("Reply in JSON:", 60, k, None)))
        .collect();
    d.run();
    let valid = ids
        .iter()
        .flat_map(|&id| d.choices(id))
        .filter(|c| {
            serde_json::from_str::<serde_json::Value>(&c.text).is_ok_and(|v| validator.is_valid(&v))
        })
        .count();
    assert_eq!(valid, 0, "a random model writes gibberish");
    assert_eq!(d.core.stats().mask_steps, 0);
}

#[test]
fn choices_and_a_lark_grammar_end_with_stop() {
    let (_tmp, ck) = checkpoint();
    let mut d = Driver::new(core(&ck, &EngineConfig::default()));
    let choices = vec!["positive".to_string(), "negative".into(), "neutral".into()];
    let lark = r#"
        start: "[" item ("," item)* "]"
        item: NUM | WORD
        NUM: /[0-9]{1,3}/
        WORD: /[a-z]{1,4}/
    "#;
    let mut ids = Vec::new();
    for k in 0..6 {
        ids.push((
            d.add(sampled(
                "Sentiment:",
                50,
                k,
                Some(ResponseFormat::Choice(choices.clone())),
            )),
            true,
        ));
        ids.push((
            d.add(sampled(
                "List:",
                300,
                50 + k,
                Some(ResponseFormat::Grammar(lark.into())),
            )),
            false,
        ));
    }
    // Greedy decoding honours the mask too.
    let mut greedy = Request::new(Prompt::Text("Sentiment:".into()), 50);
    greedy.response_format = Some(ResponseFormat::Choice(choices.clone()));
    ids.push((d.add(greedy), true));
    d.run();
    let rx = regex::Regex::new(r"^\[([0-9]{1,3}|[a-z]{1,4})(,([0-9]{1,3}|[a-z]{1,4}))*\]$")
        .expect("regex");
    let eos = ck.eos_token_ids.clone();
    for (id, is_choice) in ids {
        for c in d.choices(id) {
            assert_eq!(c.finish, Some(FinishReason::Stop), "{:?}", c.text);
            if is_choice {
                assert!(choices.contains(&c.text), "{:?}", c.text);
                // The grammar stopped at its last character: no end token
                // was spent.
                assert!(!c.tokens.iter().any(|t| eos.contains(t)), "{:?}", c.tokens);
            } else {
                assert!(rx.is_match(&c.text), "{:?}", c.text);
            }
        }
    }
}

#[test]
fn logprobs_are_those_of_the_masked_distribution() {
    let (_tmp, ck) = checkpoint();
    let mut d = Driver::new(core(&ck, &EngineConfig::default()));
    let mut r = sampled(
        "Pick:",
        10,
        3,
        Some(ResponseFormat::Choice(vec!["a".into(), "b".into()])),
    );
    r.sampling.logprobs = Some(5);
    let id = d.add(r);
    d.run();
    let c = &d.choices(id)[0];
    assert!(c.text == "a" || c.text == "b", "{:?}", c.text);
    let lp = &c.logprobs[0];
    let allowed = [u32::from(b'a'), u32::from(b'b')];
    assert_eq!(lp.top.len(), 2, "only the allowed tokens: {lp:?}");
    assert!(lp.top.iter().all(|(t, _)| allowed.contains(t)));
    let mass: f32 = lp.top.iter().map(|(_, l)| l.exp()).sum();
    assert!(
        (mass - 1.0).abs() < 1e-4,
        "renormalised over the allowed: {mass}"
    );
}

#[test]
fn invalid_formats_are_refused_at_admission_with_the_engine_message() {
    let (_tmp, ck) = checkpoint();
    let mut d = Driver::new(core(&ck, &EngineConfig::default()));
    for (f, field) in [
        (
            ResponseFormat::JsonSchema("{not json".into()),
            "response_format.json_schema",
        ),
        (
            ResponseFormat::JsonSchema(r#"{"type": "integer", "minimum": 3, "maximum": 1}"#.into()),
            "response_format.json_schema",
        ),
        (
            ResponseFormat::Regex("([a-z]".into()),
            "response_format.regex",
        ),
        (
            ResponseFormat::Grammar("start: missing_rule".into()),
            "response_format.grammar",
        ),
        (ResponseFormat::Choice(vec![]), "response_format.choice"),
    ] {
        let err = d
            .try_add(sampled("x", 10, 0, Some(f.clone())))
            .expect_err("invalid format");
        match err {
            EngineError::InvalidRequest(m) => assert!(m.starts_with(field), "{f:?}: {m}"),
            other => panic!("{f:?}: {other}"),
        }
    }
    assert!(!d.core.has_work());
    let s = d.core.stats();
    assert_eq!(s.free_blocks, s.num_blocks);

    // Without a tokenizer there are no token bytes to constrain.
    let model = tandem_engine::Model::load(&ck.dir).expect("load");
    let mut bare = EngineCore::new(model, None, vec![], &EngineConfig::default()).expect("core");
    let mut r = Request::new(Prompt::Tokens(vec![1, 2]), 4);
    r.response_format = Some(ResponseFormat::JsonObject);
    let (tx, _rx) = unbounded_channel();
    let err = bare.add_request(0, r, tx).expect_err("no tokenizer");
    assert!(err.to_string().contains("tokenizer"), "{err}");
}

#[test]
fn preempted_constrained_sequences_resume_in_their_grammar() {
    let (_tmp, ck) = checkpoint();
    // A pool too small for all of them at once.
    let config = EngineConfig {
        kv_pool: KvPoolSize::Blocks(24),
        block_size: 4,
        ..EngineConfig::default()
    };
    let mut d = Driver::new(core(&ck, &config));
    let rx = regex::Regex::new(r"^[a-z]{5,12}( [a-z]{5,12}){2}$").expect("regex");
    let ids: Vec<u64> = (0..6)
        .map(|k| {
            d.add(sampled(
                "Three words:",
                60,
                k,
                Some(ResponseFormat::Regex("[a-z]{5,12}( [a-z]{5,12}){2}".into())),
            ))
        })
        .collect();
    d.run();
    assert!(d.core.stats().preemptions > 0, "the pool forces preemption");
    for id in ids {
        for c in d.choices(id) {
            assert_eq!(c.finish, Some(FinishReason::Stop));
            assert!(rx.is_match(&c.text), "{:?}", c.text);
        }
    }
}

#[test]
fn remote_prefill_samples_the_first_token_under_the_constraint() {
    let (_tmp, ck) = checkpoint();
    let mut decode = Driver::new(core(&ck, &EngineConfig::default()));
    let mut prefill = core(&ck, &EngineConfig::default());
    let prompt: Vec<u32> = (0..80).map(|i| (i * 7 + 3) % 256).collect();
    let schema = &schemas()[2];
    let mut r = Request::new(Prompt::Tokens(prompt), 100);
    r.sampling.temperature = 1.0;
    r.sampling.seed = Some(9);
    r.prefill = PrefillMode::Remote(PrefillPlacement {
        worker: "prefill".into(),
        min_uncached: 16,
    });
    r.response_format = Some(ResponseFormat::JsonSchema(schema.to_string()));
    let id = decode.add(r);
    decode.core.step();
    let (_, rx) = decode
        .streams
        .iter_mut()
        .find(|s| s.0 == id)
        .expect("stream");
    let rp = match rx.try_recv() {
        Ok(RequestEvent::RemotePrefill(rp)) => rp,
        other => panic!("expected a remote prefill, got {other:?}"),
    };
    // The prefill side: an export request (it never samples, and ignores
    // the format).
    let sink = Arc::new(CollectedExport::default());
    let mut exp = Request::new(Prompt::Tokens(rp.tokens.clone()), 1);
    exp.max_tokens = None;
    exp.prefill = PrefillMode::Export {
        sink: sink.clone(),
        from_block: rp.cached_tokens / 16,
    };
    exp.response_format = Some(ResponseFormat::JsonSchema(schema.to_string()));
    let (tx, _erx) = unbounded_channel();
    prefill.add_request(0, exp, tx).expect("export");
    while prefill.has_work() {
        prefill.step();
    }
    assert_eq!(
        prefill.stats().mask_steps,
        0,
        "the prefill side computes no mask"
    );
    for (layer, logical, k, v) in sink.take().iter() {
        decode
            .core
            .write_kv(rp.transfer, *layer, rp.blocks[*logical], k, v)
            .expect("destination block");
    }
    decode.core.finish_remote_prefill(rp.transfer, Ok(()));
    decode.run();
    let c = &decode.choices(id)[0];
    assert_eq!(c.finish, Some(FinishReason::Stop), "{:?}", c.text);
    let v: serde_json::Value = serde_json::from_str(&c.text).expect(&c.text);
    let validator = jsonschema::validator_for(schema).expect("schema");
    assert!(validator.is_valid(&v), "{:?}", c.text);
}
