//! Tensor- and pipeline-parallel shards of a model, run as threads joined by
//! channels (an in-process stand-in for the communicator: the real one, with
//! one process per rank, is tested in `tandem-parallel` and the CLI), give
//! the whole model's logits.

mod common;

use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};

use tandem_engine::shard::ShardPeers;
use tandem_engine::{BlockTable, DType, EngineError, KvCache, Model, ModelConfig, SeqInput};

/// Channels between every pair of ranks; rank = stage * tp + tp_rank.
struct ChannelPeers {
    rank: usize,
    tp: usize,
    to: HashMap<usize, Sender<Vec<f32>>>,
    from: HashMap<usize, Receiver<Vec<f32>>>,
}

fn mesh(world: usize, tp: usize) -> Vec<ChannelPeers> {
    let mut peers: Vec<ChannelPeers> = (0..world)
        .map(|rank| ChannelPeers {
            rank,
            tp,
            to: HashMap::new(),
            from: HashMap::new(),
        })
        .collect();
    for a in 0..world {
        for b in 0..world {
            if a != b {
                let (tx, rx) = channel();
                peers[a].to.insert(b, tx);
                peers[b].from.insert(a, rx);
            }
        }
    }
    peers
}

fn lost(e: impl std::fmt::Display) -> EngineError {
    EngineError::Backend {
        device: "test",
        message: e.to_string(),
    }
}

impl ShardPeers for ChannelPeers {
    fn all_reduce(&mut self, buf: &mut [f32]) -> tandem_engine::Result<()> {
        let first = self.rank / self.tp * self.tp;
        let group: Vec<usize> = (first..first + self.tp).collect();
        for &p in group.iter().filter(|&&p| p != self.rank) {
            self.to[&p].send(buf.to_vec()).map_err(lost)?;
        }
        let mut sum = vec![0.0f32; buf.len()];
        for &p in &group {
            let part = if p == self.rank {
                buf.to_vec()
            } else {
                self.from[&p].recv().map_err(lost)?
            };
            for (s, x) in sum.iter_mut().zip(part) {
                *s += x;
            }
        }
        buf.copy_from_slice(&sum);
        Ok(())
    }

    fn recv_activations(&mut self, buf: &mut [f32]) -> tandem_engine::Result<()> {
        let got = self.from[&(self.rank - self.tp)].recv().map_err(lost)?;
        buf.copy_from_slice(&got);
        Ok(())
    }

    fn send_activations(&mut self, buf: &[f32]) -> tandem_engine::Result<()> {
        self.to[&(self.rank + self.tp)]
            .send(buf.to_vec())
            .map_err(lost)
    }
}

fn prompt(seed: u32, n: usize, vocab: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed * 37 + i * 11) % vocab)
        .collect()
}

/// Two steps (a batch of two prompts, then one decode token each) on
/// `tp × pp` ranks; returns the logit rows of the rank that computes them.
fn run_sharded(dir: &std::path::Path, tp: usize, pp: usize) -> Vec<Vec<f32>> {
    run_split(dir, tp, pp, 1)
}

