//! A decoder layer's MLP: dense, or a mixture of experts.
//!
//! A sparse MLP routes each token to `top_k` of its experts and sums their
//! outputs, weighted. It never loops over tokens: after routing, the
//! batch's (token, expert) pairs are sorted by expert (a counting sort), and
//! each expert that got tokens runs one gated MLP over all of them, its rows
//! gathered into one matrix, so its weights are read once per step however
//! many tokens chose it. Each output row is then added to its token's sum in
//! ascending expert order, the same order whatever else is in the batch, so
//! with [`MatmulPolicy::BatchInvariant`] a token's result does not depend on
//! its batch. The experts are [`Linear`]s like any other: mapped in place,
//! split by intermediate feature under tensor parallelism (the router is
//! replicated, each rank routes identically and the all-reduce after the MLP
//! sums the ranks' partial outputs), quantized by `--quantize int4`.

use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use crate::arch::{Activation, GroupScore, MoeSpec, Routing};
use crate::kernels::{self, clamped_swiglu_mul, gelu_tanh_mul, silu_mul, MatmulPolicy};
use crate::weights::Matrix;

use super::linear::Linear;
use crate::lora::{LayerLora, LoraTarget};

/// `down(act(gate(x)) · up(x))`.
#[derive(Debug)]
pub(super) struct DenseMlp {
    pub(super) gate: Linear,
    pub(super) up: Linear,
    pub(super) down: Linear,
}

impl DenseMlp {
    /// Runs `m` rows of `x` into `out` (`m × hidden`), with `gate` and `up`
    /// as scratch of at least `m × intermediate` each, each row's LoRA
    /// adapter added to its projections (experts have none).
    pub(super) fn forward(
        &self,
        x: &[f32],
        m: usize,
        (act, policy): (Activation, MatmulPolicy),
        lora: LayerLora<'_>,
        scratch: (&mut [f32], &mut [f32]),
        out: &mut [f32],
    ) {
        let inter = self.gate.out_features();
        let (gate, up) = (&mut scratch.0[..m * inter], &mut scratch.1[..m * inter]);
        Linear::forward_fused(
            [(&self.gate, &mut *gate), (&self.up, &mut *up)],
            x,
            m,
            policy,
        );
        lora.apply(LoraTarget::Gate, x, gate);
        lora.apply(LoraTarget::Up, x, up);
        match act {
            Activation::Silu => silu_mul(gate, up),
            Activation::GeluTanh => gelu_tanh_mul(gate, up),
            Activation::ClampedSwiglu { alpha, limit } => {
                clamped_swiglu_mul(gate, up, alpha, limit)
            }
        }
        self.down.forward(gate, m, policy, out);
        lora.apply(LoraTarget::Down, gate, out);
    }

