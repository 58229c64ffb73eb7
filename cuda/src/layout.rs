//! The host side of one forward step: what the CPU uploads before the
//! kernels run.
//!
//! The kernels read every per-step quantity from device buffers (token ids,
//! positions, KV slots, query tiles, block tables), so a CUDA graph captured
//! once replays for any batch of its size after the host rewrites those
//! buffers. [`StepLayout::build`] flattens a batch of [`SeqInput`]s into those
//! arrays, padding to a captured size where asked: padding rows have position
//! and slot `-1`, and padding tiles hold no rows, so every kernel skips them.

use tandem_engine::SeqInput;

use crate::error::CudaError;

/// Flattened per-step arrays, in the layout the kernels read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepLayout {
    /// Token id per row (`0` for padding).
    pub tokens: Vec<i32>,
    /// Position per row; `-1` marks padding.
    pub positions: Vec<i32>,
    /// `block * block_size + slot` where each row's K/V goes; `-1` for padding.
    pub slots: Vec<i32>,
    /// Four ints per query tile: sequence, first row, rows (0 for padding), unused.
    pub tiles: Vec<i32>,
    /// `[sequences, max_blocks]` block ids, zero-padded.
    pub block_tables: Vec<i32>,
    /// Rows whose logits are computed, in output order.
    pub logit_rows: Vec<i32>,
    /// Index into `logit_rows` where each sequence starts, plus an end marker.
    pub logit_starts: Vec<usize>,
    /// Rows that belong to real sequences (the rest are padding).
    pub real_rows: usize,
    /// Longest context of the step, in KV blocks.
    pub max_context_blocks: usize,
    /// Most query rows in one tile (1 for a decode-only step).
    pub max_tile_rows: usize,
}

/// The fixed geometry a layout is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutShape {
    pub block_size: usize,
    /// Query rows per attention tile (8 warps / query heads per CTA).
    pub tile_tokens: usize,
    /// Block-table stride: the most blocks one sequence may hold.
    pub max_blocks: usize,
    /// Blocks in the pool (block ids must be below it).
    pub num_blocks: usize,
}

impl StepLayout {
    /// Flattens `batch`; with `pad_rows = Some(p)` (a decode-only batch of at
    /// most `p` sequences, one token each) pads rows, tiles and logits to `p`.
    pub fn build(
        batch: &[SeqInput<'_>],
        shape: LayoutShape,
        pad_rows: Option<usize>,
    ) -> Result<Self, CudaError> {
        let LayoutShape {
            block_size: bs,
            tile_tokens,
            max_blocks,
            num_blocks,
        } = shape;
        let mut l = StepLayout::default();
        for (si, s) in batch.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(CudaError::InvalidBatch(format!(
                    "sequence {si} has no tokens"
                )));
            }
            let end = s.start_pos + s.tokens.len();
            let need = end.div_ceil(bs);
            if s.blocks.len() < need {
                return Err(CudaError::InvalidBatch(format!(
                    "sequence {si}: block table holds {} tokens, needs {end}",
                    s.blocks.len() * bs
                )));
            }
            if need > max_blocks {
                return Err(CudaError::InvalidBatch(format!(
                    "sequence {si} needs {need} blocks, more than the {max_blocks} a sequence may hold"
                )));
            }
            if let Some(&b) = s.blocks.iter().find(|&&b| b as usize >= num_blocks) {
                return Err(CudaError::InvalidBatch(format!(
                    "block id {b} is outside the pool ({num_blocks} blocks)"
                )));
            }
            l.max_context_blocks = l.max_context_blocks.max(need);
            let row0 = l.tokens.len();
            for (j, &t) in s.tokens.iter().enumerate() {
                let pos = s.start_pos + j;
                l.tokens.push(t as i32);
                l.positions.push(pos as i32);
                l.slots
                    .push((s.blocks[pos / bs] as usize * bs + pos % bs) as i32);
            }
            for t0 in (0..s.tokens.len()).step_by(tile_tokens.max(1)) {
                let n = tile_tokens.max(1).min(s.tokens.len() - t0);
                l.max_tile_rows = l.max_tile_rows.max(n);
                l.tiles.extend([si as i32, (row0 + t0) as i32, n as i32, 0]);
            }
            let mut table = vec![0i32; max_blocks];
            for (dst, &b) in table.iter_mut().zip(&s.blocks[..need]) {
                *dst = b as i32;
            }
            l.block_tables.extend(table);
            l.logit_starts.push(l.logit_rows.len());
            if s.all_logits {
                l.logit_rows
                    .extend((row0..row0 + s.tokens.len()).map(|r| r as i32));
            } else {
                l.logit_rows.push((row0 + s.tokens.len() - 1) as i32);
            }
        }
        l.logit_starts.push(l.logit_rows.len());
        l.real_rows = l.tokens.len();
        if let Some(p) = pad_rows {
            if batch.len() > p || l.real_rows != batch.len() || batch.iter().any(|s| s.all_logits) {
                return Err(CudaError::InvalidBatch(format!(
                    "only a decode batch of at most {p} single-token sequences can be padded to {p}"
                )));
            }
            for r in l.real_rows..p {
                l.tokens.push(0);
                l.positions.push(-1);
                l.slots.push(-1);
                l.tiles.extend([0, r as i32, 0, 0]);
                l.logit_rows.push(r as i32);
            }
            l.block_tables.resize(p.max(1) * max_blocks, 0);
        }
        Ok(l)
    }

    /// Rows of the step, padding included.
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// Query tiles of the step, padding included.
    pub fn num_tiles(&self) -> usize {
        self.tiles.len() / 4
    }
}

