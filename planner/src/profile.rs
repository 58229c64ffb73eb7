//! What one worker of each pool sustains within the objectives, measured by
//! `tandem bench sweep` (one sweep per pool: long prompts with short
//! answers load the prefill pool, short prompts with long answers the
//! decode pool). A pool's capacity is the token throughput of the sweep's
//! highest rate whose SLO attainment reached 90% (its goodput), divided by
//! the pool's workers in the swept cluster.
//!
//! `tandem planner profile` writes the file; the planner reads it.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tandem_discovery::Role;
use thiserror::Error;

use crate::observe::Slo;

/// The share of requests within the objectives a rate needs to count
/// (tandem-loadgen's goodput definition).
pub const GOODPUT_ATTAINMENT: f64 = 0.9;

#[derive(Debug, Error)]
pub enum ProfileError {
    #[error("{0}: {1}")]
    Sweep(&'static str, String),
    #[error("no rate of the {0} sweep met its objectives for 90% of requests: sweep lower rates")]
    NoGoodput(Role),
    #[error(
        "the {role} sweep has no {what} objective (run `tandem bench sweep` with --slo-{what}-ms)"
    )]
    NoObjective { role: Role, what: &'static str },
    #[error("the profile: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{0}")]
    Invalid(String),
}

/// Tokens per second one worker of each pool sustains at the objectives.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub slo: Slo,
    /// Prompt tokens per second one prefill worker takes within the TTFT
    /// objective.
    pub prefill_tokens_per_s: f64,
    /// Tokens per second one decode worker streams within the TPOT
    /// objective.
    pub decode_tokens_per_s: f64,
}

/// One pool's measured capacity, from its sweep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolCapacity {
    pub tokens_per_s: f64,
    /// The objective the sweep judged by (seconds).
    pub objective_s: f64,
    /// The highest rate swept met the objectives: the pool sustains at
    /// least this, perhaps more (sweep higher rates to find the knee).
    pub lower_bound: bool,
}

impl PoolCapacity {
    /// `sweep` is `tandem bench sweep`'s `sweep.json`; the first
    /// configuration in it is read. `workers`: the pool's workers in the
    /// swept cluster.
    pub fn from_sweep(sweep: &Value, role: Role, workers: usize) -> Result<Self, ProfileError> {
        let bad = |why: &str| ProfileError::Sweep("sweep.json", why.to_string());
        if workers == 0 {
            return Err(ProfileError::Invalid(format!(
                "{role} workers must be at least 1"
            )));
        }
        let points = sweep["sweeps"][0]["points"]
            .as_array()
            .ok_or_else(|| bad("no sweeps[0].points"))?;
        let (throughput, objective) = match role {
            Role::Prefill => ("input_token_throughput", "ttft_s"),
            Role::Decode => ("output_token_throughput", "tpot_s"),
        };
        let mut best: Option<(f64, f64)> = None;
        let mut objective_s = None;
        let mut highest = f64::NEG_INFINITY;
        for p in points {
            let s = &p["summary"];
            let rate = p["rate"]
                .as_f64()
                .ok_or_else(|| bad("a point without a rate"))?;
            let attainment = s["slo_attainment"]
                .as_f64()
                .ok_or_else(|| bad("a point without slo_attainment"))?;
            objective_s = objective_s.or(s["slo"][objective].as_f64());
            highest = highest.max(rate);
            let tokens = s[throughput]
                .as_f64()
                .ok_or_else(|| bad("a point without token throughput"))?;
            if attainment >= GOODPUT_ATTAINMENT && best.is_none_or(|(r, _)| rate > r) {
                best = Some((rate, tokens));
            }
        }
        let objective_s = objective_s.ok_or(ProfileError::NoObjective {
            role,
            what: match role {
                Role::Prefill => "ttft",
                Role::Decode => "tpot",
            },
        })?;
        let (rate, tokens) = best.ok_or(ProfileError::NoGoodput(role))?;
        Ok(Self {
            tokens_per_s: tokens / workers as f64,
            objective_s,
            lower_bound: rate >= highest,
        })
    }
}

