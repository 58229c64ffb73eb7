//! Routing policies: which worker of a pool gets a request.
//!
//! Every policy sees the same [`Candidate`] facts — the prefix blocks the
//! worker already caches for this request and its load — and returns an
//! index. `kv` is NVIDIA Dynamo's cost,
//! `overlap_weight × new_prefill_blocks + active_blocks`, lowest wins, with
//! SGLang's balance guard: when the busiest and idlest workers differ by
//! more than `abs_threshold` requests and by more than `rel_threshold`
//! times, the least-loaded worker wins regardless of cache, so one popular
//! prefix cannot herd all traffic onto one worker.
//!
//! Ties are broken by rendezvous hashing of the prompt's key (the hash of
//! its first block) with each tied worker's identity, not by a counter: a
//! decision is a function of the state and the request alone, so router
//! replicas that see the same workers, loads and caches pick the same
//! worker, in whatever order they list the workers, and distinct prefixes
//! still spread over the pool.

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};

/// What a policy knows about one worker for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Leading prompt blocks this worker has cached in its KV pool ...
    pub matched_blocks: usize,
    /// ... and in its disk tier (read back, not recomputed; usually a
    /// superset of the pool's, since the tier is written through) ...
    pub disk_blocks: usize,
    /// ... and what one of those costs there against computing it, as
    /// the worker measured (`None`: not yet; the policy's default).
    pub disk_block_cost: Option<f64>,
    /// Requests in flight (router-counted).
    pub active_requests: usize,
    /// KV blocks in use (worker-reported, plus the router's in-flight estimate).
    pub active_blocks: usize,
    /// The request's LoRA adapter is known there but not resident: the
    /// worker reads it from disk first.
    pub adapter_cold: bool,
    /// A stable hash of the worker's address (for tie-breaking).
    pub identity: u64,
}

/// What a policy knows about the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PromptFacts {
    /// Full blocks in the prompt.
    pub blocks: usize,
    /// The hash of its first (possibly partial) block.
    pub key: u64,
}

/// A pick and why (a metric label and a span field, so a small fixed set).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Index into the candidates.
    pub index: usize,
    /// `kv`: `prefix_match` (the cheapest worker caches part of the
    /// prompt), `load` (it caches none: load decided) or `balance_guard`
    /// (the guard overrode the cost); the other policies name themselves.
    pub reason: &'static str,
}

/// A way to pick a worker.
pub trait RoutingPolicy: Send + Sync + std::fmt::Debug {
    /// The policy's name, as on the command line.
    fn name(&self) -> &'static str;

    /// Picks from `candidates` (never empty) for `prompt`, and says why.
    fn decide(&self, candidates: &[Candidate], prompt: PromptFacts) -> Decision;

    /// Index into `candidates` (never empty) for `prompt`.
    fn pick(&self, candidates: &[Candidate], prompt: PromptFacts) -> usize {
        self.decide(candidates, prompt).index
    }
}

/// Policy names accepted on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    Kv,
    LeastLoaded,
    RoundRobin,
    Random,
}

/// A policy name that is not one of [`PolicyKind`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown policy {0:?} (kv, least-loaded, round-robin, random)")]
pub struct UnknownPolicy(pub String);

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, UnknownPolicy> {
        match s {
            "kv" => Ok(Self::Kv),
            "least-loaded" => Ok(Self::LeastLoaded),
            "round-robin" => Ok(Self::RoundRobin),
            "random" => Ok(Self::Random),
            other => Err(UnknownPolicy(other.to_string())),
        }
    }
}

impl PolicyKind {
    /// The policy's name, as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kv => "kv",
            Self::LeastLoaded => "least-loaded",
            Self::RoundRobin => "round-robin",
            Self::Random => "random",
        }
    }

    /// The policy with default settings.
    pub fn build(self) -> Box<dyn RoutingPolicy> {
        match self {
            Self::Kv => Box::new(KvPolicy::default()),
            Self::LeastLoaded => Box::new(LeastLoaded),
            Self::RoundRobin => Box::new(RoundRobin::default()),
            Self::Random => Box::new(Random::default()),
        }
    }
}

