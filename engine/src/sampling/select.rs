//! The selection kernels under the sampler: the top `k` of a row in one
//! pass, top-p's nucleus in linear time, a vectorisable `exp`, and the
//! ordering they share (by value, ties to the lower token id).

use std::cmp::Ordering;

pub(super) fn by_value_desc(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.partial_cmp(&a.1)
        .unwrap_or(Ordering::Equal)
        .then(a.0.cmp(&b.0))
}

/// Index of the largest value (the first, on ties).
pub fn argmax(z: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in z.iter().enumerate() {
        if v > z[best] {
            best = i;
        }
    }
    best as u32
}

/// The `k` largest logits (ties to the lower token id, as `by_value_desc`
/// orders them), masked-out ones (−∞) never: one pass against the worst
/// kept so far, which rejects almost every token with one comparison, where
/// a selection over the whole vocabulary moves every element.
pub(crate) fn top_k_logits(z: &[f32], k: usize) -> Vec<(u32, f32)> {
    use std::collections::BinaryHeap;
    /// Ordered so that the heap's top is the worst kept candidate.
    struct Kept((u32, f32));
    impl PartialEq for Kept {
        fn eq(&self, other: &Self) -> bool {
            self.cmp(other) == Ordering::Equal
        }
    }
    impl Eq for Kept {}
    impl PartialOrd for Kept {
        fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
            Some(self.cmp(other))
        }
    }
    impl Ord for Kept {
        fn cmp(&self, other: &Self) -> Ordering {
            by_value_desc(&self.0, &other.0)
        }
    }
    let mut heap = BinaryHeap::with_capacity(k + 1);
    for (i, &v) in z.iter().enumerate() {
        // Masked out (−∞), or NaN: never a candidate.
        if v == f32::NEG_INFINITY || v.is_nan() {
            continue;
        }
        let c = (i as u32, v);
        if heap.len() < k {
            heap.push(Kept(c));
        } else if let Some(mut worst) = heap.peek_mut() {
            // A later token ranks after an equal earlier one: only a
            // strictly larger logit displaces the worst.
            if v > worst.0 .1 {
                *worst = Kept(c);
            }
        }
    }
    heap.into_iter().map(|kept| kept.0).collect()
}

/// `exp(x)` for `x ≤ 0` (a logit minus the largest, over a temperature),
/// within 2 ulp of `f32::exp`, and 0 below −87.3 (where the result is no
/// longer a normal float) and for −∞ and NaN. Plain arithmetic and bit
/// operations only (Cephes' `expf`: round `x·log2 e` to `n` with the
/// 1.5·2^23 trick, a degree-6 polynomial for `e^r` on |r| ≤ ln2/2, then
/// scale by `2^n` through the exponent bits; no `mul_add`, which is a libm
/// call on CPUs built without FMA), so a loop of it vectorises:
/// `f32::exp` is a libm call per token, the sampler's largest cost on a
/// 128k vocabulary.
pub(super) fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const MIN: f32 = -87.336_54;
    let in_range = x >= MIN; // false for NaN and −∞
    let x = if in_range { x.min(0.0) } else { 0.0 };
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p: f32 = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // The low mantissa bits of `t` hold n (−126 ≤ n ≤ 0 here).
    let n = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let scale = f32::from_bits(((n + 127) as u32) << 23);
    if in_range {
        e * scale
    } else {
        0.0
    }
}

/// Top-p buckets weights by the top bits of their `f32` pattern: sign,
/// exponent and 7 mantissa bits. Weights are in [0, 1] (the largest logit
/// was subtracted before `exp`), and non-negative floats order like their
/// bit patterns, so the buckets order like the weights, each spanning
/// under 1% of its values.
const TOP_P_BUCKET_SHIFT: u32 = 16;

/// Buckets up to and including the one of weight 1.
const TOP_P_BUCKETS: usize = (1.0f32.to_bits() >> TOP_P_BUCKET_SHIFT) as usize + 1;

