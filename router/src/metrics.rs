//! The router's Prometheus metrics: requests by outcome, the latency the
//! client sees (TTFT and E2E measured here, so they include routing and
//! the hops), every routing decision by pool, policy and reason, where
//! prompts were prefilled and why, and the worker table read at scrape
//! time.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tandem_telemetry::metrics::{
    Counter, Family, Histogram, Registry, LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS,
};

use crate::pool::{Cluster, Resync, Role};

/// The router's instruments.
#[derive(Debug, Clone)]
pub struct RouterMetrics {
    requests: Family<Counter>,
    pub(crate) ttft: Histogram,
    pub(crate) e2e: Histogram,
    pub(crate) tpot: Histogram,
    pub(crate) prompt_tokens: Counter,
    pub(crate) generation_tokens: Counter,
    pub(crate) prefill_demand: Counter,
    decisions: Family<Counter>,
    placements: Family<Counter>,
    migrations: Family<Counter>,
    pub(crate) decision: Histogram,
}

/// Bucket bounds for a routing decision: microseconds, not the
/// milliseconds of request latency; 10 µs apart from 20 to 100 µs, where
/// the 50 µs target of a long prompt's decision lies (a p99 interpolated
/// in a bucket of 50–100 µs said little).
pub const DECISION_BUCKETS: &[f64] = &[
    1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 3e-5, 4e-5, 5e-5, 6e-5, 7e-5, 8e-5, 9e-5, 1e-4, 2e-4, 5e-4, 1e-3,
    2e-3, 5e-3, 1e-2,
];

impl RouterMetrics {
    /// Registers the instruments on `registry`.
    pub fn register(registry: &Registry) -> Arc<Self> {
        Arc::new(Self {
            requests: registry.counter_family(
                "tandem_router_requests_total",
                "Generate requests by how they ended: finished, error (upstream failed), \
                 cancelled (the client left), invalid, unavailable (no worker).",
                &["outcome"],
            ),
            ttft: registry.histogram(
                "tandem_router_time_to_first_token_seconds",
                "From the router receiving a request to forwarding its first token.",
                LATENCY_BUCKETS,
            ),
            e2e: registry.histogram(
                "tandem_router_e2e_request_latency_seconds",
                "From the router receiving a request to the end of its stream.",
                LATENCY_BUCKETS,
            ),
            tpot: registry.histogram(
                "tandem_router_time_per_output_token_seconds",
                "Per finished request: the time from its first to its last token over the \
                 tokens after the first, every choice's counted (requests of one token are \
                 not observed).",
                TOKEN_LATENCY_BUCKETS,
            ),
            prompt_tokens: registry.counter(
                "tandem_router_prompt_tokens_total",
                "Prompt tokens of the requests routed (text prompts as the router's \
                 tokenizer counts them): the prefill load the planner sizes for.",
            ),
            generation_tokens: registry.counter(
                "tandem_router_generation_tokens_total",
                "Tokens streamed to clients (every choice's): the decode load.",
            ),
            prefill_demand: registry.counter(
                "tandem_router_prefill_demand_tokens_total",
                "Uncached prompt tokens of requests at or over the remote-prefill threshold: \
                 the work a prefill pool takes (prefilled there, or locally when no prefill \
                 worker could), what the planner sizes that pool for.",
            ),
            decisions: registry.counter_family(
                "tandem_router_decisions_total",
                "Workers picked, by pool, policy and the policy's reason.",
                &["pool", "policy", "reason"],
            ),
            placements: registry.counter_family(
                "tandem_router_prefill_placements_total",
                "Where prompts were prefilled (remote: a prefill worker; local: the decode \
                 worker) and why.",
                &["placement", "reason"],
            ),
            migrations: registry.counter_family(
                "tandem_router_migrations_total",
                "Requests whose decode worker failed mid-stream (cause=failure) or \
                 handed them over while draining (cause=drain), by what happened next: \
                 resumed (re-sent with each choice's tokens so far to another decode \
                 worker), no_worker (none was left to take it) or cannot_resume (a beam \
                 search whose results had begun to stream); and by path: kv_moved (the \
                 new worker is told to pull the KV from the draining one; its \
                 tandem_remote_prefills_total says whether it did) or reprefilled.",
                &["cause", "result", "path"],
            ),
            decision: registry.histogram(
                "tandem_router_decision_seconds",
                "One request's routing decision: matching its block hashes against the \
                 KV index for every candidate and the policies' picks (tokenizing and \
                 hashing excluded).",
                DECISION_BUCKETS,
            ),
        })
    }

