//! A small Prometheus registry and its text exposition (format 0.0.4).
//!
//! Why hand-written: tandem needs counters, gauges and histograms with a
//! few labels, plus gauges read from state that already exists (the
//! engine's `EngineStats`, the router's worker table) at scrape time. That
//! is a few hundred lines; a crate would bring a second metrics model and
//! OpenMetrics quirks (`# EOF`, `# UNIT`) the plain Prometheus text format
//! does not have.
//!
//! * Instruments ([`Counter`], [`Gauge`], [`Histogram`]) are cheap handles
//!   (`Arc` of atomics): clone them into whatever records. A [`Family`] is
//!   one instrument per label-value tuple, created on first use.
//! * [`Registry::collector`] registers a callback that writes families at
//!   scrape time ([`Scrape`]): how components expose gauges they already
//!   keep, instead of mirroring them into parallel counters.
//! * [`Registry::render`] writes every family in registration order:
//!   `# HELP`, `# TYPE`, then samples; histograms as cumulative
//!   `_bucket{le=..}` series ending at `+Inf`, then `_sum` and `_count`.
//!
//! Names follow Prometheus conventions, checked at registration: base units
//! (`_seconds`, `_bytes`), counters end in `_total`, and no name is
//! registered twice (both panics: names are constants, and every
//! component's registration runs in its unit tests).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What a family is, for its `# TYPE` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
            Self::Histogram => "histogram",
        }
    }
}

/// An `f64` in an atomic, for sums and gauges.
#[derive(Debug, Default)]
struct AtomicF64(AtomicU64);

impl AtomicF64 {
    fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }

    fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Ordering::Relaxed);
    }

    fn add(&self, v: f64) {
        let mut cur = self.0.load(Ordering::Relaxed);
        loop {
            let new = (f64::from_bits(cur) + v).to_bits();
            match self
                .0
                .compare_exchange_weak(cur, new, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(actual) => cur = actual,
            }
        }
    }
}

/// A monotonically increasing count.
#[derive(Debug, Clone, Default)]
pub struct Counter(Arc<AtomicU64>);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }

    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down.
#[derive(Debug, Clone, Default)]
pub struct Gauge(Arc<AtomicF64>);

impl Gauge {
    pub fn set(&self, v: f64) {
        self.0.set(v);
    }

    pub fn add(&self, v: f64) {
        self.0.add(v);
    }

    pub fn get(&self) -> f64 {
        self.0.get()
    }
}

/// Observations counted into fixed buckets, with their sum.
#[derive(Debug, Clone)]
pub struct Histogram(Arc<HistogramInner>);

#[derive(Debug)]
struct HistogramInner {
    /// Upper bounds, strictly increasing; `+Inf` is implicit.
    bounds: Arc<[f64]>,
    /// Per bucket (not cumulative), plus one for `+Inf`.
    counts: Box<[AtomicU64]>,
    sum: AtomicF64,
}

impl Histogram {
    fn new(bounds: Arc<[f64]>) -> Self {
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        Self(Arc::new(HistogramInner {
            bounds,
            counts,
            sum: AtomicF64::default(),
        }))
    }

    /// Records one value (NaN is ignored).
    pub fn observe(&self, v: f64) {
        if v.is_nan() {
            return;
        }
        let i = self.0.bounds.partition_point(|&b| b < v);
        self.0.counts[i].fetch_add(1, Ordering::Relaxed);
        self.0.sum.add(v);
    }

    /// Records a duration in seconds.
    pub fn observe_duration(&self, d: std::time::Duration) {
        self.observe(d.as_secs_f64());
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.0
            .counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    /// Their sum.
    pub fn sum(&self) -> f64 {
        self.0.sum.get()
    }

    fn write(&self, name: &str, labels: &[(&str, &str)], out: &mut String) {
        let mut cumulative = 0u64;
        let mut le = String::new();
        for (i, c) in self.0.counts.iter().enumerate() {
            cumulative += c.load(Ordering::Relaxed);
            le.clear();
            match self.0.bounds.get(i) {
                Some(b) => write_float(&mut le, *b),
                None => le.push_str("+Inf"),
            }
            let mut l: Vec<(&str, &str)> = labels.to_vec();
            l.push(("le", &le));
            write_sample(out, name, "_bucket", &l, cumulative as f64);
        }
        write_sample(out, name, "_sum", labels, self.sum());
        write_sample(out, name, "_count", labels, cumulative as f64);
    }
}

/// Bucket bounds for request latencies (TTFT, E2E, queue): 1 ms to 5 min.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 300.0,
];

