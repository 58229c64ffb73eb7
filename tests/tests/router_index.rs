//! The router's KV index against event streams that lie: a real
//! `tandem_router::Cluster` following simulated workers
//! (`tandem_tests::sim_worker`) over gRPC, whose feeds drop events on
//! purpose, with and without the sequence numbers showing it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_block_hash::SetDigest;
use tandem_router::{Cluster, Resync, Role};
use tandem_tests::sim_worker::{Fault, SimConfig, SimWorker};

const DIGEST_PERIOD: Duration = Duration::from_millis(200);

async fn follow(digest_period: Duration) -> (SimWorker, Arc<Cluster>, usize) {
    follow_with(SimConfig {
        digest_period,
        ..SimConfig::default()
    })
    .await
}

async fn follow_with(config: SimConfig) -> (SimWorker, Arc<Cluster>, usize) {
    let sim = SimWorker::start(config).await.expect("a simulated worker");
    let cluster = Cluster::new(Duration::from_millis(50));
    cluster.add(Role::Decode, sim.addr()).expect("added");
    let slot = cluster.all()[0].slot;
    // Followed once a first block shows in the index.
    sim.cache_tokens(&(0..16).collect::<Vec<u32>>());
    converged(&sim, &cluster, slot, Duration::from_secs(10)).await;
    (sim, cluster, slot)
}

/// Waits (at most `limit`) until the index holds exactly what the worker
/// caches; how long that took.
async fn converged(sim: &SimWorker, cluster: &Cluster, slot: usize, limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let truth = sim.cached();
        if cluster.index.digest_of(slot) == SetDigest::of(truth.iter().copied())
            && cluster.index.blocks_of(slot) == truth.len()
        {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "the index still differs from the worker's cache after {limit:?}: {} blocks indexed, {} cached",
            cluster.index.blocks_of(slot),
            truth.len()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// 100 prompts of 4 blocks, one `Stored` event each.
fn cache_prompts(sim: &SimWorker, salt: u32) {
    for p in 0..100u32 {
        let tokens: Vec<u32> = (0..64).map(|i| salt * 1_000_000 + p * 100 + i).collect();
        sim.cache_tokens(&tokens);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_that_loses_events_with_no_gap_is_resynced_within_one_digest_period() {
    let (sim, cluster, slot) = follow(DIGEST_PERIOD).await;
    sim.set_fault(Fault {
        drop_fraction: 0.1,
        hide_gaps: true,
    });
    cache_prompts(&sim, 1);
    // A dump is not subject to the fault: once resynced, the index is whole.
    let took = converged(&sim, &cluster, slot, Duration::from_secs(5)).await;
    eprintln!("resynced {took:?} after the last lost event");
    assert!(cluster.resyncs(Resync::Digest) >= 1, "the digest caught it");
    assert_eq!(cluster.resyncs(Resync::Gap), 0, "no gap was visible");
    assert!(
        took <= DIGEST_PERIOD + Duration::from_millis(300),
        "resynced {took:?} after the loss: more than one digest period ({DIGEST_PERIOD:?}) and a dump"
    );
    // A healthy feed afterwards stays in sync with no more resyncs.
    sim.set_fault(Fault::default());
    let resyncs = cluster.resyncs(Resync::Digest);
    cache_prompts(&sim, 2);
    converged(&sim, &cluster, slot, Duration::from_secs(5)).await;
    tokio::time::sleep(DIGEST_PERIOD * 2).await;
    assert_eq!(cluster.resyncs(Resync::Digest), resyncs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_whose_numbers_skip_is_resynced_at_the_gap() {
    // Digests too rare to help: only the sequence numbers can.
    let (sim, cluster, slot) = follow(Duration::from_secs(3600)).await;
    sim.set_fault(Fault {
        drop_fraction: 0.1,
        hide_gaps: false,
    });
    cache_prompts(&sim, 3);
    sim.set_fault(Fault::default());
    // The loss shows at the next event after it; one more makes sure.
    sim.cache_tokens(&(500..564).collect::<Vec<u32>>());
    converged(&sim, &cluster, slot, Duration::from_secs(5)).await;
    assert!(cluster.resyncs(Resync::Gap) >= 1);
    assert_eq!(cluster.resyncs(Resync::Digest), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_worker_leaves_no_entry_even_as_its_feed_goes_on() {
    let (sim, cluster, slot) = follow(DIGEST_PERIOD).await;
    cache_prompts(&sim, 4);
    converged(&sim, &cluster, slot, Duration::from_secs(5)).await;
    assert!(cluster.index.len() >= 400);
    cluster.remove(sim.addr());
    assert!(cluster.index.is_empty(), "purged at once");
    // Events in flight or still coming from the worker do not bring it back.
    cache_prompts(&sim, 5);
    tokio::time::sleep(DIGEST_PERIOD * 2).await;
    assert!(cluster.index.is_empty());
    assert_eq!(cluster.index.blocks_of(slot), 0);
}

/// Waits (at most a second) for the index to certify `slot`'s set closed:
/// the flag is set just after the change that made the set whole.
async fn certified(cluster: &Cluster, slot: usize) {
    for _ in 0..200 {
        if cluster.index.prefix_closed(slot) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the worker's set is not certified closed");
}

/// A worker that evicts tail first certifies its set prefix-closed; the
/// router then bisects its matches, which equal the walk along its true
/// cache, through evictions and after a resync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_feed_is_bisected_to_the_true_match() {
    let (sim, cluster, slot) = follow_with(SimConfig {
        digest_period: DIGEST_PERIOD,
        capacity_blocks: 120,
        cache_on_generate: false,
        ..SimConfig::default()
    })
    .await;
    // 12 prompts of 4 to 40 blocks over 3 shared 8-block prefixes: the
    // cache of 120 blocks evicts as they come.
    let prompt = |p: u32| -> Vec<u32> {
        let family = p % 3;
        let blocks = 4 + (p * 7) % 37;
        (0..blocks * 16)
            .map(|i| {
                if i < 128 {
                    family * 1_000 + i
                } else {
                    100_000 * (p + 1) + i
                }
            })
            .collect()
    };
    let check = |label: &str| {
        let cached: std::collections::HashSet<u64> = sim.cached().into_iter().collect();
        for p in 0..12 {
            let hashes = tandem_block_hash::block_hashes(&prompt(p), 16);
            let truth = hashes.iter().take_while(|h| cached.contains(h)).count();
            assert_eq!(
                cluster.index.matched(&[slot], &hashes),
                [truth],
                "{label}, prompt {p}"
            );
        }
    };
    for p in 0..12 {
        sim.cache_tokens(&prompt(p));
    }
    converged(&sim, &cluster, slot, Duration::from_secs(5)).await;
    certified(&cluster, slot).await;
    check("live");
    // Lost events: the digest resyncs, and the dump certifies again.
    sim.set_fault(Fault {
        drop_fraction: 0.5,
        hide_gaps: true,
    });
    for p in (0..12).rev() {
        sim.cache_tokens(&prompt(p));
    }
    sim.set_fault(Fault::default());
    converged(&sim, &cluster, slot, Duration::from_secs(5)).await;
    assert!(cluster.resyncs(Resync::Digest) >= 1);
    certified(&cluster, slot).await;
    check("after a resync");
}
