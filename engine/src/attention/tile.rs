//! One task of [`paged_attention`](super::paged_attention): a tile of one
//! sequence's queries under the query heads of one KV head, walked block by
//! block with the online-softmax recurrence.
//!
//! An FP8 cache's recent window (`kv_cache/recent.rs`) is decided here, row
//! by row: token `i` reads the rows from `cut(i) = pos(i) + 1 − 32` on from
//! their block's 16-bit copy where it has one, the older ones as codes. A
//! block can be recent to one query of a prefill and old to another, so a
//! block with a copy may be read both ways; one that every query reads
//! from the copy (a decode's last blocks) skips its codes.

use std::cell::RefCell;
use std::ops::Range;

use crate::kv_cache::{rotate_row, unrotate_row, CacheLevel, HalfRows, KvCache, LayerView};

use super::block::{BlockMath, Rows, WeightedSum, MAX_QUERIES, SLOTS};
use super::{AttnSeq, Scoring};

/// One layer's K/V rows and how they are scored, for [`attend_tile`].
pub(super) struct LayerRows<'a> {
    pub kv: &'a KvCache,
    pub view: LayerView<'a>,
    pub scoring: Scoring<'a>,
    pub d: usize,
    pub stride: usize,
    pub bs: usize,
    pub groups: usize,
    pub layer_group: usize,
    pub math: BlockMath,
}

/// One task: queries `t0..t1` of one sequence under query heads `heads`
/// (which share KV head `kv_head`).
pub(super) struct QueryTile<'s, 'b> {
    pub seq: &'s AttnSeq<'b>,
    pub heads: Range<usize>,
    pub kv_head: usize,
    pub t0: usize,
    pub t1: usize,
}

impl QueryTile<'_, '_> {
    /// Tokens in the tile.
    fn len(&self) -> usize {
        self.t1 - self.t0
    }

    /// Position of token `i`.
    fn pos(&self, i: usize) -> usize {
        self.seq.start_pos + self.t0 + i
    }

    /// First position token `i` sees (its sliding window's start).
    fn lo(&self, i: usize, scoring: &Scoring<'_>) -> usize {
        scoring
            .window
            .map_or(0, |w| (self.pos(i) + 1).saturating_sub(w))
    }

    /// The keys any of the tile's queries sees: the first token's window
    /// start to the last token's position.
    fn key_range(&self, scoring: &Scoring<'_>) -> (usize, usize) {
        (self.lo(0, scoring), self.pos(self.len() - 1))
    }

    /// First position token `i` reads from a recent copy.
    fn cut(&self, i: usize, recent: Option<usize>) -> usize {
        recent.map_or(usize::MAX, |w| (self.pos(i) + 1).saturating_sub(w))
    }

    /// Query `qi` is token `qi % len` under head `heads.start + qi / len`.
    fn head(&self, qi: usize) -> usize {
        self.heads.start + qi / self.len()
    }

    /// Query `qi`'s row range in `q` and `out`.
    fn query(&self, qi: usize, rows: &LayerRows<'_>) -> Range<usize> {
        let (row, h) = (self.seq.row + self.t0 + qi % self.len(), self.head(qi));
        let (stride, d) = (rows.stride, rows.d);
        row * stride + h * d..row * stride + (h + 1) * d
    }
}

/// A task's buffers, reused across the tasks one thread runs.
pub(super) struct TileScratch {
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
    /// K then V rows of the block's 16-bit copy (an FP8 cache's recent
    /// window), and their factors (1).
    recent: Vec<f32>,
    ones: Vec<f32>,
    /// The block's keys as the block math reads them (transposed for
    /// AVX-512), for the codes and for the recent copy.
    keys_laid: Vec<f32>,
    recent_laid: Vec<f32>,
    /// Where each query's row starts in `q` and the output (per task).
    query_rows: Vec<usize>,
    /// Each token's `(s0, e, s1)` in the block at hand ([`attend_block`]).
    spans: Vec<Option<(usize, usize, usize)>>,
    /// The block size, head size and queries the buffers are for.
    dims: (usize, usize, usize),
}

