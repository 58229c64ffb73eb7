//! A request-rate sweep: the same workload offered at rising rates, and the
//! goodput of a configuration — the highest rate at which at least 90% of
//! requests meet every SLO (DistServe's definition).

use std::path::Path;

use serde::Serialize;
use tonic::transport::Channel;

use crate::arrival::Arrival;
use crate::client::{run, RunOptions};
use crate::metrics::{summarize, RequestRecord, Slo, Summary};
use crate::plot::{cdf, line_chart, Chart, PlotError, Series};
use crate::workload::WorkItem;

/// The attainment a rate must reach to count for goodput.
pub const GOODPUT_ATTAINMENT: f64 = 0.9;

/// One rate of a sweep.
#[derive(Debug, Clone, Serialize)]
pub struct SweepPoint {
    pub rate: f64,
    pub summary: Summary,
    /// Per-request TTFT and TPOT (seconds), for the CDFs.
    pub ttfts: Vec<f64>,
    pub tpots: Vec<f64>,
}

/// One configuration's sweep.
#[derive(Debug, Clone, Serialize)]
pub struct Sweep {
    pub name: String,
    pub points: Vec<SweepPoint>,
    /// Goodput in requests per second, if any rate met the SLOs.
    pub goodput: Option<f64>,
}

/// The highest rate whose SLO attainment reaches [`GOODPUT_ATTAINMENT`].
pub fn goodput(points: &[SweepPoint]) -> Option<f64> {
    points
        .iter()
        .filter(|p| p.summary.slo_attainment >= GOODPUT_ATTAINMENT)
        .map(|p| p.rate)
        .fold(None, |best, r| Some(best.map_or(r, |b: f64| b.max(r))))
}

impl SweepPoint {
    pub fn new(rate: f64, records: &[RequestRecord], slo: Slo) -> Self {
        let ok = records.iter().filter(|r| r.ok());
        Self {
            rate,
            summary: summarize(records, slo),
            ttfts: ok.clone().filter_map(|r| r.ttft).collect(),
            tpots: ok.filter_map(RequestRecord::tpot).collect(),
        }
    }
}

/// Offers `workload(i)` at the `i`-th of `rates` (Poisson, or gamma with
/// `opts`' burstiness; `workload(usize::MAX)` is the warm-up) and
/// summarises each run. Give each rate fresh prompts: prompts repeated from
/// an earlier rate hit the prefix cache and make prefill look free.
pub async fn sweep(
    name: &str,
    channel: Channel,
    workload: impl Fn(usize) -> Vec<WorkItem>,
    rates: &[f64],
    opts: &RunOptions,
    slo: Slo,
) -> Sweep {
    let burstiness = match opts.arrival {
        Arrival::Rate { burstiness, .. } => burstiness,
        Arrival::Concurrency(_) => 1.0,
    };
    // Warm up (connections, the server's first allocations) off the record.
    let warmup = RunOptions {
        arrival: Arrival::Concurrency(2),
        observer: None,
        ..opts.clone()
    };
    let mut first = workload(usize::MAX);
    first.truncate(4);
    let _ = run(channel.clone(), first, &warmup).await;
    let mut points = Vec::new();
    for (i, &rate) in rates.iter().enumerate() {
        let o = RunOptions {
            arrival: Arrival::Rate { rate, burstiness },
            ..opts.clone()
        };
        if let Some(obs) = &o.observer {
            obs.phase(&format!("{name} @ {rate:.2} req/s"));
        }
        let records = run(channel.clone(), workload(i), &o).await;
        points.push(SweepPoint::new(rate, &records, slo));
    }
    Sweep {
        name: name.to_string(),
        goodput: goodput(&points),
        points,
    }
}

/// Writes `attainment.png` (SLO attainment against rate, every sweep) and
/// `ttft_cdf.png` / `tpot_cdf.png` (each sweep at its goodput rate, or its
/// lowest rate when none met the SLOs) into `dir`.
pub fn plot_sweeps(dir: &Path, sweeps: &[Sweep]) -> Result<(), PlotError> {
    line_chart(
        &dir.join("attainment.png"),
        &Chart {
            title: format!(
                "SLO attainment against request rate (goodput: >= {:.0}%)",
                GOODPUT_ATTAINMENT * 100.0
            ),
            x_label: "request rate (req/s)".into(),
            y_label: "requests meeting both SLOs (fraction)".into(),
            x_log: false,
            series: sweeps
                .iter()
                .map(|s| {
                    Series::new(
                        s.name.clone(),
                        s.points
                            .iter()
                            .map(|p| (p.rate, p.summary.slo_attainment))
                            .collect(),
                    )
                })
                .collect(),
        },
    )?;
    let at_goodput = |s: &Sweep| -> Option<SweepPoint> {
        let rate = s.goodput.or_else(|| s.points.first().map(|p| p.rate))?;
        s.points.iter().find(|p| p.rate == rate).cloned()
    };
    for (file, what, pick) in [
        (
            "ttft_cdf.png",
            "TTFT",
            (|p: &SweepPoint| p.ttfts.clone()) as fn(&SweepPoint) -> Vec<f64>,
        ),
        ("tpot_cdf.png", "TPOT", |p: &SweepPoint| p.tpots.clone()),
    ] {
        let series = sweeps
            .iter()
            .filter_map(|s| {
                let p = at_goodput(s)?;
                let ms: Vec<f64> = pick(&p).iter().map(|x| x * 1e3).collect();
                Some(Series::new(
                    format!("{} @ {:.2} req/s", s.name, p.rate),
                    cdf(&ms),
                ))
            })
            .collect();
        line_chart(
            &dir.join(file),
            &Chart {
                title: format!("{what} CDF at each configuration's goodput rate"),
                x_label: format!("{what} (ms)"),
                y_label: "fraction of requests".into(),
                x_log: false,
                series,
            },
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(rate: f64, attainment: f64) -> SweepPoint {
        SweepPoint {
            rate,
            summary: Summary {
                slo_attainment: attainment,
                ..Summary::default()
            },
            ttfts: Vec::new(),
            tpots: Vec::new(),
        }
    }

    #[test]
    fn goodput_is_the_highest_rate_at_90_percent() {
        let pts = [
            point(1.0, 1.0),
            point(2.0, 0.95),
            point(4.0, 0.9),
            point(8.0, 0.4),
        ];
        assert_eq!(goodput(&pts), Some(4.0));
        assert_eq!(goodput(&[point(1.0, 0.89)]), None);
        // Non-monotonic noise: the highest passing rate still counts.
        let pts = [point(1.0, 0.95), point(2.0, 0.85), point(3.0, 0.92)];
        assert_eq!(goodput(&pts), Some(3.0));
    }
}