    pub(crate) fn request(&self, outcome: &str) {
        self.requests.with(&[outcome]).inc();
    }

    pub(crate) fn decision(&self, pool: &str, policy: &str, reason: &str) {
        self.decisions.with(&[pool, policy, reason]).inc();
    }

    pub(crate) fn migration(&self, cause: &str, result: &str, path: &str) {
        self.migrations.with(&[cause, result, path]).inc();
    }

    pub(crate) fn placement(&self, placement: &str, reason: &str) {
        self.placements.with(&[placement, reason]).inc();
    }
}

/// Exposes the worker table on `registry`, read at every scrape: healthy
/// workers and the requests this router has in flight, per role.
pub fn register_cluster(registry: &Registry, cluster: Arc<Cluster>) {
    registry.collector(move |s| {
        for (role, name) in [(Role::Decode, "decode"), (Role::Prefill, "prefill")] {
            let healthy = cluster.healthy(role);
            s.gauge(
                "tandem_router_healthy_workers",
                "Workers admitted and answering probes.",
                &[("role", name)],
                healthy.len() as f64,
            );
            let inflight: usize = cluster
                .all()
                .iter()
                .filter(|w| w.role == role)
                .map(|w| w.active_requests.load(Ordering::Relaxed))
                .sum();
            s.gauge(
                "tandem_router_inflight_requests",
                "Requests this router has in flight at workers of the role.",
                &[("role", name)],
                inflight as f64,
            );
        }
        s.gauge(
            "tandem_router_kv_index_blocks",
            "Distinct blocks in the KV index, over all workers.",
            &[],
            cluster.index.len() as f64,
        );
        for w in cluster.present() {
            for (peer, seconds) in w.measured().fetch_seconds_per_block {
                s.gauge(
                    "tandem_router_peer_fetch_seconds_per_block",
                    "Seconds per block a decode worker's remote prefills from a peer took, as the \
                     worker measured (what the router weighs a peer fetch with).",
                    &[("worker", w.addr.as_str()), ("peer", peer.as_str())],
                    seconds,
                );
            }
            if let Some(cost) = w.disk_block_cost() {
                s.gauge(
                    "tandem_router_disk_block_cost",
                    "What a block from a worker's disk tier costs against computing it there, \
                     as the worker measured both (the kv policy's weight for its disk hits).",
                    &[("worker", w.addr.as_str())],
                    cost,
                );
            }
        }
        s.gauge(
            "tandem_router_kv_disk_index_blocks",
            "Distinct blocks the workers hold in their disk tiers (--kv-disk), over all workers.",
            &[],
            cluster.disk_index.len() as f64,
        );
        s.gauge(
            "tandem_router_kv_index_bytes",
            "The KV index's memory (an estimate from its tables' capacities).",
            &[],
            cluster.index.memory_bytes() as f64,
        );
        s.counter(
            "tandem_router_kv_events_applied_total",
            "Block hashes applied to the KV index from the workers' event streams.",
            &[],
            cluster.events_applied() as f64,
        );
        s.counter(
            "tandem_router_kv_digests_matched_total",
            "Workers' digests of their cached blocks that matched the index's.",
            &[],
            cluster.digests_matched() as f64,
        );
        for reason in Resync::ALL {
            s.counter(
                "tandem_router_kv_resyncs_total",
                "Times a worker's index entries were dropped and its feed reopened with a \
                 dump: gap (a sequence number skipped or went back), digest (its digest \
                 of its cached blocks differed from the index's), stream_ended.",
                &[("reason", reason.label())],
                cluster.resyncs(reason) as f64,
            );
        }
    });
}
