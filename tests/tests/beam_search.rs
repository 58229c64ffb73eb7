//! Beam search against transformers, and its block books.
//!
//! Fixtures come from `tests/golden/make_beams.py` (pinned torch and
//! transformers): `generate(num_beams=4, do_sample=False)` on the golden f32
//! checkpoints, with no end-of-sequence token, with one or two picked so
//! that beams end early, and with the `length_penalty` / `early_stopping`
//! variants. The serving engine must return the same hypotheses in the
//! same order with the same scores, with the accounting checked after every
//! step (small blocks, so beams share and copy partial blocks), and every
//! block back in the pool at the end.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tandem_engine::serving::{
    BeamSearch, EarlyStopping, EngineConfig, EngineCore, KvPoolSize, Prompt, Request, RequestEvent,
    TokenDelta,
};
use tandem_engine::{Checkpoint, FinishReason, SamplingParams};

#[derive(Deserialize)]
struct Fixture {
    runs: Vec<Run>,
}

#[derive(Deserialize)]
struct Run {
    case: String,
    prompt_ids: Vec<u32>,
    num_beams: usize,
    max_new_tokens: usize,
    eos: Option<Vec<u32>>,
    n: usize,
    length_penalty: f32,
    early_stopping: serde_json::Value,
    beams: Vec<Hypothesis>,
}

#[derive(Deserialize)]
struct Hypothesis {
    tokens: Vec<u32>,
    score: f32,
}

const TOLERANCE: f32 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/golden")
}

fn runs() -> Vec<Run> {
    let text = std::fs::read_to_string(fixtures().join("beams.json")).expect("beams.json");
    serde_json::from_str::<Fixture>(&text)
        .expect("beams.json parses")
        .runs
}

fn early_stopping(v: &serde_json::Value) -> EarlyStopping {
    match v {
        serde_json::Value::Bool(false) => EarlyStopping::Heuristic,
        serde_json::Value::Bool(true) => EarlyStopping::WhenFull,
        serde_json::Value::String(s) if s == "never" => EarlyStopping::Never,
        other => panic!("early_stopping {other}"),
    }
}

/// What a search returned and cost.
struct Searched {
    /// (tokens, summed logprob, finish) per hypothesis, best first.
    /// Transformers' score is that sum over `len ^ length_penalty`.
    beams: Vec<(Vec<u32>, f32, FinishReason)>,
    /// Most blocks in use after any step.
    peak_blocks: usize,
    preemptions: u64,
}

