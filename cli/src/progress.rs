//! What the person at the terminal sees while long work runs: progress bars
//! (indicatif) on stderr for checkpoint loading and INT4 quantization (the
//! engine reports through [`tandem_engine::progress`]), `bench serve` and
//! `bench sweep` (live TTFT / TPOT / throughput, SLO attainment so far) and
//! `tandem up` waiting for its processes.
//!
//! Bars are drawn only when stderr is a terminal, logs are text and
//! `--no-progress` is not given, so pipes, CI logs and `--log-format json`
//! stay clean; [`init`] decides once per process. Log lines written while
//! a bar is up go through [`log_writer`], which lifts the bars off the
//! screen for the line and draws them again below it.

use std::io::{IsTerminal, Write};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tandem_telemetry::LogFormat;

/// The bars of this process; unset when progress is off.
static BARS: OnceLock<MultiProgress> = OnceLock::new();

/// Turns progress on when stderr is a terminal, logs are text and
/// `no_progress` is not set; installs the engine's sink. Call once, before
/// logging starts.
pub fn init(log_format: LogFormat, no_progress: bool) {
    let on = !no_progress && log_format == LogFormat::Text && std::io::stderr().is_terminal();
    if !on {
        return;
    }
    BARS.get_or_init(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr()));
    let sink = EngineBars {
        current: Mutex::new(None),
    };
    // A second init keeps the first sink: the same bars either way.
    let _ = tandem_engine::progress::set_sink(Box::new(sink));
}

/// Whether bars are drawn in this process.
pub fn enabled() -> bool {
    BARS.get().is_some()
}

/// A bar of `total` steps labelled `prefix` (hidden when progress is off).
pub fn bar(total: u64, prefix: &str) -> ProgressBar {
    let Some(bars) = BARS.get() else {
        return ProgressBar::hidden();
    };
    let style = ProgressStyle::with_template(
        "{prefix:>18.bold} [{bar:30.cyan/blue}] {pos}/{len} {elapsed:>4} {wide_msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    let pb = bars.add(ProgressBar::new(total).with_style(style));
    pb.set_prefix(prefix.to_string());
    pb
}

/// A spinner with `message` (hidden when progress is off), ticking on its own.
pub fn spinner(message: &str) -> ProgressBar {
    let Some(bars) = BARS.get() else {
        return ProgressBar::hidden();
    };
    let style = ProgressStyle::with_template("{spinner:.cyan} {msg} {elapsed}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let pb = bars.add(ProgressBar::new_spinner().with_style(style));
    pb.set_message(message.to_string());
    pb.enable_steady_tick(Duration::from_millis(100));
    pb
}

/// Takes `pb` off the screen and, when bars are drawn, prints `line` above
/// the others in its place: a finished bar left in place would be wiped by
/// the next log line's redraw.
pub fn finish_with_line(pb: &ProgressBar, line: impl FnOnce() -> String) {
    pb.finish_and_clear();
    if let Some(bars) = BARS.get() {
        let _ = bars.println(line());
    }
}

/// Runs `f` (which prints) with the bars lifted off the screen.
pub fn suspend<R>(f: impl FnOnce() -> R) -> R {
    match BARS.get() {
        Some(bars) => bars.suspend(f),
        None => f(),
    }
}

/// The log writer: stderr, with the bars lifted off for each line.
pub fn log_writer() -> Box<dyn Write> {
    Box::new(LogLine)
}

struct LogLine;

impl Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        suspend(|| std::io::stderr().write_all(buf))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// The engine's load-time tasks as bars, one at a time; a finished one
/// leaves a line with its count and time.
struct EngineBars {
    current: Mutex<Option<ProgressBar>>,
}

impl tandem_engine::progress::ProgressSink for EngineBars {
    fn begin(&self, what: &str, total: u64) {
        let pb = bar(total, what);
        pb.tick();
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(pb);
    }

    fn advance(&self, steps: u64) {
        if let Some(pb) = &*self.current.lock().unwrap_or_else(|e| e.into_inner()) {
            pb.inc(steps);
        }
    }

    fn finish(&self) {
        let current = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(pb) = current {
            finish_with_line(&pb, || {
                format!(
                    "{:>18} {}/{} in {:.1} s",
                    pb.prefix(),
                    pb.position(),
                    pb.length().unwrap_or(0),
                    pb.elapsed().as_secs_f64()
                )
            });
        }
    }
}
