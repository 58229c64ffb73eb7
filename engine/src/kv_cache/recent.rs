//! The recent window of an FP8 cache: every query reads the last
//! [`RECENT_TOKENS`] positions behind it (itself included) at 16 bits, the
//! rest as 8-bit codes. KIVI's residual window, in a paged cache.
//!
//! Why (bench/RESULTS.md, "8-bit KV"): E4M3 keeps 3 mantissa bits, a
//! relative step no scale choice shrinks, and on a real checkpoint the
//! error that flips answers is the keys' at the positions a query looks at
//! hardest, its most recent ones. Simulated in transformers, 16-bit copies
//! of the last 32 positions took fp8's perplexity cost from +0.52% to
//! +0.04% and kept all 13 answers (16 kept 10, none 11).
//!
//! How: a side pool of 16-bit (bf16) copies of whole blocks, `1 /`
//! [`RECENT_SHARE`] of the pool's block count (and never fewer than one
//! window's blocks, for a one-request pool), holding the rows exactly as
//! attention scores them (rotated, unscaled). Before a step, the cache is
//! told which blocks each sequence's queries will read recent rows from
//! ([`RecentRows::hold`]): those keep their copy or take one, the least
//! recently held giving theirs up. A block taking a copy gets its rows
//! decoded from the codes (they are the best there is for rows written
//! before it had one); every row written while it has one is written to
//! both. So the window's rows are exact from the step a sequence is first
//! computed on. Attention decides row by row whether a query reads the copy
//! (`attention::attend_tile`): a block holds rows recent to one query and
//! old to another of the same step.
//!
//! Across workers: a prefill worker sends a prompt's last blocks from their
//! copies (`KvCache::recent_block`), the decode worker holds those blocks
//! before they arrive (`EngineCore::write_kv`), and a block written whole
//! while it has a copy fills both; so the decode worker's first tokens read
//! the prompt's tail as the sender did. Other blocks travel as codes (and
//! re-encode to the same codes), as do blocks read back from a lower tier.
//!
//! When the side pool is too small for a step (more sequences' windows
//! than it holds), the blocks that found no copy read codes: the window
//! degrades to the plain FP8 cache, never to a wrong or missing row.

use super::half::Half;
use super::BlockId;

/// Positions behind a query (itself included) it reads at 16 bits: the
/// smallest window that kept every answer in the simulation.
pub const RECENT_TOKENS: usize = 32;

/// The side pool holds one copy per this many blocks of the pool: room
/// for three blocks (a 32-token window at block size 16 spans up to three)
/// of every sequence when sequences average 384 tokens or more.
pub const RECENT_SHARE: usize = 8;

/// What the copies are stored as.
const COPY: Half = Half::Bf16;

/// A block with no copy, a copy with no block.
const NONE: u32 = u32::MAX;

/// The side pool and who holds which copy.
#[derive(Debug)]
pub(super) struct RecentRows {
    /// Each block's copy, or [`NONE`].
    of_block: Vec<u32>,
    /// Each copy's block, or [`NONE`].
    owner: Vec<u32>,
    /// The hold (see `tick`) that last asked for each copy; 0 never.
    last_held: Vec<u64>,
    /// Counts holds: a copy held in the current one is not given up.
    tick: u64,
    /// Per pool (layer slot), K and V copies, `[copy][kv_head][slot][head_dim]`.
    k: Vec<Vec<u16>>,
    v: Vec<Vec<u16>>,
    block_elems: usize,
}

/// Read access to one layer's copies.
#[derive(Debug, Clone, Copy)]
pub(super) struct RecentView<'a> {
    of_block: &'a [u32],
    k: &'a [u16],
    v: &'a [u16],
    block_elems: usize,
}

