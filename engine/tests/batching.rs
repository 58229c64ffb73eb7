//! One forward call over a flattened batch must equal running each sequence
//! on its own: a prefill chunk of one sequence and decode tokens of others
//! share every GEMM, and only attention separates them.

mod common;

use tandem_engine::{BlockAllocator, BlockTable, DType, KvCache, KvError, Model, SeqInput};

fn model() -> (tempfile::TempDir, Model) {
    common::synth_model("tiny", 9, DType::F32)
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (seed * 37 + i * 11) % 500).collect()
}

#[test]
fn mixed_prefill_chunk_and_decodes_match_separate_runs() {
    let (_tmp, model) = model();
    let bs = 4;
    let pool = BlockAllocator::new(64, bs).expect("pool");
    let a = prompt(1, 23);
    let b = prompt(2, 9);
    let c = prompt(3, 14);

    // Reference: each sequence alone in its own cache.
    let alone = |toks: &[u32], split: usize| {
        let mut kv = KvCache::new(model.kv_layout(bs), 64);
        let mut t = BlockTable::new(&pool);
        t.append(split).expect("blocks");
        let first = SeqInput {
            tokens: &toks[..split],
            start_pos: 0,
            blocks: t.blocks(),
            all_logits: false,
            lora: None,
        };
        model.forward(&[first], &mut kv).expect("first part");
        t.append(toks.len() - split).expect("blocks");
        let rest = SeqInput {
            tokens: &toks[split..],
            start_pos: split,
            blocks: t.blocks(),
            all_logits: true,
            lora: None,
        };
        model
            .forward(&[rest], &mut kv)
            .expect("second part")
            .seq(0)
            .to_vec()
    };
    let want_a = alone(&a, 10);
    let want_b = alone(&b, 8);
    let want_c = alone(&c, 13);

    // Batched: first parts together, then A's second prefill chunk beside
    // single decode tokens of B and C, in one call.
    let mut kv = KvCache::new(model.kv_layout(bs), 64);
    let (mut ta, mut tb, mut tc) = (
        BlockTable::new(&pool),
        BlockTable::new(&pool),
        BlockTable::new(&pool),
    );
    ta.append(10).expect("a");
    tb.append(8).expect("b");
    tc.append(13).expect("c");
    model
        .forward(
            &[
                SeqInput {
                    tokens: &a[..10],
                    start_pos: 0,
                    blocks: ta.blocks(),
                    all_logits: false,
                    lora: None,
                },
                SeqInput {
                    tokens: &b[..8],
                    start_pos: 0,
                    blocks: tb.blocks(),
                    all_logits: false,
                    lora: None,
                },
                SeqInput {
                    tokens: &c[..13],
                    start_pos: 0,
                    blocks: tc.blocks(),
                    all_logits: false,
                    lora: None,
                },
            ],
            &mut kv,
        )
        .expect("batched prefill");
    ta.append(13).expect("a");
    tb.append(1).expect("b");
    tc.append(1).expect("c");
    let out = model
        .forward(
            &[
                SeqInput {
                    tokens: &b[8..],
                    start_pos: 8,
                    blocks: tb.blocks(),
                    all_logits: true,
                    lora: None,
                },
                SeqInput {
                    tokens: &a[10..],
                    start_pos: 10,
                    blocks: ta.blocks(),
                    all_logits: true,
                    lora: None,
                },
                SeqInput {
                    tokens: &c[13..],
                    start_pos: 13,
                    blocks: tc.blocks(),
                    all_logits: true,
                    lora: None,
                },
            ],
            &mut kv,
        )
        .expect("mixed step");
    for (got, want, name) in [
        (out.seq(1), &want_a, "a"),
        (out.seq(0), &want_b, "b"),
        (out.seq(2), &want_c, "c"),
    ] {
        assert_eq!(got.len(), want.len(), "{name}");
        let worst = got
            .iter()
            .zip(want.iter())
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "{name}: batched logits differ by {worst}");
    }
}

#[test]
fn forward_rejects_bad_batches_without_panicking() {
    let (_tmp, model) = model();
    let pool = BlockAllocator::new(2, 4).expect("pool");
    let mut kv = KvCache::new(model.kv_layout(4), 2);
    let mut t = BlockTable::new(&pool);
    t.append(4).expect("one block");
    let run = |tokens: &[u32], start: usize, blocks: &[u32], kv: &mut KvCache| {
        model
            .forward(
                &[SeqInput {
                    tokens,
                    start_pos: start,
                    blocks,
                    all_logits: false,
                    lora: None,
                }],
                kv,
            )
            .map(|_| ())
    };
    let err = |r: Result<(), tandem_engine::EngineError>| match r {
        Ok(()) => String::from("<accepted>"),
        Err(e) => e.to_string(),
    };
    {
        let m = err(run(&[1, 2, 3, 4, 5], 0, t.blocks(), &mut kv));
        assert!(m.contains("block table holds 4"), "{m}");
    }
    {
        let m = err(run(&[600], 0, t.blocks(), &mut kv));
        assert!(m.contains("outside the vocabulary"), "{m}");
    }
    {
        let m = err(run(&[], 0, t.blocks(), &mut kv));
        assert!(m.contains("no tokens"), "{m}");
    }
    {
        let m = err(run(&[1], 0, &[7], &mut kv));
        assert!(m.contains("outside the cache"), "{m}");
    }
    {
        let m = err(run(&[1], 600, &[0; 200], &mut kv));
        assert!(m.contains("max_position_embeddings"), "{m}");
    }
    // A cache shaped for another model (one KV head instead of two).
    let other = tandem_engine::KvLayout {
        rows: tandem_engine::KvRows::PerHead,
        num_kv_heads: 1,
        ..model.kv_layout(4)
    };
    let mut wrong = KvCache::new(other, 2);
    {
        let m = err(run(&[1], 0, t.blocks(), &mut wrong));
        assert!(m.contains("layout"), "{m}");
    }
    // Running out of blocks is an error from the table, and leaks nothing.
    let mut big = BlockTable::new(&pool);
    assert!(matches!(big.append(9), Err(KvError::OutOfBlocks { .. })));
    drop(t);
    assert_eq!(pool.num_free(), 2);
}
