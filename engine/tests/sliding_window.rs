//! Sliding-window layers free their blocks (vLLM's hybrid allocator): a
//! Gemma-3-shaped model — five sliding-window layers to one global, window
//! 128 — serving 4k-token sequences. The blocks a sequence holds stay within
//! the global layers' whole sequence plus the windowed layers' windows, the
//! tokens are those of a cache that frees nothing, the freed blocks serve
//! another request at the same time, and the prefix cache still hits.
//! Every step checks the block books.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;
use tandem_engine::serving::{
    EngineConfig, EngineCore, KvPoolSize, Prompt, Request, RequestEvent, Usage,
};
use tandem_engine::{Model, SamplingParams};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

const LAYERS: usize = 6;
const WINDOW: usize = 128;
const BS: usize = 16;
const H: usize = 64;
const HEADS: usize = 4;
const KV: usize = 2;
const D: usize = 16;
const VOCAB: usize = 128;
const PROMPT: usize = 4000;
const OUTPUT: usize = 96;

/// A random Gemma 3 text checkpoint: layers 0-4 slide, layer 5 is global.
fn write_gemma3(dir: &Path) {
    let types: Vec<&str> = (0..LAYERS)
        .map(|l| match l % 6 {
            5 => "full_attention",
            _ => "sliding_attention",
        })
        .collect();
    let config = json!({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": H, "intermediate_size": H, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": D,
        "vocab_size": VOCAB, "max_position_embeddings": 8192, "sliding_window": WINDOW,
        "layer_types": types, "query_pre_attn_scalar": 24, "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true,
        "bos_token_id": 1, "eos_token_id": 2,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config.json");
    let (q, kv) = (HEADS * D, KV * D);
    let mut shapes = vec![
        ("model.embed_tokens.weight".to_string(), vec![VOCAB, H]),
        ("model.norm.weight".to_string(), vec![H]),
    ];
    for l in 0..LAYERS {
        let p = |s: &str| format!("model.layers.{l}.{s}.weight");
        for norm in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ] {
            shapes.push((p(norm), vec![H]));
        }
        shapes.push((p("self_attn.q_norm"), vec![D]));
        shapes.push((p("self_attn.k_norm"), vec![D]));
        shapes.push((p("self_attn.q_proj"), vec![q, H]));
        shapes.push((p("self_attn.k_proj"), vec![kv, H]));
        shapes.push((p("self_attn.v_proj"), vec![kv, H]));
        shapes.push((p("self_attn.o_proj"), vec![H, q]));
        shapes.push((p("mlp.gate_proj"), vec![H, H]));
        shapes.push((p("mlp.up_proj"), vec![H, H]));
        shapes.push((p("mlp.down_proj"), vec![H, H]));
    }
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let buffers: Vec<(String, Vec<usize>, Vec<u8>)> = shapes
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let bytes = (0..n)
                .flat_map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    // Uniform in ±0.4: weights large enough that greedy
                    // tokens depend on the whole context.
                    let u = (state >> 40) as f32 / (1u64 << 24) as f32;
                    ((u - 0.5) * 0.8).to_le_bytes()
                })
                .collect();
            (name, shape, bytes)
        })
        .collect();
    let views: BTreeMap<String, TensorView<'_>> = buffers
        .iter()
        .map(|(name, shape, bytes)| {
            let view = TensorView::new(Dtype::F32, shape.clone(), bytes).expect("view");
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(&views, None, &dir.join("model.safetensors"))
        .expect("safetensors");
}

fn prompt(seed: u64) -> Vec<u32> {
    let mut state = seed;
    (0..PROMPT)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            3 + (state >> 33) as u32 % (VOCAB as u32 - 3)
        })
        .collect()
}

fn request(prompt: Vec<u32>) -> Request {
    let mut r = Request::new(Prompt::Tokens(prompt), OUTPUT);
    r.sampling = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    r.ignore_eos = true;
    r
}

/// Drives an engine step by step, collecting tokens and checking books.
struct Driver {
    core: EngineCore,
    streams: Vec<(u64, UnboundedReceiver<RequestEvent>)>,
    tokens: BTreeMap<u64, Vec<u32>>,
    usage: BTreeMap<u64, Usage>,
    next: u64,
}

