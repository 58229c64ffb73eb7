//! What fetching KV from each peer has cost a decode worker: seconds per
//! block of its remote prefills, by the peer's address, as moving
//! averages. The worker measures them (`GrpcPrefiller`) and reports them
//! in every `LoadReport`; the router weighs a peer fetch against computing
//! the blocks with them (`tandem_router::peer`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tandem_proto::worker::v1 as wv1;

/// Weight of the newest sample.
const WEIGHT: f64 = 0.3;

/// Peers remembered at most (a worker talks to a handful; the bound keeps
/// a churning fleet from growing the map and the load report without end).
pub const MAX_PEERS: usize = 256;

/// Seconds per block fetched, by peer. Cheap to clone; clones share.
#[derive(Debug, Clone, Default)]
pub struct PeerFetchCosts(Arc<Mutex<HashMap<String, f64>>>);

impl PeerFetchCosts {
    /// Folds one remote prefill from `peer` (`blocks` blocks in
    /// `seconds`) into its average.
    pub fn record(&self, peer: &str, blocks: usize, seconds: f64) {
        if blocks == 0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let sample = seconds / blocks as f64;
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if !map.contains_key(peer) && map.len() >= MAX_PEERS {
            return;
        }
        map.entry(peer.to_string())
            .and_modify(|avg| *avg += WEIGHT * (sample - *avg))
            .or_insert(sample);
    }

    /// Every peer's average, for a load report.
    pub fn to_proto(&self) -> Vec<wv1::PeerFetchCost> {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<wv1::PeerFetchCost> = map
            .iter()
            .map(|(peer, &seconds_per_block)| wv1::PeerFetchCost {
                peer: peer.clone(),
                seconds_per_block,
            })
            .collect();
        out.sort_by(|a, b| a.peer.cmp(&b.peer));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn averages_per_peer_and_ignores_empty_samples() {
        let c = PeerFetchCosts::default();
        c.record("a:1", 10, 1.0);
        c.record("a:1", 10, 2.0);
        c.record("b:2", 4, 0.4);
        c.record("b:2", 0, 9.0);
        let got: Vec<(String, f64)> = c
            .to_proto()
            .into_iter()
            .map(|p| (p.peer, p.seconds_per_block))
            .collect();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].0, "a:1");
        assert!((got[0].1 - 0.13).abs() < 1e-9, "{got:?}");
        assert!((got[1].1 - 0.1).abs() < 1e-9, "{got:?}");
    }
}