impl RecentRows {
    /// Copies for `1 / RECENT_SHARE` of `num_blocks`, and at least one
    /// sequence's window (a small pool: one request's), in `pools` pools of
    /// `block_elems` K (and V when `with_v`) elements a block of
    /// `block_size` tokens.
    pub fn new(
        pools: usize,
        num_blocks: usize,
        block_size: usize,
        block_elems: usize,
        with_v: bool,
    ) -> Self {
        // The window's positions span this many blocks at most.
        let window_blocks = RECENT_TOKENS.div_ceil(block_size.max(1)) + 1;
        let copies = num_blocks
            .div_ceil(RECENT_SHARE)
            .max(window_blocks.min(num_blocks))
            .max(1);
        let zeros = |n: usize| (0..pools).map(|_| vec![0u16; n]).collect();
        Self {
            of_block: vec![NONE; num_blocks],
            owner: vec![NONE; copies],
            last_held: vec![0; copies],
            tick: 0,
            k: zeros(copies * block_elems),
            v: zeros(if with_v { copies * block_elems } else { 0 }),
            block_elems,
        }
    }

    /// Copies in the side pool.
    #[cfg(test)]
    pub fn copies(&self) -> usize {
        self.owner.len()
    }

    /// The copy `block` has.
    pub fn copy_of(&self, block: BlockId) -> Option<usize> {
        match self.of_block.get(block as usize) {
            Some(&c) if c != NONE => Some(c as usize),
            _ => None,
        }
    }

    /// Gives every block of `blocks` a copy, keeping the ones they have;
    /// returns the blocks that took a new one (with it), whose rows the
    /// caller must fill. A copy held here is not given up within this call;
    /// blocks that find none free keep reading codes.
    pub fn hold(&mut self, blocks: &[BlockId]) -> Vec<(BlockId, usize)> {
        self.tick += 1;
        let mut missing = Vec::new();
        for &b in blocks {
            match self.copy_of(b) {
                Some(c) => self.last_held[c] = self.tick,
                None if (b as usize) < self.of_block.len() => missing.push(b),
                None => {}
            }
        }
        let mut taken = Vec::new();
        for b in missing {
            if self.copy_of(b).is_some() {
                continue; // listed twice
            }
            let Some(c) = self.assign(b) else { break };
            taken.push((b, c));
        }
        taken
    }

    /// Hands `block` the least recently held copy not held in this tick.
    fn assign(&mut self, block: BlockId) -> Option<usize> {
        let c = (0..self.owner.len())
            .filter(|&c| self.last_held[c] < self.tick)
            .min_by_key(|&c| self.last_held[c])?;
        if self.owner[c] != NONE {
            self.of_block[self.owner[c] as usize] = NONE;
        }
        self.owner[c] = block;
        self.of_block[block as usize] = c as u32;
        self.last_held[c] = self.tick;
        Some(c)
    }

    /// `block` gives its copy up (its codes were overwritten wholesale).
    pub fn forget(&mut self, block: BlockId) {
        if let Some(c) = self.copy_of(block) {
            self.of_block[block as usize] = NONE;
            self.owner[c] = NONE;
            self.last_held[c] = 0;
        }
    }

    /// After the codes of `src` were copied onto `dst`: `dst`'s copy, if
    /// `src` has one, becomes the same rows.
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId) {
        self.forget(dst);
        let Some(from) = self.copy_of(src) else {
            return;
        };
        // `src` keeps its copy while `dst` takes one.
        self.tick += 1;
        self.last_held[from] = self.tick;
        let Some(to) = self.assign(dst) else {
            return;
        };
        let n = self.block_elems;
        for pool in self.k.iter_mut().chain(self.v.iter_mut()) {
            if !pool.is_empty() {
                pool.copy_within(from * n..(from + 1) * n, to * n);
            }
        }
    }

    /// Writes one row (rotated, unscaled: what attention scores) at
    /// element `offset` of copy `copy` in pool `pool`.
    pub fn write_row(&mut self, pool: usize, copy: usize, keys: bool, offset: usize, row: &[f32]) {
        let store = if keys { &mut self.k } else { &mut self.v };
        let at = copy * self.block_elems + offset;
        COPY.encode_into(row, &mut store[pool][at..at + row.len()]);
    }

    /// Writes a whole block's rows of copy `copy` in pool `pool`.
    pub fn write_block(&mut self, pool: usize, copy: usize, keys: bool, rows: &[f32]) {
        self.write_row(pool, copy, keys, 0, rows);
    }

    /// Copy `copy`'s K (or V) rows in pool `pool`, decoded into `out`
    /// (rotated, as written).
    pub fn read_block(&self, pool: usize, copy: usize, keys: bool, out: &mut [f32]) {
        let store = if keys { &self.k } else { &self.v };
        let at = copy * self.block_elems;
        COPY.decode_into(&store[pool][at..at + out.len()], out);
    }

    /// Pool `pool`'s copies; `latent` reads values from the keys' rows.
    pub fn view(&self, pool: usize, latent: bool) -> RecentView<'_> {
        RecentView {
            of_block: &self.of_block,
            k: &self.k[pool],
            v: if latent { &self.k[pool] } else { &self.v[pool] },
            block_elems: self.block_elems,
        }
    }
}

