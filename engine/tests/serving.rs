//! The serving engine: batch invariance under chunking and preemption, the
//! prefix cache, parallel sampling, stop strings, aborts and validation.
//! Every test checks the block books after every step.

use std::collections::HashMap;
use std::sync::Arc;

use tandem_engine::kernels::MatmulPolicy;
use tandem_engine::serving::{
    EngineConfig, EngineCore, KvPoolSize, Prompt, Request, RequestEvent, RequestSummary,
    StepTimeLimit,
};
use tandem_engine::{synth, Checkpoint, DType, EngineError, FinishReason, SamplingParams};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// A tiny random checkpoint with room for long prompts.
fn checkpoint(max_positions: usize) -> (tempfile::TempDir, Checkpoint) {
    checkpoint_in(max_positions, DType::F32)
}

fn checkpoint_in(max_positions: usize, dtype: DType) -> (tempfile::TempDir, Checkpoint) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cfg = synth::SynthConfig {
        max_position_embeddings: max_positions,
        ..synth::preset("tiny").expect("preset")
    };
    cfg.write(tmp.path(), 11, dtype).expect("write");
    let ck = Checkpoint::open(tmp.path()).expect("open");
    (tmp, ck)
}

fn core(ck: &Checkpoint, config: &EngineConfig) -> EngineCore {
    let model = tandem_engine::Model::load(&ck.dir).expect("load");
    let tok = tandem_engine::tokenizer::Tokenizer::from_file(&ck.dir.join("tokenizer.json"))
        .expect("tokenizer");
    EngineCore::new(model, Some(Arc::new(tok)), ck.eos_token_ids.clone(), config).expect("core")
}

/// What one request produced: tokens per choice, then the summary.
#[derive(Debug, Default)]
struct Outcome {
    tokens: HashMap<u32, Vec<u32>>,
    text: HashMap<u32, String>,
    finish: HashMap<u32, FinishReason>,
    summary: Option<RequestSummary>,
}

struct Driver {
    core: EngineCore,
    streams: Vec<(u64, UnboundedReceiver<RequestEvent>)>,
    outcomes: HashMap<u64, Outcome>,
    next: u64,
    steps: usize,
}

impl Driver {
    fn new(core: EngineCore) -> Self {
        Self {
            core,
            streams: Vec::new(),
            outcomes: HashMap::new(),
            next: 0,
            steps: 0,
        }
    }

    fn add(&mut self, req: Request) -> u64 {
        let id = self.next;
        self.next += 1;
        let (tx, rx) = unbounded_channel();
        self.core.add_request(id, req, tx).expect("valid request");
        self.streams.push((id, rx));
        id
    }

    fn step(&mut self) {
        self.core.step();
        self.steps += 1;
        if let Err(e) = self.core.check_accounting() {
            panic!("block accounting broken after step {}: {e}", self.steps);
        }
        for (id, rx) in &mut self.streams {
            while let Ok(ev) = rx.try_recv() {
                let o = self.outcomes.entry(*id).or_default();
                match ev {
                    RequestEvent::Delta(d) => {
                        o.tokens.entry(d.index).or_default().extend(&d.token_ids);
                        o.text.entry(d.index).or_default().push_str(&d.text);
                        if let Some(f) = d.finish_reason {
                            o.finish.insert(d.index, f);
                        }
                    }
                    RequestEvent::Finished(s) => o.summary = Some(s),
                    RequestEvent::Error(e) => panic!("request {id} failed: {e}"),
                    RequestEvent::RemotePrefill(rp) => panic!("unexpected {rp:?}"),
                    RequestEvent::PromptLogprobs(_) => panic!("unexpected prompt scores"),
                }
            }
        }
    }

    fn run(&mut self) {
        let limit = self.steps + 100_000;
        while self.core.has_work() {
            assert!(self.steps < limit, "engine did not finish");
            self.step();
        }
    }

    fn assert_all_free(&self) {
        let s = self.core.stats();
        assert_eq!(s.free_blocks, s.num_blocks, "blocks leaked: {s:?}");
        assert_eq!(s.running + s.waiting, 0);
    }
}

