//! Multi-head latent attention (DeepSeek-V2/V3, [`MlaSpec`]) on the CPU.
//!
//! The cache holds one row per token and layer: the normed latent `c`
//! (`kv_lora_rank`) and the rotated shared key part `k_pe`
//! (`qk_rope_head_dim`). Head `h`'s key is `[W_UK[h]·c, k_pe]` and its
//! value `W_UV[h]·c`, `W_UK`/`W_UV` being `kv_b_proj`'s rows. Two forms
//! compute the same attention:
//!
//! - **Absorbed** (decode): `q_nope·(W_UK·c) = (W_UKᵀ·q_nope)·c`, so each
//!   query head becomes one `kv_lora_rank + qk_rope_head_dim` vector scored
//!   against the cached rows as they are (multi-query attention over one
//!   latent "head"); the weighted sum of rows is mapped to the value by
//!   `W_UV[h]` once per query. A step reads the latent cache and nothing
//!   else: the point of the layout, since decode is bound by reading KV.
//! - **Expanded** (prefill): every cached row of the sequence is expanded
//!   through `kv_b_proj` into per-head keys and values once, then ordinary
//!   attention runs on `qk_nope + qk_rope` wide keys. Expanding costs
//!   `rank × (nope + v)` per row and head, once; each query then saves
//!   `2 × (rank + rope) − (nope + rope + v)` per row and head, so a
//!   sequence with more new tokens than the ratio of the two runs expanded
//!   ([`MlaForm::Auto`]; about 160 for DeepSeek-V3's shape).
//!
//! YaRN's factor multiplies the rotated parts of queries and keys only, as
//! in transformers; it is folded into the query's rotated part (squared),
//! so cached rows are the same under either form.

use rayon::prelude::*;

use crate::arch::MlaSpec;
use crate::attention::{paged_attention, AttnSeq, Heads, Scoring};
use crate::kernels::{axpy_f32, dot_f32, rms_norm_in_place, MatmulPolicy, RopeTable};
use crate::kv_cache::{unrotate_row, KvCache};
use crate::weights::Matrix;

use super::linear::Linear;

/// transformers' `DeepseekV3RMSNorm` default, which `q_a_layernorm` and
/// `kv_a_layernorm` are built with (not the config's `rms_norm_eps`).
const LATENT_NORM_EPS: f32 = 1e-6;

/// Queries per expanded-form task (one head each).
const QUERY_TILE: usize = 32;

/// Which form of the attention a step runs (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MlaForm {
    /// Expanded for sequences with many new tokens, absorbed otherwise.
    #[default]
    Auto,
    Absorbed,
    Expanded,
}

/// The query projection: one matrix, or a low-rank pair with a norm.
#[derive(Debug)]
pub(super) enum LatentQuery {
    Direct(Linear),
    LowRank {
        a: Linear,
        norm: Vec<f32>,
        b: Linear,
    },
}

/// One layer's latent attention weights (all heads: it runs unsplit).
#[derive(Debug)]
pub(super) struct LatentAttention {
    pub(super) spec: MlaSpec,
    pub(super) num_heads: usize,
    pub(super) q: LatentQuery,
    /// `hidden → kv_lora_rank + qk_rope_head_dim`.
    pub(super) kv_a: Linear,
    pub(super) kv_a_norm: Vec<f32>,
    /// `kv_lora_rank → heads × (qk_nope + v)`, for the expanded form.
    pub(super) kv_b: Matrix,
    /// `kv_b`'s key rows in f32, `[head][nope][rank]`, and value rows,
    /// `[head][v][rank]`, for the absorbed form.
    w_uk: Vec<f32>,
    w_uv: Vec<f32>,
}

/// What a step hands the attention besides its inputs.
pub(super) struct MlaStep<'a, 'b> {
    pub(super) layer: usize,
    pub(super) seqs: &'a [AttnSeq<'b>],
    pub(super) rope: &'a RopeTable,
    pub(super) cos: &'a [f32],
    pub(super) sin: &'a [f32],
    pub(super) scale: f32,
    pub(super) matmul: MatmulPolicy,
    pub(super) form: MlaForm,
}