fn top_p_bucket(weight: f32) -> usize {
    // Clamped: a NaN or infinite weight (from a NaN logit) must not index
    // out of range.
    ((weight.to_bits() >> TOP_P_BUCKET_SHIFT) as usize).min(TOP_P_BUCKETS - 1)
}

/// Keeps the smallest most-likely-first prefix of `cand` whose share of
/// the total weight reaches `top_p` (ties by token id, as
/// `by_value_desc` orders them), in linear time instead of a sort: one pass
/// sums the weight per bucket ([`TOP_P_BUCKET_SHIFT`]); walking the
/// buckets from the heaviest finds the one where the running mass reaches
/// the target; every candidate above it is kept, and only that boundary
/// bucket is sorted, to find exactly where the target is reached.
pub(super) fn keep_top_p(cand: &mut Vec<(u32, f32)>, top_p: f32) {
    let mut mass = vec![0.0f64; TOP_P_BUCKETS];
    let mut total = 0.0f64;
    for c in cand.iter() {
        mass[top_p_bucket(c.1)] += f64::from(c.1);
        total += f64::from(c.1);
    }
    let target = f64::from(top_p) * total;
    let (mut above, mut boundary) = (0.0f64, 0);
    for (b, &m) in mass.iter().enumerate().rev() {
        if above + m >= target {
            boundary = b;
            break;
        }
        above += m;
    }
    let mut edge: Vec<(u32, f32)> = cand
        .iter()
        .filter(|c| top_p_bucket(c.1) == boundary)
        .copied()
        .collect();
    edge.sort_unstable_by(by_value_desc);
    let mut cum = above;
    let take = edge
        .iter()
        .position(|c| {
            cum += f64::from(c.1);
            cum >= target
        })
        // Rounding left the whole mass a hair short: keep the bucket.
        .map_or(edge.len(), |i| i + 1);
    cand.retain(|c| top_p_bucket(c.1) > boundary);
    cand.extend_from_slice(&edge[..take]);
}

/// The `n` largest log-probabilities, most likely first (ties to the lower
/// token id); masked-out tokens (−∞) are not alternatives.
pub(super) fn top_n(lp: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut top = top_k_logits(lp, n);
    top.sort_unstable_by(by_value_desc);
    top
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::Rng;

    #[test]
    fn exp_nonpositive_matches_the_library_exp() {
        let mut worst = 0.0f64;
        let mut x = 0.0f32;
        while x > -87.3 {
            let (got, want) = (exp_nonpositive(x), x.exp());
            let rel = ((f64::from(got) - f64::from(want)) / f64::from(want)).abs();
            worst = worst.max(rel);
            x -= 0.000_37;
        }
        assert!(worst < 3.0e-7, "worst relative error {worst:e}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-100.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(f32::NAN), 0.0);
    }

    #[test]
    fn top_k_keeps_the_largest_logits_ties_to_the_lower_id() {
        let z = [1.0f32, 3.0, f32::NEG_INFINITY, 3.0, 2.0, 3.0, 0.5];
        let mut top = top_k_logits(&z, 3);
        top.sort_unstable_by(by_value_desc);
        assert_eq!(top, [(1, 3.0), (3, 3.0), (5, 3.0)]);
        let mut top = top_k_logits(&z, 5);
        top.sort_unstable_by(by_value_desc);
        assert_eq!(top, [(1, 3.0), (3, 3.0), (5, 3.0), (4, 2.0), (0, 1.0)]);
        let mut rng = Rng::seeded(5);
        let z: Vec<f32> = (0..5000).map(|_| (rng.next_f64() * 8.0) as f32).collect();
        let mut all: Vec<(u32, f32)> = z.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        all.sort_unstable_by(by_value_desc);
        let mut top = top_k_logits(&z, 50);
        top.sort_unstable_by(by_value_desc);
        assert_eq!(top, all[..50]);
    }
}
