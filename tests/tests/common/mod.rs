//! Helpers shared by the Hugging Face parity tests (`golden_parity.rs`,
//! `gguf.rs`).

use tandem_engine::{generate, Checkpoint, GenerateOptions, GenerateRequest, SamplingParams};

/// Largest |Δ logprob| allowed against a transformers reference.
pub const TOLERANCE: f32 = 1e-4;

/// Incremental greedy generation of `prompt` (chunked prefill, paged KV of
/// `block_size`) against a reference's `(token, logprob)` steps: the tokens
/// must match and each logprob be within [`TOLERANCE`]; returns the worst
/// logprob difference.
pub fn greedy_error(
    label: &str,
    ckpt: &Checkpoint,
    prompt: &[u32],
    steps: &[(u32, f32)],
    block_size: usize,
) -> f32 {
    let req = GenerateRequest {
        prompt_ids: prompt.to_vec(),
        max_tokens: steps.len(),
        sampling: SamplingParams {
            logprobs: Some(1),
            ..SamplingParams::default()
        },
        stop_token_ids: vec![],
        // The reference loop does not stop at eos.
        ignore_eos: true,
    };
    let opts = GenerateOptions {
        block_size,
        // Chunked prefill: the prompt runs as several forward calls.
        prefill_chunk: 5,
        ..GenerateOptions::default()
    };
    let out = generate(&ckpt.model, &ckpt.eos_token_ids, &req, opts, |_| Ok(())).expect("generate");
    let want: Vec<u32> = steps.iter().map(|s| s.0).collect();
    assert_eq!(
        out.output_ids, want,
        "{label}: greedy tokens differ from transformers"
    );
    let mut worst = 0.0f32;
    for (i, (lp, &(_, reference))) in out.logprobs.iter().zip(steps).enumerate() {
        let d = (lp.logprob - reference).abs();
        assert!(
            d < TOLERANCE,
            "{label} step {i}: logprob {} vs {reference}",
            lp.logprob
        );
        worst = worst.max(d);
    }
    worst
}