impl TileScratch {
    /// Runs `f` on this thread's buffers for up to `queries` (head, token)
    /// pairs, made on the first call that needs them: a step's attention
    /// runs a few hundred tasks per thread, and scratch made per task (or
    /// per rayon split) was as many allocations of some 45 KB.
    pub fn with_thread_local<R>(
        bs: usize,
        d: usize,
        queries: usize,
        f: impl FnOnce(&mut TileScratch) -> R,
    ) -> R {
        thread_local! {
            static SCRATCH: RefCell<Option<TileScratch>> = const { RefCell::new(None) };
        }
        SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut held) => {
                if held.as_ref().is_some_and(|sc| sc.dims != (bs, d, queries)) {
                    *held = None;
                }
                f(held.get_or_insert_with(|| Self::new(bs, d, queries)))
            }
            // Held by a caller further up this thread's stack: its own.
            Err(_) => f(&mut Self::new(bs, d, queries)),
        })
    }

    /// Buffers for up to `queries` (head, token) pairs.
    fn new(bs: usize, d: usize, queries: usize) -> Self {
        Self {
            dims: (bs, d, queries),
            rows: vec![0.0; bs * d],
            row_scales: vec![0.0; bs],
            probs: vec![0.0; queries * bs],
            m: vec![0.0; queries],
            l: vec![0.0; queries],
            q_rot: vec![0.0; queries * d],
            recent: vec![0.0; bs * d],
            ones: vec![1.0; bs],
            keys_laid: vec![0.0; d * SLOTS],
            recent_laid: vec![0.0; d * SLOTS],
            query_rows: Vec::with_capacity(queries),
            spans: Vec::with_capacity(queries),
        }
    }
}

/// Attention for one query tile, block by block: each K and V block is
/// decoded once for all the tile's queries (every token under every head of
/// the task), then every query runs the online-softmax step over the slots
/// it sees. Per query the arithmetic and its order are the same whatever
/// else is in the task, so results do not depend on the tiling.
pub(super) fn attend_tile(
    q: &[f32],
    layer: &LayerRows<'_>,
    tile: &QueryTile<'_, '_>,
    sc: &mut TileScratch,
    out: &mut [f32],
) {
    let (n, d, bs) = (tile.len(), layer.d, layer.bs);
    let queries = n * tile.heads.len();
    sc.query_rows.clear();
    sc.query_rows
        .extend((0..queries).map(|qi| tile.query(qi, layer).start));
    if layer.view.rotated() {
        // Keys are stored rotated: (HDq)·(HDk) = q·k.
        for qi in 0..queries {
            let qr = &mut sc.q_rot[qi * d..(qi + 1) * d];
            qr.copy_from_slice(&q[tile.query(qi, layer)]);
            rotate_row(qr);
        }
    }
    for qi in 0..queries {
        out[tile.query(qi, layer)].fill(0.0);
    }
    sc.m[..queries].fill(f32::NEG_INFINITY);
    sc.l[..queries].fill(0.0);
    let (lo, hi) = tile.key_range(&layer.scoring);
    let (b0, b1) = (lo / bs, hi / bs);
    // Blocks ahead arrive while earlier ones are worked on: the next one
    // into L1, the one L2_AHEAD on into L2 (and the first ones now).
    for b in b0 + 1..=(b0 + L2_AHEAD - 1).min(b1) {
        prefetch_block(layer, tile, b, hi, CacheLevel::L2);
    }
    for b in b0..=b1 {
        // Slots of this block inside [lo, hi].
        let first = (b * bs).max(lo) - b * bs;
        let end = ((b + 1) * bs).min(hi + 1) - b * bs;
        if b < b1 {
            prefetch_block(layer, tile, b + 1, hi, CacheLevel::L1);
        }
        if b + L2_AHEAD <= b1 {
            prefetch_block(layer, tile, b + L2_AHEAD, hi, CacheLevel::L2);
        }
        // The block math takes 16 slots at a time: a larger block runs as
        // pieces ending at block-relative multiples of 16, whatever the
        // tile's first slot, so a query's steps do not depend on its tile.
        let mut from = first;
        while from < end {
            let to = ((from / SLOTS + 1) * SLOTS).min(end);
            let span = BlockSpan {
                b,
                first: from,
                rows: to - from,
            };
            attend_block(q, layer, tile, &span, sc, out);
            from = to;
        }
    }
    finish(layer, tile, sc, out);
}

/// Asks for the K/V rows of `tile`'s first [`NEXT_TILE_BLOCKS`] blocks
/// into L2: a task asks for the next one's while it computes, so a
/// decode's tasks (one sequence's few blocks under one KV head, cold after
/// the step's weights streamed through the caches) find their rows
/// waiting (at batch 32 the tasks' summed time fell by a fifth). The task
/// itself asks for the rest ahead of use (a long context's whole rows
/// would not fit in L2).
pub(super) fn prefetch_tile(layer: &LayerRows<'_>, tile: &QueryTile<'_, '_>) {
    let (lo, hi) = tile.key_range(&layer.scoring);
    let b0 = lo / layer.bs;
    for b in b0..=(hi / layer.bs).min(b0 + NEXT_TILE_BLOCKS - 1) {
        prefetch_block(layer, tile, b, hi, CacheLevel::L2);
    }
}

/// How many of the next task's blocks a task asks for.
const NEXT_TILE_BLOCKS: usize = 8;

/// How many blocks ahead attention asks for K/V rows into L2.
const L2_AHEAD: usize = 4;

