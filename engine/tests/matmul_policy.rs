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

/// Resident kB of this process's mappings of files under `dir`.
#[cfg(target_os = "linux")]
fn mapped_rss_kb(dir: &std::path::Path) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
    let dir = dir.to_string_lossy();
    let mut inside = false;
    let mut kb = 0;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("Rss:") if inside => {
                kb += words
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
            }
            // A mapping's header: its address range first, its path last.
            Some(first) if first.contains('-') && !first.ends_with(':') => {
                inside = line
                    .split_whitespace()
                    .last()
                    .is_some_and(|p| p.starts_with(&*dir));
            }
            _ => {}
        }
    }
    kb
}

/// Packing a model read from a mapped file drops the pages it read: the
/// packed copy replaces them (a tied or separate head too; an embedding
/// lookup faults a row's page back in), and the logits are the packed ones.
#[cfg(target_os = "linux")]
#[test]
fn packing_a_mapped_model_releases_the_file_pages_it_read() {
    if !MatmulPolicy::Bf16Activations.packs_weights() {
        eprintln!("skipped: this CPU has no AVX512-BF16");
        return;
    }
    for preset in ["small", "tiny-mqa"] {
        let tmp = tempfile::tempdir().expect("tempdir");
        tandem_engine::synth::preset(preset)
            .expect("preset")
            .write(tmp.path(), 5, DType::Bf16)
            .expect("write checkpoint");
        let mut model =
            Model::load_with(tmp.path(), tandem_engine::weights::Residency::Mapped).expect("load");
        assert!(model.weights_mapped(), "{preset}");
        let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 500).collect();
        logits(&model, &tokens);
        let before = mapped_rss_kb(tmp.path());
        model.set_matmul_policy(MatmulPolicy::Bf16Activations);
        let packed = logits(&model, &tokens);
        let after = mapped_rss_kb(tmp.path());
        // tiny-mqa's matrices are a few pages each, and the pages a matrix
        // shares with its neighbours stay: less, not a quarter.
        let factor = if preset == "small" { 4 } else { 1 };
        assert!(
            after * factor < before,
            "{preset}: {after} kB of the file resident after packing, {before} kB before"
        );
        // The same model packed from a resident copy gives the same logits.
        let mut resident = Model::load(tmp.path()).expect("load");
        resident.set_matmul_policy(MatmulPolicy::Bf16Activations);
        assert_eq!(logits(&resident, &tokens), packed, "{preset}");
    }
}
