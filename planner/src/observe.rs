//! What the planner sees of the cluster: the router's counters at one
//! moment ([`Snapshot`], summed over router replicas) and one interval
//! between two of them ([`Interval`]): the load offered (prompt and
//! generated tokens per second) and the share of requests that met each
//! objective.

use std::time::Duration;

use serde::Serialize;

use crate::prom::{Exposition, Histogram};

/// The router's metric names the planner reads.
pub mod names {
    pub const REQUESTS: &str = "tandem_router_requests_total";
    pub const PREFILL_DEMAND: &str = "tandem_router_prefill_demand_tokens_total";
    pub const GENERATION_TOKENS: &str = "tandem_router_generation_tokens_total";
    pub const TTFT: &str = "tandem_router_time_to_first_token_seconds";
    pub const TPOT: &str = "tandem_router_time_per_output_token_seconds";
    pub const HEALTHY: &str = "tandem_router_healthy_workers";
    pub const INFLIGHT: &str = "tandem_router_inflight_requests";
}

/// Latency objectives.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
pub struct Slo {
    /// Time to first token, seconds.
    pub ttft_s: f64,
    /// Time per output token after the first, seconds.
    pub tpot_s: f64,
}

/// Cumulative router counters at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub finished: f64,
    /// Requests that ended in an upstream error or found no worker (not
    /// those the client cancelled, nor invalid ones).
    pub failed: f64,
    pub prefill_tokens: f64,
    pub generation_tokens: f64,
    pub ttft: Histogram,
    pub tpot: Histogram,
    /// Requests in flight at decode workers now (a gauge).
    pub inflight_decode: f64,
}

impl Snapshot {
    /// One router's scrape.
    pub fn from_router(e: &Exposition) -> Self {
        use names::*;
        Self {
            finished: e.sum(REQUESTS, &[("outcome", "finished")]),
            failed: e.sum(REQUESTS, &[("outcome", "error")])
                + e.sum(REQUESTS, &[("outcome", "unavailable")]),
            prefill_tokens: e.sum(PREFILL_DEMAND, &[]),
            generation_tokens: e.sum(GENERATION_TOKENS, &[]),
            ttft: e.histogram(TTFT),
            tpot: e.histogram(TPOT),
            inflight_decode: e.sum(INFLIGHT, &[("role", "decode")]),
        }
    }

    /// Adds another router replica's counters.
    pub fn merge(&mut self, other: &Snapshot) {
        self.finished += other.finished;
        self.failed += other.failed;
        self.prefill_tokens += other.prefill_tokens;
        self.generation_tokens += other.generation_tokens;
        self.ttft.merge(&other.ttft);
        self.tpot.merge(&other.tpot);
        self.inflight_decode += other.inflight_decode;
    }
}

/// One planning interval, from two snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Interval {
    pub seconds: f64,
    pub finished: f64,
    pub failed: f64,
    /// Uncached prompt tokens per second of requests long enough for a
    /// prefill worker (the prefill pool's load).
    pub prefill_tokens_per_s: f64,
    /// Tokens streamed per second (the decode load).
    pub generation_tokens_per_s: f64,
    /// Of the first tokens in the interval, the share within the TTFT
    /// objective; `None` when there were none.
    pub ttft_attainment: Option<f64>,
    /// Of the requests that ended in the interval, the share whose TPOT
    /// met the objective.
    pub tpot_attainment: Option<f64>,
}

impl Interval {
    /// The interval from `earlier` to `later`, `elapsed` apart. Counters
    /// that went down (a router restarted) count from zero.
    pub fn between(earlier: &Snapshot, later: &Snapshot, elapsed: Duration, slo: Slo) -> Self {
        let seconds = elapsed.as_secs_f64().max(1e-3);
        let grew = |a: f64, b: f64| if b >= a { b - a } else { b };
        Self {
            seconds,
            finished: grew(earlier.finished, later.finished),
            failed: grew(earlier.failed, later.failed),
            prefill_tokens_per_s: grew(earlier.prefill_tokens, later.prefill_tokens) / seconds,
            generation_tokens_per_s: grew(earlier.generation_tokens, later.generation_tokens)
                / seconds,
            ttft_attainment: later.ttft.since(&earlier.ttft).fraction_at_most(slo.ttft_s),
            tpot_attainment: later.tpot.since(&earlier.tpot).fraction_at_most(slo.tpot_s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrape(
        finished: u32,
        prompt: u32,
        generated: u32,
        ttft_fast: u32,
        ttft_all: u32,
    ) -> Snapshot {
        let text = format!(
            "tandem_router_requests_total{{outcome=\"finished\"}} {finished}\n\
             tandem_router_requests_total{{outcome=\"cancelled\"}} 5\n\
             tandem_router_prefill_demand_tokens_total {prompt}\n\
             tandem_router_generation_tokens_total {generated}\n\
             tandem_router_time_to_first_token_seconds_bucket{{le=\"0.5\"}} {ttft_fast}\n\
             tandem_router_time_to_first_token_seconds_bucket{{le=\"+Inf\"}} {ttft_all}\n\
             tandem_router_time_to_first_token_seconds_count {ttft_all}\n\
             tandem_router_inflight_requests{{role=\"decode\"}} 4\n"
        );
        Snapshot::from_router(&Exposition::parse(&text).expect("parses"))
    }

    #[test]
    fn an_interval_is_rates_and_attainment_between_two_scrapes() {
        let slo = Slo {
            ttft_s: 0.5,
            tpot_s: 0.05,
        };
        let (a, b) = (scrape(10, 1000, 500, 9, 10), scrape(30, 5000, 2500, 24, 30));
        let i = Interval::between(&a, &b, Duration::from_secs(10), slo);
        assert_eq!(i.finished, 20.0);
        assert_eq!(i.failed, 0.0);
        assert_eq!(i.prefill_tokens_per_s, 400.0);
        assert_eq!(i.generation_tokens_per_s, 200.0);
        assert_eq!(i.ttft_attainment, Some(15.0 / 20.0));
        assert_eq!(i.tpot_attainment, None);
        assert_eq!(b.inflight_decode, 4.0);
    }

    #[test]
    fn replicas_add_up_and_a_restart_counts_from_zero() {
        let mut both = scrape(10, 100, 50, 1, 1);
        both.merge(&scrape(20, 300, 150, 2, 2));
        assert_eq!((both.finished, both.prefill_tokens), (30.0, 400.0));
        assert_eq!(both.ttft.count, 3.0);
        let slo = Slo {
            ttft_s: 1.0,
            tpot_s: 1.0,
        };
        let restarted = scrape(3, 60, 10, 1, 1);
        let i = Interval::between(&both, &restarted, Duration::from_secs(1), slo);
        assert_eq!((i.finished, i.prefill_tokens_per_s), (3.0, 60.0));
    }
}