impl RecentView<'_> {
    /// Rows `row0..row0 + n` of `d` elements (numbered as `LayerView`
    /// numbers them, all in one block) from the block's copy, decoded into
    /// `buf` (which holds `n * d`), if the block has one.
    pub fn rows<'b>(
        &self,
        keys: bool,
        row0: usize,
        d: usize,
        buf: &'b mut [f32],
    ) -> Option<&'b [f32]> {
        let first = row0 * d;
        let block = first / self.block_elems;
        let copy = match self.of_block.get(block) {
            Some(&c) if c != NONE => c as usize,
            _ => return None,
        };
        let within = first - block * self.block_elems;
        debug_assert!(within + buf.len() <= self.block_elems, "rows of one block");
        let at = copy * self.block_elems + within;
        let store = if keys { self.k } else { self.v };
        COPY.decode_into(&store[at..at + buf.len()], buf);
        Some(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_go_to_the_least_recently_held_and_never_within_a_hold() {
        // 24 blocks: 3 copies (a window of 32 at block size 32 spans 2).
        let mut r = RecentRows::new(1, 24, 32, 4, true);
        assert_eq!(r.copies(), 3);
        let took: Vec<BlockId> = r.hold(&[5, 6, 5]).iter().map(|&(b, _)| b).collect();
        assert_eq!(took, [5, 6], "a block listed twice takes one copy");
        assert!(r.hold(&[7]).iter().any(|&(b, _)| b == 7));
        // 5 and 6 were held before 7: a new block takes 5's copy first.
        assert!(r.hold(&[6, 8]).iter().any(|&(b, _)| b == 8));
        assert_eq!(r.copy_of(5), None);
        assert!(r.copy_of(6).is_some() && r.copy_of(7).is_some());
        // Four blocks in one hold, three copies: one reads codes, and no
        // block of the hold loses its copy to another of the same hold.
        let took = r.hold(&[1, 2, 3, 4]);
        assert_eq!(took.len(), 3);
        assert_eq!(
            [1, 2, 3, 4]
                .iter()
                .filter(|&&b| r.copy_of(b).is_some())
                .count(),
            3
        );
        // A block out of range is ignored.
        assert!(r.hold(&[99]).is_empty());
    }

    #[test]
    fn a_small_pool_still_holds_one_window() {
        // 5 blocks of 16: a 32-token window spans up to 3.
        assert_eq!(RecentRows::new(1, 5, 16, 4, true).copies(), 3);
        assert_eq!(RecentRows::new(1, 2, 16, 4, true).copies(), 2);
        assert_eq!(RecentRows::new(1, 800, 16, 4, true).copies(), 100);
    }

    #[test]
    fn a_copied_block_takes_the_rows_of_its_source_and_a_rewritten_one_forgets() {
        let mut r = RecentRows::new(1, 16, 32, 4, false);
        r.hold(&[3]);
        let c = r.copy_of(3).expect("held");
        r.write_block(0, c, true, &[1.0, 2.0, 3.0, 4.0]);
        r.copy_block(3, 9);
        assert!(r.copy_of(3).is_some(), "the source keeps its copy");
        let mut buf = [0.0; 4];
        let rows = r.view(0, true).rows(true, 9, 4, &mut buf).expect("a copy");
        assert_eq!(rows, [1.0, 2.0, 3.0, 4.0]);
        r.forget(9);
        assert!(r.view(0, true).rows(true, 9, 4, &mut buf).is_none());
        // A source with no copy leaves none on the destination.
        r.copy_block(5, 3);
        assert_eq!(r.copy_of(3), None);
    }
}
