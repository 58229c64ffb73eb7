//! Speculative decoding in the serving engine: greedy output is exactly
//! plain greedy output with every drafter, rejected drafts give their blocks
//! back (target and draft pools), and speculation stands down for large
//! batches. The statistical losslessness test of sampled requests lives
//! next to the engine code (`serving::core::speculation`), where the
//! residual step can be broken on purpose. Every test checks the block
//! books after every step.

use std::collections::HashMap;

use tandem_engine::serving::{
    EngineConfig, EngineCore, KvPoolSize, Prompt, Request, RequestEvent, RequestSummary,
};
use tandem_engine::speculative::{
    DraftModelDrafter, Drafter, NgramDrafter, SpecCounts, SpeculativeConfig,
};
use tandem_engine::{synth, CpuBackend, DType, Model, SamplingParams, TokenLogprob};
use tokio::sync::mpsc::unbounded_channel;

const POOL: usize = 512;

fn write_model(seed: u64) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    synth::preset("tiny")
        .expect("preset")
        .write(tmp.path(), seed, DType::F32)
        .expect("write");
    tmp
}

fn engine(dir: &std::path::Path) -> EngineCore {
    let config = EngineConfig {
        kv_pool: KvPoolSize::Blocks(POOL),
        ..EngineConfig::default()
    };
    let model = Model::load(dir).expect("load");
    EngineCore::new(model, None, Vec::new(), &config).expect("core")
}

/// A draft model from `dir`, optionally cut to its first `layers` layers.
fn draft_model(
    dir: &std::path::Path,
    layers: Option<usize>,
    target: &std::path::Path,
) -> Box<dyn Drafter> {
    let mut m = Model::load(dir).expect("load draft");
    if let Some(n) = layers {
        m.truncate_layers(n).expect("truncate");
    }
    let target = Model::load(target).expect("load target").config().clone();
    let backend = CpuBackend::new(m, 16, POOL);
    Box::new(DraftModelDrafter::new(Box::new(backend), &target).expect("drafter"))
}

/// Always `k` drafts (adaptive `k` would rightly refuse to pay for the
/// tiny model's expensive drafts; its own test is below).
fn spec_config(k: usize) -> SpeculativeConfig {
    SpeculativeConfig {
        num_speculative_tokens: k,
        adaptive: false,
        ..SpeculativeConfig::default()
    }
}

/// What one request produced.
#[derive(Debug, Default, Clone)]
struct Outcome {
    tokens: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    summary: Option<RequestSummary>,
}

/// Runs `requests` together to the end, checking the books every step.
fn run(core: &mut EngineCore, requests: Vec<Request>) -> Vec<Outcome> {
    let mut streams = Vec::new();
    for (i, req) in requests.into_iter().enumerate() {
        let (tx, rx) = unbounded_channel();
        core.add_request(i as u64, req, tx).expect("valid request");
        streams.push(rx);
    }
    let mut steps = 0;
    while core.has_work() {
        core.step();
        steps += 1;
        core.check_accounting()
            .unwrap_or_else(|e| panic!("block books broken after step {steps}: {e}"));
        assert!(steps < 10_000, "requests did not finish");
    }
    streams
        .into_iter()
        .map(|mut rx| {
            let mut o = Outcome::default();
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    RequestEvent::Delta(d) => {
                        o.tokens.extend(d.token_ids);
                        o.logprobs.extend(d.logprobs);
                    }
                    RequestEvent::Finished(s) => o.summary = Some(s),
                    other => panic!("unexpected event {other:?}"),
                }
            }
            o
        })
        .collect()
}

/// Prompts with and without repetition (prompt lookup needs some).
fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 2, 3, 4],
        vec![7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8],
        (0..40).map(|i| (i * 37 % 500) as u32 + 1).collect(),
        vec![100, 200, 300, 100, 200, 300, 100, 200],
        vec![5; 20],
    ]
}

fn greedy_requests(max_tokens: usize) -> Vec<Request> {
    prompts()
        .into_iter()
        .map(|p| {
            let mut r = Request::new(Prompt::Tokens(p), max_tokens);
            r.ignore_eos = true;
            r
        })
        .collect()
}

fn counts(outcomes: &[Outcome]) -> SpecCounts {
    let mut total = SpecCounts::default();
    for o in outcomes {
        let s = o.summary.as_ref().expect("finished").speculation;
        total.drafted += s.drafted;
        total.accepted += s.accepted;
        total.verifications += s.verifications;
    }
    total
}