impl Profile {
    pub fn new(prefill: PoolCapacity, decode: PoolCapacity) -> Result<Self, ProfileError> {
        let p = Self {
            slo: Slo {
                ttft_s: prefill.objective_s,
                tpot_s: decode.objective_s,
            },
            prefill_tokens_per_s: prefill.tokens_per_s,
            decode_tokens_per_s: decode.tokens_per_s,
        };
        p.check()?;
        Ok(p)
    }

    pub fn from_json(text: &str) -> Result<Self, ProfileError> {
        let p: Self = serde_json::from_str(text)?;
        p.check()?;
        Ok(p)
    }

    fn check(&self) -> Result<(), ProfileError> {
        let positive = |v: f64, what: &str| match v.is_finite() && v > 0.0 {
            true => Ok(()),
            false => Err(ProfileError::Invalid(format!(
                "{what} must be positive, not {v}"
            ))),
        };
        positive(self.prefill_tokens_per_s, "prefill_tokens_per_s")?;
        positive(self.decode_tokens_per_s, "decode_tokens_per_s")?;
        positive(self.slo.ttft_s, "slo.ttft_s")?;
        positive(self.slo.tpot_s, "slo.tpot_s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn point(rate: f64, attainment: f64, input: f64, output: f64) -> Value {
        json!({"rate": rate, "summary": {
            "slo_attainment": attainment,
            "input_token_throughput": input,
            "output_token_throughput": output,
            "slo": {"ttft_s": 1.5, "tpot_s": 0.1},
        }})
    }

    #[test]
    fn capacity_is_the_highest_good_rates_throughput_per_worker() {
        let sweep = json!({"sweeps": [{"name": "x", "points": [
            point(1.0, 1.0, 500.0, 60.0),
            point(2.0, 0.95, 1000.0, 120.0),
            point(4.0, 0.5, 1800.0, 200.0),
        ]}]});
        let p = PoolCapacity::from_sweep(&sweep, Role::Prefill, 2).expect("profile");
        let want = PoolCapacity {
            tokens_per_s: 500.0,
            objective_s: 1.5,
            lower_bound: false,
        };
        assert_eq!(p, want);
        let d = PoolCapacity::from_sweep(&sweep, Role::Decode, 1).expect("profile");
        assert_eq!((d.tokens_per_s, d.objective_s), (120.0, 0.1));
        // Every rate met the objectives: only a lower bound.
        let easy = json!({"sweeps": [{"points": [point(1.0, 1.0, 500.0, 60.0)]}]});
        let easy = PoolCapacity::from_sweep(&easy, Role::Prefill, 1).expect("profile");
        assert!(easy.lower_bound);
        let profile = Profile::new(p, d).expect("valid");
        let back = Profile::from_json(&serde_json::to_string(&profile).expect("json"));
        assert_eq!(back.expect("reads"), profile);
    }

    #[test]
    fn a_sweep_with_no_good_rate_or_no_objective_is_refused() {
        let bad = json!({"sweeps": [{"points": [point(4.0, 0.5, 1800.0, 200.0)]}]});
        assert!(matches!(
            PoolCapacity::from_sweep(&bad, Role::Decode, 1),
            Err(ProfileError::NoGoodput(Role::Decode))
        ));
        let no_slo = json!({"sweeps": [{"points": [{"rate": 1.0, "summary": {
            "slo_attainment": 1.0, "input_token_throughput": 1.0, "output_token_throughput": 1.0,
            "slo": {"ttft_s": null, "tpot_s": null}}}]}]});
        assert!(matches!(
            PoolCapacity::from_sweep(&no_slo, Role::Prefill, 1),
            Err(ProfileError::NoObjective { .. })
        ));
        assert!(Profile::from_json(
            r#"{"slo":{"ttft_s":1,"tpot_s":0.1},"prefill_tokens_per_s":0,"decode_tokens_per_s":5}"#
        )
        .is_err());
    }
}
