//! The index against a set per worker: matches, digests, retirement.

use super::*;

#[test]
fn matches_stop_at_the_first_missing_block() {
    let ix = KvIndex::default();
    ix.stored(0, &[1, 2, 3]);
    ix.stored(1, &[1]);
    assert_eq!(ix.matched(&[0, 1, 7], &[1, 2, 3, 4]), [3, 1, 0]);
    ix.removed(0, &[2]);
    assert_eq!(ix.matched(&[0, 1], &[1, 2, 3]), [1, 1]);
    ix.clear(0);
    assert_eq!(ix.matched(&[0, 1], &[1]), [0, 1]);
    assert_eq!(ix.blocks_of(0), 0);
    assert_eq!(ix.len(), 1);
}

#[test]
fn a_retired_worker_leaves_no_entry_and_its_late_events_are_ignored() {
    let ix = KvIndex::default();
    ix.stored(0, &[1, 2]);
    ix.stored(1, &[1]);
    ix.retire(0);
    ix.stored(0, &[5]);
    assert_eq!(ix.matched(&[0, 1], &[1, 2]), [0, 1]);
    assert_eq!(ix.len(), 1, "only worker 1's block is left");
    // Its id goes to the next worker, which starts empty.
    ix.stored(2, &[9]);
    assert_eq!(ix.matched(&[2, 1], &[1]), [0, 1]);
    assert_eq!(ix.matched(&[2], &[9]), [1]);
}

#[test]
fn digests_follow_the_applied_set() {
    let ix = KvIndex::default();
    ix.stored(3, &[1, 2, 3]);
    ix.stored(3, &[3]);
    ix.removed(3, &[2, 8]);
    assert_eq!(ix.digest_of(3), SetDigest::of([1, 3]));
    assert_eq!(ix.blocks_of(3), 2);
}

#[test]
fn wide_clusters_match_like_the_per_worker_walk() {
    // 200 workers: worker w holds the first w % 37 blocks of a chain.
    let ix = KvIndex::default();
    let chain: Vec<BlockHash> = (100..140).collect();
    for w in 0..200 {
        ix.stored(w, &chain[..w % 37]);
    }
    let slots: Vec<usize> = (0..200).collect();
    let got = ix.matched(&slots, &chain);
    let want: Vec<usize> = slots.iter().map(|w| w % 37).collect();
    assert_eq!(got, want);
    for w in 0..200 {
        ix.retire(w);
    }
    assert!(ix.is_empty());
}

#[test]
fn random_events_match_a_set_per_worker() {
    use std::collections::{BTreeSet, HashMap};
    // The model: each worker's set of hashes; the walk per worker.
    let mut model: HashMap<usize, BTreeSet<BlockHash>> = HashMap::new();
    let mut gone = std::collections::HashSet::new();
    let ix = KvIndex::default();
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    let chain: Vec<BlockHash> = (1..=24).collect();
    for step in 0..4000 {
        let w = next(90) as usize;
        let from = next(24) as usize;
        let to = (from + 1 + next(8) as usize).min(24);
        if gone.contains(&w) {
            // A retired slot's events are ignored; checked below.
            ix.stored(w, &chain[from..to]);
            continue;
        }
        match next(10) {
            0..=4 => {
                ix.stored(w, &chain[from..to]);
                model.entry(w).or_default().extend(&chain[from..to]);
            }
            5..=7 => {
                ix.removed(w, &chain[from..to]);
                let set = model.entry(w).or_default();
                for h in &chain[from..to] {
                    set.remove(h);
                }
            }
            8 => {
                ix.clear(w);
                model.remove(&w);
            }
            _ => {
                // Retire, and a new slot takes over (ids are reused).
                ix.retire(w);
                model.remove(&w);
                gone.insert(w);
                let fresh = 1000 + step;
                assert_eq!(ix.matched(&[fresh], &chain), [0]);
            }
        }
        if step % 50 == 0 {
            let slots: Vec<usize> = (0..90).collect();
            let want: Vec<usize> = slots
                .iter()
                .map(|w| {
                    let set = model.get(w);
                    chain
                        .iter()
                        .take_while(|h| set.is_some_and(|s| s.contains(h)))
                        .count()
                })
                .collect();
            let got = ix.matched(&slots, &chain);
            assert_eq!(got, want, "step {step}");
            for (slot, set) in &model {
                let want = SetDigest::of(set.iter().copied());
                assert_eq!(ix.digest_of(*slot), want, "step {step}");
                assert_eq!(ix.blocks_of(*slot), set.len());
            }
        }
    }
}

/// Up to 64 workers take the one-word walk: it gives what the general
/// walk gives, on random holders of a branching set of chains long
/// enough to cross several lookahead windows.
#[test]
fn the_one_word_walk_matches_the_general_walk() {
    let ix = KvIndex::default();
    let mut x = 0x1234_5678_9abc_def1_u64;
    let mut next = |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    // Four chains sharing their first 50 blocks.
    let chains: Vec<Vec<BlockHash>> = (0..4u64)
        .map(|c| {
            (0..200u64)
                .map(|i| if i < 50 { i + 1 } else { 1000 * (c + 1) + i })
                .collect()
        })
        .collect();
    for w in 0..64 {
        let chain = &chains[next(4) as usize];
        let upto = next(201) as usize;
        ix.stored(w, &chain[..upto]);
        // Holes: some blocks evicted out of order.
        for _ in 0..next(3) {
            let at = next(200) as usize;
            ix.removed(w, &chain[at..at + 1]);
        }
    }
    for chain in &chains {
        for cut in [0, 1, 31, 32, 33, 50, 120, 200] {
            let hashes = &chain[..cut];
            let mut want = 0u64;
            for w in 0..64u64 {
                if next(4) != 0 {
                    want |= 1 << w;
                }
            }
            let guards = ix.read_all();
            let general = walk(&guards, &[want], hashes);
            let narrow = walk_narrow(&guards, want, hashes);
            for id in 0..64 {
                if want & (1 << id) != 0 {
                    assert_eq!(narrow[id], general[id], "cut {cut} id {id}");
                }
            }
        }
    }
}