/// The engine's search for `run` over a pool of `blocks` blocks.
fn engine_beams(run: &Run, block_size: usize, blocks: usize) -> Searched {
    let ckpt = Checkpoint::open(&fixtures().join(&run.case)).expect("checkpoint");
    let config = EngineConfig {
        block_size,
        kv_pool: KvPoolSize::Blocks(blocks),
        enable_prefix_caching: true,
        ..EngineConfig::default()
    };
    let eos = run.eos.clone().unwrap_or_default();
    let mut core = EngineCore::new(ckpt.model, None, eos, &config).expect("engine");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut req = Request::new(Prompt::Tokens(run.prompt_ids.clone()), run.max_new_tokens);
    req.n = run.n;
    req.sampling = SamplingParams {
        logprobs: Some(0),
        ..SamplingParams::default()
    };
    req.beam = Some(BeamSearch {
        width: run.num_beams,
        length_penalty: run.length_penalty,
        early_stopping: early_stopping(&run.early_stopping),
    });
    core.add_request(1, req, tx).expect("valid");
    let mut steps = 0;
    let mut peak_blocks = 0;
    while core.has_work() {
        core.step();
        core.check_accounting().expect("block books");
        let s = core.stats();
        peak_blocks = peak_blocks.max(s.num_blocks - s.free_blocks);
        steps += 1;
        assert!(steps < 1000, "the search ends");
    }
    let stats = core.stats();
    assert_eq!(
        stats.free_blocks, stats.num_blocks,
        "{}: every block is back in the pool",
        run.case
    );
    let mut deltas: Vec<TokenDelta> = Vec::new();
    let mut finished = false;
    while let Ok(ev) = rx.try_recv() {
        match ev {
            RequestEvent::Delta(d) => deltas.push(d),
            RequestEvent::Finished(s) => {
                assert_eq!(s.choices.len(), run.n);
                finished = true;
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    assert!(finished);
    deltas.sort_by_key(|d| d.index);
    let beams = deltas
        .into_iter()
        .map(|d| {
            let sum = d.logprobs.iter().map(|l| l.logprob).sum::<f32>();
            assert_eq!(d.logprobs.len(), d.token_ids.len());
            (
                d.token_ids,
                sum,
                d.finish_reason.expect("one delta per choice"),
            )
        })
        .collect();
    Searched {
        beams,
        peak_blocks,
        preemptions: stats.preemptions,
    }
}

/// Checks `got` against transformers' hypotheses; the worst per-token
/// difference of the summed logprobs.
fn check(run: &Run, got: &Searched) -> f32 {
    let label = format!(
        "{} eos {:?} n {} lp {} es {}",
        run.case, run.eos, run.n, run.length_penalty, run.early_stopping
    );
    assert_eq!(got.beams.len(), run.beams.len(), "{label}");
    let mut worst = 0.0f32;
    for (i, ((tokens, sum, finish), want)) in got.beams.iter().zip(&run.beams).enumerate() {
        assert_eq!(tokens, &want.tokens, "{label}: hypothesis {i}");
        let norm = (tokens.len() as f64).powf(f64::from(run.length_penalty)) as f32;
        // Per token: the summed logprob's error grows with the length.
        let d = (sum - want.score * norm).abs() / tokens.len() as f32;
        assert!(
            d < TOLERANCE,
            "{label}: hypothesis {i} score |Δ| {d} per token"
        );
        worst = worst.max(d);
        let stopped = run
            .eos
            .as_ref()
            .is_some_and(|e| tokens.last().is_some_and(|t| e.contains(t)));
        let want_finish = if stopped {
            FinishReason::Stop
        } else {
            FinishReason::Length
        };
        assert_eq!(*finish, want_finish, "{label}: hypothesis {i}");
    }
    worst
}

#[test]
fn beam_search_matches_transformers() {
    let runs = runs();
    assert!(runs.len() >= 20);
    let mut worst = 0.0f32;
    for run in &runs {
        // Blocks of 4: beams fork inside partial blocks and copy them.
        worst = worst.max(check(run, &engine_beams(run, 4, 256)));
    }
    eprintln!(
        "{} runs, summed logprob max |Δ| {worst:.2e} per token",
        runs.len()
    );
}

/// Beams hold their common prefix once: at their peak, four beams of a
/// 12-token prompt plus 20 tokens in blocks of 4 use far fewer blocks than
/// four separate sequences (4 × 8).
#[test]
fn beams_share_their_prefix_blocks() {
    let runs = runs();
    let run = runs
        .iter()
        .find(|r| r.eos.is_none() && r.case == "llama_gqa_f32")
        .expect("a run without eos");
    let got = engine_beams(run, 4, 256);
    check(run, &got);
    let per_seq = (run.prompt_ids.len() + run.max_new_tokens).div_ceil(4);
    let separate = run.num_beams * per_seq;
    eprintln!(
        "peak {} blocks for {} beams; {separate} without sharing",
        got.peak_blocks, run.num_beams
    );
    // The prompt's 3 blocks are held once, not four times.
    assert!(
        got.peak_blocks <= separate - 3 * (run.num_beams - 1),
        "peak {} blocks, {separate} without sharing",
        got.peak_blocks
    );
}

/// A pool too small for every beam at once: beams are preempted (an idle
/// beam, its row in, makes room for a sibling) and computed again, and the
/// search returns the same hypotheses.
#[test]
fn beams_survive_preemption_in_a_small_pool() {
    let runs = runs();
    // Models without sliding-window layers: a windowed model's recompute
    // needs every window's blocks at once, more than this pool has.
    let cases = ["llama_gqa_f32", "qwen3_gqa_f32", "mixtral_top2_f32"];
    for run in runs
        .iter()
        .filter(|r| r.eos.is_none() && cases.contains(&r.case.as_str()))
    {
        // One sequence of 32 tokens needs 8 blocks; four up to 32.
        let got = engine_beams(run, 4, 9);
        check(run, &got);
        eprintln!("{}: {} preemptions", run.case, got.preemptions);
        assert!(
            got.preemptions > 0,
            "{}: the pool forces preemption",
            run.case
        );
        assert!(got.peak_blocks <= 9);
    }
}

/// An aborted search frees every beam's blocks and ends each choice with
/// an abort finish; refused settings name their field.
#[test]
fn an_aborted_search_frees_its_beams_and_bad_settings_are_refused() {
    let ckpt = Checkpoint::open(&fixtures().join("llama_gqa_f32")).expect("checkpoint");
    let config = EngineConfig {
        block_size: 4,
        kv_pool: KvPoolSize::Blocks(64),
        ..EngineConfig::default()
    };
    let mut core = EngineCore::new(ckpt.model, None, vec![], &config).expect("engine");
    let beam_request = |n: usize, width: usize| {
        let mut req = Request::new(Prompt::Tokens(vec![5, 6, 7, 8, 9]), 30);
        req.n = n;
        req.beam = Some(BeamSearch::new(width));
        req
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    core.add_request(1, beam_request(2, 4), tx).expect("valid");
    for _ in 0..6 {
        core.step();
        core.check_accounting().expect("block books");
    }
    assert_eq!(core.stats().running, 4, "four beams run");
    core.abort(1);
    core.check_accounting().expect("block books");
    let s = core.stats();
    assert_eq!(s.free_blocks, s.num_blocks);
    assert!(!core.has_work());
    let mut aborted = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        match ev {
            RequestEvent::Delta(d) => {
                assert!(d.token_ids.is_empty(), "nothing streams before the end");
                assert_eq!(d.finish_reason, Some(FinishReason::Abort));
                aborted.push(d.index);
            }
            RequestEvent::Finished(s) => assert_eq!(s.choices.len(), 2),
            other => panic!("unexpected event {other:?}"),
        }
    }
    assert_eq!(aborted, [0, 1]);

    let mut refused = |req: Request, field: &str| {
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let err = core
            .add_request(9, req, tx)
            .expect_err("refused")
            .to_string();
        assert!(err.contains(&format!("{field}: ")), "{field}: {err}");
    };
    refused(beam_request(3, 2), "best_of");
    let mut hot = beam_request(1, 2);
    hot.sampling.temperature = 0.7;
    refused(hot, "temperature");
    let mut stop = beam_request(1, 2);
    stop.stop = vec!["x".into()];
    refused(stop, "stop");
}