/// A deterministic mixed workload: prompt lengths 1..=200 (half of them
/// behind a shared 64-token prefix), outputs of 1..=48 tokens.
fn workload(count: usize) -> Vec<Request> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = |m: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % m
    };
    let shared: Vec<u32> = (0..64).map(|i| (i * 37 % 251) as u32).collect();
    (0..count)
        .map(|i| {
            let len = 1 + next(200) as usize;
            let mut prompt: Vec<u32> = if i % 2 == 0 { shared.clone() } else { vec![] };
            prompt.extend((0..len).map(|_| next(256) as u32));
            let mut r = Request::new(Prompt::Tokens(prompt), 1 + next(48) as usize);
            r.request_id = format!("req-{i}");
            r
        })
        .collect()
}

fn tokens_alone(ck: &Checkpoint, reqs: &[Request], matmul: MatmulPolicy) -> Vec<Vec<u32>> {
    let config = EngineConfig {
        matmul,
        enable_prefix_caching: false,
        ..EngineConfig::default()
    };
    reqs.iter()
        .map(|r| {
            let mut d = Driver::new(core(ck, &config));
            let id = d.add(r.clone());
            d.run();
            d.outcomes
                .remove(&id)
                .expect("outcome")
                .tokens
                .remove(&0)
                .expect("tokens")
        })
        .collect()
}

fn tokens_together(
    ck: &Checkpoint,
    reqs: &[Request],
    config: &EngineConfig,
) -> (Vec<Vec<u32>>, Driver) {
    let mut d = Driver::new(core(ck, config));
    let ids: Vec<u64> = reqs.iter().map(|r| d.add(r.clone())).collect();
    d.run();
    d.assert_all_free();
    let out = ids
        .iter()
        .map(|id| {
            let o = d.outcomes.get_mut(id).expect("outcome");
            assert!(o.summary.is_some(), "request {id} has no summary");
            o.tokens.remove(&0).expect("tokens")
        })
        .collect();
    (out, d)
}

#[test]
fn batching_chunking_and_preemption_do_not_change_greedy_tokens() {
    let (_tmp, ck) = checkpoint(512);
    let reqs = workload(64);
    let alone = tokens_alone(&ck, &reqs, MatmulPolicy::BatchInvariant);

    let batched = EngineConfig {
        matmul: MatmulPolicy::BatchInvariant,
        ..EngineConfig::default()
    };
    let (together, d) = tokens_together(&ck, &reqs, &batched);
    assert!(
        d.core.stats().prefix.hit_blocks > 0,
        "the shared prefix was reused"
    );
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, b, "request {i} differs when batched");
    }

    // 32-token chunks and a pool of 48 blocks (768 tokens) for 64 requests
    // of up to 312 tokens: chunked prefill and preemption by recompute.
    let tight = EngineConfig {
        matmul: MatmulPolicy::BatchInvariant,
        max_prefill_chunk: Some(32),
        max_num_batched_tokens: 256,
        kv_pool: KvPoolSize::Blocks(48),
        ..EngineConfig::default()
    };
    let (together, d) = tokens_together(&ck, &reqs, &tight);
    let stats = d.core.stats();
    assert!(
        stats.preemptions > 0,
        "the pool was meant to force preemption: {stats:?}"
    );
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, b, "request {i} differs under chunking and preemption");
    }
}

/// bf16 activations on a bf16 checkpoint, where the CPU runs them: every
/// request's greedy tokens are the same batched (prefills past the GEMM's
/// 48 rows, a shared prefix) and chunked as alone, since the kernel sums
/// each output in one order at every batch size.
#[test]
fn bf16_activations_do_not_change_greedy_tokens_with_the_batch() {
    if !MatmulPolicy::Bf16Activations.runs_here() {
        eprintln!("skipped: this CPU has no AVX512-BF16");
        return;
    }
    let (_tmp, ck) = checkpoint_in(512, DType::Bf16);
    let reqs = workload(24);
    let alone = tokens_alone(&ck, &reqs, MatmulPolicy::Bf16Activations);
    let chunked = EngineConfig {
        matmul: MatmulPolicy::Bf16Activations,
        max_prefill_chunk: Some(96),
        ..EngineConfig::default()
    };
    let (together, _) = tokens_together(&ck, &reqs, &chunked);
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, b, "request {i} differs when batched");
    }
}