impl Driver {
    fn new(dir: &Path, pool_blocks: usize, keep_windowed_blocks: bool) -> Self {
        let config = EngineConfig {
            kv_pool: KvPoolSize::Blocks(pool_blocks),
            block_size: BS,
            max_num_batched_tokens: 256,
            matmul: tandem_engine::kernels::MatmulPolicy::BatchInvariant,
            keep_windowed_blocks,
            ..EngineConfig::default()
        };
        let model = Model::load(dir).expect("load");
        let core = EngineCore::new(model, None, vec![], &config).expect("core");
        Self {
            core,
            streams: Vec::new(),
            tokens: BTreeMap::new(),
            usage: BTreeMap::new(),
            next: 0,
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

    /// One step; returns the blocks referenced after it.
    fn step(&mut self) -> usize {
        self.core.step();
        self.core.check_accounting().expect("block books");
        for (id, rx) in &mut self.streams {
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    RequestEvent::Delta(d) => {
                        self.tokens.entry(*id).or_default().extend(&d.token_ids)
                    }
                    RequestEvent::Finished(s) => {
                        self.usage.insert(*id, s.usage);
                    }
                    RequestEvent::Error(e) => panic!("request {id} failed: {e}"),
                    RequestEvent::RemotePrefill(rp) => panic!("unexpected {rp:?}"),
                    RequestEvent::PromptLogprobs(_) => panic!("unexpected prompt scores"),
                }
            }
        }
        let s = self.core.stats();
        s.num_blocks - s.free_blocks
    }

    fn run(&mut self) {
        for _ in 0..100_000 {
            if !self.core.has_work() {
                let s = self.core.stats();
                assert_eq!(s.free_blocks, s.num_blocks, "blocks leaked: {s:?}");
                return;
            }
            self.step();
        }
        panic!("engine did not finish");
    }

    fn output(&self, id: u64) -> Vec<u32> {
        self.tokens.get(&id).cloned().unwrap_or_default()
    }
}

/// Blocks a sequence of `tokens` may hold between decode steps: the global
/// layer's whole sequence and each windowed layer's window, rounded out to
/// whole blocks (one more for alignment). A block holds one layer here: 5
/// windowed and 1 global layer have no larger common divisor.
fn bound(tokens: usize) -> usize {
    let global_layers = LAYERS / 6;
    let windowed_layers = LAYERS - global_layers;
    global_layers * tokens.div_ceil(BS) + windowed_layers * (WINDOW.div_ceil(BS) + 1)
}

#[test]
fn a_4k_sequence_holds_the_global_layer_and_the_windows_with_the_same_tokens() {
    let tmp = tempfile::tempdir().expect("tempdir");
    write_gemma3(tmp.path());
    let a = prompt(7);

    // Keeping every block, one block holds all six layers.
    let mut keep = Driver::new(tmp.path(), 2 * (PROMPT + OUTPUT).div_ceil(BS), true);
    let id = keep.add(request(a.clone()));
    let mut kept_peak = 0;
    while keep.core.has_work() {
        kept_peak = kept_peak.max(keep.step());
    }
    let reference = keep.output(id);
    assert_eq!(reference.len(), OUTPUT);
    assert_eq!(kept_peak, (PROMPT + OUTPUT - 1).div_ceil(BS));
    // In blocks of one layer, as the freeing cache counts them.
    let kept_peak = kept_peak * LAYERS;

    // A pool smaller than one such sequence without freeing.
    let pool = 900;
    assert!(pool < kept_peak);
    let mut free = Driver::new(tmp.path(), pool, false);
    let id = free.add(request(a.clone()));
    let mut decode_peak = 0;
    while free.core.has_work() {
        let held = free.step();
        let out = free.output(id).len();
        // From the first decode step on (the step before ran the prompt's
        // last chunk, whose window reached back further).
        if out > 1 {
            let tokens = PROMPT + out - 1;
            assert!(
                held <= bound(tokens),
                "{held} blocks held at {tokens} tokens, bound {}",
                bound(tokens)
            );
            decode_peak = decode_peak.max(held);
        }
    }
    assert_eq!(free.output(id), reference, "freeing changed the tokens");
    eprintln!(
        "blocks held at {} tokens: {decode_peak} freeing, {kept_peak} keeping ({:.2}x)",
        PROMPT + OUTPUT - 1,
        kept_peak as f64 / decode_peak as f64
    );
    assert!(decode_peak * 4 < kept_peak, "{decode_peak} vs {kept_peak}");

    // The same prompt again: the global layer's blocks and the windowed
    // layers' last window before the hit come from the prefix cache.
    let again = free.add(request(a));
    free.run();
    assert_eq!(free.output(again), reference);
    let cached = free.usage.get(&again).map_or(0, |u| u.cached_tokens);
    assert!(
        cached >= PROMPT - 2 * WINDOW,
        "only {cached} prompt tokens cached"
    );
}

