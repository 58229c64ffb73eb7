//! What `tandem bench serve` and `sweep` show a person: a live progress bar
//! (requests done, TTFT / TPOT medians so far, output throughput, SLO
//! attainment so far) while the run goes, then the summary table in the
//! shape vLLM's and SGLang's `bench serve` print, and, with `--plot`, the
//! latency CDFs as PNGs.

use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::ProgressBar;
use tandem_loadgen::plot::{cdf, line_chart, Chart, Series};
use tandem_loadgen::{RequestRecord, RunObserver, Slo, Stats, Summary};

/// A progress bar fed by the load generator as requests end.
#[derive(Debug)]
pub struct LiveBench {
    bar: ProgressBar,
    slo: Slo,
    live: Mutex<Live>,
}

#[derive(Debug)]
struct Live {
    started: Instant,
    ttfts: Vec<f64>,
    tpots: Vec<f64>,
    output_tokens: u64,
    failed: usize,
    met: usize,
    done: usize,
    /// When the message was last redrawn (its medians sort every sample).
    refreshed: Option<Instant>,
}

impl Live {
    fn new() -> Self {
        Self {
            started: Instant::now(),
            ttfts: Vec::new(),
            tpots: Vec::new(),
            output_tokens: 0,
            failed: 0,
            met: 0,
            done: 0,
            refreshed: None,
        }
    }

    fn message(&self, slo: &Slo) -> String {
        let ms = |v: &[f64]| match Stats::of(v.iter().copied()) {
            s if s.count == 0 => "-".to_string(),
            s => format!("{:.1}", s.p50 * 1e3),
        };
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let mut m = format!(
            "TTFT p50 {} ms · TPOT p50 {} ms · {:.0} tok/s",
            ms(&self.ttfts),
            ms(&self.tpots),
            self.output_tokens as f64 / secs
        );
        if slo.ttft_s.is_some() || slo.tpot_s.is_some() {
            let attained = self.met as f64 / self.done.max(1) as f64;
            m.push_str(&format!(" · SLO {:.0}%", attained * 100.0));
        }
        if self.failed > 0 {
            m.push_str(&format!(" · {} failed", self.failed));
        }
        m
    }
}

impl LiveBench {
    /// A bar judging requests against `slo`; `None` when progress is off.
    pub fn new(slo: Slo) -> Option<Self> {
        crate::progress::enabled().then(|| Self {
            bar: {
                let bar = crate::progress::bar(0, "requests");
                // The clock moves while every request is still in flight.
                bar.enable_steady_tick(std::time::Duration::from_millis(500));
                bar
            },
            slo,
            live: Mutex::new(Live::new()),
        })
    }
}

impl RunObserver for LiveBench {
    fn phase(&self, label: &str) {
        self.bar.set_prefix(label.to_string());
    }

    fn started(&self, total: usize) {
        *self.live.lock().unwrap_or_else(|e| e.into_inner()) = Live::new();
        self.bar.reset();
        self.bar.set_length(total as u64);
        self.bar.set_message("");
    }

    fn finished(&self, r: &RequestRecord) {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.done += 1;
        if r.ok() {
            live.ttfts.extend(r.ttft);
            live.tpots.extend(r.tpot());
            live.output_tokens += u64::from(r.output_tokens);
        } else {
            live.failed += 1;
        }
        if r.meets(&self.slo) {
            live.met += 1;
        }
        // Medians sort every sample: redraw them at most 4 times a second.
        let stale = live
            .refreshed
            .is_none_or(|t| t.elapsed() >= std::time::Duration::from_millis(250));
        if stale {
            live.refreshed = Some(Instant::now());
            self.bar.set_message(live.message(&self.slo));
        }
        self.bar.inc(1);
    }
}

impl Drop for LiveBench {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

/// The summary as vLLM's `bench serve` prints it.
pub fn print_summary(s: &Summary, input_tokens: u64, output_tokens: u64) {
    let rule = |title: &str| println!("{title:-^50}");
    let row = |name: &str, value: String| println!("{name:<40}{value:>10}");
    println!("{:=^50}", " Serving Benchmark Result ");
    row("Successful requests:", s.completed.to_string());
    row("Failed requests:", s.failed.to_string());
    row("Benchmark duration (s):", format!("{:.2}", s.duration_s));
    row("Total input tokens:", input_tokens.to_string());
    row("Total generated tokens:", output_tokens.to_string());
    row(
        "Request throughput (req/s):",
        format!("{:.2}", s.request_throughput),
    );
    row(
        "Output token throughput (tok/s):",
        format!("{:.2}", s.output_token_throughput),
    );
    row(
        "Total token throughput (tok/s):",
        format!(
            "{:.2}",
            s.output_token_throughput + s.input_token_throughput
        ),
    );
    if s.slo.ttft_s.is_some() || s.slo.tpot_s.is_some() {
        row(
            "SLO attainment (%):",
            format!("{:.1}", s.slo_attainment * 100.0),
        );
        row("Goodput (req/s):", format!("{:.2}", s.goodput));
    }
    for (title, short, st) in [
        ("Time to First Token", "TTFT", s.ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", s.tpot),
        ("Inter-token Latency", "ITL", s.itl),
        ("End-to-end Latency", "E2EL", s.e2e),
    ] {
        rule(title);
        row(
            &format!("Mean {short} (ms):"),
            format!("{:.2}", st.mean * 1e3),
        );
        row(
            &format!("Median {short} (ms):"),
            format!("{:.2}", st.p50 * 1e3),
        );
        row(
            &format!("P90 {short} (ms):"),
            format!("{:.2}", st.p90 * 1e3),
        );
        row(
            &format!("P99 {short} (ms):"),
            format!("{:.2}", st.p99 * 1e3),
        );
    }
    println!("{:=^50}", "");
}

/// Writes `ttft_cdf.png`, `tpot_cdf.png`, `itl_cdf.png` and `e2e_cdf.png`
/// of the completed requests into `dir`; returns the files written.
pub fn plot_cdfs(dir: &Path, records: &[RequestRecord]) -> Result<Vec<String>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
    let series: [(&str, &str, Vec<f64>); 4] = [
        (
            "ttft_cdf.png",
            "TTFT",
            ok.iter().filter_map(|r| r.ttft).collect(),
        ),
        (
            "tpot_cdf.png",
            "TPOT",
            ok.iter().filter_map(|r| r.tpot()).collect(),
        ),
        (
            "itl_cdf.png",
            "ITL",
            ok.iter().flat_map(|r| r.itls.iter().copied()).collect(),
        ),
        (
            "e2e_cdf.png",
            "E2E latency",
            ok.iter().map(|r| r.e2e).collect(),
        ),
    ];
    let mut written = Vec::new();
    for (file, what, seconds) in series {
        if seconds.is_empty() {
            continue;
        }
        let ms: Vec<f64> = seconds.iter().map(|s| s * 1e3).collect();
        line_chart(
            &dir.join(file),
            &Chart {
                title: format!("{what} CDF ({} requests)", ok.len()),
                x_label: format!("{what} (ms)"),
                y_label: "fraction".into(),
                x_log: false,
                series: vec![Series::new(what, cdf(&ms))],
            },
        )?;
        written.push(dir.join(file).display().to_string());
    }
    Ok(written)
}
