//! Paged causal attention with online softmax.
//!
//! Each query walks its sequence's block table block by block, keeping a
//! running max, normaliser and weighted sum (the FlashAttention recurrence),
//! so no score matrix is ever materialised and K/V are read straight from the
//! paged pool. Work is split over (sequence, KV head, tile of queries): the
//! query heads that share a KV head (grouped-query attention) share a task,
//! so each K and V block is read and decoded once for all of them, and a
//! long prefill and many single-token decodes parallelise alike. When that
//! leaves too few tasks for the threads (one sequence's decode), each query
//! head is a task of its own. The per-block arithmetic is [`block`]'s.
//!
//! A 16- or 8-bit cache is read in place too: each key or value row is
//! decoded into the task's `head_dim` buffer, and an 8-bit row's scale
//! multiplies the score (keys) or the softmax weight (values). 8-bit rows
//! are stored Hadamard-rotated (`kv_cache/q8.rs`): the query is rotated
//! once before scoring and the output once after.

mod block;

use rayon::prelude::*;

use crate::kernels::OutPtr;
use crate::kv_cache::{rotate_row, unrotate_row, BlockId, KvCache};
use block::BlockMath;

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

    let tiles: usize = seqs.iter().map(|s| s.len.div_ceil(QUERY_TILE)).sum();
    let threads = rayon::current_num_threads().max(1);
    // The group's heads share a task unless that leaves threads idle.
    let heads_per_task = if tiles * num_kv_heads >= 4 * threads {
        group
    } else {
        1
    };
    let mut tasks = Vec::new();
    for (s, seq) in seqs.iter().enumerate() {
        for h in (0..num_heads).step_by(heads_per_task) {
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
        math: BlockMath::for_head_dim(d),
    };
    tasks.into_par_iter().for_each_init(
        || TileScratch::new(bs, d, heads_per_task * QUERY_TILE),
        |scratch, (s, h, t0, t1)| {
            let seq = &seqs[s];
            // The whole pointer, not its field (a field alone is not Sync).
            let ptr = out_ptr;
            // SAFETY: this task alone writes rows `seq.row + t0..t1`, heads
            // `h..h + heads_per_task`, of `out` (tasks partition (sequence,
            // head range, query tile)); `out` outlives the parallel loop and
            // `out_len` is its length.
            let o = unsafe { std::slice::from_raw_parts_mut(ptr.0, out_len) };
            let tile = QueryTile {
                seq,
                heads: h..h + heads_per_task,
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
    math: BlockMath,
}

/// One task: queries `t0..t1` of one sequence under query heads `heads`
/// (which share KV head `kv_head`).
struct QueryTile<'s, 'b> {
    seq: &'s AttnSeq<'b>,
    heads: std::ops::Range<usize>,
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
    /// One query's softmax weights times the value rows' factors.
    weights: Vec<f32>,
    /// Running max and normaliser per query.
    m: Vec<f32>,
    l: Vec<f32>,
    /// The queries, rotated for an 8-bit cache.
    q_rot: Vec<f32>,
}

impl TileScratch {
    /// Buffers for up to `queries` (head, token) pairs.
    fn new(bs: usize, d: usize, queries: usize) -> Self {
        Self {
            rows: vec![0.0; bs * d],
            row_scales: vec![0.0; bs],
            probs: vec![0.0; queries * bs],
            weights: vec![0.0; bs],
            m: vec![0.0; queries],
            l: vec![0.0; queries],
            q_rot: vec![0.0; queries * d],
        }
    }
}

/// Attention for one query tile, block by block: each K and V block is
/// decoded once for all the tile's queries (every token under every head of
/// the task), then every query runs the online-softmax step over the slots
/// it sees. Per query the arithmetic and its order are the same whatever
/// else is in the task, so results do not depend on the tiling.
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
        math,
    } = *layer;
    let seq = tile.seq;
    let n = tile.t1 - tile.t0;
    // Query `qi` is token `qi % n` of the tile under head `heads.start + qi / n`.
    let queries = n * tile.heads.len();
    let head_of = |qi: usize| tile.heads.start + qi / n;
    let rotated = view.rotated();
    let pos_of = |i: usize| seq.start_pos + tile.t0 + i;
    let lo_of = |i: usize| {
        scoring
            .window
            .map_or(0, |w| (pos_of(i) + 1).saturating_sub(w))
    };
    let query = |qi: usize| {
        let (row, h) = (seq.row + tile.t0 + qi % n, head_of(qi));
        row * stride + h * d..row * stride + (h + 1) * d
    };
    if rotated {
        // Keys are stored rotated: (HDq)·(HDk) = q·k.
        for qi in 0..queries {
            let qr = &mut sc.q_rot[qi * d..(qi + 1) * d];
            qr.copy_from_slice(&q[query(qi)]);
            rotate_row(qr);
        }
    }
    for qi in 0..queries {
        out[query(qi)].fill(0.0);
    }
    sc.m[..queries].fill(f32::NEG_INFINITY);
    sc.l[..queries].fill(0.0);
    // Keys any query of the tile sees: the first token's window start to
    // the last token's position.
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
        // A token's visible slots of the block, as `first..end`-relative
        // indices; empty when the block is outside its window or future.
        let visible = |i: usize| {
            let (qlo, qhi) = (
                lo_of(i).max(b * bs + first),
                pos_of(i).min(b * bs + end - 1),
            );
            (qlo <= qhi).then(|| (qlo - b * bs - first, qhi + 1 - b * bs - first))
        };
        for qi in 0..queries {
            let Some((s0, s1)) = visible(qi % n) else {
                continue;
            };
            let qv = if rotated {
                &sc.q_rot[qi * d..(qi + 1) * d]
            } else {
                &q[query(qi)]
            };
            let probs = &mut sc.probs[qi * bs..qi * bs + span];
            math.scores(qv, keys, scoring.scale, &sc.row_scales[..span], probs);
            let mut bmax = f32::NEG_INFINITY;
            for p in &mut probs[s0..s1] {
                if let Some(cap) = scoring.softcap {
                    *p = cap * (*p / cap).tanh();
                }
                bmax = bmax.max(*p);
            }
            let acc = &mut out[query(qi)];
            if bmax > sc.m[qi] {
                let c = (sc.m[qi] - bmax).exp();
                sc.l[qi] *= c;
                for a in acc.iter_mut() {
                    *a *= c;
                }
                sc.m[qi] = bmax;
            }
            sc.l[qi] += math.exp_sum(&mut probs[s0..s1], sc.m[qi]);
        }
        let values = view.value_rows(
            base_row + first,
            &mut sc.rows[..span * d],
            &mut sc.row_scales[..span],
        );
        for qi in 0..queries {
            let Some((s0, s1)) = visible(qi % n) else {
                continue;
            };
            let weights = &mut sc.weights[..s1 - s0];
            let probs = &sc.probs[qi * bs + s0..qi * bs + s1];
            for ((w, p), f) in weights.iter_mut().zip(probs).zip(&sc.row_scales[s0..s1]) {
                *w = p * f;
            }
            math.accumulate(&mut out[query(qi)], weights, &values[s0 * d..s1 * d]);
        }
    }
    for qi in 0..queries {
        let (m, l) = (sc.m[qi], sc.l[qi]);
        let acc = &mut out[query(qi)];
        let l = match scoring.sinks.map(|s| s[head_of(qi)]) {
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