#[test]
fn blocks_a_window_freed_serve_a_second_4k_request() {
    let tmp = tempfile::tempdir().expect("tempdir");
    write_gemma3(tmp.path());
    let (a, b) = (prompt(7), prompt(8));
    let mut alone = Driver::new(tmp.path(), 2 * (PROMPT + OUTPUT).div_ceil(BS), true);
    let (ia, ib) = (alone.add(request(a.clone())), alone.add(request(b.clone())));
    alone.run();

    // Two sequences in a pool that cannot hold one of them unfreed.
    let pool = 900;
    let mut d = Driver::new(tmp.path(), pool, false);
    let first = d.add(request(a));
    while d.output(first).is_empty() {
        d.step();
    }
    let second = d.add(request(b));
    d.run();
    assert_eq!(d.output(first), alone.output(ia));
    assert_eq!(d.output(second), alone.output(ib));
    assert_eq!(d.core.stats().preemptions, 0, "both fit once windows free");
}

#[test]
fn a_remote_prefill_moves_each_groups_blocks_and_skips_what_left_the_window() {
    use tandem_engine::serving::{CollectedExport, PrefillMode, PrefillPlacement};
    let tmp = tempfile::tempdir().expect("tempdir");
    write_gemma3(tmp.path());
    let long: Vec<u32> = prompt(9)[..1000].to_vec();
    let mut local = Driver::new(tmp.path(), 2000, false);
    let want = local.add(request(long.clone()));
    local.run();

    let mut decode = Driver::new(tmp.path(), 2000, false);
    let mut remote = request(long.clone());
    remote.prefill = PrefillMode::Remote(PrefillPlacement {
        worker: "prefill".into(),
        min_uncached: 16,
    });
    let id = decode.add(remote);
    decode.core.step();
    let rp = match decode.streams[0].1.try_recv() {
        Ok(RequestEvent::RemotePrefill(rp)) => rp,
        other => panic!("expected a remote prefill, got {other:?}"),
    };
    let groups = tandem_engine::KvGroups::of(&decode.core.kv_layout());
    let g = groups.num_groups();
    assert_eq!(g, LAYERS, "one layer per group here");
    assert_eq!(rp.blocks.len(), 999usize.div_ceil(BS) * g);

    // The prefill side runs the prompt in 256-token chunks, freeing its
    // windowed blocks as it goes.
    let mut prefill = Driver::new(tmp.path(), 2000, false);
    let sink = Arc::new(CollectedExport::default());
    let mut export = request(rp.tokens.clone());
    export.max_tokens = None;
    export.prefill = PrefillMode::Export {
        sink: sink.clone(),
        from_block: 0,
    };
    prefill.add(export);
    prefill.run();
    let blocks = sink.take();
    let global_layer = 5;
    let sent = |layer: usize| blocks.iter().filter(|b| b.0 == layer).map(|b| b.1).max();
    assert_eq!(sent(global_layer), Some(62));
    // A windowed layer sends only what the decode side's next token reads:
    // position 999 reads from 872 on, logical blocks 54..63.
    let windowed: Vec<usize> = blocks.iter().filter(|b| b.0 == 0).map(|b| b.1).collect();
    assert_eq!(windowed, (54..63).collect::<Vec<_>>());
    assert_eq!(blocks.iter().filter(|b| b.0 == global_layer).count(), 63);

    // A block of another layer group is refused for this layer.
    let other_group = rp.blocks[groups.group(0)];
    let refused = decode.core.write_kv(
        rp.transfer,
        global_layer,
        other_group,
        &blocks[0].2,
        &blocks[0].3,
    );
    assert!(matches!(
        refused,
        Err(tandem_engine::serving::KvWriteError::NotADestination { layer: 5, .. })
    ));

    for (layer, logical, k, v) in &blocks {
        let dst = rp.blocks[logical * g + groups.group(*layer)];
        decode
            .core
            .write_kv(rp.transfer, *layer, dst, k, v)
            .expect("its own group's block");
    }
    decode.core.finish_remote_prefill(rp.transfer, Ok(()));
    // Accepted: one step computes the last prompt token and samples.
    decode.step();
    assert_eq!(decode.output(id).len(), 1, "the transfer was taken whole");
    decode.run();
    assert_eq!(decode.output(id), local.output(want));
}
