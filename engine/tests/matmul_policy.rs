//! Matmul policies on a whole model: bf16 activations pack the bf16 linear
//! layers and the output head into panels, and another policy unpacks them
//! to the same bits as never packed.

mod common;

use tandem_engine::kernels::MatmulPolicy;
use tandem_engine::{BlockId, DType, KvCache, Model, SeqInput};

/// Every position's logits of one prefill of `tokens`.
fn logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let bs = 16;
    let blocks: Vec<BlockId> = (0..tokens.len().div_ceil(bs) as BlockId).collect();
    let mut kv = KvCache::new(model.kv_layout(bs), blocks.len());
    let out = model
        .forward(
            &[SeqInput {
                tokens,
                start_pos: 0,
                blocks: &blocks,
                all_logits: true,
                lora: None,
            }],
            &mut kv,
        )
        .expect("forward");
    out.rows().to_vec()
}

#[test]
fn bf16_activations_pack_the_weights_and_another_policy_unpacks_them() {
    if !MatmulPolicy::Bf16Activations.packs_weights() {
        eprintln!("skipped: this CPU has no AVX512-BF16");
        return;
    }
    for preset in ["tiny", "tiny-mqa"] {
        let (_tmp, mut model) = common::synth_model(preset, 3, DType::Bf16);
        let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 500).collect();
        let exact = logits(&model, &tokens);
        model.set_matmul_policy(MatmulPolicy::Bf16Activations);
        // q, k, v, o, gate, up, down in each of 2 layers, and the head.
        assert_eq!(model.packed_matrices(), 2 * 7 + 1, "{preset}");
        let rounded = logits(&model, &tokens);
        let scale = exact.iter().fold(0f32, |a, v| a.max(v.abs()));
        let worst = exact
            .iter()
            .zip(&rounded)
            .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        // Activations rounded to 8 significant bits: near, not equal.
        assert!(
            worst > 0.0 && worst < 0.01 * scale,
            "{preset}: {worst} of {scale}"
        );
        model.set_matmul_policy(MatmulPolicy::Fastest);
        assert_eq!(model.packed_matrices(), 0, "{preset}");
        assert_eq!(logits(&model, &tokens), exact, "{preset}: unpacked");
    }
}
