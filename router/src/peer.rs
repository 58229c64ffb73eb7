//! Peer fetch: when another decode worker holds (in its pool or on its
//! disk tier) more of the prompt's prefix than the worker chosen to decode
//! it, the chosen worker can pull those blocks from it over the KV
//! transport instead of computing them. It is the remote prefill the
//! router already names, with the holder as the "prefill worker": the
//! holder's `Prefill` finds the prefix in its cache, computes only what it
//! lacks, and pushes the blocks, as a draining worker does at a hand-over.
//!
//! Whether to fetch is decided from measurements, not a prompt-length rule:
//! the chosen worker reports its seconds per computed block and, per peer,
//! the seconds per block its remote prefills from that peer took; the
//! holder reports its seconds per block restored from disk. For the `gain`
//! blocks the peer holds beyond the chosen worker,
//!
//! ```text
//! fetch     = gain × fetch_seconds_per_block(peer → chosen)
//!           + blocks the peer has only on disk × its disk seconds per block
//! recompute = gain × prefill_seconds_per_block(chosen)
//! ```
//!
//! and the cheaper wins. A link not measured yet is tried (fetching is how
//! it gets measured), as is fetching for a worker that has not measured its
//! own prefill: one slow fetch teaches the router to stop.

use crate::policy::Candidate;
use crate::pool::Measured;

/// Why a request fetches from a peer, or why it does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerDecision {
    /// Fetch from candidate `peer`: `gain` blocks, for `reason`.
    Fetch {
        peer: usize,
        gain: usize,
        reason: &'static str,
    },
    /// Compute here, for this reason.
    Compute(&'static str),
}

/// Blocks of the prompt a candidate can serve without computing them.
fn held(c: &Candidate) -> usize {
    c.matched_blocks.max(c.disk_blocks)
}

/// Decides for the worker `chosen` of `cands` (whose measurements
/// `measured(i)` gives, read only for the chosen worker and the peer, and
/// whose addresses are `addrs[i]`): fetch from the peer holding the most
/// blocks beyond it if that gain is at least `min_blocks` and fetching is
/// not measured slower than computing.
pub fn decide(
    cands: &[Candidate],
    measured: &dyn Fn(usize) -> Measured,
    addrs: &[&str],
    chosen: usize,
    min_blocks: usize,
) -> PeerDecision {
    let own = cands.get(chosen).map_or(0, held);
    let best = (0..cands.len()).filter(|&i| i != chosen).max_by_key(|&i| {
        (
            held(&cands[i]),
            cands[i].matched_blocks,
            std::cmp::Reverse(i),
        )
    });
    let Some(peer) = best.filter(|&i| held(&cands[i]) > own) else {
        return PeerDecision::Compute("no_peer_holds_more");
    };
    let gain = held(&cands[peer]) - own;
    if gain < min_blocks.max(1) {
        return PeerDecision::Compute("peer_gain_below_threshold");
    }
    let here = measured(chosen);
    let (Some(compute), Some(fetch)) = (
        here.prefill_seconds_per_block,
        here.fetch_seconds_per_block.get(addrs[peer]).copied(),
    ) else {
        return PeerDecision::Fetch {
            peer,
            gain,
            reason: "peer_unmeasured",
        };
    };
    let on_disk_only = held(&cands[peer]).saturating_sub(cands[peer].matched_blocks.max(own));
    let restore = match on_disk_only {
        0 => 0.0,
        _ => measured(peer).disk_seconds_per_block.unwrap_or(0.0),
    };
    let fetch = gain as f64 * fetch + on_disk_only as f64 * restore;
    if fetch < gain as f64 * compute {
        PeerDecision::Fetch {
            peer,
            gain,
            reason: "peer_faster",
        }
    } else {
        PeerDecision::Compute("recompute_faster")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(pool: usize, disk: usize) -> Candidate {
        Candidate {
            matched_blocks: pool,
            disk_blocks: disk,
            disk_block_cost: None,
            active_requests: 0,
            active_blocks: 0,
            adapter_cold: false,
            identity: 0,
        }
    }

    fn measured(prefill: Option<f64>, fetch_from_b: Option<f64>, disk: Option<f64>) -> Measured {
        Measured {
            prefill_seconds_per_block: prefill,
            disk_seconds_per_block: disk,
            fetch_seconds_per_block: fetch_from_b
                .map(|f| [("b".to_string(), f)].into_iter().collect())
                .unwrap_or_default(),
        }
    }

    const ADDRS: [&str; 3] = ["a", "b", "c"];

    #[test]
    fn the_peer_holding_most_is_fetched_from_until_measured_slower() {
        let cands = [cand(0, 0), cand(40, 40), cand(10, 0)];
        // Nothing measured: try the link.
        let none = vec![Measured::default(); 3];
        assert_eq!(
            decide(&cands, &|i| none[i].clone(), &ADDRS, 0, 16),
            PeerDecision::Fetch {
                peer: 1,
                gain: 40,
                reason: "peer_unmeasured"
            }
        );
        // Measured: 1 ms a block fetched against 20 ms computed.
        let fast = [
            measured(Some(0.020), Some(0.001), None),
            Measured::default(),
            Measured::default(),
        ];
        assert!(matches!(
            decide(&cands, &|i| fast[i].clone(), &ADDRS, 0, 16),
            PeerDecision::Fetch {
                peer: 1,
                reason: "peer_faster",
                ..
            }
        ));
        // A throttled link: 30 ms a block against 20 ms computed.
        let slow = [
            measured(Some(0.020), Some(0.030), None),
            Measured::default(),
            Measured::default(),
        ];
        assert_eq!(
            decide(&cands, &|i| slow[i].clone(), &ADDRS, 0, 16),
            PeerDecision::Compute("recompute_faster")
        );
    }

    #[test]
    fn small_gains_and_no_holder_compute_here() {
        let none = vec![Measured::default(); 3];
        assert_eq!(
            decide(
                &[cand(30, 30), cand(40, 40), cand(0, 0)],
                &|i| none[i].clone(),
                &ADDRS,
                0,
                16
            ),
            PeerDecision::Compute("peer_gain_below_threshold")
        );
        assert_eq!(
            decide(
                &[cand(40, 40), cand(40, 0), cand(0, 0)],
                &|i| none[i].clone(),
                &ADDRS,
                0,
                16
            ),
            PeerDecision::Compute("no_peer_holds_more")
        );
        assert_eq!(
            decide(&[cand(0, 0)], &|i| none[i].clone(), &ADDRS, 0, 16),
            PeerDecision::Compute("no_peer_holds_more")
        );
    }

    #[test]
    fn blocks_only_on_the_peers_disk_add_its_restore_time() {
        // b holds 40 blocks on disk, none in its pool: 40 × (1 + 2) ms
        // fetched against 40 × 2.5 ms computed.
        let cands = [cand(0, 0), cand(0, 40), cand(0, 0)];
        let m = [
            measured(Some(0.0025), Some(0.001), None),
            measured(None, None, Some(0.002)),
            Measured::default(),
        ];
        assert_eq!(
            decide(&cands, &|i| m[i].clone(), &ADDRS, 0, 16),
            PeerDecision::Compute("recompute_faster")
        );
        let m = [
            measured(Some(0.0035), Some(0.001), None),
            measured(None, None, Some(0.002)),
            Measured::default(),
        ];
        assert!(matches!(
            decide(&cands, &|i| m[i].clone(), &ADDRS, 0, 16),
            PeerDecision::Fetch { peer: 1, .. }
        ));
    }
}
