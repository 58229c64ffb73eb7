//! Matches of prefix-closed workers by bisection.
//!
//! A worker whose cached set holds every member's parent (it says so in its
//! feed, [`tandem_block_hash::PrefixClosure`]) holds block `i` of a prompt
//! only if it holds blocks `0..i`: whether it holds a block is monotone
//! along the prompt, and its match is where holding stops. One lookup at
//! the middle of a range splits the candidates whose match lies in it into
//! those that hold that block (their match is further on) and the rest, so
//! all candidates are placed with O(distinct matches × log blocks) lookups
//! instead of a walk's one per matched block.
//!
//! The lookups of a binary search depend on each other, and in a router
//! each is a cold line and often a TLB miss (the table holds millions of
//! slots), so 11 of them in a row for a 2,048-block prompt cost more than
//! their count suggests. The search is therefore 8-ary: each round looks
//! up 7 evenly spaced blocks of a range at once (their slots requested
//! together, so the misses overlap) and splits the range's candidates into
//! 8 parts: 4 rounds for 2,048 blocks.

use std::sync::RwLockReadGuard;

use tandem_block_hash::BlockHash;

use super::{prefetch_slot, record_dropped, shard_of, Shard};

/// Blocks each round of the search looks up in a range.
const PROBES: usize = 7;

/// The holders of `h` among ids `64 w .. 64 (w + 1)`.
fn holders(guards: &[RwLockReadGuard<'_, Shard>], h: BlockHash, w: usize) -> u64 {
    let shard = &guards[shard_of(h)];
    if w == 0 {
        return shard.low.get(h).unwrap_or(0);
    }
    shard
        .high
        .get(&h)
        .and_then(|words| words.get(w - 1).copied())
        .unwrap_or(0)
}

/// Sets `depth[64 w + i]` for each bit `i` of `set` to the number of
/// leading blocks of `hashes` that id holds, every id in `set` holding a
/// prefix-closed set.
pub(super) fn bisect(
    guards: &[RwLockReadGuard<'_, Shard>],
    w: usize,
    set: u64,
    hashes: &[BlockHash],
    depth: &mut [usize],
) {
    // (ids, lo, hi): each id's match is in lo..=hi.
    let mut ranges = vec![(set, 0, hashes.len())];
    while let Some((ids, lo, hi)) = ranges.pop() {
        if ids == 0 {
            continue;
        }
        if lo == hi {
            record_dropped(depth, w, ids, lo);
            continue;
        }
        // Probes lo ≤ p_1 < … < p_n < hi, evenly spaced (every block of
        // a range of up to PROBES).
        let n = PROBES.min(hi - lo);
        let probe = |j: usize| lo + (hi - lo) * j / (n + 1);
        for j in 1..=n {
            prefetch_slot(guards, hashes[probe(j)]);
        }
        // Holding a block means holding every one before it: an id not
        // holding p_1 matches in lo..=p_1, one holding p_j but not
        // p_{j+1} in p_j+1..=p_{j+1}, one holding all in p_n+1..=hi.
        let mut left = ids;
        let mut from = lo;
        for j in 1..=n {
            let held = holders(guards, hashes[probe(j)], w);
            ranges.push((left & !held, from, probe(j)));
            left &= held;
            from = probe(j) + 1;
        }
        ranges.push((left, from, hi));
    }
}

#[cfg(test)]
mod tests {
    use super::super::KvIndex;
    use tandem_block_hash::{BlockHash, PrefixClosure, ROOT};

    /// Random closed sets (chains of a branching tree stored parents first,
    /// evicted tail first): a certified match equals the walk's, for 40
    /// and 150 workers (one word and three), and a worker whose set has a
    /// hole is walked while others are bisected.
    #[test]
    fn certified_matches_equal_the_walk() {
        let mut x = 0x0123_4567_89ab_cdef_u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        // Eight chains of 300 blocks sharing the first 40 (or 120) blocks.
        let chains: Vec<Vec<BlockHash>> = (0..8u64)
            .map(|c| {
                let shared = if c < 4 { 40 } else { 120 };
                (0..300u64)
                    .map(|i| {
                        if i < shared {
                            i + 1
                        } else {
                            10_000 * (c + 1) + i
                        }
                    })
                    .collect()
            })
            .collect();
        let parent = |chain: &[BlockHash], i: usize| if i == 0 { ROOT } else { chain[i - 1] };
        for workers in [40usize, 150] {
            let mut certified = 0;
            let walked = KvIndex::default();
            let bisected = KvIndex::default();
            for w in 0..workers {
                let mut set = PrefixClosure::default();
                for _ in 0..=next(3) {
                    let chain = &chains[next(8) as usize];
                    let upto = next(301) as usize;
                    for ix in [&walked, &bisected] {
                        ix.stored(w, &chain[..upto]);
                    }
                    for (i, &h) in chain[..upto].iter().enumerate() {
                        set.insert(h, parent(chain, i));
                    }
                    // Tail first, as engines evict.
                    let evict = next(upto as u64 + 1) as usize;
                    for &h in chain[upto - evict..upto].iter().rev() {
                        for ix in [&walked, &bisected] {
                            ix.removed(w, &[h]);
                        }
                        set.remove(h);
                    }
                }
                // Worker 7 loses a middle block: open, and not certified.
                if w == 7 {
                    let chain = &chains[0];
                    for ix in [&walked, &bisected] {
                        ix.stored(w, chain);
                        ix.removed(w, &chain[20..21]);
                    }
                    for (i, &h) in chain.iter().enumerate() {
                        set.insert(h, parent(chain, i));
                    }
                    set.remove(chain[20]);
                    assert!(!set.is_closed());
                }
                // Evicting one chain's tail into a prefix another chain
                // shares opens a set too (an engine's LRU would not).
                certified += usize::from(set.is_closed());
                bisected.set_prefix_closed(w, set.is_closed());
            }
            assert!(certified >= workers / 2, "{certified} of {workers} closed");
            let slots: Vec<usize> = (0..workers).collect();
            for chain in &chains {
                for cut in [0, 1, 20, 21, 40, 41, 120, 299, 300] {
                    let want = walked.matched(&slots, &chain[..cut]);
                    let got = bisected.matched(&slots, &chain[..cut]);
                    assert_eq!(got, want, "{workers} workers, cut {cut}");
                }
            }
        }
    }

    #[test]
    fn the_flag_follows_clear_and_retire() {
        let ix = KvIndex::default();
        let prompt: Vec<BlockHash> = (1..=100).collect();
        // A false claim shows: block 2 is missing, the rest held, and a
        // search that never looks at block 2 matches all 100.
        let open: Vec<BlockHash> = prompt.iter().copied().filter(|&h| h != 2).collect();
        ix.stored(1, &open);
        ix.set_prefix_closed(1, true);
        assert_eq!(
            ix.matched(&[1], &prompt),
            [100],
            "bisected: trusts the flag"
        );
        ix.clear(1);
        ix.stored(1, &open);
        assert_eq!(ix.matched(&[1], &prompt), [1], "walked after a clear");
        ix.set_prefix_closed(1, true);
        ix.retire(1);
        // The id goes to a new worker, uncertified.
        ix.stored(2, &open);
        assert_eq!(ix.matched(&[2], &prompt), [1]);
        // A retired slot's flag is ignored.
        ix.set_prefix_closed(1, true);
        assert_eq!(ix.matched(&[2], &prompt), [1]);
    }
}