/// Flash-decoding split count: enough CTAs to fill the GPU twice over when a
/// step has few (tile, head) pairs, never more splits than there are
/// context blocks, at most `max`.
pub fn choose_splits(ctas: usize, sm_count: usize, context_blocks: usize, max: usize) -> usize {
    if ctas == 0 {
        return 1;
    }
    let want = (2 * sm_count).div_ceil(ctas);
    want.min(context_blocks.max(1)).clamp(1, max.max(1))
}

/// Query rows per attention tile: the CTA's 8 warps are shared between the
/// query heads of one KV head (up to 8 of them) and consecutive tokens.
pub fn heads_per_cta(num_heads: usize, num_kv_heads: usize) -> usize {
    let group = num_heads / num_kv_heads.max(1);
    let mut h = group.min(crate::ATTN_WARPS);
    while !group.is_multiple_of(h) {
        h -= 1;
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: LayoutShape = LayoutShape {
        block_size: 4,
        tile_tokens: 2,
        max_blocks: 3,
        num_blocks: 10,
    };

    #[test]
    fn a_prefill_and_a_decode_flatten_into_rows_tiles_and_tables() {
        let prompt = [5u32, 6, 7, 8, 9];
        let batch = [
            SeqInput {
                tokens: &prompt,
                start_pos: 0,
                blocks: &[7, 2],
                all_logits: false,
                lora: None,
            },
            SeqInput {
                tokens: &[42],
                start_pos: 6,
                blocks: &[1, 3],
                all_logits: false,
                lora: None,
            },
        ];
        let l = StepLayout::build(&batch, SHAPE, None).expect("valid batch");
        assert_eq!(l.tokens, vec![5, 6, 7, 8, 9, 42]);
        assert_eq!(l.positions, vec![0, 1, 2, 3, 4, 6]);
        // Position 4 is slot 0 of the second block (2); position 6 is slot 2 of block 3.
        assert_eq!(l.slots, vec![28, 29, 30, 31, 8, 14]);
        assert_eq!(
            l.tiles,
            vec![0, 0, 2, 0, 0, 2, 2, 0, 0, 4, 1, 0, 1, 5, 1, 0]
        );
        assert_eq!(l.block_tables, vec![7, 2, 0, 1, 3, 0]);
        assert_eq!(l.logit_rows, vec![4, 5]);
        assert_eq!(l.logit_starts, vec![0, 1, 2]);
        assert_eq!(l.max_context_blocks, 2);
        assert_eq!(l.max_tile_rows, 2);
    }

    #[test]
    fn all_logits_asks_for_every_row() {
        let batch = [SeqInput {
            tokens: &[1, 2, 3],
            start_pos: 2,
            blocks: &[0, 1],
            all_logits: true,
            lora: None,
        }];
        let l = StepLayout::build(&batch, SHAPE, None).expect("valid batch");
        assert_eq!(l.logit_rows, vec![0, 1, 2]);
        assert_eq!(l.logit_starts, vec![0, 3]);
    }

    #[test]
    fn a_decode_batch_pads_to_the_captured_size() {
        let batch = [
            SeqInput {
                tokens: &[3],
                start_pos: 0,
                blocks: &[4],
                all_logits: false,
                lora: None,
            },
            SeqInput {
                tokens: &[9],
                start_pos: 5,
                blocks: &[5, 6],
                all_logits: false,
                lora: None,
            },
        ];
        let l = StepLayout::build(&batch, SHAPE, Some(4)).expect("valid batch");
        assert_eq!(l.rows(), 4);
        assert_eq!(l.real_rows, 2);
        assert_eq!(l.positions, vec![0, 5, -1, -1]);
        assert_eq!(l.slots, vec![16, 25, -1, -1]);
        assert_eq!(l.num_tiles(), 4);
        assert_eq!(&l.tiles[8..], &[0, 2, 0, 0, 0, 3, 0, 0]);
        assert_eq!(l.block_tables.len(), 4 * SHAPE.max_blocks);
        assert_eq!(l.logit_rows, vec![0, 1, 2, 3]);
        assert_eq!(l.max_tile_rows, 1);
    }

    #[test]
    fn bad_batches_are_refused_with_a_reason() {
        let short = [SeqInput {
            tokens: &[1, 2, 3, 4, 5],
            start_pos: 0,
            blocks: &[0],
            all_logits: false,
            lora: None,
        }];
        let err = StepLayout::build(&short, SHAPE, None).expect_err("table too short");
        assert!(
            err.to_string().contains("block table holds 4 tokens"),
            "{err}"
        );
        let outside = [SeqInput {
            tokens: &[1],
            start_pos: 0,
            blocks: &[10],
            all_logits: false,
            lora: None,
        }];
        let err = StepLayout::build(&outside, SHAPE, None).expect_err("block outside");
        assert!(err.to_string().contains("outside the pool"), "{err}");
        let prefill = [SeqInput {
            tokens: &[1, 2],
            start_pos: 0,
            blocks: &[0],
            all_logits: false,
            lora: None,
        }];
        let err = StepLayout::build(&prefill, SHAPE, Some(4)).expect_err("prefill cannot pad");
        assert!(err.to_string().contains("decode batch"), "{err}");
    }

    #[test]
    fn splits_fill_the_gpu_only_when_the_batch_does_not() {
        // One sequence, 8 head chunks on 132 SMs: 33 splits, capped by context.
        assert_eq!(choose_splits(8, 132, 100, 64), 33);
        assert_eq!(choose_splits(8, 132, 5, 64), 5);
        assert_eq!(choose_splits(8, 132, 100, 16), 16);
        // A big batch already fills the machine.
        assert_eq!(choose_splits(2048, 132, 100, 64), 1);
        assert_eq!(choose_splits(0, 132, 100, 64), 1);
    }

    #[test]
    fn heads_per_cta_divides_the_gqa_group() {
        assert_eq!(heads_per_cta(32, 8), 4);
        assert_eq!(heads_per_cta(32, 2), 8);
        assert_eq!(heads_per_cta(12, 4), 3);
        assert_eq!(heads_per_cta(4, 4), 1);
        assert_eq!(heads_per_cta(24, 2), 6);
    }
}
