//! Paged causal attention with online softmax.
//!
//! Each query walks its sequence's block table block by block, keeping a
//! running max, normaliser and weighted sum (the FlashAttention recurrence),
//! so no score matrix is ever materialised and K/V are read straight from the
//! paged pool. Work is split over (sequence, query head, tile of queries), so
//! a long prefill and many single-token decodes parallelise alike.
//!
//! A 16- or 8-bit cache is read in place too: each key or value row is
//! decoded into the task's `head_dim` buffer, and an 8-bit row's scale
//! multiplies the score (keys) or the softmax weight (values). 8-bit rows
//! are stored Hadamard-rotated (`kv_cache/q8.rs`): the query is rotated
//! once before scoring and the output once after.

use rayon::prelude::*;

use crate::kernels::{axpy_f32, dot_f32, OutPtr};
use crate::kv_cache::{rotate_row, unrotate_row, BlockId, KvCache};

/// One sequence's slice of the flattened batch.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    /// Position of the first new token.
    pub start_pos: usize,
    /// New tokens of this sequence in the batch.
    pub len: usize,
    /// Row of its first new token in the flattened batch.
    pub row: usize,
    /// Its block table (must cover `start_pos + len` tokens), one entry per
    /// layer group per logical block ([`BlockTable`](crate::BlockTable)).
    pub blocks: &'a [BlockId],
}

/// Head geometry.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// How one layer scores keys.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scoring<'a> {
    /// Scores are `q·k · scale` (`1/√head_dim` unless the family says).
    pub scale: f32,
    /// Scores become `cap · tanh(score / cap)` before the softmax.
    pub softcap: Option<f32>,
    /// Only the last `window` positions (the query's own included) are seen.
    pub window: Option<usize>,
    /// One learned logit per head that joins every softmax's denominator
    /// but has no value (gpt-oss's attention sinks): a head can attend to
    /// nothing.
    pub sinks: Option<&'a [f32]>,
}

impl Scoring<'_> {
    /// Plain causal attention scaled by `1/√head_dim`.
    pub fn causal(head_dim: usize) -> Self {
        Self {
            scale: 1.0 / (head_dim as f32).sqrt(),
            softcap: None,
            window: None,
            sinks: None,
        }
    }
}

const QUERY_TILE: usize = 32;

/// `out[row, head] = softmax(cap(q·Kᵀ·scale) + causal/window mask)·V` for
/// every new token of every sequence. `q` and `out` are
/// `[rows, num_heads * head_dim]`.
pub fn paged_attention(
    q: &[f32],
    kv: &KvCache,
    layer: usize,
    seqs: &[AttnSeq<'_>],
    heads: Heads,
    scoring: Scoring<'_>,
    out: &mut [f32],
) {
    let Heads {
        num_heads,
        num_kv_heads,
        head_dim: d,
    } = heads;
    let stride = num_heads * d;
    let group = num_heads / num_kv_heads;
    let Scoring {
        scale,
        softcap,
        window,
        sinks,
    } = scoring;
    let bs = kv.layout().block_size;
    let view = kv.layer(layer);
    let (groups, layer_group) = (kv.groups().num_groups(), kv.groups().group(layer));

    let mut tasks = Vec::new();
    for (s, seq) in seqs.iter().enumerate() {
        for h in 0..num_heads {
            for t0 in (0..seq.len).step_by(QUERY_TILE) {
                tasks.push((s, h, t0, (t0 + QUERY_TILE).min(seq.len)));
            }
        }
    }
    let out_ptr = OutPtr(out.as_mut_ptr());
    let out_len = out.len();
    tasks.into_par_iter().for_each(|(s, h, t0, t1)| {
        let seq = &seqs[s];
        let kvh = h / group;
        let ptr = out_ptr;
        let mut scores = vec![0.0f32; bs];
        let mut row_buf = vec![0.0f32; d];
        let rotated = view.rotated();
        let mut q_rot = vec![0.0f32; if rotated { d } else { 0 }];
        for t in t0..t1 {
            let row = seq.row + t;
            let mut qv = &q[row * stride + h * d..row * stride + (h + 1) * d];
            if rotated {
                // Keys are stored rotated: (HDq)·(HDk) = q·k.
                q_rot.copy_from_slice(qv);
                rotate_row(&mut q_rot);
                qv = &q_rot;
            }
            // SAFETY: this task alone writes row `row`, head `h`; the range
            // lies inside `out` (checked by the slice bounds below).
            let o = unsafe { std::slice::from_raw_parts_mut(ptr.0, out_len) };
            let acc = &mut o[row * stride + h * d..row * stride + (h + 1) * d];
            acc.fill(0.0);
            let pos = seq.start_pos + t;
            let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
            let mut kpos = lo;
            while kpos <= pos {
                let b = kpos / bs;
                let slot0 = kpos % bs;
                let slot1 = (bs).min(slot0 + pos + 1 - kpos);
                let block = seq.blocks[b * groups + layer_group];
                let base_row = kv.offset(block, kvh, 0) / d;
                let mut bmax = f32::NEG_INFINITY;
                for (slot, score) in scores.iter_mut().enumerate().take(slot1).skip(slot0) {
                    let (kr, k_scale) = view.key(base_row + slot, &mut row_buf);
                    let sc = dot_f32(qv, kr) * (scale * k_scale);
                    let sc = match softcap {
                        Some(cap) => cap * (sc / cap).tanh(),
                        None => sc,
                    };
                    *score = sc;
                    bmax = bmax.max(sc);
                }
                if bmax > m {
                    let c = (m - bmax).exp();
                    l *= c;
                    for a in acc.iter_mut() {
                        *a *= c;
                    }
                    m = bmax;
                }
                for (slot, &score) in scores.iter().enumerate().take(slot1).skip(slot0) {
                    let p = (score - m).exp();
                    l += p;
                    let (vr, v_scale) = view.value(base_row + slot, &mut row_buf);
                    axpy_f32(acc, p * v_scale, vr);
                }
                kpos += slot1 - slot0;
            }
            if let Some(sink) = sinks.map(|s| s[h]) {
                // The sink joins the denominator; rescale first if it is the
                // largest logit, so nothing overflows.
                if sink > m {
                    let c = (m - sink).exp();
                    l = l * c + 1.0;
                    for a in acc.iter_mut() {
                        *a *= c;
                    }
                } else {
                    l += (sink - m).exp();
                }
            }
            let inv = 1.0 / l;
            for a in acc.iter_mut() {
                *a *= inv;
            }
            if rotated {
                // The values summed were rotated.
                unrotate_row(acc);
            }
        }
    });
}