impl LatentAttention {
    pub(super) fn new(
        spec: MlaSpec,
        num_heads: usize,
        q: LatentQuery,
        (kv_a, kv_a_norm): (Linear, Vec<f32>),
        kv_b: Matrix,
    ) -> Self {
        let (rank, nope, v) = (spec.kv_lora_rank, spec.qk_nope_head_dim, spec.v_head_dim);
        let mut w_uk = vec![0.0f32; num_heads * nope * rank];
        let mut w_uv = vec![0.0f32; num_heads * v * rank];
        for h in 0..num_heads {
            let base = h * (nope + v);
            for i in 0..nope {
                let dst = (h * nope + i) * rank;
                kv_b.row_to_f32(base + i, &mut w_uk[dst..dst + rank]);
            }
            for i in 0..v {
                let dst = (h * v + i) * rank;
                kv_b.row_to_f32(base + nope + i, &mut w_uv[dst..dst + rank]);
            }
        }
        Self {
            spec,
            num_heads,
            q,
            kv_a,
            kv_a_norm,
            kv_b,
            w_uk,
            w_uv,
        }
    }

    /// The projections INT4 may replace (`kv_b` stays: both forms read it).
    pub(super) fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        let mut out = vec![("kv_a_proj_with_mqa", &mut self.kv_a)];
        match &mut self.q {
            LatentQuery::Direct(q) => out.push(("q_proj", q)),
            LatentQuery::LowRank { a, b, .. } => {
                out.push(("q_a_proj", a));
                out.push(("q_b_proj", b));
            }
        }
        out
    }

    pub(super) fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let mut out = vec![("kv_a_proj_with_mqa", &self.kv_a)];
        match &self.q {
            LatentQuery::Direct(q) => out.push(("q_proj", q)),
            LatentQuery::LowRank { a, b, .. } => {
                out.push(("q_a_proj", a));
                out.push(("q_b_proj", b));
            }
        }
        out
    }

    /// Attention over `t` rows of normed input `x`: writes each new
    /// token's latent row into the cache and returns `[t, heads × v]`,
    /// the output projection's input.
    pub(super) fn forward(
        &self,
        x: &[f32],
        t: usize,
        kv: &mut KvCache,
        step: &MlaStep<'_, '_>,
    ) -> Vec<f32> {
        let s = &self.spec;
        let (heads, qk, width) = (self.num_heads, s.qk_head_dim(), s.latent_width());
        let mut q = vec![0.0f32; t * heads * qk];
        match &self.q {
            LatentQuery::Direct(p) => p.forward(x, t, step.matmul, &mut q),
            LatentQuery::LowRank { a, norm, b } => {
                let mut low = vec![0.0f32; t * norm.len()];
                a.forward(x, t, step.matmul, &mut low);
                rms_norm_in_place(&mut low, norm, LATENT_NORM_EPS);
                b.forward(&low, t, step.matmul, &mut q);
            }
        }
        let mut latent = vec![0.0f32; t * width];
        self.kv_a.forward(x, t, step.matmul, &mut latent);
        let (rank, rope_dim) = (s.kv_lora_rank, s.qk_rope_head_dim);
        let half = rope_dim / 2;
        let factor = step.rope.score_factor();
        for i in 0..t {
            let (cs, sn) = (
                &step.cos[i * half..(i + 1) * half],
                &step.sin[i * half..(i + 1) * half],
            );
            let row = &mut latent[i * width..(i + 1) * width];
            rms_norm_in_place(&mut row[..rank], &self.kv_a_norm, LATENT_NORM_EPS);
            self.rotate(&mut row[rank..], step.rope, cs, sn, 1.0);
            for h in 0..heads {
                let head = &mut q[(i * heads + h) * qk..(i * heads + h + 1) * qk];
                self.rotate(&mut head[s.qk_nope_head_dim..], step.rope, cs, sn, factor);
            }
        }
        let bs = kv.layout().block_size;
        for seq in step.seqs {
            for j in 0..seq.len {
                let pos = seq.start_pos + j;
                let row = &latent[(seq.row + j) * width..(seq.row + j + 1) * width];
                kv.write(step.layer, seq.blocks[pos / bs], pos % bs, row, &[]);
            }
        }
        let (expanded, absorbed): (Vec<AttnSeq<'_>>, Vec<AttnSeq<'_>>) = step
            .seqs
            .iter()
            .partition(|seq| self.expands(seq.len, step.form));
        let mut out = vec![0.0f32; t * heads * s.v_head_dim];
        if !absorbed.is_empty() {
            self.absorbed(&q, t, kv, step, &absorbed, &mut out);
        }
        if !expanded.is_empty() {
            self.expanded(&q, kv, step, &expanded, &mut out);
        }
        out
    }

    /// Whether a sequence with `new_tokens` runs the expanded form.
    fn expands(&self, new_tokens: usize, form: MlaForm) -> bool {
        let s = &self.spec;
        match form {
            MlaForm::Absorbed => false,
            MlaForm::Expanded => true,
            MlaForm::Auto => {
                let saved = (2 * s.latent_width()).saturating_sub(s.qk_head_dim() + s.v_head_dim);
                new_tokens * saved > s.kv_lora_rank * (s.qk_nope_head_dim + s.v_head_dim)
            }
        }
    }

    /// RoPE on one rotated part (de-interleaved first where the checkpoint
    /// pairs neighbours), scaled by `factor`.
    fn rotate(&self, part: &mut [f32], rope: &RopeTable, cos: &[f32], sin: &[f32], factor: f32) {
        if self.spec.rope_interleave {
            // `(x0, x1), (x2, x3)…` → `(x0, x2…, x1, x3…)`: then the pairs
            // are `(x_i, x_{i + d/2})`, as `RopeTable::apply` rotates them.
            let mut stack = [0.0f32; 128];
            let mut heap = Vec::new();
            let pairs: &mut [f32] = match part.len() <= stack.len() {
                true => &mut stack[..part.len()],
                false => {
                    heap.resize(part.len(), 0.0);
                    &mut heap
                }
            };
            pairs.copy_from_slice(part);
            let half = part.len() / 2;
            for i in 0..half {
                part[i] = pairs[2 * i];
                part[half + i] = pairs[2 * i + 1];
            }
        }
        rope.apply(part, part.len(), cos, sin);
        if factor != 1.0 {
            for v in part.iter_mut() {
                *v *= factor;
            }
        }
    }

    /// The absorbed form over `seqs`: queries folded through `W_UK`,
    /// paged attention over the latent rows, sums mapped through `W_UV`.
    fn absorbed(
        &self,
        q: &[f32],
        t: usize,
        kv: &KvCache,
        step: &MlaStep<'_, '_>,
        seqs: &[AttnSeq<'_>],
        out: &mut [f32],
    ) {
        let s = &self.spec;
        let (heads, qk, width) = (self.num_heads, s.qk_head_dim(), s.latent_width());
        let (rank, nope, vd) = (s.kv_lora_rank, s.qk_nope_head_dim, s.v_head_dim);
        let mut q_lat = vec![0.0f32; t * heads * width];
        q_lat
            .par_chunks_mut(width)
            .enumerate()
            .for_each(|(rh, dst)| {
                let h = rh % heads;
                let src = &q[rh * qk..(rh + 1) * qk];
                let (lat, pe) = dst.split_at_mut(rank);
                for (i, &qi) in src[..nope].iter().enumerate() {
                    let w = &self.w_uk[(h * nope + i) * rank..(h * nope + i + 1) * rank];
                    axpy_f32(lat, qi, w);
                }
                pe.copy_from_slice(&src[nope..]);
            });
        let geometry = Heads {
            num_heads: heads,
            num_kv_heads: 1,
            head_dim: width,
        };
        let scoring = Scoring {
            scale: step.scale,
            ..Scoring::causal(width)
        };
        let mut summed = vec![0.0f32; t * heads * width];
        paged_attention(&q_lat, kv, step.layer, seqs, geometry, scoring, &mut summed);
        let rows: Vec<usize> = seqs.iter().flat_map(|q| q.row..q.row + q.len).collect();
        let out_ptr = crate::kernels::OutPtr(out.as_mut_ptr());
        let out_len = out.len();
        rows.par_iter().for_each(|&row| {
            let ptr = out_ptr;
            // SAFETY: each task writes only its own row's `heads × vd`
            // values; rows are distinct and inside `out` (sliced below).
            let all = unsafe { std::slice::from_raw_parts_mut(ptr.0, out_len) };
            let dst = &mut all[row * heads * vd..(row + 1) * heads * vd];
            for h in 0..heads {
                let c = &summed[(row * heads + h) * width..(row * heads + h) * width + rank];
                for (i, o) in dst[h * vd..(h + 1) * vd].iter_mut().enumerate() {
                    *o = dot_f32(&self.w_uv[(h * vd + i) * rank..(h * vd + i + 1) * rank], c);
                }
            }
        });
    }

    /// The expanded form over `seqs`: each sequence's cached latents
    /// through `kv_b_proj` into per-head keys and values, then causal
    /// attention with the full `qk_nope + qk_rope` keys. Keys and values
    /// are laid out head by head, so a task (one head, a tile of queries)
    /// streams contiguous rows.
    fn expanded(
        &self,
        q: &[f32],
        kv: &KvCache,
        step: &MlaStep<'_, '_>,
        seqs: &[AttnSeq<'_>],
        out: &mut [f32],
    ) {
        let s = &self.spec;
        let (heads, qk, vd) = (self.num_heads, s.qk_head_dim(), s.v_head_dim);
        for seq in seqs {
            let ctx = seq.start_pos + seq.len;
            let (keys, values) = self.expand(kv, step, seq, ctx);
            let tiles: Vec<(usize, usize)> = (0..heads)
                .flat_map(|h| (0..seq.len).step_by(QUERY_TILE).map(move |j| (h, j)))
                .collect();
            let out_ptr = crate::kernels::OutPtr(out.as_mut_ptr());
            let out_len = out.len();
            tiles.into_par_iter().for_each(|(h, j0)| {
                let ptr = out_ptr;
                let (keys, values) = (&keys[h * ctx * qk..], &values[h * ctx * vd..]);
                let mut scores = vec![0.0f32; ctx];
                for j in j0..(j0 + QUERY_TILE).min(seq.len) {
                    let row = seq.row + j;
                    let qh = &q[(row * heads + h) * qk..(row * heads + h + 1) * qk];
                    let visible = seq.start_pos + j + 1;
                    let mut max = f32::NEG_INFINITY;
                    for (p, sc) in scores[..visible].iter_mut().enumerate() {
                        *sc = dot_f32(qh, &keys[p * qk..(p + 1) * qk]) * step.scale;
                        max = max.max(*sc);
                    }
                    // SAFETY: each task writes only rows of its own queries
                    // and head, inside `out` (sliced below); tasks differ
                    // in head or in query tile.
                    let all = unsafe { std::slice::from_raw_parts_mut(ptr.0, out_len) };
                    let acc = &mut all[(row * heads + h) * vd..(row * heads + h + 1) * vd];
                    acc.fill(0.0);
                    let mut sum = 0.0f32;
                    for (p, &sc) in scores[..visible].iter().enumerate() {
                        let w = (sc - max).exp();
                        sum += w;
                        axpy_f32(acc, w, &values[p * vd..(p + 1) * vd]);
                    }
                    let inv = 1.0 / sum;
                    for a in acc.iter_mut() {
                        *a *= inv;
                    }
                }
            });
        }
    }

    /// A sequence's first `ctx` latents expanded through `kv_b_proj`:
    /// keys `[head][pos][qk_nope + qk_rope]` (the shared rotated part
    /// appended to each head's) and values `[head][pos][v]`.
    fn expand(
        &self,
        kv: &KvCache,
        step: &MlaStep<'_, '_>,
        seq: &AttnSeq<'_>,
        ctx: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let s = &self.spec;
        let heads = self.num_heads;
        let (rank, nope, vd, width) = (
            s.kv_lora_rank,
            s.qk_nope_head_dim,
            s.v_head_dim,
            s.latent_width(),
        );
        let qk = s.qk_head_dim();
        let rows = self.cached_rows(kv, step.layer, seq, ctx);
        let mut c = vec![0.0f32; ctx * rank];
        for (dst, src) in c.chunks_exact_mut(rank).zip(rows.chunks_exact(width)) {
            dst.copy_from_slice(&src[..rank]);
        }
        let per_head = nope + vd;
        let mut kvx = vec![0.0f32; ctx * heads * per_head];
        crate::kernels::linear(&c, ctx, &self.kv_b, None, step.matmul, &mut kvx);
        let mut keys = vec![0.0f32; heads * ctx * qk];
        let mut values = vec![0.0f32; heads * ctx * vd];
        keys.par_chunks_mut(ctx * qk)
            .zip(values.par_chunks_mut(ctx * vd))
            .enumerate()
            .for_each(|(h, (k, v))| {
                for p in 0..ctx {
                    let src = &kvx[(p * heads + h) * per_head..(p * heads + h + 1) * per_head];
                    let key = &mut k[p * qk..(p + 1) * qk];
                    key[..nope].copy_from_slice(&src[..nope]);
                    key[nope..].copy_from_slice(&rows[p * width + rank..(p + 1) * width]);
                    v[p * vd..(p + 1) * vd].copy_from_slice(&src[nope..]);
                }
            });
        (keys, values)
    }

    /// A sequence's first `ctx` cached latent rows, in f32 and unrotated.
    fn cached_rows(&self, kv: &KvCache, layer: usize, seq: &AttnSeq<'_>, ctx: usize) -> Vec<f32> {
        let width = self.spec.latent_width();
        let bs = kv.layout().block_size;
        let view = kv.layer(layer);
        let mut rows = vec![0.0f32; ctx * width];
        let mut buf = vec![0.0f32; width];
        for (p, dst) in rows.chunks_exact_mut(width).enumerate() {
            let base = kv.offset(seq.blocks[p / bs], 0, p % bs) / width;
            let (row, scale) = view.key(base, &mut buf);
            for (d, &v) in dst.iter_mut().zip(row) {
                *d = v * scale;
            }
            if view.rotated() {
                unrotate_row(dst);
            }
        }
        rows
    }
}