/// Bucket bounds for per-token times (TPOT): 0.1 ms to 10 s.
pub const TOKEN_LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0,
];

/// One instrument per label-value tuple.
#[derive(Debug, Clone)]
pub struct Family<M> {
    inner: Arc<FamilyInner<M>>,
}

#[derive(Debug)]
struct FamilyInner<M> {
    labels: &'static [&'static str],
    members: Mutex<BTreeMap<Vec<String>, M>>,
    make: fn(&FamilyInner<M>) -> M,
    bounds: Option<Arc<[f64]>>,
}

impl<M: Clone> Family<M> {
    /// The instrument for these label values (one per label name, in
    /// order). A wrong number of values is a programming error: the
    /// missing ones are empty and extra ones are dropped.
    pub fn with(&self, values: &[&str]) -> M {
        let key: Vec<String> = (0..self.inner.labels.len())
            .map(|i| values.get(i).copied().unwrap_or_default().to_string())
            .collect();
        debug_assert_eq!(values.len(), self.inner.labels.len(), "label values");
        let mut members = self.inner.members.lock().unwrap_or_else(|e| e.into_inner());
        members
            .entry(key)
            .or_insert_with(|| (self.inner.make)(&self.inner))
            .clone()
    }

    fn each(&self, mut f: impl FnMut(&[(&str, &str)], &M)) {
        let members = self.inner.members.lock().unwrap_or_else(|e| e.into_inner());
        for (values, m) in members.iter() {
            let labels: Vec<(&str, &str)> = self
                .inner
                .labels
                .iter()
                .copied()
                .zip(values.iter().map(String::as_str))
                .collect();
            f(&labels, m);
        }
    }
}

/// One sample written at scrape time: its labels and value.
type OwnedSample = (Vec<(String, String)>, f64);

/// Writes families at scrape time (see [`Registry::collector`]).
#[derive(Debug, Default)]
pub struct Scrape {
    families: Vec<(Header, Vec<OwnedSample>)>,
}

#[derive(Debug, Clone)]
struct Header {
    name: String,
    help: String,
    kind: Kind,
}

impl Scrape {
    /// One sample of counter `name` (which must end in `_total`).
    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.sample(name, help, Kind::Counter, labels, value);
    }

    /// One sample of gauge `name`.
    pub fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.sample(name, help, Kind::Gauge, labels, value);
    }

    fn sample(&mut self, name: &str, help: &str, kind: Kind, labels: &[(&str, &str)], v: f64) {
        let labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        if let Some((_, samples)) = self.families.iter_mut().find(|(h, _)| h.name == name) {
            samples.push((labels, v));
            return;
        }
        check_name(name, kind);
        self.families.push((
            Header {
                name: name.to_string(),
                help: help.to_string(),
                kind,
            },
            vec![(labels, v)],
        ));
    }
}

type CollectFn = Box<dyn Fn(&mut Scrape) + Send + Sync>;

enum Entry {
    Counter(Header, Family<Counter>),
    Gauge(Header, Family<Gauge>),
    Histogram(Header, Family<Histogram>),
    Collector(CollectFn),
}

/// Every metric of one process.
#[derive(Clone, Default)]
pub struct Registry {
    inner: Arc<Mutex<RegistryInner>>,
}

#[derive(Default)]
struct RegistryInner {
    entries: Vec<Entry>,
    names: Vec<String>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f.debug_struct("Registry")
            .field("names", &inner.names)
            .finish_non_exhaustive()
    }
}

/// The `Content-Type` of [`Registry::render`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