/// As [`run_sharded`], the experts also split into `ep` groups over each
/// stage's `tp` ranks.
fn run_split(dir: &std::path::Path, tp: usize, pp: usize, ep: usize) -> Vec<Vec<f32>> {
    let world = tp * pp;
    let bs = 4;
    let vocab = ModelConfig::from_dir(dir).expect("config").vocab_size as u32;
    let prompts = [prompt(1, 13, vocab), prompt(2, 6, vocab)];
    let results: Vec<Option<Vec<Vec<f32>>>> = std::thread::scope(|s| {
        let handles: Vec<_> = mesh(world, tp)
            .into_iter()
            .map(|mut peers| {
                let prompts = &prompts;
                s.spawn(move || {
                    let (stage, tp_rank) = (peers.rank / tp, peers.rank % tp);
                    let split = tandem_engine::shard::Split {
                        tp,
                        tp_rank,
                        pp,
                        stage,
                        ep,
                    };
                    let model = Model::load_split(dir, split).expect("shard");
                    let mut kv = KvCache::new(model.kv_layout(bs), 32);
                    // Every rank allocates the same block ids, as the leader's
                    // allocator would hand them out.
                    let pool = kv.allocator().expect("pool");
                    let mut tables: Vec<BlockTable> =
                        prompts.iter().map(|_| BlockTable::new(&pool)).collect();
                    let mut out = Vec::new();
                    let steps: [Vec<(usize, Vec<u32>)>; 2] = [
                        vec![(0, prompts[0].clone()), (0, prompts[1].clone())],
                        vec![(prompts[0].len(), vec![7]), (prompts[1].len(), vec![9])],
                    ];
                    for step in steps {
                        for (t, (_, toks)) in tables.iter_mut().zip(&step) {
                            t.append(toks.len()).expect("blocks");
                        }
                        let batch: Vec<SeqInput<'_>> = step
                            .iter()
                            .zip(&tables)
                            .map(|((start, toks), t)| SeqInput {
                                tokens: toks,
                                start_pos: *start,
                                blocks: t.blocks(),
                                all_logits: *start == 0,
                                lora: None,
                            })
                            .collect();
                        let logits = model
                            .forward_stage(&batch, &mut kv, &mut peers, &mut |_, _| {})
                            .expect("forward");
                        if let Some(l) = logits {
                            out.extend((0..batch.len()).map(|i| l.seq(i).to_vec()));
                        }
                    }
                    model.shard().computes_logits().then_some(out)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    let mut with_logits = results.into_iter().flatten();
    let out = with_logits.next().expect("one rank computes logits");
    assert!(
        with_logits.next().is_none(),
        "exactly one rank computes logits"
    );
    out
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

#[test]
fn tensor_and_pipeline_shards_give_the_whole_models_logits() {
    for (preset, layouts) in [
        ("tiny", &[(2, 1), (1, 2), (2, 2)][..]),
        // One KV head, replicated on every rank of the group; tied head.
        ("tiny-mqa", &[(2, 1), (4, 1), (4, 2)][..]),
    ] {
        let tmp = tempfile::tempdir().expect("tempdir");
        tandem_engine::synth::preset(preset)
            .expect("preset")
            .write(tmp.path(), 5, DType::F32)
            .expect("write");
        let whole = run_sharded(tmp.path(), 1, 1);
        for &(tp, pp) in layouts {
            let d = max_diff(&whole, &run_sharded(tmp.path(), tp, pp));
            assert!(d < 1e-4, "{preset} tp={tp} pp={pp}: logits differ by {d}");
        }
    }
}

/// Every family splits as its shapes allow: checkpoints made by
/// transformers (`tests/fixtures/golden`), 4 query and 2 KV heads, 2 layers.
#[test]
fn every_family_shards_to_the_whole_models_logits() {
    let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/golden");
    let both = &[(2, 1), (1, 2), (2, 2), (4, 1)][..];
    for (case, layouts) in [
        ("qwen3_gqa_f32", both),
        // Sliding and global layers, local RoPE, (1 + w) sandwich norms.
        ("gemma3_gqa_f32", both),
        ("gemma2_softcap_f32", both),
        // Fused q/k/v and gate/up, split by row ranges of the fused tensor.
        ("phi3_fused_f32", both),
        ("granite_gqa_f32", both),
        ("qwen3_yarn_f32", both),
        // Experts split by intermediate feature, the router replicated; a
        // shared expert; a dense layer between sparse ones.
        ("mixtral_top2_f32", both),
        ("qwen2moe_shared_f32", both),
        ("qwen3moe_norm_f32", &[(2, 1), (1, 3), (2, 3), (4, 1)][..]),
        // Sinks split with their heads, stacked experts by feature, the
        // down biases added once.
        ("gptoss_sinks_f32", both),
        // MXFP4 experts, dequantized row by row for each rank's features.
        ("gptoss_mxfp4_f32", both),
        // Its q/k norm spans every head: pipeline only.
        ("olmo2_gqa_f32", &[(1, 2)][..]),
        // Latent attention: query heads and kv_b_proj split by head, the
        // latent replicated on every rank; grouped routing, shared experts.
        ("deepseekv3_yarn_f32", &[(2, 1), (1, 3), (2, 3), (4, 1)][..]),
        ("deepseekv2_lite_f32", &[(2, 1), (1, 3), (4, 1)][..]),
        ("deepseekv2_group_f32", both),
    ] {
        let dir = golden.join(case);
        let whole = run_sharded(&dir, 1, 1);
        for &(tp, pp) in layouts {
            let d = max_diff(&whole, &run_sharded(&dir, tp, pp));
            assert!(d < 1e-4, "{case} tp={tp} pp={pp}: logits differ by {d}");
        }
    }
}

/// Expert parallelism: whole experts per group of ranks, alone (ep = tp),
/// with a feature split inside each group (tp = 2 × ep), and pipelined.
#[test]
fn expert_parallel_shards_give_the_whole_models_logits() {
    let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/golden");
    for case in [
        "qwen3moe_norm_f32",
        "qwen2moe_shared_f32",
        "gptoss_sinks_f32",
        "gptoss_mxfp4_f32",
        "mixtral_top2_f32",
        // Grouped sigmoid routing with its choice bias, a shared expert and
        // a dense first layer.
        "deepseekv3_yarn_f32",
    ] {
        let dir = golden.join(case);
        let whole = run_sharded(&dir, 1, 1);
        for (tp, pp, ep) in [(2, 1, 2), (4, 1, 2), (4, 1, 4), (2, 2, 2)] {
            let d = max_diff(&whole, &run_split(&dir, tp, pp, ep));
            assert!(
                d < 1e-4,
                "{case} tp={tp} pp={pp} ep={ep}: logits differ by {d}"
            );
        }
    }
}

#[test]
fn expert_splits_the_model_cannot_take_are_refused_by_name() {
    let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/golden");
    let split = |tp, ep| tandem_engine::shard::Split {
        tp,
        tp_rank: 0,
        pp: 1,
        stage: 0,
        ep,
    };
    // 6 experts in 4 groups.
    let err =
        Model::load_split(&golden.join("qwen3moe_step2_f32"), split(4, 4)).expect_err("6 / 4");
    assert!(err.to_string().contains("num_experts 6"), "{err}");
    let err = Model::load_split(&golden.join("qwen3_gqa_f32"), split(2, 2)).expect_err("dense");
    assert!(err.to_string().contains("no mixture-of-experts"), "{err}");
    let err = Model::load_split(&golden.join("qwen3moe_norm_f32"), split(2, 4)).expect_err("4 > 2");
    assert!(
        err.to_string().contains("4 expert groups over 2 ranks"),
        "{err}"
    );
}

#[test]
fn splits_that_do_not_divide_the_model_are_refused_by_name() {
    let (tmp, _) = common::synth_model("tiny", 1, DType::F32);
    let err = Model::load_shard(tmp.path(), 3, 0, 1, 0).expect_err("4 heads / 3");
    assert!(err.to_string().contains("attention heads"), "{err}");
    let err = Model::load_shard(tmp.path(), 1, 0, 3, 0).expect_err("2 layers / 3 stages");
    assert!(err.to_string().contains("layers"), "{err}");
    let shard = Model::load_shard(tmp.path(), 2, 1, 2, 1).expect("tp2 pp2");
    let layout = shard.kv_layout(16);
    assert_eq!((layout.num_layers, layout.num_kv_heads), (1, 1));
}

/// A GGUF file's quantized blocks split over ranks as they lie: a
/// column-parallel rank keeps whole rows, a row-parallel one the blocks of
/// its input range (block-aligned here), and each activation block is
/// quantized as the whole model quantizes it, so only the all-reduce's
/// float order differs.
#[test]
fn gguf_block_shards_give_the_whole_models_logits() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gguf");
    for ty in ["q4_0", "q5_1", "q8_0"] {
        let file = fixtures.join(format!("llama256_{ty}.gguf"));
        let whole = run_sharded(&file, 1, 1);
        let split = Model::load_split(
            &file,
            tandem_engine::shard::Split {
                tp: 2,
                tp_rank: 1,
                pp: 1,
                stage: 0,
                ep: 1,
            },
        )
        .expect("shard");
        assert_eq!(
            split.gguf_block_matrices(),
            split.linear_matrices(),
            "{ty}: every sharded linear layer keeps its blocks"
        );
        let d = max_diff(&whole, &run_sharded(&file, 2, 1));
        assert!(d < 1e-4, "{ty} tp=2: logits differ by {d}");
    }
}