/// The rendezvous weight of a worker for a prompt (SplitMix64 of both).
fn rendezvous(key: u64, identity: u64) -> u64 {
    let mut z = (key ^ identity.rotate_left(32)).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fewest requests in flight, then fewest blocks in use; ties go to the
/// highest rendezvous hash of the prompt's key and the worker, as `kv`'s
/// do: idle workers share the prompts (ties to the lowest index left a
/// worker that joined later idle at light load) and replicas still agree.
#[derive(Debug, Default)]
pub struct LeastLoaded;

fn least_loaded(c: &[Candidate], key: u64) -> usize {
    (0..c.len())
        .min_by_key(|&i| {
            (
                c[i].active_requests,
                c[i].active_blocks,
                std::cmp::Reverse(rendezvous(key, c[i].identity)),
            )
        })
        .unwrap_or(0)
}

impl RoutingPolicy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least-loaded"
    }

    fn decide(&self, c: &[Candidate], prompt: PromptFacts) -> Decision {
        Decision {
            index: least_loaded(c, prompt.key),
            reason: "least_loaded",
        }
    }
}

/// Each worker in turn.
#[derive(Debug, Default)]
pub struct RoundRobin(AtomicU64);

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn decide(&self, c: &[Candidate], _: PromptFacts) -> Decision {
        Decision {
            index: (self.0.fetch_add(1, Ordering::Relaxed) % c.len() as u64) as usize,
            reason: "round_robin",
        }
    }
}

/// Uniformly at random (xorshift; no seed needed).
#[derive(Debug)]
pub struct Random(AtomicU64);

impl Default for Random {
    fn default() -> Self {
        Self(AtomicU64::new(0x9e37_79b9_7f4a_7c15))
    }
}

impl RoutingPolicy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn decide(&self, c: &[Candidate], _: PromptFacts) -> Decision {
        let mut x = self.0.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0.store(x, Ordering::Relaxed);
        Decision {
            index: (x % c.len() as u64) as usize,
            reason: "random",
        }
    }
}

/// Prefix-affinity cost with a balance guard. Ties (no worker has the
/// prefix, equal load) go to the tied worker whose identity hashes highest
/// with the prompt's key (rendezvous hashing), so new prefixes spread over
/// the pool and replicas agree.
#[derive(Debug)]
pub struct KvPolicy {
    pub overlap_weight: f64,
    /// What loading a non-resident LoRA adapter costs, in blocks of prompt
    /// to compute (a worker with the adapter resident is preferred).
    pub cold_adapter_cost: f64,
    /// What a block read from a worker's disk tier costs, as a share of
    /// computing it, until the worker has measured both (its own ratio
    /// wins then: a GPU computes a block faster than a disk returns it).
    /// kv-tier-bench measured 0.034 on the CPU engine (bench-100m,
    /// page-cached files); 0.2 leaves room for a cold disk.
    pub disk_block_cost: f64,
    pub abs_threshold: usize,
    pub rel_threshold: f64,
}

impl Default for KvPolicy {
    fn default() -> Self {
        Self {
            overlap_weight: 1.0,
            cold_adapter_cost: 16.0,
            disk_block_cost: 0.2,
            abs_threshold: 8,
            rel_threshold: 2.0,
        }
    }
}

