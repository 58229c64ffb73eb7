//! Measuring a quantized model against its f32 reference.
//!
//! Both models score the same token sequences with logits at every
//! position (teacher forcing), so each position compares the two
//! next-token distributions directly: does the argmax agree, and how far
//! is the quantized model's log-probability of the reference's choice from
//! the reference's own?

use crate::error::Result;
use crate::kernels::log_softmax;
use crate::kv_cache::{KvCache, KvCacheDtype};
use crate::model::{Model, SeqInput};

/// Agreement of two models over a set of positions.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Agreement {
    /// Positions compared.
    pub positions: usize,
    /// Share of positions whose argmax agrees.
    pub top1: f64,
    /// Mean `|log p_ref(a) − log p_test(a)|` with `a` the reference's argmax.
    pub mean_logprob_error: f64,
    /// Largest such error.
    pub max_logprob_error: f64,
}

#[derive(Debug, Default)]
struct Tally {
    positions: usize,
    agree: usize,
    err_sum: f64,
    err_max: f64,
}

impl Tally {
    fn add(&mut self, reference: &[f32], test: &[f32]) {
        let mut r = reference.to_vec();
        let mut t = test.to_vec();
        log_softmax(&mut r);
        log_softmax(&mut t);
        let argmax = |v: &[f32]| {
            v.iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |best, (i, &x)| {
                    if x > best.1 {
                        (i, x)
                    } else {
                        best
                    }
                })
                .0
        };
        let a = argmax(&r);
        self.positions += 1;
        self.agree += usize::from(a == argmax(&t));
        let err = f64::from((r[a] - t[a]).abs());
        self.err_sum += err;
        self.err_max = self.err_max.max(err);
    }

    fn finish(&self) -> Agreement {
        let n = self.positions.max(1) as f64;
        Agreement {
            positions: self.positions,
            top1: self.agree as f64 / n,
            mean_logprob_error: self.err_sum / n,
            max_logprob_error: self.err_max,
        }
    }
}

/// Logits at every position of `tokens`, from a fresh f32 cache.
pub fn score(model: &Model, tokens: &[u32]) -> Result<Vec<f32>> {
    score_with(model, tokens, KvCacheDtype::F32, tokens.len())
}

/// Logits at every position of `tokens`, from a fresh cache of `dtype`,
/// fed `chunk` tokens per forward step as a chunked prefill is: each step
/// writes its tokens' K and V into the cache and attends to them there, so
/// every position reads the cache's rounding of its context, its own token
/// included, exactly as serving does. A `chunk` of at most the row-kernel
/// size (48) sends every matmul down the path decode steps take (INT4
/// weights against int8 activations).
pub fn score_with(
    model: &Model,
    tokens: &[u32],
    dtype: KvCacheDtype,
    chunk: usize,
) -> Result<Vec<f32>> {
    let block_size = 16;
    let layout = model.kv_layout(block_size);
    let groups = crate::KvGroups::of(&layout).num_groups();
    let mut kv = KvCache::with_dtype(layout, tokens.len().div_ceil(block_size) * groups, dtype);
    let mut table = crate::BlockTable::new(&kv.allocator()?);
    table.append(tokens.len())?;
    let mut out = Vec::with_capacity(tokens.len() * model.config().vocab_size);
    for (i, part) in tokens.chunks(chunk.max(1)).enumerate() {
        let logits = model.forward(
            &[SeqInput {
                tokens: part,
                start_pos: i * chunk.max(1),
                blocks: table.blocks(),
                all_logits: true,
                lora: None,
            }],
            &mut kv,
        )?;
        out.extend_from_slice(logits.seq(0));
    }
    Ok(out)
}

/// Scores every sequence with both models and compares them position by
/// position.
pub fn compare_models(
    reference: &Model,
    test: &Model,
    sequences: &[Vec<u32>],
) -> Result<Agreement> {
    let vocab = reference.config().vocab_size;
    let mut tally = Tally::default();
    for seq in sequences {
        let r = score(reference, seq)?;
        let t = score(test, seq)?;
        for (rr, tr) in r.chunks_exact(vocab).zip(t.chunks_exact(vocab)) {
            tally.add(rr, tr);
        }
    }
    Ok(tally.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tally_counts_agreement_and_error() {
        let mut t = Tally::default();
        t.add(&[0.0, 1.0, 0.0], &[0.0, 1.0, 0.0]);
        t.add(&[0.0, 1.0, 0.0], &[2.0, 0.0, 0.0]);
        let a = t.finish();
        assert_eq!(a.positions, 2);
        assert!((a.top1 - 0.5).abs() < 1e-12);
        assert!(a.mean_logprob_error > 0.0 && a.max_logprob_error >= a.mean_logprob_error);
    }
}
