//! Per-request latency records and their summary, computed the way vLLM's
//! `bench serve` and aiperf compute them.
//!
//! * TTFT: send to the first output token.
//! * TPOT: `(E2E - TTFT) / (output tokens - 1)`, per request; requests with
//!   fewer than two tokens have none.
//! * ITL: every gap between successive token deliveries, pooled over all
//!   requests (a delivery carrying several tokens is one gap).
//! * Percentiles interpolate linearly between order statistics (NumPy's
//!   default).
//! * Goodput: requests per second that succeeded and met every SLO given.

use serde::Serialize;

/// What one request did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RequestRecord {
    /// When it was sent, in seconds from the start of the run.
    pub sent_at: f64,
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// Seconds to the first output token.
    pub ttft: Option<f64>,
    /// Seconds between successive token deliveries.
    pub itls: Vec<f64>,
    /// Seconds from send to the end of the response.
    pub e2e: f64,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

impl RequestRecord {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    /// Time per output token after the first.
    pub fn tpot(&self) -> Option<f64> {
        let ttft = self.ttft?;
        (self.output_tokens >= 2).then(|| (self.e2e - ttft) / f64::from(self.output_tokens - 1))
    }

    /// Succeeded within both SLOs (an SLO not given always holds; a request
    /// without a TPOT meets any TPOT SLO).
    pub fn meets(&self, slo: &Slo) -> bool {
        self.ok()
            && slo.ttft_s.is_none_or(|s| self.ttft.is_some_and(|t| t <= s))
            && slo
                .tpot_s
                .is_none_or(|s| self.tpot().is_none_or(|t| t <= s))
    }
}

/// Latency objectives, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_s: Option<f64>,
    pub tpot_s: Option<f64>,
}

/// Summary statistics of one metric, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Stats {
    pub count: usize,
    pub mean: f64,
    pub min: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// The `p`-th percentile (0–100) of sorted values, interpolating linearly.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        1 => sorted[0],
        n => {
            let rank = p.clamp(0.0, 100.0) / 100.0 * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = rank.ceil() as usize;
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

impl Stats {
    pub fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        Self {
            count: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            min: v[0],
            p50: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
            max: v[v.len() - 1],
        }
    }
}

/// A run's results.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Summary {
    pub completed: usize,
    pub failed: usize,
    /// From the first send to the last response's end.
    pub duration_s: f64,
    pub request_throughput: f64,
    pub input_token_throughput: f64,
    pub output_token_throughput: f64,
    pub ttft: Stats,
    pub tpot: Stats,
    pub itl: Stats,
    pub e2e: Stats,
    pub slo: Slo,
    /// Fraction of all requests (failed ones included) that met the SLOs.
    pub slo_attainment: f64,
    /// Requests per second that met the SLOs.
    pub goodput: f64,
}

