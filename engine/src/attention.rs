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
    let bs = kv.layout().block_size;

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
    let rows = LayerRows {
        kv,
        view: kv.layer(layer),
        scoring,
        d,
        stride,
        bs,
        groups: kv.groups().num_groups(),
        layer_group: kv.groups().group(layer),
    };
    tasks.into_par_iter().for_each_init(
        || TileScratch::new(bs, d),
        |scratch, (s, h, t0, t1)| {
            let seq = &seqs[s];
            // The whole pointer, not its field (a field alone is not Sync).
            let ptr = out_ptr;
            // SAFETY: this task alone writes rows `seq.row + t0..t1`, head
            // `h`, of `out` (tasks partition (sequence, head, query tile));
            // `out` outlives the parallel loop and `out_len` is its length.
            let o = unsafe { std::slice::from_raw_parts_mut(ptr.0, out_len) };
            let tile = QueryTile {
                seq,
                head: h,
                kv_head: h / group,
                t0,
                t1,
            };
            attend_tile(q, &rows, &tile, scratch, o);
        },
    );
}

/// One layer's K/V rows and how they are scored, for [`attend_tile`].
struct LayerRows<'a> {
    kv: &'a KvCache,
    view: crate::kv_cache::LayerView<'a>,
    scoring: Scoring<'a>,
    d: usize,
    stride: usize,
    bs: usize,
    groups: usize,
    layer_group: usize,
}

/// One task: queries `t0..t1` of one sequence under one query head.
struct QueryTile<'s, 'b> {
    seq: &'s AttnSeq<'b>,
    head: usize,
    kv_head: usize,
    t0: usize,
    t1: usize,
}

/// A task's buffers, reused across the tasks one thread runs.
struct TileScratch {
    /// Decoded K then V rows of one block (16- and 8-bit caches).
    rows: Vec<f32>,
    /// Their factors (8-bit scales; 1 otherwise).
    row_scales: Vec<f32>,
    /// Each query's scores, then softmax weights, over the block's slots.
    probs: Vec<f32>,
    /// Running max and normaliser per query.
    m: Vec<f32>,
    l: Vec<f32>,
    /// The queries, rotated for an 8-bit cache.
    q_rot: Vec<f32>,
}

impl TileScratch {
    fn new(bs: usize, d: usize) -> Self {
        Self {
            rows: vec![0.0; bs * d],
            row_scales: vec![0.0; bs],
            probs: vec![0.0; QUERY_TILE * bs],
            m: vec![0.0; QUERY_TILE],
            l: vec![0.0; QUERY_TILE],
            q_rot: vec![0.0; QUERY_TILE * d],
        }
    }
}

/// Attention for one query tile, block by block: each K and V block is
/// decoded once for the tile's queries (not once per query), then every
/// query runs the online-softmax step over the slots it sees. Per query
/// the arithmetic and its order are the one-query-at-a-time loop's, so
/// results do not depend on the tiling.
fn attend_tile(
    q: &[f32],
    layer: &LayerRows<'_>,
    tile: &QueryTile<'_, '_>,
    sc: &mut TileScratch,
    out: &mut [f32],
) {
    let LayerRows {
        kv,
        ref view,
        scoring,
        d,
        stride,
        bs,
        groups,
        layer_group,
    } = *layer;
    let (seq, h) = (tile.seq, tile.head);
    let n = tile.t1 - tile.t0;
    let rotated = view.rotated();
    let pos_of = |i: usize| seq.start_pos + tile.t0 + i;
    let lo_of = |i: usize| {
        scoring
            .window
            .map_or(0, |w| (pos_of(i) + 1).saturating_sub(w))
    };
    let query = |i: usize| {
        let row = seq.row + tile.t0 + i;
        row * stride + h * d..row * stride + (h + 1) * d
    };
    if rotated {
        // Keys are stored rotated: (HDq)·(HDk) = q·k.
        for i in 0..n {
            let qr = &mut sc.q_rot[i * d..(i + 1) * d];
            qr.copy_from_slice(&q[query(i)]);
            rotate_row(qr);
        }
    }
    for i in 0..n {
        out[query(i)].fill(0.0);
    }
    sc.m[..n].fill(f32::NEG_INFINITY);
    sc.l[..n].fill(0.0);
    // Keys any query of the tile sees: the first query's window start to
    // the last query's position.
    let (lo, hi) = (lo_of(0), pos_of(n - 1));
    for b in lo / bs..=hi / bs {
        let block = seq.blocks[b * groups + layer_group];
        let base_row = kv.offset(block, tile.kv_head, 0) / d;
        // Slots of this block inside [lo, hi].
        let first = (b * bs).max(lo) - b * bs;
        let end = ((b + 1) * bs).min(hi + 1) - b * bs;
        let span = end - first;
        let keys = view.key_rows(
            base_row + first,
            &mut sc.rows[..span * d],
            &mut sc.row_scales[..span],
        );
        // Each query's visible slots of the block, as `first..end`-relative
        // indices; empty when the block is outside its window or future.
        let visible = |i: usize| {
            let (qlo, qhi) = (
                lo_of(i).max(b * bs + first),
                pos_of(i).min(b * bs + end - 1),
            );
            (qlo <= qhi).then(|| (qlo - b * bs - first, qhi + 1 - b * bs - first))
        };
        for i in 0..n {
            let Some((s0, s1)) = visible(i) else {
                continue;
            };
            let qv = if rotated {
                &sc.q_rot[i * d..(i + 1) * d]
            } else {
                &q[query(i)]
            };
            let probs = &mut sc.probs[i * bs..i * bs + span];
            let mut bmax = f32::NEG_INFINITY;
            for j in s0..s1 {
                let s = dot_f32(qv, &keys[j * d..(j + 1) * d]) * (scoring.scale * sc.row_scales[j]);
                let s = match scoring.softcap {
                    Some(cap) => cap * (s / cap).tanh(),
                    None => s,
                };
                probs[j] = s;
                bmax = bmax.max(s);
            }
            let acc = &mut out[query(i)];
            if bmax > sc.m[i] {
                let c = (sc.m[i] - bmax).exp();
                sc.l[i] *= c;
                for a in acc.iter_mut() {
                    *a *= c;
                }
                sc.m[i] = bmax;
            }
            for p in &mut probs[s0..s1] {
                *p = (*p - sc.m[i]).exp();
                sc.l[i] += *p;
            }
        }
        let values = view.value_rows(
            base_row + first,
            &mut sc.rows[..span * d],
            &mut sc.row_scales[..span],
        );
        for i in 0..n {
            let Some((s0, s1)) = visible(i) else {
                continue;
            };
            let acc = &mut out[query(i)];
            for j in s0..s1 {
                let p = sc.probs[i * bs + j];
                axpy_f32(acc, p * sc.row_scales[j], &values[j * d..(j + 1) * d]);
            }
        }
    }
    for i in 0..n {
        let (m, l) = (sc.m[i], sc.l[i]);
        let acc = &mut out[query(i)];
        let l = match scoring.sinks.map(|s| s[h]) {
            // The sink joins the denominator; rescale first if it is the
            // largest logit, so nothing overflows.
            Some(sink) if sink > m => {
                let c = (m - sink).exp();
                for a in acc.iter_mut() {
                    *a *= c;
                }
                l * c + 1.0
            }
            Some(sink) => l + (sink - m).exp(),
            None => l,
        };
        let inv = 1.0 / l;
        for a in acc.iter_mut() {
            *a *= inv;
        }
        if rotated {
            // The values summed were rotated.
            unrotate_row(acc);
        }
    }
}