fn assert_idle_and_clean(core: &EngineCore) {
    let st = core.stats();
    assert_eq!(st.running + st.waiting, 0);
    assert_eq!(
        st.free_blocks, st.num_blocks,
        "every target block is free (cached ones count as free)"
    );
    assert_eq!(st.draft_blocks, 0, "the drafter holds no blocks when idle");
}

#[test]
fn greedy_with_every_drafter_gives_exactly_the_plain_tokens() {
    let target = write_model(11);
    let other = write_model(12);
    let plain = run(&mut engine(target.path()), greedy_requests(48));
    let drafters: Vec<(&str, Box<dyn Drafter>)> = vec![
        ("ngram", Box::new(NgramDrafter::default())),
        ("self", draft_model(target.path(), None, target.path())),
        (
            "first layer",
            draft_model(target.path(), Some(1), target.path()),
        ),
        ("unrelated", draft_model(other.path(), None, target.path())),
    ];
    for (name, drafter) in drafters {
        let mut core = engine(target.path());
        core.enable_speculation(drafter, spec_config(4))
            .expect("on");
        let out = run(&mut core, greedy_requests(48));
        for (i, (a, b)) in plain.iter().zip(&out).enumerate() {
            assert_eq!(a.tokens, b.tokens, "{name}: request {i} differs");
        }
        let c = counts(&out);
        assert_eq!(c, core.stats().speculation, "{name}: per-request sums");
        eprintln!(
            "{name}: drafted {} accepted {} rate {:.2} mean accepted {:.2}",
            c.drafted,
            c.accepted,
            c.acceptance_rate(),
            c.mean_accepted_len()
        );
        assert!(c.drafted > 0, "{name}: nothing drafted");
        if name == "self" {
            assert_eq!(c.accepted, c.drafted, "the target agrees with itself");
        }
        assert_idle_and_clean(&core);
    }
}

#[test]
fn logprobs_and_stop_tokens_match_plain_decoding() {
    let target = write_model(11);
    let mut plain_core = engine(target.path());
    let probe = run(&mut plain_core, greedy_requests(24));
    let with = |core: &mut EngineCore| {
        let reqs = prompts()
            .into_iter()
            .zip(&probe)
            .map(|(p, o)| {
                let mut r = Request::new(Prompt::Tokens(p), 24);
                r.ignore_eos = true;
                r.sampling.logprobs = Some(2);
                // Stop part-way, inside what a verification step emits.
                r.stop_token_ids = vec![o.tokens[9]];
                r
            })
            .collect();
        run(core, reqs)
    };
    let plain = with(&mut engine(target.path()));
    let mut core = engine(target.path());
    core.enable_speculation(
        draft_model(target.path(), None, target.path()),
        spec_config(4),
    )
    .expect("on");
    let spec = with(&mut core);
    for (a, b) in plain.iter().zip(&spec) {
        assert_eq!(a.tokens, b.tokens);
        assert!(a.tokens.len() <= 10, "stopped at the stop token");
        assert_eq!(a.logprobs.len(), b.logprobs.len());
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert_eq!(x.token, y.token);
            assert!((x.logprob - y.logprob).abs() < 1e-4, "{x:?} vs {y:?}");
            assert_eq!(x.top.len(), y.top.len());
        }
    }
    assert!(core.stats().speculation.accepted > 0);
    assert_idle_and_clean(&core);
}

#[test]
fn a_large_batch_does_not_speculate_and_a_small_one_does() {
    let target = write_model(11);
    let batch = |n: usize| {
        let mut core = engine(target.path());
        let config = SpeculativeConfig {
            max_batch_rows: 8,
            ..spec_config(4)
        };
        core.enable_speculation(draft_model(target.path(), None, target.path()), config)
            .expect("on");
        let reqs = (0..n)
            .map(|i| {
                let mut r = Request::new(Prompt::Tokens(vec![1 + i as u32, 2, 3]), 16);
                r.ignore_eos = true;
                r
            })
            .collect();
        run(&mut core, reqs);
        core.stats().speculation
    };
    // 8 decoding sequences fill the 8 rows: no room for drafts.
    assert_eq!(batch(8).drafted, 0);
    // 2 sequences get up to 3 drafts each (8 / 2 - 1).
    let small = batch(2);
    assert!(small.drafted > 0);
    assert!(small.drafted <= 3 * small.verifications);
}