fn check_name(name: &str, kind: Kind) {
    let valid = !name.is_empty()
        && name
            .chars()
            .enumerate()
            .all(|(i, c)| c.is_ascii_alphabetic() || c == '_' || (i > 0 && c.is_ascii_digit()));
    assert!(valid, "metric name {name:?} is not [a-zA-Z_][a-zA-Z0-9_]*");
    assert_eq!(
        kind == Kind::Counter,
        name.ends_with("_total"),
        "{name}: counters, and only counters, end in _total"
    );
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    fn header(&self, name: &str, help: &str, kind: Kind) -> Header {
        check_name(name, kind);
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        assert!(
            !inner.names.iter().any(|n| n == name),
            "metric {name} registered twice"
        );
        inner.names.push(name.to_string());
        Header {
            name: name.to_string(),
            help: help.to_string(),
            kind,
        }
    }

    fn push(&self, entry: Entry) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.entries.push(entry);
    }

    /// A counter without labels.
    pub fn counter(&self, name: &str, help: &str) -> Counter {
        self.counter_family(name, help, &[]).with(&[])
    }

    /// Counters by `labels`.
    pub fn counter_family(
        &self,
        name: &str,
        help: &str,
        labels: &'static [&'static str],
    ) -> Family<Counter> {
        let h = self.header(name, help, Kind::Counter);
        let f = Family {
            inner: Arc::new(FamilyInner {
                labels,
                members: Mutex::new(BTreeMap::new()),
                make: |_| Counter::default(),
                bounds: None,
            }),
        };
        self.push(Entry::Counter(h, f.clone()));
        f
    }

    /// A gauge without labels.
    pub fn gauge(&self, name: &str, help: &str) -> Gauge {
        self.gauge_family(name, help, &[]).with(&[])
    }

    /// Gauges by `labels`.
    pub fn gauge_family(
        &self,
        name: &str,
        help: &str,
        labels: &'static [&'static str],
    ) -> Family<Gauge> {
        let h = self.header(name, help, Kind::Gauge);
        let f = Family {
            inner: Arc::new(FamilyInner {
                labels,
                members: Mutex::new(BTreeMap::new()),
                make: |_| Gauge::default(),
                bounds: None,
            }),
        };
        self.push(Entry::Gauge(h, f.clone()));
        f
    }

    /// A histogram without labels over `bounds` (strictly increasing).
    pub fn histogram(&self, name: &str, help: &str, bounds: &[f64]) -> Histogram {
        self.histogram_family(name, help, &[], bounds).with(&[])
    }

    /// Histograms by `labels`, all over `bounds` (strictly increasing).
    pub fn histogram_family(
        &self,
        name: &str,
        help: &str,
        labels: &'static [&'static str],
        bounds: &[f64],
    ) -> Family<Histogram> {
        assert!(
            bounds.windows(2).all(|w| w[0] < w[1]) && bounds.iter().all(|b| b.is_finite()),
            "{name}: bucket bounds must be finite and strictly increasing"
        );
        let h = self.header(name, help, Kind::Histogram);
        let f = Family {
            inner: Arc::new(FamilyInner {
                labels,
                members: Mutex::new(BTreeMap::new()),
                make: |inner| Histogram::new(inner.bounds.clone().unwrap_or_else(|| Arc::from([]))),
                bounds: Some(Arc::from(bounds)),
            }),
        };
        self.push(Entry::Histogram(h, f.clone()));
        f
    }

    /// Calls `collect` at every scrape; what it writes goes out after the
    /// families registered before it.
    pub fn collector(&self, collect: impl Fn(&mut Scrape) + Send + Sync + 'static) {
        self.push(Entry::Collector(Box::new(collect)));
    }

    /// Forgets every metric and collector: a worker that switches roles
    /// registers its new role's afresh (its counters restart from zero,
    /// which Prometheus reads as a reset).
    pub fn clear(&self) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.entries.clear();
        inner.names.clear();
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = String::new();
        let mut seen: Vec<String> = inner.names.clone();
        for entry in &inner.entries {
            match entry {
                Entry::Counter(h, f) => {
                    write_header(&mut out, h);
                    f.each(|l, c| write_sample(&mut out, &h.name, "", l, c.get() as f64));
                }
                Entry::Gauge(h, f) => {
                    write_header(&mut out, h);
                    f.each(|l, g| write_sample(&mut out, &h.name, "", l, g.get()));
                }
                Entry::Histogram(h, f) => {
                    write_header(&mut out, h);
                    f.each(|l, hist| hist.write(&h.name, l, &mut out));
                }
                Entry::Collector(collect) => {
                    let mut scrape = Scrape::default();
                    collect(&mut scrape);
                    for (h, samples) in scrape.families {
                        // A name already written would make the
                        // exposition invalid: skip it rather than break
                        // the whole scrape.
                        if seen.contains(&h.name) {
                            continue;
                        }
                        seen.push(h.name.clone());
                        write_header(&mut out, &h);
                        for (labels, v) in &samples {
                            let l: Vec<(&str, &str)> = labels
                                .iter()
                                .map(|(k, v)| (k.as_str(), v.as_str()))
                                .collect();
                            write_sample(&mut out, &h.name, "", &l, *v);
                        }
                    }
                }
            }
        }
        out
    }
}