impl RoutingPolicy for KvPolicy {
    fn name(&self) -> &'static str {
        "kv"
    }

    fn decide(&self, c: &[Candidate], prompt: PromptFacts) -> Decision {
        let prompt_blocks = prompt.blocks;
        let max = c.iter().map(|x| x.active_requests).max().unwrap_or(0);
        let min = c.iter().map(|x| x.active_requests).min().unwrap_or(0);
        if max - min > self.abs_threshold && max as f64 > self.rel_threshold * min as f64 {
            return Decision {
                index: least_loaded(c, prompt.key),
                reason: "balance_guard",
            };
        }
        let cost = |x: &Candidate| {
            let held = x.matched_blocks.max(x.disk_blocks).min(prompt_blocks);
            let new_blocks = (prompt_blocks - held) as f64;
            let from_disk = held.saturating_sub(x.matched_blocks) as f64;
            let cold = if x.adapter_cold {
                self.cold_adapter_cost
            } else {
                0.0
            };
            let disk_cost = x.disk_block_cost.unwrap_or(self.disk_block_cost);
            self.overlap_weight * (new_blocks + disk_cost * from_disk)
                + x.active_blocks as f64
                + cold
        };
        let key = |x: &Candidate| (cost(x), x.active_requests);
        let best = c
            .iter()
            .map(key)
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let Some(best) = best else {
            return Decision {
                index: 0,
                reason: "load",
            };
        };
        let index = (0..c.len())
            .filter(|&i| key(&c[i]) == best)
            .max_by_key(|&i| rendezvous(prompt.key, c[i].identity))
            .unwrap_or(0);
        Decision {
            index,
            reason: if c[index].matched_blocks > 0 {
                "prefix_match"
            } else if c[index].disk_blocks > 0 {
                "disk_match"
            } else {
                "load"
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(matched: usize, reqs: usize, blocks: usize) -> Candidate {
        Candidate {
            matched_blocks: matched,
            disk_blocks: 0,
            disk_block_cost: None,
            active_requests: reqs,
            active_blocks: blocks,
            adapter_cold: false,
            identity: (matched * 31 + reqs * 7 + blocks) as u64,
        }
    }

    fn prompt(blocks: usize) -> PromptFacts {
        PromptFacts { blocks, key: 42 }
    }

    #[test]
    fn kv_prefers_a_worker_with_the_adapter_resident() {
        let p = KvPolicy::default();
        let cold = Candidate {
            adapter_cold: true,
            ..cand(0, 0, 0)
        };
        assert_eq!(p.pick(&[cold, cand(0, 1, 4)], prompt(8)), 1);
        // A long cached prefix is still worth a load from disk.
        let cached_cold = Candidate {
            adapter_cold: true,
            ..cand(40, 0, 0)
        };
        assert_eq!(p.pick(&[cached_cold, cand(0, 0, 0)], prompt(40)), 0);
    }

    #[test]
    fn kv_prefers_the_cached_prefix() {
        let p = KvPolicy::default();
        let c = [cand(0, 1, 10), cand(30, 1, 10), cand(5, 0, 0)];
        assert_eq!(
            p.decide(&c, prompt(32)),
            Decision {
                index: 1,
                reason: "prefix_match"
            }
        );
        assert_eq!(
            p.decide(&[cand(0, 0, 3), cand(0, 0, 1)], prompt(4)).reason,
            "load"
        );
    }

    #[test]
    fn kv_weighs_a_disk_hit_between_a_pool_hit_and_a_miss() {
        let p = KvPolicy::default();
        let on_disk = |blocks: usize, active: usize| Candidate {
            disk_blocks: blocks,
            ..cand(0, 0, active)
        };
        // A prefix on disk beats a miss ...
        let d = p.decide(&[cand(0, 0, 0), on_disk(30, 0)], prompt(32));
        assert_eq!((d.index, d.reason), (1, "disk_match"));
        // ... a pool hit beats the disk ...
        assert_eq!(p.pick(&[on_disk(30, 0), cand(30, 0, 0)], prompt(32)), 1);
        // ... and 30 blocks on disk (6 blocks' worth at 0.2) lose to an
        // idle miss once the worker holding them is 40 blocks busier.
        assert_eq!(p.pick(&[on_disk(30, 40), cand(0, 0, 0)], prompt(32)), 1);
        assert_eq!(p.pick(&[on_disk(30, 20), cand(0, 0, 0)], prompt(32)), 0);
        // Disk blocks past the pool's count; the pool's own are free.
        let both = Candidate {
            disk_blocks: 30,
            ..cand(10, 0, 0)
        };
        assert_eq!(p.pick(&[both, on_disk(30, 0)], prompt(32)), 0);
        // A worker's measured ratio wins over the default: where a disk
        // block costs as much as computing it, 30 of them are a miss.
        let slow_disk = Candidate {
            disk_block_cost: Some(1.0),
            ..on_disk(30, 0)
        };
        let busy_miss = cand(0, 0, 10);
        assert_eq!(p.pick(&[on_disk(30, 0), busy_miss], prompt(32)), 0);
        assert_eq!(
            p.pick(&[slow_disk, busy_miss], prompt(32)),
            0,
            "30 + 2 < 32 + 10"
        );
        let busier = Candidate {
            disk_block_cost: Some(1.0),
            ..on_disk(30, 12)
        };
        assert_eq!(
            p.pick(&[busier, busy_miss], prompt(32)),
            1,
            "30 + 2 + 12 > 42"
        );
    }

    #[test]
    fn kv_weighs_load_against_overlap() {
        let p = KvPolicy::default();
        // 4 cached blocks are not worth 100 busy blocks.
        let c = [cand(4, 2, 100), cand(0, 2, 0)];
        assert_eq!(p.pick(&c, prompt(8)), 1);
    }

    #[test]
    fn the_balance_guard_stops_herding() {
        let p = KvPolicy::default();
        let c = [cand(32, 20, 0), cand(0, 2, 0)];
        assert_eq!(p.pick(&c, prompt(32)), 1, "20 vs 2 in flight: balance wins");
        assert_eq!(p.decide(&c, prompt(32)).reason, "balance_guard");
        let c = [cand(32, 5, 0), cand(0, 2, 0)];
        assert_eq!(
            p.pick(&c, prompt(32)),
            0,
            "a small imbalance keeps affinity"
        );
    }

    #[test]
    fn round_robin_cycles_and_least_loaded_picks_the_idlest() {
        let rr = RoundRobin::default();
        let c = [cand(0, 0, 0); 3];
        let picks: Vec<usize> = (0..6).map(|_| rr.pick(&c, prompt(1))).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        assert_eq!(
            LeastLoaded.pick(&[cand(0, 3, 0), cand(0, 1, 0)], prompt(1)),
            1
        );
        let r = Random::default();
        assert!((0..50).all(|_| r.pick(&c, prompt(1)) < 3));
    }

    /// Four idle workers: least-loaded spreads prompts over all of them
    /// (not all to the first), and a prompt's pick is the same worker
    /// whatever order the candidates come in.
    #[test]
    fn least_loaded_ties_spread_by_prompt_and_agree_across_orders() {
        let idle: Vec<Candidate> = (0..4u64)
            .map(|i| Candidate {
                identity: 1000 + i,
                ..cand(0, 0, 0)
            })
            .collect();
        let mut reversed = idle.clone();
        reversed.reverse();
        let mut used = [0usize; 4];
        for key in 0..64u64 {
            let facts = PromptFacts { blocks: 1, key };
            let pick = LeastLoaded.pick(&idle, facts);
            used[pick] += 1;
            assert_eq!(
                reversed[LeastLoaded.pick(&reversed, facts)].identity,
                idle[pick].identity,
                "key {key}"
            );
        }
        assert!(used.iter().all(|&n| n >= 6), "{used:?}");
    }

    #[test]
    fn policy_names_parse() {
        assert_eq!("kv".parse::<PolicyKind>(), Ok(PolicyKind::Kv));
        assert!("nope".parse::<PolicyKind>().is_err());
        for kind in [
            PolicyKind::Kv,
            PolicyKind::LeastLoaded,
            PolicyKind::RoundRobin,
            PolicyKind::Random,
        ] {
            assert_eq!(kind.name().parse::<PolicyKind>(), Ok(kind));
            assert_eq!(kind.build().name(), kind.name());
        }
    }

    #[test]
    fn kv_ties_follow_the_prompt_not_the_order_or_the_history() {
        let p = KvPolicy::default();
        let idle = |identity| Candidate {
            identity,
            ..cand(0, 0, 0)
        };
        let pool = [idle(11), idle(22), idle(33), idle(44)];
        let mut reversed = pool;
        reversed.reverse();
        let mut spread = std::collections::HashSet::new();
        for key in 0..64 {
            let facts = PromptFacts { blocks: 4, key };
            let a = pool[p.pick(&pool, facts)].identity;
            // Again, and in another order: the same worker.
            assert_eq!(pool[p.pick(&pool, facts)].identity, a);
            assert_eq!(reversed[p.pick(&reversed, facts)].identity, a);
            spread.insert(a);
        }
        assert_eq!(spread.len(), 4, "distinct prompts spread over the pool");
    }
}