/// Asks for the tile's K/V rows of logical block `b` (up to position `hi`).
fn prefetch_block(
    layer: &LayerRows<'_>,
    tile: &QueryTile<'_, '_>,
    b: usize,
    hi: usize,
    to: CacheLevel,
) {
    let (bs, d) = (layer.bs, layer.d);
    let block = tile.seq.blocks[b * layer.groups + layer.layer_group];
    let rows = ((b + 1) * bs).min(hi + 1) - b * bs;
    let row0 = layer.kv.offset(block, tile.kv_head, 0) / d;
    layer.view.prefetch(row0, rows, d, to);
}

/// The slots `first..first + rows` of logical block `b` that some query of
/// a tile sees.
struct BlockSpan {
    b: usize,
    first: usize,
    rows: usize,
}

/// One block's online-softmax step for every query of the tile.
fn attend_block(
    q: &[f32],
    layer: &LayerRows<'_>,
    tile: &QueryTile<'_, '_>,
    span: &BlockSpan,
    sc: &mut TileScratch,
    out: &mut [f32],
) {
    let LayerRows {
        kv,
        ref view,
        scoring,
        d,
        bs,
        groups,
        layer_group,
        math,
        ..
    } = *layer;
    let (n, queries) = (tile.len(), tile.len() * tile.heads.len());
    let BlockSpan { b, first, rows } = *span;
    let p0 = b * bs + first; // position of span slot 0
    let block = tile.seq.blocks[b * groups + layer_group];
    let row0 = kv.offset(block, tile.kv_head, first) / d;
    let window = view.recent_window();
    // The copy serves the tile from span slot `split(i)` on (`rows`: none);
    // the codes are needed unless it serves every query from slot 0.
    let recent_keys = match window {
        Some(_) if tile.cut(0, window) < p0 + rows => {
            view.recent_rows(true, row0, d, &mut sc.recent[..rows * d])
        }
        _ => None,
    };
    let has_recent = recent_keys.is_some();
    let recent_keys =
        recent_keys.map(|k| math.keys(Rows::F32(k), rows, d, &mut sc.recent_laid, queries));
    let codes = !has_recent || tile.cut(n - 1, window) > p0;
    let keys = codes.then(|| {
        let k = block_rows(
            layer,
            true,
            row0,
            &mut sc.rows[..rows * d],
            &mut sc.row_scales[..rows],
        );
        math.keys(k, rows, d, &mut sc.keys_laid, queries)
    });
    // Each token's slots of the span as span-relative `(s0, e, s1)`: it sees
    // `s0..s1` (none when the block is outside its window or in its
    // future), from the codes up to `e` and from the recent copy after.
    sc.spans.clear();
    sc.spans.extend((0..n).map(|i| {
        let (qlo, qhi) = (tile.lo(i, &scoring).max(p0), tile.pos(i).min(p0 + rows - 1));
        (qlo <= qhi).then(|| {
            let (s0, s1) = (qlo - p0, qhi + 1 - p0);
            let e = match has_recent {
                true => tile.cut(i, window).saturating_sub(p0).clamp(s0, s1),
                false => s1,
            };
            (s0, e, s1)
        })
    }));
    let query_of = |qi: usize| match view.rotated() {
        true => &sc.q_rot[qi * d..(qi + 1) * d],
        false => &q[sc.query_rows[qi]..sc.query_rows[qi] + d],
    };
    // Every seeing query's scores against the codes, a few queries a call
    // (they share the key loads).
    if let Some(keys) = &keys {
        let mut qs: [&[f32]; MAX_QUERIES] = [&[]; MAX_QUERIES];
        let mut outs: [&mut [f32]; MAX_QUERIES] = Default::default();
        let mut count = 0;
        let factors = &sc.row_scales[..rows];
        // Rows taken in query order: `next` is the first one not yet passed.
        let (mut probs, mut next) = (sc.probs.chunks_mut(bs), 0);
        for (qi, _) in seeing(&sc.spans, queries) {
            let Some(row) = probs.nth(qi - next) else {
                break;
            };
            next = qi + 1;
            (qs[count], outs[count]) = (query_of(qi), &mut row[..rows]);
            count += 1;
            if count == MAX_QUERIES {
                math.scores(&qs, keys, scoring.scale, factors, &mut outs, 0..rows);
                count = 0;
            }
        }
        let (qs, outs) = (&qs[..count], &mut outs[..count]);
        math.scores(qs, keys, scoring.scale, factors, outs, 0..rows);
    }
    for (qi, (s0, e, s1)) in seeing(&sc.spans, queries) {
        let probs = &mut sc.probs[qi * bs..qi * bs + rows];
        if let Some(exact) = &recent_keys {
            let (q, ones) = ([query_of(qi)], &sc.ones[..rows]);
            math.scores(&q, exact, scoring.scale, ones, &mut [&mut *probs], e..s1);
        }
        if let Some(cap) = scoring.softcap {
            for p in &mut probs[s0..s1] {
                *p = cap * (*p / cap).tanh();
            }
        }
        let bmax = math.max(&probs[s0..s1]);
        if bmax > sc.m[qi] {
            let c = (sc.m[qi] - bmax).exp();
            sc.l[qi] *= c;
            let row = sc.query_rows[qi];
            for a in &mut out[row..row + d] {
                *a *= c;
            }
            sc.m[qi] = bmax;
        }
        sc.l[qi] += math.exp_sum(&mut probs[s0..s1], sc.m[qi]);
    }
    let values = codes.then(|| {
        block_rows(
            layer,
            false,
            row0,
            &mut sc.rows[..rows * d],
            &mut sc.row_scales[..rows],
        )
    });
    let recent_values = if has_recent {
        view.recent_rows(false, row0, d, &mut sc.recent[..rows * d])
            .map(Rows::F32)
    } else {
        None
    };
    // The codes' weights carry their rows' factors (8-bit scales; 1
    // otherwise): scaled in place, as the recent copy reads the slots past
    // `e` unscaled.
    if values.is_some() {
        for (qi, (s0, e, _)) in seeing(&sc.spans, queries) {
            let probs = &mut sc.probs[qi * bs + s0..qi * bs + e];
            for (p, f) in probs.iter_mut().zip(&sc.row_scales[s0..e]) {
                *p *= f;
            }
        }
    }
    // Every query's weighted sum of the codes' values, then of the recent
    // copy's, a few queries a call (they share the value loads).
    for (block_values, codes_part) in [(values, true), (recent_values, false)] {
        let Some(block_values) = block_values else {
            continue;
        };
        let mut sums: [WeightedSum<'_>; MAX_QUERIES] = Default::default();
        let mut count = 0;
        for (qi, (s0, e, s1)) in seeing(&sc.spans, queries) {
            let slots = if codes_part { s0..e } else { e..s1 };
            if slots.is_empty() {
                continue;
            }
            sums[count] = WeightedSum {
                row: sc.query_rows[qi],
                weights: &sc.probs[qi * bs..qi * bs + rows],
                slots,
            };
            count += 1;
            if count == MAX_QUERIES {
                math.accumulate(out, &sums, block_values, d);
                count = 0;
            }
        }
        if count > 0 {
            math.accumulate(out, &sums[..count], block_values, d);
        }
    }
}

/// A block's K (`keys`) or V rows from `row0` (`scales.len()` of them,
/// `buf` holding their f32 decoding) and their factors: a 16-bit cache's
/// as stored where the block math widens them itself (their factors 1),
/// else decoded into `buf` ([`LayerView::key_rows`]).
fn block_rows<'b>(
    layer: &'b LayerRows<'b>,
    keys: bool,
    row0: usize,
    buf: &'b mut [f32],
    scales: &mut [f32],
) -> Rows<'b> {
    let (rows, d) = (scales.len(), layer.d);
    let half = layer
        .math
        .widens_half()
        .then(|| layer.view.half_rows(keys, row0, rows, d));
    if let Some(Some(rows)) = half {
        scales.fill(1.0);
        return match rows {
            HalfRows::Bf16(x) => Rows::Bf16(x),
            HalfRows::F16(x) => Rows::F16(x),
        };
    }
    Rows::F32(match keys {
        true => layer.view.key_rows(row0, buf, scales),
        false => layer.view.value_rows(row0, buf, scales),
    })
}

/// `(query, its token's (s0, e, s1))` for every query of a task that sees
/// the block: query `qi` is token `qi % n` (`n = spans.len()`), walked
/// without a division.
fn seeing(
    spans: &[Option<(usize, usize, usize)>],
    queries: usize,
) -> impl Iterator<Item = (usize, (usize, usize, usize))> + '_ {
    let tokens = spans.iter().copied().cycle();
    (0..queries)
        .zip(tokens)
        .filter_map(|(qi, s)| s.map(|s| (qi, s)))
}

/// Divides each query's sum by its normaliser (the sink joining it) and
/// rotates an 8-bit cache's output back.
fn finish(layer: &LayerRows<'_>, tile: &QueryTile<'_, '_>, sc: &TileScratch, out: &mut [f32]) {
    for qi in 0..tile.len() * tile.heads.len() {
        let (m, l) = (sc.m[qi], sc.l[qi]);
        let acc = &mut out[tile.query(qi, layer)];
        let l = match layer.scoring.sinks.map(|s| s[tile.head(qi)]) {
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
        if layer.view.rotated() {
            // The values summed were rotated.
            unrotate_row(acc);
        }
    }
}