fn write_header(out: &mut String, h: &Header) {
    let help = h.help.replace('\\', "\\\\").replace('\n', "\\n");
    let _ = writeln!(out, "# HELP {} {help}", h.name);
    let _ = writeln!(out, "# TYPE {} {}", h.name, h.kind.as_str());
}

fn write_sample(out: &mut String, name: &str, suffix: &str, labels: &[(&str, &str)], v: f64) {
    out.push_str(name);
    out.push_str(suffix);
    if !labels.is_empty() {
        out.push('{');
        for (i, (k, val)) in labels.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(k);
            out.push_str("=\"");
            for c in val.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '"' => out.push_str("\\\""),
                    '\n' => out.push_str("\\n"),
                    c => out.push(c),
                }
            }
            out.push('"');
        }
        out.push('}');
    }
    out.push(' ');
    write_float(out, v);
    out.push('\n');
}

fn write_float(out: &mut String, v: f64) {
    if v.is_nan() {
        out.push_str("NaN");
    } else if v.is_infinite() {
        out.push_str(if v > 0.0 { "+Inf" } else { "-Inf" });
    } else {
        let _ = write!(out, "{v}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_kind_in_the_text_format() {
        let r = Registry::new();
        let c = r.counter_family("x_requests_total", "Requests.", &["outcome"]);
        c.with(&["ok"]).add(3);
        c.with(&["error"]).inc();
        let g = r.gauge("x_queue_depth", "Waiting.");
        g.set(2.0);
        let h = r.histogram("x_latency_seconds", "Latency.", &[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(7.0);
        r.collector(|s| {
            s.gauge("x_blocks", "Blocks.", &[("state", "free")], 5.0);
            s.gauge("x_blocks", "Blocks.", &[("state", "used")], 3.0);
        });
        let text = r.render();
        let expected = "\
# HELP x_requests_total Requests.
# TYPE x_requests_total counter
x_requests_total{outcome=\"error\"} 1
x_requests_total{outcome=\"ok\"} 3
# HELP x_queue_depth Waiting.
# TYPE x_queue_depth gauge
x_queue_depth 2
# HELP x_latency_seconds Latency.
# TYPE x_latency_seconds histogram
x_latency_seconds_bucket{le=\"0.1\"} 1
x_latency_seconds_bucket{le=\"1\"} 2
x_latency_seconds_bucket{le=\"+Inf\"} 3
x_latency_seconds_sum 7.55
x_latency_seconds_count 3
# HELP x_blocks Blocks.
# TYPE x_blocks gauge
x_blocks{state=\"free\"} 5
x_blocks{state=\"used\"} 3
";
        assert_eq!(text, expected);
        assert_eq!(h.count(), 3);
    }

    #[test]
    fn label_values_are_escaped() {
        let r = Registry::new();
        r.counter_family("y_total", "Y.", &["v"])
            .with(&["a\"b\\c\nd"])
            .inc();
        assert!(r.render().contains(r#"y_total{v="a\"b\\c\nd"} 1"#));
    }

    #[test]
    fn a_bound_is_inclusive() {
        let r = Registry::new();
        let h = r.histogram("z_seconds", "Z.", &[1.0, 2.0]);
        h.observe(1.0);
        h.observe(2.5);
        let text = r.render();
        assert!(text.contains("z_seconds_bucket{le=\"1\"} 1\n"));
        assert!(text.contains("z_seconds_bucket{le=\"2\"} 1\n"));
        assert!(text.contains("z_seconds_bucket{le=\"+Inf\"} 2\n"));
    }

    #[test]
    #[should_panic(expected = "end in _total")]
    fn a_counter_must_end_in_total() {
        Registry::new().counter("requests", "R.");
    }

    #[test]
    fn a_cleared_registry_takes_the_same_names_again() {
        let r = Registry::new();
        r.counter("c_total", "C.").inc();
        r.clear();
        assert_eq!(r.render(), "");
        r.counter("c_total", "C.");
        assert!(r.render().contains("c_total 0\n"), "{}", r.render());
    }

    #[test]
    #[should_panic(expected = "registered twice")]
    fn a_name_is_registered_once() {
        let r = Registry::new();
        r.gauge("g", "G.");
        r.gauge("g", "G.");
    }

    #[test]
    fn a_collector_cannot_shadow_a_registered_name() {
        let r = Registry::new();
        r.gauge("g", "G.").set(1.0);
        r.collector(|s| s.gauge("g", "Again.", &[], 9.0));
        assert_eq!(r.render().matches("# TYPE g gauge").count(), 1);
    }
}