/// A long prompt arriving while another request decodes, stepped by hand:
/// the most tokens any step computed while the prompt was prefilling, and
/// both requests' tokens.
fn prompt_beside_a_decode(
    ck: &Checkpoint,
    limit: StepTimeLimit,
) -> (usize, Vec<Vec<u32>>, Vec<Request>) {
    let config = EngineConfig {
        matmul: MatmulPolicy::BatchInvariant,
        max_step_time: limit,
        ..EngineConfig::default()
    };
    let mut d = Driver::new(core(ck, &config));
    let mut decoding = Request::new(Prompt::Tokens(vec![3, 1, 4, 1, 5]), 100);
    decoding.ignore_eos = true;
    let long = Request::new(Prompt::Tokens((0..300).map(|i| i * 7 % 256).collect()), 4);
    let a = d.add(decoding.clone());
    d.step();
    d.step();
    let b = d.add(long.clone());
    let mut widest = 0;
    while d.outcomes.get(&b).is_none_or(|o| o.tokens.is_empty()) {
        let before = d.core.stats().computed_tokens;
        d.step();
        widest = widest.max((d.core.stats().computed_tokens - before) as usize);
        assert!(d.steps < 1000, "the long prompt never finished");
    }
    d.run();
    d.assert_all_free();
    let tokens = [a, b].map(|id| d.outcomes[&id].tokens[&0].clone());
    (widest, tokens.to_vec(), vec![decoding, long])
}

#[test]
fn a_step_time_limit_chunks_prefill_beside_decodes_and_keeps_tokens() {
    let (_tmp, ck) = checkpoint(512);
    // Without a limit the whole prompt joins the decode's step.
    let (widest, _, _) = prompt_beside_a_decode(&ck, StepTimeLimit::Off);
    assert_eq!(widest, 301);
    // A bound no step can meet: the first chunk while the cost line is
    // unknown (32 tokens), then the progress floor (8), beside one decode.
    let (widest, tokens, reqs) = prompt_beside_a_decode(
        &ck,
        StepTimeLimit::Fixed(std::time::Duration::from_nanos(1)),
    );
    assert!((9..=33).contains(&widest), "widest step {widest}");
    assert_eq!(
        tokens,
        tokens_alone(&ck, &reqs, MatmulPolicy::BatchInvariant),
        "chunking changed tokens"
    );
}

#[test]
fn a_shared_512_token_prefix_is_served_from_the_cache() {
    let (_tmp, ck) = checkpoint(1024);
    let mut d = Driver::new(core(&ck, &EngineConfig::default()));
    let prefix: Vec<u32> = (0..512).map(|i| (i * 13 % 256) as u32).collect();
    let with_suffix = |s: u32| {
        let mut p = prefix.clone();
        p.extend([s, s + 1, s + 2]);
        Request::new(Prompt::Tokens(p), 4)
    };
    let first = d.add(with_suffix(1));
    d.run();
    let second = d.add(with_suffix(7));
    d.run();
    fn usage(d: &Driver, id: u64) -> tandem_engine::serving::Usage {
        d.outcomes[&id].summary.as_ref().expect("summary").usage
    }
    assert_eq!(usage(&d, first).cached_tokens, 0);
    assert_eq!(usage(&d, second).prompt_tokens, 515);
    assert!(
        usage(&d, second).cached_tokens >= 496,
        "{:?}",
        usage(&d, second)
    );
    d.assert_all_free();

    // A prompt that is entirely cached still computes its last block.
    let again = d.add(Request::new(Prompt::Tokens(prefix.clone()), 2));
    d.run();
    assert_eq!(usage(&d, again).cached_tokens, 496);
}

#[test]
fn parallel_samples_share_the_prompt_and_match_single_requests() {
    let (_tmp, ck) = checkpoint(512);
    let config = EngineConfig {
        matmul: MatmulPolicy::BatchInvariant,
        ..EngineConfig::default()
    };
    let prompt: Vec<u32> = (0..21).map(|i| i * 5 % 256).collect(); // partial last block
    let sampled = |n: usize, seed: u64| {
        let mut r = Request::new(Prompt::Tokens(prompt.clone()), 12);
        r.n = n;
        r.ignore_eos = true;
        r.sampling = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..SamplingParams::default()
        };
        r
    };
    let mut d = Driver::new(core(&ck, &config));
    let id = d.add(sampled(4, 100));
    d.run();
    d.assert_all_free();
    let o = d.outcomes.remove(&id).expect("outcome");
    let summary = o.summary.expect("summary");
    assert_eq!(summary.choices.len(), 4);
    assert_eq!(summary.usage.completion_tokens, 48);
    for i in 0..4u32 {
        assert_eq!(o.finish[&i], FinishReason::Length);
        // Choice i draws with seed + i, exactly as a lone request would.
        let mut single = Driver::new(core(&ck, &config));
        let sid = single.add(sampled(1, 100 + u64::from(i)));
        single.run();
        assert_eq!(o.tokens[&i], single.outcomes[&sid].tokens[&0], "choice {i}");
    }
}

