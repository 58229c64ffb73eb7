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
mod tile;

use rayon::prelude::*;

use crate::kernels::OutPtr;
use crate::kv_cache::{BlockId, KvCache};
use block::BlockMath;
use tile::{attend_tile, LayerRows, QueryTile, TileScratch};

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
    let tiles: usize = seqs.iter().map(|s| s.len.div_ceil(QUERY_TILE)).sum();
    let threads = rayon::current_num_threads().max(1);
    // The group's heads share a task unless that leaves threads idle.
    let heads_per_task = if tiles * heads.num_kv_heads >= 4 * threads {
        heads.num_heads / heads.num_kv_heads
    } else {
        1
    };
    let call = Call {
        q,
        kv,
        layer,
        seqs,
        heads,
        scoring,
    };
    attend_in_tasks(&call, heads_per_task, out);
}

/// One layer's attention, as [`paged_attention`] takes it.
struct Call<'a, 'b> {
    q: &'a [f32],
    kv: &'a KvCache,
    layer: usize,
    seqs: &'a [AttnSeq<'b>],
    heads: Heads,
    scoring: Scoring<'a>,
}

/// `call` in tasks of `heads_per_task` query heads (1 or the group size).
fn attend_in_tasks(call: &Call<'_, '_>, heads_per_task: usize, out: &mut [f32]) {
    let Call {
        q,
        kv,
        layer,
        seqs,
        heads,
        scoring,
    } = *call;
    let Heads {
        num_heads,
        num_kv_heads,
        head_dim: d,
    } = heads;
    let stride = num_heads * d;
    let group = num_heads / num_kv_heads;
    assert!(heads_per_task == 1 || heads_per_task == group);
    let bs = kv.layout().block_size;
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
    let tile_of = |(s, h, t0, t1): (usize, usize, usize, usize)| QueryTile {
        seq: &seqs[s],
        heads: h..h + heads_per_task,
        kv_head: h / group,
        t0,
        t1,
    };
    let queries = heads_per_task * QUERY_TILE;
    (0..tasks.len()).into_par_iter().for_each(|i| {
        // The next task runs on this thread as a rule (rayon splits the
        // range in halves): its rows come in while this one computes.
        if let Some(&next) = tasks.get(i + 1) {
            tile::prefetch_tile(&rows, &tile_of(next));
        }
        let tile = tile_of(tasks[i]);
        // The whole pointer, not its field (a field alone is not Sync).
        let ptr = out_ptr;
        // SAFETY: this task alone writes rows `seq.row + t0..t1`, heads
        // `h..h + heads_per_task`, of `out` (tasks partition (sequence,
        // head range, query tile)); `out` outlives the parallel loop and
        // `out_len` is its length.
        let o = unsafe { std::slice::from_raw_parts_mut(ptr.0, out_len) };
        TileScratch::with_thread_local(bs, d, queries, |scratch| {
            attend_tile(q, &rows, &tile, scratch, o)
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values;
    use crate::kv_cache::{KvCacheDtype, KvLayout, KvRows, SlidingLayers, RECENT_TOKENS};

    /// Three sequences (a prefill of 40, one decode token at position 20,
    /// five tokens from 30) over 2 KV heads × 3 query heads each.
    fn scene(
        d: usize,
        dtype: KvCacheDtype,
        bs: usize,
    ) -> (KvCache, Vec<Vec<BlockId>>, Vec<(usize, usize)>) {
        let kv_heads = 2;
        let layout = KvLayout {
            num_layers: 1,
            num_kv_heads: kv_heads,
            head_dim: d,
            block_size: bs,
            sliding: SlidingLayers::default(),
            rows: KvRows::PerHead,
        };
        let mut kv = KvCache::with_dtype(layout, 8, dtype);
        let spans = vec![(0, 40), (20, 1), (30, 5)];
        let tables = vec![vec![0, 1, 2], vec![3, 4], vec![5, 6, 7]];
        for (s, (&(start, len), table)) in spans.iter().zip(&tables).enumerate() {
            // FP8: 3 recent copies for 8 blocks; the last sequence's hold
            // takes them, so blocks are read both ways.
            kv.hold_recent([(0, start + len, &table[..])]);
            for pos in 0..start + len {
                let k = test_values(kv_heads * d, (s * 1000 + pos) as u32);
                let v = test_values(kv_heads * d, (s * 1000 + pos + 500) as u32);
                kv.write(0, table[pos / bs], pos % bs, &k, &v);
            }
        }
        (kv, tables, spans)
    }

    #[test]
    fn a_task_per_kv_head_computes_what_a_task_per_query_head_does() {
        // 64: the AVX-512 block math where the CPU has it; 24: the portable one.
        // Blocks of 32 slots: the block math takes them 16 at a time.
        for (d, bs) in [(64, 16), (24, 16), (64, 32)] {
            for dtype in [
                KvCacheDtype::F32,
                KvCacheDtype::Bf16,
                KvCacheDtype::Int8,
                KvCacheDtype::Fp8E4m3,
            ] {
                let (kv, tables, spans) = scene(d, dtype, bs);
                let mut row = 0;
                let seqs: Vec<AttnSeq<'_>> = spans
                    .iter()
                    .zip(&tables)
                    .map(|(&(start_pos, len), blocks)| {
                        row += len;
                        AttnSeq {
                            start_pos,
                            len,
                            row: row - len,
                            blocks,
                        }
                    })
                    .collect();
                let heads = Heads {
                    num_heads: 6,
                    num_kv_heads: 2,
                    head_dim: d,
                };
                let q = test_values(row * 6 * d, 77);
                let scoring = Scoring {
                    window: Some(24),
                    ..Scoring::causal(d)
                };
                let call = Call {
                    q: &q,
                    kv: &kv,
                    layer: 0,
                    seqs: &seqs,
                    heads,
                    scoring,
                };
                let (mut per_head, mut per_kv_head) = (vec![0.0; q.len()], vec![1.0; q.len()]);
                attend_in_tasks(&call, 1, &mut per_head);
                attend_in_tasks(&call, 3, &mut per_kv_head);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&per_head),
                    bits(&per_kv_head),
                    "d {d}, bs {bs}, {dtype:?}"
                );
                if dtype != KvCacheDtype::F32 {
                    continue;
                }
                // And both are windowed softmax attention: the prefill's last
                // token (row and position 39) under head 4 (KV head 1)
                // against an f64 reference.
                let (t, h, pos) = (39, 4, 39);
                let qv = &q[(t * 6 + h) * d..(t * 6 + h + 1) * d];
                let seen = (pos + 1 - 24)..=pos;
                let rows =
                    |pos: usize, off: u32| test_values(2 * d, pos as u32 + off)[d..].to_vec();
                let scores: Vec<f64> = seen
                    .clone()
                    .map(|p| {
                        let k = rows(p, 0);
                        qv.iter()
                            .zip(&k)
                            .map(|(a, b)| f64::from(a * b))
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for c in 0..d {
                    let want: f64 = seen
                        .clone()
                        .zip(&scores)
                        .map(|(p, s)| (s - max).exp() / z * f64::from(rows(p, 500)[c]))
                        .sum();
                    let got = f64::from(per_head[(t * 6 + h) * d + c]);
                    assert!(
                        (got - want).abs() < 1e-5,
                        "d {d}, bs {bs}, channel {c}: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// Softmax attention of one query over `rows(p)` (key, value) for `p`
    /// in `positions`, in f64.
    fn reference(
        qv: &[f32],
        positions: std::ops::Range<usize>,
        rows: impl Fn(usize) -> (Vec<f32>, Vec<f32>),
    ) -> Vec<f64> {
        let d = qv.len();
        let kv: Vec<_> = positions.map(&rows).collect();
        let scores: Vec<f64> = kv
            .iter()
            .map(|(k, _)| {
                qv.iter().zip(k).map(|(a, b)| f64::from(a * b)).sum::<f64>() / (d as f64).sqrt()
            })
            .collect();
        let max = scores.iter().copied().fold(f64::MIN, f64::max);
        let z: f64 = scores.iter().map(|s| (s - max).exp()).sum();
        (0..d)
            .map(|c| {
                kv.iter()
                    .zip(&scores)
                    .map(|((_, v), s)| (s - max).exp() / z * f64::from(v[c]))
                    .sum()
            })
            .collect()
    }

    #[test]
    fn fp8_reads_each_querys_last_32_positions_at_16_bits_and_older_ones_as_codes() {
        let (d, bs) = (64, 16);
        let layout = KvLayout {
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: d,
            block_size: bs,
            sliding: SlidingLayers::default(),
            rows: KvRows::PerHead,
        };
        let table: Vec<BlockId> = (0..5).collect();
        // Room for every block's copy (a pool of 40 blocks has 5).
        let mut kv = KvCache::with_dtype(layout, 40, KvCacheDtype::Fp8E4m3);
        let truth = |p: usize| (test_values(d, p as u32), test_values(d, p as u32 + 900));
        // A prefill of 70 positions in one step, then a decode of one more,
        // each held before it is written, as `Model::forward_stage` does.
        for (start, len) in [(0, 70), (70, 1)] {
            kv.hold_recent([(start, len, &table[..])]);
            for p in start..start + len {
                let (k, v) = truth(p);
                kv.write(0, table[p / bs], p % bs, &k, &v);
            }
        }
        let coded = |p: usize| {
            let (k, v) = kv.block(0, table[p / bs]);
            let r = (p % bs) * d..(p % bs + 1) * d;
            (k[r.clone()].to_vec(), v[r].to_vec())
        };
        let heads = Heads {
            num_heads: 1,
            num_kv_heads: 1,
            head_dim: d,
        };
        let q = test_values(71 * d, 5);
        let seqs = [AttnSeq {
            start_pos: 0,
            len: 71,
            row: 0,
            blocks: &table,
        }];
        let mut out = vec![0.0; q.len()];
        paged_attention(&q, &kv, 0, &seqs, heads, Scoring::causal(d), &mut out);
        let (mut worst_windowed, mut worst_coded) = (0f64, 0f64);
        for t in [0, 20, 31, 32, 50, 69, 70] {
            let qv = &q[t * d..(t + 1) * d];
            let cut = (t + 1).saturating_sub(RECENT_TOKENS);
            let windowed = reference(qv, 0..t + 1, |p| if p >= cut { truth(p) } else { coded(p) });
            let all_coded = reference(qv, 0..t + 1, coded);
            for c in 0..d {
                let got = f64::from(out[t * d + c]);
                worst_windowed = worst_windowed.max((got - windowed[c]).abs());
                worst_coded = worst_coded.max((got - all_coded[c]).abs());
            }
        }
        // The copies are bf16 (a relative step of 2^-9); codes are E4M3's 2^-4.
        assert!(
            worst_windowed < 4e-3,
            "against the window's reference: {worst_windowed}"
        );
        assert!(
            worst_coded > 3.0 * worst_windowed,
            "the window changes nothing: {worst_coded}"
        );
    }
}
