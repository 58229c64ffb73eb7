//! Per-request draft length from the request's acceptance rate.
//!
//! Model each drafted token as accepted with probability `α`, independently,
//! until the first rejection. A step drafting `k` tokens then emits
//! `1 + α + … + α^k` tokens on average and costs `1 + k·(d + v)` decode
//! steps (`d` to draft a token, `v` to verify one more row). [`AdaptiveK`]
//! estimates `α` from the request's verifications — each examined draft is
//! a Bernoulli trial, so `α̂ = accepted / (accepted + rejections)` with
//! exponential forgetting and a mild prior — and picks the `k` with the most
//! tokens per unit of cost. When no `k` pays, it still drafts one token every
//! [`PROBE_EVERY`] steps so the estimate can recover.

/// Steps between one-token probes while speculation does not pay.
pub const PROBE_EVERY: u32 = 16;

/// Weight of the past in the estimate (per verification).
const DECAY: f64 = 0.9;
/// Prior: as if 1 of 2 drafts had been accepted (weak, so a drafter that
/// never agrees is dropped after a few verifications).
const PRIOR_ACCEPTED: f64 = 1.0;
const PRIOR_TRIALS: f64 = 2.0;

/// One request's acceptance estimate and draft-length choice.
#[derive(Debug, Clone)]
pub struct AdaptiveK {
    accepted: f64,
    trials: f64,
    idle_steps: u32,
}

impl Default for AdaptiveK {
    fn default() -> Self {
        Self {
            accepted: 0.0,
            trials: 0.0,
            idle_steps: 0,
        }
    }
}

impl AdaptiveK {
    /// The estimated per-token acceptance probability.
    pub fn rate(&self) -> f64 {
        (self.accepted + PRIOR_ACCEPTED) / (self.trials + PRIOR_TRIALS)
    }

    /// Records one verification: `accepted` of `drafted` kept.
    pub fn observe(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let rejected = usize::from(accepted < drafted);
        self.accepted = self.accepted * DECAY + accepted as f64;
        self.trials = self.trials * DECAY + (accepted + rejected) as f64;
    }

    /// The draft length for the next step, at most `k_max`, for a drafter
    /// costing `draft_cost` and a verification row costing `verify_cost`
    /// (both as fractions of a decode step).
    pub fn choose(&mut self, k_max: usize, draft_cost: f64, verify_cost: f64) -> usize {
        let best = best_k(self.rate(), k_max, draft_cost + verify_cost);
        if best > 0 {
            self.idle_steps = 0;
            return best;
        }
        self.idle_steps += 1;
        if self.idle_steps >= PROBE_EVERY && k_max > 0 {
            self.idle_steps = 0;
            1
        } else {
            0
        }
    }
}

/// The `k` in `0..=k_max` with the most expected tokens per unit of cost.
pub fn best_k(alpha: f64, k_max: usize, cost_per_draft: f64) -> usize {
    let alpha = alpha.clamp(0.0, 1.0);
    let mut best = (0, 1.0);
    let (mut tokens, mut power) = (1.0, 1.0);
    for k in 1..=k_max {
        power *= alpha;
        tokens += power;
        let per_cost = tokens / (1.0 + k as f64 * cost_per_draft);
        if per_cost > best.1 * (1.0 + 1e-9) {
            best = (k, per_cost);
        }
    }
    best.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_drafts_when_accepted_none_when_rejected() {
        assert_eq!(best_k(0.9, 8, 0.03), 8);
        assert_eq!(best_k(0.0, 8, 0.03), 0);
        // A draft model at a quarter of the target's cost needs α > ~0.27
        // for even one token to pay.
        assert_eq!(best_k(0.2, 8, 0.28), 0);
        assert!(best_k(0.8, 8, 0.28) >= 2);
    }

    #[test]
    fn the_estimate_follows_the_verifications_and_probes_when_idle() {
        let mut a = AdaptiveK::default();
        for _ in 0..30 {
            a.observe(4, 0);
        }
        // The prior still weighs in: 1 / (10 + 2).
        assert!(a.rate() < 0.2, "{}", a.rate());
        let picks: Vec<usize> = (0..PROBE_EVERY).map(|_| a.choose(4, 0.3, 0.03)).collect();
        assert_eq!(picks.iter().filter(|&&k| k == 1).count(), 1, "{picks:?}");
        assert!(picks.iter().all(|&k| k <= 1));
        for _ in 0..30 {
            a.observe(4, 4);
        }
        assert!(a.rate() > 0.9, "{}", a.rate());
        assert_eq!(a.choose(4, 0.0, 0.03), 4);
    }
}