#[test]
fn stop_strings_cut_the_text_and_end_the_choice() {
    let (_tmp, ck) = checkpoint(512);
    let mut d = Driver::new(core(&ck, &EngineConfig::default()));
    let mut base = Request::new(Prompt::Text("The quick brown fox".into()), 24);
    base.ignore_eos = true;
    let free = d.add(base.clone());
    d.run();
    let full = d.outcomes[&free].text[&0].clone();
    // Pick a stop string from the middle of the unconstrained text.
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 6, "text too short to test: {full:?}");
    let stop: String = chars[3..5].iter().collect();
    let before = &full[..full.find(&stop).expect("present")];
    let mut req = base;
    req.stop = vec![stop.clone()];
    let id = d.add(req);
    d.run();
    let o = &d.outcomes[&id];
    assert_eq!(o.text[&0], before);
    assert_eq!(o.finish[&0], FinishReason::Stop);
    let summary = o.summary.as_ref().expect("summary");
    assert_eq!(
        summary.choices[0].matched_stop.as_deref(),
        Some(stop.as_str())
    );
    d.assert_all_free();
}

#[test]
fn aborts_mid_prefill_and_mid_decode_free_every_block() {
    let (_tmp, ck) = checkpoint(512);
    let config = EngineConfig {
        max_prefill_chunk: Some(32),
        ..EngineConfig::default()
    };
    let mut d = Driver::new(core(&ck, &config));
    let long: Vec<u32> = (0..300).map(|i| i % 256).collect();
    let a = d.add(Request::new(Prompt::Tokens(long.clone()), 50));
    let b = d.add(Request::new(Prompt::Tokens(vec![1, 2, 3]), 50));
    d.step();
    d.step();
    // `a` is mid-prefill (64 of 300 tokens), `b` is decoding.
    let s = d.core.stats();
    assert!(s.free_blocks < s.num_blocks);
    d.core.abort(a);
    d.step();
    assert!(d.outcomes[&b].tokens[&0].len() >= 2, "b is decoding");
    d.core.abort(b);
    d.step();
    d.assert_all_free();
    for id in [a, b] {
        let o = &d.outcomes[&id];
        assert_eq!(o.finish[&0], FinishReason::Abort);
        let summary = o.summary.as_ref().expect("summary");
        assert_eq!(summary.choices[0].finish_reason, FinishReason::Abort);
    }

    // A client that goes away (its receiver dropped) is aborted too.
    let c = d.add(Request::new(Prompt::Tokens(long), 100));
    d.step();
    d.streams.retain(|(id, _)| *id != c);
    d.run();
    d.assert_all_free();
}

#[test]
fn invalid_requests_name_the_field() {
    let (_tmp, ck) = checkpoint(512);
    let mut c = core(&ck, &EngineConfig::default());
    let ok = || Request::new(Prompt::Tokens(vec![1, 2, 3]), 4);
    let cases: Vec<(Request, &str)> = vec![
        (
            Request {
                sampling: SamplingParams {
                    temperature: -1.0,
                    ..SamplingParams::default()
                },
                ..ok()
            },
            "temperature",
        ),
        (
            Request {
                sampling: SamplingParams {
                    top_p: 0.0,
                    ..SamplingParams::default()
                },
                ..ok()
            },
            "top_p",
        ),
        (
            Request {
                sampling: SamplingParams {
                    top_p: 1.5,
                    ..SamplingParams::default()
                },
                ..ok()
            },
            "top_p",
        ),
        (
            Request {
                max_tokens: Some(0),
                ..ok()
            },
            "max_tokens",
        ),
        (Request::new(Prompt::Tokens(vec![]), 4), "prompt"),
        (Request::new(Prompt::Text(String::new()), 4), "prompt"),
        (Request::new(Prompt::Tokens(vec![1; 600]), 4), "prompt"),
        (
            Request::new(Prompt::Tokens(vec![1, 99_999]), 4),
            "token_ids",
        ),
        (
            Request::new(Prompt::Tokens(vec![1; 500]), 100),
            "max_tokens",
        ),
        (Request { n: 0, ..ok() }, "n must"),
    ];
    for (req, field) in cases {
        let (tx, _rx) = unbounded_channel();
        match c.add_request(0, req.clone(), tx) {
            Err(EngineError::InvalidRequest(msg)) => {
                assert!(msg.contains(field), "{msg:?} should name {field}")
            }
            other => panic!("{req:?} gave {other:?}"),
        }
    }
    assert!(!c.has_work());
}

