//! INT4 weights against the f32 model: the built-in trained Shakespeare
//! models scored on held-out prompts, quantized at load (linear layers and
//! output head).

use std::path::PathBuf;

use tandem_engine::quant::eval::{compare_models, score};
use tandem_engine::quant::{Int4Config, GROUP_SIZES};
use tandem_engine::{Checkpoint, Model};

fn repo_path(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(rel)
}

/// The held-out prompts, each followed by the f32 model's greedy
/// continuation, so positions cover both text and the model's own output.
fn sequences(ckpt: &Checkpoint, continuation: usize) -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(repo_path("bench/prompts/held-out.txt")).expect("prompts");
    let tok = ckpt.tokenizer().expect("tokenizer");
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .take(6)
        .map(|line| {
            let mut ids = tok.encode(&line.replace("\\n", "\n")).expect("encode");
            for _ in 0..continuation {
                let logits = score(&ckpt.model, &ids).expect("score");
                let last = &logits[logits.len() - ckpt.model.config().vocab_size..];
                let next = last
                    .iter()
                    .enumerate()
                    .fold(
                        (0, f32::NEG_INFINITY),
                        |b, (i, &v)| if v > b.1 { (i, v) } else { b },
                    )
                    .0;
                ids.push(next as u32);
            }
            ids
        })
        .collect()
}

#[test]
fn int4_tracks_the_f32_model_on_trained_models() {
    for name in ["shakespeare-target", "shakespeare-draft"] {
        let dir = repo_path(&format!("models/{name}"));
        let reference = Checkpoint::open(&dir).expect("open");
        let seqs = sequences(&reference, 24);
        for g in GROUP_SIZES {
            let mut quantized = Model::load(&dir).expect("load");
            // With 128, down_proj (704 inputs) falls back to groups of 64.
            quantized
                .quantize_int4(Int4Config::new(g).expect("group"))
                .expect("quantize");
            let n = quantized.config().num_layers * 7;
            assert_eq!(quantized.int4_matrices(), n);
            let a = compare_models(&reference.model, &quantized, &seqs).expect("compare");
            eprintln!(
                "{name} int4 g{g}: {} positions, top-1 agreement {:.3}, mean |Δlogprob| {:.4}, max {:.3}",
                a.positions, a.top1, a.mean_logprob_error, a.max_logprob_error
            );
            assert!(a.positions > 100);
            assert!(a.top1 >= 0.85, "{name} g{g}: top-1 agreement {:.3}", a.top1);
            assert!(
                a.mean_logprob_error <= 0.15,
                "{name} g{g}: mean logprob error {:.4}",
                a.mean_logprob_error
            );
        }
    }
}

/// The bounds discriminate: a different model of the same vocabulary (the
/// 2-layer draft against the 6-layer target, trained on the same text)
/// fails them, so a kernel that computed something else would too.
#[test]
fn a_different_model_fails_the_accuracy_bound() {
    let reference = Checkpoint::open(&repo_path("models/shakespeare-target")).expect("open");
    let seqs = sequences(&reference, 8);
    let other = Model::load(&repo_path("models/shakespeare-draft")).expect("load");
    let a = compare_models(&reference.model, &other, &seqs).expect("compare");
    eprintln!(
        "draft vs target: top-1 {:.3}, mean |Δlogprob| {:.4}",
        a.top1, a.mean_logprob_error
    );
    assert!(a.top1 < 0.85 || a.mean_logprob_error > 0.15);
}
