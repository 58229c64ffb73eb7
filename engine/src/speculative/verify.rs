//! Verification: which drafts the target keeps, and its own next token.
//!
//! Greedy: accept drafts while each is the argmax of the target's row for
//! its position; the first disagreement is replaced by the argmax, and when
//! all agree the last row gives a bonus token. The emitted tokens are then
//! exactly greedy decoding's.
//!
//! Sampled: draft `x` at a position is accepted with probability
//! `min(1, p(x) / q(x))`, `p` the target's processed distribution there and
//! `q` the draft's (one-hot for a deterministic drafter). On rejection the
//! position gets a draw from `normalize(max(0, p − q))` and verification
//! stops; on full acceptance a bonus token is drawn from the last row. Each
//! emitted token is then distributed exactly as a plain draw from `p`.

use crate::sampling::{argmax, Sampler};

use super::Draft;

/// How a rejected position is resampled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Residual {
    /// From `normalize(max(0, p − q))`: lossless.
    #[default]
    Lossless,
    /// From `p` itself, ignoring what the draft already covered: wrong
    /// (it over-weights the drafted tokens). Kept so the statistical test
    /// can show it detects a broken residual step.
    FromTarget,
}

/// The outcome of verifying one sequence's drafts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// The accepted drafts, then the target's own token.
    pub tokens: Vec<u32>,
    /// How many drafts were accepted.
    pub accepted: usize,
}

/// Verifies `draft` against the target's `rows` (`draft.len() + 1` rows of
/// `vocab` logits: row `i` predicts the token after the `i`-th input).
pub fn verify(
    rows: &[f32],
    vocab: usize,
    draft: &Draft,
    sampler: &mut Sampler,
    residual: Residual,
) -> Verified {
    let k = draft.len();
    debug_assert!(rows.len() >= (k + 1) * vocab);
    let row = |i: usize| &rows[i * vocab..(i + 1) * vocab];
    let mut tokens = Vec::with_capacity(k + 1);
    if sampler.params().temperature == 0.0 {
        for (i, &x) in draft.tokens.iter().enumerate() {
            let best = argmax(row(i));
            tokens.push(best);
            if best != x {
                return Verified {
                    tokens,
                    accepted: i,
                };
            }
        }
        tokens.push(argmax(row(k)));
        return Verified {
            tokens,
            accepted: k,
        };
    }
    for (i, &x) in draft.tokens.iter().enumerate() {
        let p = sampler.distribution(row(i));
        let q = draft.probs.get(i);
        let px = p.get(x as usize).copied().unwrap_or(0.0);
        let qx = q.map_or(1.0, |q| q.get(x as usize).copied().unwrap_or(0.0));
        // Accept with probability min(1, p(x) / q(x)).
        if qx > 0.0 && sampler.uniform() * f64::from(qx) < f64::from(px) {
            tokens.push(x);
            continue;
        }
        let resample = match residual {
            Residual::Lossless => {
                let mut r = p.clone();
                match q {
                    Some(q) => r
                        .iter_mut()
                        .zip(q)
                        .for_each(|(r, &q)| *r = (*r - q).max(0.0)),
                    None => {
                        if let Some(v) = r.get_mut(x as usize) {
                            *v = 0.0;
                        }
                    }
                }
                // p ≤ q everywhere only when p = q, where nothing is
                // rejected; rounding could still leave no mass.
                if r.iter().any(|&v| v > 0.0) {
                    r
                } else {
                    p
                }
            }
            Residual::FromTarget => p,
        };
        tokens.push(sampler.draw_from(&resample));
        return Verified {
            tokens,
            accepted: i,
        };
    }
    let p = sampler.distribution(row(k));
    tokens.push(sampler.draw_from(&p));
    Verified {
        tokens,
        accepted: k,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

    fn sampler(temperature: f32, seed: u64) -> Sampler {
        Sampler::new(
            SamplingParams {
                temperature,
                seed: Some(seed),
                ..Default::default()
            },
            &[],
        )
        .expect("valid")
    }

    #[test]
    fn greedy_keeps_the_agreeing_prefix_and_adds_the_argmax() {
        // Rows' argmaxes: 2, 1, 0.
        let rows = [0.0, 0.0, 5.0, 0.0, 5.0, 0.0, 5.0, 0.0, 0.0];
        let mut s = sampler(0.0, 1);
        let all = Draft {
            tokens: vec![2, 1],
            probs: Vec::new(),
        };
        assert_eq!(
            verify(&rows, 3, &all, &mut s, Residual::Lossless),
            Verified {
                tokens: vec![2, 1, 0],
                accepted: 2
            }
        );
        let second_wrong = Draft {
            tokens: vec![2, 2],
            probs: Vec::new(),
        };
        assert_eq!(
            verify(&rows, 3, &second_wrong, &mut s, Residual::Lossless),
            Verified {
                tokens: vec![2, 1],
                accepted: 1
            }
        );
    }

    /// One position, vocabulary of 3: the emitted token must follow `p`
    /// whatever the draft distribution `q`; with the broken residual it
    /// does not.
    #[test]
    fn sampled_verification_follows_the_target_distribution() {
        let logits = [0.0f32, 1.0, 2.0];
        let p = sampler(1.0, 0).distribution(&logits);
        let q = vec![0.7f32, 0.2, 0.1];
        let freq = |residual: Residual| {
            let mut s = sampler(1.0, 42);
            let mut counts = [0usize; 3];
            let n = 60_000;
            for _ in 0..n {
                // The drafter draws x ~ q, then verification runs.
                let x = s.draw_from(&q);
                let draft = Draft {
                    tokens: vec![x],
                    probs: vec![q.clone()],
                };
                let rows: Vec<f32> = logits.iter().chain(&logits).copied().collect();
                let v = verify(&rows, 3, &draft, &mut s, residual);
                counts[v.tokens[0] as usize] += 1;
            }
            counts.map(|c| c as f64 / n as f64)
        };
        let good = freq(Residual::Lossless);
        for t in 0..3 {
            assert!(
                (good[t] - f64::from(p[t])).abs() < 0.01,
                "{good:?} vs {p:?}"
            );
        }
        let bad = freq(Residual::FromTarget);
        assert!(
            (0..3).any(|t| (bad[t] - f64::from(p[t])).abs() > 0.05),
            "the broken residual should be visibly off: {bad:?} vs {p:?}"
        );
    }

    #[test]
    fn a_deterministic_draft_is_accepted_with_the_target_probability() {
        let logits = [0.0f32, (3.0f32).ln()]; // p = [0.25, 0.75]
        let mut s = sampler(1.0, 9);
        let draft = Draft {
            tokens: vec![0],
            probs: Vec::new(),
        };
        let rows: Vec<f32> = logits.iter().chain(&logits).copied().collect();
        let n = 20_000;
        let accepted = (0..n)
            .filter(|_| verify(&rows, 2, &draft, &mut s, Residual::Lossless).accepted == 1)
            .count() as f64
            / f64::from(n);
        assert!((accepted - 0.25).abs() < 0.02, "{accepted}");
    }
}
