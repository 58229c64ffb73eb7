//! Stop conditions of the single-request generation loop.

mod common;

use tandem_engine::{
    generate, DType, FinishReason, GenerateOptions, GenerateRequest, SamplingParams,
};

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_ids: prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        stop_token_ids: vec![],
        ignore_eos: false,
    }
}

#[test]
fn eos_stop_ids_max_tokens_and_context_limit() {
    let (_tmp, model) = common::synth_model("tiny", 4, DType::F32);
    let opts = GenerateOptions::default();
    let run = |req: &GenerateRequest, eos: &[u32]| {
        generate(&model, eos, req, opts, |_| Ok(())).expect("generate")
    };

    let base = run(&request(vec![3, 4, 5], 12), &[]);
    assert_eq!(base.output_ids.len(), 12);
    assert_eq!(base.finish_reason, FinishReason::Length);
    let first_at = |tok: u32| {
        base.output_ids
            .iter()
            .position(|&t| t == tok)
            .expect("present")
            + 1
    };

    // An eos id ends generation at its first occurrence, included.
    let eos = base.output_ids[5];
    let out = run(&request(vec![3, 4, 5], 12), &[eos]);
    assert_eq!(out.output_ids, base.output_ids[..first_at(eos)]);
    assert_eq!(out.finish_reason, FinishReason::Stop);

    // ...unless eos is ignored.
    let mut ignore = request(vec![3, 4, 5], 12);
    ignore.ignore_eos = true;
    assert_eq!(run(&ignore, &[eos]).output_ids, base.output_ids);

    // Stop token ids work like eos, and are not ignored with it.
    let stop = base.output_ids[7];
    let mut req = request(vec![3, 4, 5], 12);
    req.stop_token_ids = vec![stop];
    req.ignore_eos = true;
    let out = run(&req, &[]);
    assert_eq!(out.output_ids, base.output_ids[..first_at(stop)]);
    assert_eq!(out.finish_reason, FinishReason::Stop);

    // The context limit (512 for `tiny`) caps the output: a `length` finish.
    let long: Vec<u32> = (0..509).map(|i| i % 250).collect();
    let mut req = request(long, 50);
    req.ignore_eos = true;
    let out = run(&req, &[]);
    assert_eq!(out.output_ids.len(), 3);
    assert_eq!(out.finish_reason, FinishReason::Length);

    // Empty prompts and prompts that fill the context are errors.
    let err = generate(&model, &[], &request(vec![], 4), opts, |_| Ok(())).expect_err("empty");
    assert!(err.to_string().contains("empty"), "{err}");
    let full: Vec<u32> = vec![1; 512];
    let err = generate(&model, &[], &request(full, 4), opts, |_| Ok(())).expect_err("full");
    assert!(err.to_string().contains("max_position_embeddings"), "{err}");
}