#[test]
fn the_kv_event_feed_follows_the_prefix_cache() {
    use tandem_engine::serving::KvFeed;
    use tandem_engine::CacheEvent;

    let (_tmp, ck) = checkpoint(512);
    let config = EngineConfig {
        kv_pool: KvPoolSize::Blocks(8),
        ..EngineConfig::default()
    };
    let mut d = Driver::new(core(&ck, &config));
    let (tx, mut feed) = tokio::sync::mpsc::channel(64);
    d.core.subscribe_kv_events(tx);
    assert_eq!(
        feed.try_recv().expect("snapshot"),
        KvFeed::Snapshot {
            seq: 0,
            events: vec![],
            digest: tandem_block_hash::SetDigest::default(),
            pool_closed: true,
        }
    );
    let a: Vec<u32> = (0..40).collect();
    d.add(Request::new(Prompt::Tokens(a.clone()), 1));
    d.run();
    let h = tandem_block_hash::block_hashes(&a, 16);
    let mut got = Vec::new();
    let mut digest = None;
    while let Ok(KvFeed::Events {
        events,
        digest: d,
        pool_closed,
    }) = feed.try_recv()
    {
        got.extend(events);
        digest = Some(d);
        assert!(pool_closed, "a chain stored parents first stays closed");
    }
    // Each message says what the set is once it is applied.
    assert_eq!(digest, Some(tandem_block_hash::SetDigest::of(h.clone())));
    assert_eq!(
        got,
        vec![
            (
                1,
                CacheEvent::Stored {
                    parent: 0,
                    hash: h[0]
                }
            ),
            (
                2,
                CacheEvent::Stored {
                    parent: h[0],
                    hash: h[1]
                }
            ),
        ]
    );
    // A prompt that needs the whole pool evicts them.
    let b: Vec<u32> = (100..220).collect();
    d.add(Request::new(Prompt::Tokens(b.clone()), 1));
    d.run();
    let mut removed = Vec::new();
    let mut digest = None;
    while let Ok(KvFeed::Events {
        events,
        digest: d,
        pool_closed,
    }) = feed.try_recv()
    {
        digest = Some(d);
        // The pool evicts a chain's tail first: never a parent before
        // its child.
        assert!(pool_closed);
        for (_, e) in events {
            if let CacheEvent::Removed { hash } = e {
                removed.push(hash);
            }
        }
    }
    removed.sort_unstable();
    let mut want = h.clone();
    want.sort_unstable();
    assert_eq!(removed, want);
    // A late subscriber's snapshot lists b's blocks, parents first.
    let (tx, mut late) = tokio::sync::mpsc::channel(64);
    d.core.subscribe_kv_events(tx);
    let hb = tandem_block_hash::block_hashes(&b, 16);
    match late.try_recv().expect("snapshot") {
        KvFeed::Snapshot {
            events,
            digest: snapshot_digest,
            ..
        } => {
            assert_eq!(
                Some(snapshot_digest),
                digest,
                "the snapshot's set is the one the events built"
            );
            let stored: Vec<(u64, u64)> = events
                .iter()
                .map(|e| match e {
                    CacheEvent::Stored { parent, hash } => (*parent, *hash),
                    other => panic!("a pool snapshot only stores: {other:?}"),
                })
                .collect();
            assert_eq!(stored.len(), hb.len());
            for (i, &hash) in hb.iter().enumerate() {
                let at = stored.iter().position(|s| s.1 == hash).expect("listed");
                if i > 0 {
                    let parent_at = stored
                        .iter()
                        .position(|s| s.1 == hb[i - 1])
                        .expect("parent");
                    assert!(parent_at < at, "parents first");
                    assert_eq!(stored[at].0, hb[i - 1]);
                }
            }
        }
        other => panic!("{other:?}"),
    }
}