/// Summarises `records`.
pub fn summarize(records: &[RequestRecord], slo: Slo) -> Summary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
    let start = records
        .iter()
        .map(|r| r.sent_at)
        .fold(f64::INFINITY, f64::min);
    let end = records
        .iter()
        .map(|r| r.sent_at + r.e2e)
        .fold(f64::NEG_INFINITY, f64::max);
    let duration_s = if records.is_empty() { 0.0 } else { end - start };
    let rate = |x: f64| {
        if duration_s > 0.0 {
            x / duration_s
        } else {
            0.0
        }
    };
    let good = records.iter().filter(|r| r.meets(&slo)).count();
    Summary {
        completed: ok.len(),
        failed: records.len() - ok.len(),
        duration_s,
        request_throughput: rate(ok.len() as f64),
        input_token_throughput: rate(ok.iter().map(|r| f64::from(r.input_tokens)).sum()),
        output_token_throughput: rate(ok.iter().map(|r| f64::from(r.output_tokens)).sum()),
        ttft: Stats::of(ok.iter().filter_map(|r| r.ttft)),
        tpot: Stats::of(ok.iter().filter_map(|r| r.tpot())),
        itl: Stats::of(ok.iter().flat_map(|r| r.itls.iter().copied())),
        e2e: Stats::of(ok.iter().map(|r| r.e2e)),
        slo,
        slo_attainment: if records.is_empty() {
            0.0
        } else {
            good as f64 / records.len() as f64
        },
        goodput: rate(good as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    /// Tokens at 0.5 s, 0.6 s, 0.8 s and 0.9 s after a send at t = 1 s.
    fn trace() -> RequestRecord {
        RequestRecord {
            sent_at: 1.0,
            input_tokens: 10,
            output_tokens: 4,
            ttft: Some(0.5),
            itls: vec![0.1, 0.2, 0.1],
            e2e: 0.9,
            error: None,
        }
    }

    #[test]
    fn tpot_excludes_the_first_token() {
        // (0.9 - 0.5) / (4 - 1)
        assert!(close(trace().tpot().expect("tpot"), 0.4 / 3.0));
        let one = RequestRecord {
            output_tokens: 1,
            ..trace()
        };
        assert_eq!(one.tpot(), None);
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0, 10.0];
        // numpy.percentile(v, [0, 50, 90, 99, 100]) = 1, 3, 7.6, 9.76, 10
        assert!(close(percentile(&v, 0.0), 1.0));
        assert!(close(percentile(&v, 50.0), 3.0));
        assert!(close(percentile(&v, 90.0), 7.6));
        assert!(close(percentile(&v, 99.0), 9.76));
        assert!(close(percentile(&v, 100.0), 10.0));
        assert!(close(percentile(&[2.0, 4.0], 25.0), 2.5));
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn itls_are_pooled_over_requests() {
        let b = RequestRecord {
            sent_at: 1.5,
            itls: vec![0.3],
            output_tokens: 2,
            ttft: Some(0.2),
            e2e: 0.5,
            ..trace()
        };
        let s = summarize(&[trace(), b], Slo::default());
        assert_eq!(s.itl.count, 4);
        // sorted 0.1 0.1 0.2 0.3: mean 0.175, median 0.15
        assert!(close(s.itl.mean, 0.175));
        assert!(close(s.itl.p50, 0.15));
        assert!(close(s.itl.max, 0.3));
    }

    #[test]
    fn goodput_counts_requests_within_both_slos() {
        let fast = trace(); // ttft 0.5, tpot 0.133
        let slow_first = RequestRecord {
            ttft: Some(2.0),
            e2e: 2.4,
            ..trace()
        }; // tpot 0.133
        let slow_decode = RequestRecord {
            e2e: 2.0,
            ..trace()
        }; // ttft 0.5, tpot 0.5
        let failed = RequestRecord {
            error: Some("unavailable".into()),
            ..trace()
        };
        let records = [fast, slow_first, slow_decode, failed];
        let slo = Slo {
            ttft_s: Some(1.0),
            tpot_s: Some(0.2),
        };
        let s = summarize(&records, slo);
        assert_eq!((s.completed, s.failed), (3, 1));
        // Sends at 1.0; the last end is 1.0 + 2.4.
        assert!(close(s.duration_s, 2.4));
        assert!(close(s.slo_attainment, 0.25));
        assert!(close(s.goodput, 1.0 / 2.4));
        assert!(close(s.request_throughput, 3.0 / 2.4));
        assert!(close(s.output_token_throughput, 12.0 / 2.4));
        // Only the TTFT SLO: the slow decode now counts.
        let s = summarize(
            &records,
            Slo {
                ttft_s: Some(1.0),
                tpot_s: None,
            },
        );
        assert!(close(s.slo_attainment, 0.5));
        // TTFT of successful requests only: 0.5, 2.0, 0.5.
        assert!(close(s.ttft.mean, 1.0));
        assert!(close(s.ttft.p50, 0.5));
    }
}