#[test]
fn adaptive_k_drafts_when_drafts_are_cheap_and_probes_when_they_are_not() {
    let target = write_model(11);
    let adaptive = SpeculativeConfig {
        adaptive: true,
        ..spec_config(4)
    };
    // Prompt lookup costs nothing: a looping prompt gets full drafts.
    let mut core = engine(target.path());
    core.enable_speculation(Box::new(NgramDrafter::default()), adaptive.clone())
        .expect("on");
    let ngram = counts(&run(&mut core, greedy_requests(64)));
    eprintln!("ngram, adaptive: {ngram:?}");
    assert!(ngram.drafted > 3 * ngram.verifications, "{ngram:?}");
    // The target as its own draft costs a whole step per token: adaptive
    // k keeps it off except for its periodic one-token probes.
    let mut core = engine(target.path());
    core.enable_speculation(draft_model(target.path(), None, target.path()), adaptive)
        .expect("on");
    let costly = counts(&run(&mut core, greedy_requests(64)));
    assert!(costly.drafted > 0, "probes run");
    assert_eq!(
        costly.drafted, costly.verifications,
        "one-token probes only"
    );
    assert!(costly.verifications <= 5 * 64 / 16, "{costly:?}");
}

#[test]
fn aborting_a_speculating_request_frees_both_pools() {
    let target = write_model(11);
    let mut core = engine(target.path());
    core.enable_speculation(
        draft_model(target.path(), Some(1), target.path()),
        spec_config(4),
    )
    .expect("on");
    let mut rxs = Vec::new();
    for (i, p) in prompts().into_iter().enumerate() {
        let mut r = Request::new(Prompt::Tokens(p), 200);
        r.ignore_eos = true;
        let (tx, rx) = unbounded_channel();
        core.add_request(i as u64, r, tx).expect("valid");
        rxs.push(rx);
    }
    for _ in 0..6 {
        core.step();
        core.check_accounting().expect("books");
    }
    assert!(core.stats().speculation.drafted > 0, "speculation ran");
    assert!(core.stats().draft_blocks > 0, "the draft pool is in use");
    for i in 0..rxs.len() {
        core.abort(i as u64);
    }
    core.check_accounting().expect("books");
    assert_idle_and_clean(&core);
}

#[test]
fn sampled_requests_speculate_and_finish_with_the_requested_lengths() {
    let target = write_model(11);
    let mut core = engine(target.path());
    core.enable_speculation(
        draft_model(target.path(), Some(1), target.path()),
        spec_config(3),
    )
    .expect("on");
    let reqs = (0..8)
        .map(|i| {
            let mut r = Request::new(Prompt::Tokens(vec![9, 8, 7, i]), 30);
            r.ignore_eos = true;
            r.sampling = SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                seed: Some(u64::from(i)),
                ..SamplingParams::default()
            };
            r
        })
        .collect();
    let out = run(&mut core, reqs);
    let mut lengths = HashMap::new();
    for o in &out {
        *lengths.entry(o.tokens.len()).or_insert(0) += 1;
    }
    assert_eq!(lengths, HashMap::from([(30, 8)]), "exactly max_tokens each");
    let c = core.stats().speculation;
    assert!(c.drafted > 0 && c.accepted > 0, "{c:?}");
    assert_idle_and_clean(&core);
}

#[test]
fn bad_speculation_settings_are_refused() {
    let target = write_model(11);
    let other = tempfile::tempdir().expect("tempdir");
    synth::SynthConfig {
        vocab_size: 300,
        ..synth::preset("tiny").expect("preset")
    }
    .write(other.path(), 1, DType::F32)
    .expect("write");
    let target_cfg = Model::load(target.path()).expect("load").config().clone();
    let backend = CpuBackend::new(Model::load(other.path()).expect("load"), 16, 64);
    let err = DraftModelDrafter::new(Box::new(backend), &target_cfg).expect_err("vocab mismatch");
    assert!(err.to_string().contains("vocabulary"), "{err}");
    let mut core = engine(target.path());
    let err = core
        .enable_speculation(Box::new(NgramDrafter::default()), spec_config(0))
        .expect_err("k = 0");
    assert!(err.to_string().contains("num_speculative_tokens"), "{err}");
    assert!(core.speculation().is_none());
}