    fn linears(&self) -> [(&'static str, &Linear); 3] {
        [
            ("gate_proj", &self.gate),
            ("up_proj", &self.up),
            ("down_proj", &self.down),
        ]
    }

    fn linears_mut(&mut self) -> [(&'static str, &mut Linear); 3] {
        [
            ("gate_proj", &mut self.gate),
            ("up_proj", &mut self.up),
            ("down_proj", &mut self.down),
        ]
    }
}

/// The always-on expert: Qwen2-MoE's with its `[1, hidden]` sigmoid
/// gate, DeepSeek's ungated.
#[derive(Debug)]
pub(super) struct SharedExpert {
    pub(super) mlp: DenseMlp,
    pub(super) gate: Option<Matrix>,
}

/// A mixture of experts.
#[derive(Debug)]
pub(super) struct SparseMlp {
    /// `[num_experts, hidden]`, replicated on every tensor-parallel rank.
    pub(super) router: Matrix,
    pub(super) router_bias: Option<Vec<f32>>,
    /// Added to the scores to choose experts, not to weight them
    /// (DeepSeek-V3's `e_score_correction_bias`).
    pub(super) choice_bias: Option<Vec<f32>>,
    /// This rank's experts (all of them without expert parallelism),
    /// `first_expert` onwards.
    pub(super) experts: Vec<DenseMlp>,
    pub(super) first_expert: usize,
    pub(super) shared: Option<SharedExpert>,
    pub(super) top_k: usize,
    pub(super) routing: Routing,
    /// Tokens routed to each expert since load (a token counts once per
    /// expert it chose).
    pub(super) routed: Vec<AtomicU64>,
}

/// A batch's routing, sorted by expert: expert `e`'s tokens are
/// `rows[starts[e]..starts[e + 1]]`, with their weights alongside.
#[derive(Debug, PartialEq)]
pub(super) struct Routes {
    pub(super) starts: Vec<usize>,
    pub(super) rows: Vec<u32>,
    pub(super) weights: Vec<f32>,
}

impl SparseMlp {
    pub(super) fn new(
        (router, router_bias): (Matrix, Option<Vec<f32>>),
        (first_expert, experts): (usize, Vec<DenseMlp>),
        shared: Option<SharedExpert>,
        spec: &MoeSpec,
    ) -> Self {
        let routed = (0..spec.num_experts).map(|_| AtomicU64::new(0)).collect();
        Self {
            router,
            router_bias,
            choice_bias: None,
            experts,
            first_expert,
            shared,
            top_k: spec.top_k,
            routing: spec.routing,
            routed,
        }
    }

    /// Routes `m` rows of `x` and sums their experts' outputs into `out`
    /// (`m × hidden`, overwritten).
    pub(super) fn forward(
        &self,
        input: &[f32],
        m: usize,
        act: Activation,
        policy: MatmulPolicy,
        out: &mut [f32],
    ) {
        let (e, hsz) = (self.router.rows, self.router.cols);
        let mut logits = vec![0.0f32; m * e];
        let bias = self.router_bias.as_deref();
        kernels::linear(input, m, &self.router, bias, policy, &mut logits);
        let routes = route(
            &logits,
            e,
            self.top_k,
            self.routing,
            self.choice_bias.as_deref(),
        );
        for (counter, w) in self.routed.iter().zip(routes.starts.windows(2)) {
            counter.fetch_add((w[1] - w[0]) as u64, Ordering::Relaxed);
        }
        out[..m * hsz].fill(0.0);
        // Experts run side by side, one task each (a step of small batches
        // has many experts of a few rows: one parallel loop over them costs
        // far less than a parallel loop inside each of their matrices);
        // their rows are added in ascending expert order afterwards, so the
        // sum does not depend on the schedule.
        // This rank's experts that got tokens (expert parallelism: the
        // others' outputs come from their ranks through the all-reduce).
        let mine = self.first_expert..self.first_expert + self.experts.len();
        let active: Vec<usize> = mine
            .filter(|&x| routes.starts[x + 1] > routes.starts[x])
            .collect();
        let outputs: Vec<Vec<f32>> = active
            .par_iter()
            .map(|&x| {
                let rows = &routes.rows[routes.starts[x]..routes.starts[x + 1]];
                self.run_expert(x, rows, input, act, policy)
            })
            .collect();
        for (&x, done) in active.iter().zip(&outputs) {
            let span = routes.starts[x]..routes.starts[x + 1];
            let weighted = routes.rows[span.clone()].iter().zip(&routes.weights[span]);
            for (src, (&r, &w)) in done.chunks_exact(hsz).zip(weighted) {
                let r = r as usize;
                for (o, &v) in out[r * hsz..(r + 1) * hsz].iter_mut().zip(src) {
                    *o += w * v;
                }
            }
        }
        if let Some(shared) = &self.shared {
            self.add_shared(shared, input, m, act, policy, out);
        }
    }

    /// Expert `expert` over the rows `rows` of `x`, gathered into one
    /// matrix: its `rows.len() × hidden` outputs, unweighted.
    fn run_expert(
        &self,
        expert: usize,
        rows: &[u32],
        x: &[f32],
        act: Activation,
        policy: MatmulPolicy,
    ) -> Vec<f32> {
        let (n, hsz) = (rows.len(), self.router.cols);
        let mlp = &self.experts[expert - self.first_expert];
        let inter = mlp.gate.out_features();
        let mut gathered = vec![0.0f32; n * hsz];
        for (dst, &r) in gathered.chunks_exact_mut(hsz).zip(rows) {
            let r = r as usize;
            dst.copy_from_slice(&x[r * hsz..(r + 1) * hsz]);
        }
        let (mut gate, mut up) = (vec![0.0f32; n * inter], vec![0.0f32; n * inter]);
        let mut out = vec![0.0f32; n * hsz];
        let scratch = (&mut gate[..], &mut up[..]);
        mlp.forward(
            &gathered,
            n,
            (act, policy),
            LayerLora::NONE,
            scratch,
            &mut out,
        );
        out
    }

    /// `out += sigmoid(gate · x) · shared(x)` (or `shared(x)` ungated), row
    /// by row.
    fn add_shared(
        &self,
        shared: &SharedExpert,
        x: &[f32],
        m: usize,
        act: Activation,
        policy: MatmulPolicy,
        out: &mut [f32],
    ) {
        let hsz = self.router.cols;
        let inter = shared.mlp.gate.out_features();
        let (mut gate, mut up) = (vec![0.0f32; m * inter], vec![0.0f32; m * inter]);
        let mut y = vec![0.0f32; m * hsz];
        let scratch = (&mut gate[..], &mut up[..]);
        let none = LayerLora::NONE;
        shared
            .mlp
            .forward(x, m, (act, policy), none, scratch, &mut y);
        let mut g = vec![0.0f32; m];
        if let Some(gate) = &shared.gate {
            kernels::linear(x, m, gate, None, policy, &mut g);
        }
        let gated = shared.gate.is_some();
        for ((row, src), &g) in out.chunks_exact_mut(hsz).zip(y.chunks_exact(hsz)).zip(&g) {
            let s = if gated { 1.0 / (1.0 + (-g).exp()) } else { 1.0 };
            for (o, &v) in row.iter_mut().zip(src) {
                *o += s * v;
            }
        }
    }

    /// Tokens routed to each expert since load.
    pub(super) fn routed_tokens(&self) -> Vec<u64> {
        self.routed
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}

/// Each row of `logits` (`num_experts` wide) picks its `top_k` experts,
/// then the picks are sorted by expert (rows ascending within one).
/// `choice_bias` ([`Routing::Grouped`]) is added to the scores for the
/// choice only.
pub(super) fn route(
    logits: &[f32],
    num_experts: usize,
    top_k: usize,
    routing: Routing,
    choice_bias: Option<&[f32]>,
) -> Routes {
    let m = logits.len() / num_experts;
    let mut picks: Vec<(u32, f32)> = Vec::with_capacity(m * top_k);
    let mut probs = vec![0.0f32; num_experts];
    let mut choice = vec![0.0f32; num_experts];
    let mut order: Vec<usize> = Vec::with_capacity(num_experts);
    for row in logits.chunks_exact(num_experts) {
        let (renormalize, scale) = match routing {
            Routing::SoftmaxTopK { renormalize } => (renormalize, 1.0),
            // A softmax over the top k logits is the softmax over all of
            // them, restricted to those k and renormalised.
            Routing::TopKSoftmax => (true, 1.0),
            Routing::Grouped {
                renormalize, scale, ..
            } => (renormalize, scale),
        };
        match routing {
            Routing::Grouped { sigmoid: true, .. } => {
                for (p, &l) in probs.iter_mut().zip(row) {
                    *p = 1.0 / (1.0 + (-l).exp());
                }
            }
            _ => softmax_into(row, &mut probs),
        }
        choice.copy_from_slice(&probs);
        if let Some(bias) = choice_bias {
            for (c, b) in choice.iter_mut().zip(bias) {
                *c += b;
            }
        }
        if let Routing::Grouped {
            groups,
            topk_groups,
            group_score,
            ..
        } = routing
        {
            keep_best_groups(&mut choice, groups, topk_groups, group_score);
        }
        order.clear();
        order.extend(0..num_experts);
        // Largest first; equal scores keep the lower expert first.
        order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
        let top = &order[..top_k];
        let norm = match renormalize {
            // transformers' DeepSeek-V3 adds 1e-20 to the sum.
            true => top.iter().map(|&e| probs[e]).sum::<f32>() + 1e-20,
            false => 1.0,
        };
        picks.extend(top.iter().map(|&e| (e as u32, probs[e] / norm * scale)));
    }
    // Counting sort by expert; a stable pass keeps rows ascending.
    let mut starts = vec![0usize; num_experts + 1];
    for &(e, _) in &picks {
        starts[e as usize + 1] += 1;
    }
    for e in 0..num_experts {
        starts[e + 1] += starts[e];
    }
    let mut next = starts.clone();
    let mut rows = vec![0u32; picks.len()];
    let mut weights = vec![0.0f32; picks.len()];
    for (i, &(e, w)) in picks.iter().enumerate() {
        let slot = &mut next[e as usize];
        rows[*slot] = (i / top_k) as u32;
        weights[*slot] = w;
        *slot += 1;
    }
    Routes {
        starts,
        rows,
        weights,
    }
}

/// Masks (to `-inf`) every expert outside the `keep` best of `groups`
/// equal groups, each ranked by `score`.
fn keep_best_groups(choice: &mut [f32], groups: usize, keep: usize, score: GroupScore) {
    if groups <= 1 || keep >= groups {
        return;
    }
    let per = choice.len() / groups;
    let rank = |g: &[f32]| -> f32 {
        match score {
            GroupScore::Max => g.iter().copied().fold(f32::NEG_INFINITY, f32::max),
            GroupScore::TopTwoSum => {
                let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &x in g {
                    if x > a {
                        (a, b) = (x, a);
                    } else if x > b {
                        b = x;
                    }
                }
                a + b
            }
        }
    };
    let ranks: Vec<f32> = choice.chunks_exact(per).map(rank).collect();
    let mut order: Vec<usize> = (0..groups).collect();
    order.sort_by(|&a, &b| ranks[b].total_cmp(&ranks[a]).then(a.cmp(&b)));
    for &g in &order[keep..] {
        choice[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
    }
}

/// `probs = softmax(row)`.
fn softmax_into(row: &[f32], probs: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for (p, &l) in probs.iter_mut().zip(row) {
        *p = (l - max).exp();
        sum += *p;
    }
    for p in probs.iter_mut() {
        *p /= sum;
    }
}

/// A layer's MLP.
#[derive(Debug)]
pub(super) enum Mlp {
    Dense(Box<DenseMlp>),
    Sparse(Box<SparseMlp>),
}

impl Mlp {
    /// Every linear layer with a name for messages (`gate_proj`,
    /// `expert 3 up_proj`, `shared_expert down_proj`); not the router,
    /// which stays dense.
    pub(super) fn linears(&self) -> Vec<(String, &Linear)> {
        match self {
            Self::Dense(d) => d.linears().map(|(n, l)| (n.to_string(), l)).into(),
            Self::Sparse(s) => {
                let first = s.first_expert;
                let experts = s.experts.iter().enumerate().flat_map(move |(e, x)| {
                    let e = first + e;
                    x.linears()
                        .map(move |(n, l)| (format!("expert {e} {n}"), l))
                });
                let shared = s.shared.iter().flat_map(|x| {
                    x.mlp
                        .linears()
                        .map(|(n, l)| (format!("shared_expert {n}"), l))
                });
                experts.chain(shared).collect()
            }
        }
    }

    /// As [`linears`](Self::linears), mutably.
    pub(super) fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        match self {
            Self::Dense(d) => d.linears_mut().map(|(n, l)| (n.to_string(), l)).into(),
            Self::Sparse(s) => {
                let first = s.first_expert;
                let experts = s.experts.iter_mut().enumerate().flat_map(move |(e, x)| {
                    let e = first + e;
                    x.linears_mut()
                        .map(move |(n, l)| (format!("expert {e} {n}"), l))
                });
                let shared = s.shared.iter_mut().flat_map(|x| {
                    x.mlp
                        .linears_mut()
                        .map(|(n, l)| (format!("shared_expert {n}"), l))
                });
                experts.chain(shared).collect()
            }
        }
    }

    /// Bytes of the router and shared gate (kept dense, not in
    /// [`linears`](Self::linears)).
    pub(super) fn routing_bytes(&self) -> usize {
        match self {
            Self::Dense(_) => 0,
            Self::Sparse(s) => {
                s.router.bytes()
                    + s.shared
                        .as_ref()
                        .and_then(|x| x.gate.as_ref())
                        .map_or(0, Matrix::bytes)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RENORM: Routing = Routing::SoftmaxTopK { renormalize: true };
    const RAW: Routing = Routing::SoftmaxTopK { renormalize: false };

    #[test]
    fn routes_are_sorted_by_expert_with_softmax_weights() {
        // Row 0 prefers experts 2 then 0; row 1 prefers 0 then 1.
        let logits = [1.0, 0.0, 3.0, 2.0f32.ln(), 0.0, 0.0];
        let r = route(&logits, 3, 2, RAW, None);
        assert_eq!(r.starts, vec![0, 2, 3, 4]);
        assert_eq!(r.rows, vec![0, 1, 1, 0]);
        let e = |x: f32| x.exp();
        let row0 = e(1.0) + e(0.0) + e(3.0);
        let row1 = 2.0 + 1.0 + 1.0;
        let want = [e(1.0) / row0, 2.0 / row1, 1.0 / row1, e(3.0) / row0];
        for (got, want) in r.weights.iter().zip(want) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
    }

    #[test]
    fn renormalised_top_k_weights_sum_to_one() {
        let logits = [0.3, -1.0, 2.0, 0.7, 0.1, 0.0, -0.5, 1.5];
        let r = route(&logits, 4, 2, RENORM, None);
        let mut per_row = [0.0f32; 2];
        for (&row, &w) in r.rows.iter().zip(&r.weights) {
            per_row[row as usize] += w;
        }
        for s in per_row {
            assert!((s - 1.0).abs() < 1e-6, "{s}");
        }
    }

    /// DeepSeek-V3's routing: the bias moves the choice, not the weight;
    /// only the best group's experts may be chosen.
    #[test]
    fn grouped_routing_chooses_with_the_bias_and_weighs_without_it() {
        let v3 = Routing::Grouped {
            sigmoid: true,
            groups: 2,
            topk_groups: 1,
            group_score: GroupScore::TopTwoSum,
            renormalize: false,
            scale: 2.0,
        };
        // Group 0 (experts 0, 1) outscores group 1 (2, 3) only with the
        // bias, which also lifts expert 1 over expert 0.
        let logits = [1.0, 0.5, 1.2, 1.1f32];
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        let unbiased = route(&logits, 4, 1, v3, None);
        assert_eq!(unbiased.starts, vec![0, 0, 0, 1, 1], "expert 2");
        let bias = [0.0, 0.5, 0.0, 0.0];
        let r = route(&logits, 4, 1, v3, Some(&bias));
        assert_eq!(r.starts, vec![0, 0, 1, 1, 1], "expert 1");
        assert!((r.weights[0] - 2.0 * sig(0.5)).abs() < 1e-6);
        // V2's group_limited_greedy ranks groups by their best expert.
        let v2 = Routing::Grouped {
            sigmoid: false,
            groups: 2,
            topk_groups: 1,
            group_score: GroupScore::Max,
            renormalize: false,
            scale: 1.0,
        };
        let r = route(&[3.0, 0.0, 2.0, 2.0], 4, 2, v2, None);
        assert_eq!(r.starts, vec![0, 1, 2, 2, 2], "both from group 0");
    }

    #[test]
    fn equal_logits_pick_the_lower_experts() {
        let r = route(&[0.0; 4], 4, 2, RAW, None);
        assert_eq!(r.starts, vec![0, 1, 2, 2, 2]);
    }
}
