//! Just enough of the Prometheus text format (0.0.4) to read the router's
//! `/metrics`: samples with their labels, sums over label filters, and
//! histograms as cumulative bucket counts.
//!
//! The planner reads counters and histograms and differences two scrapes
//! itself (it needs one interval's rates and SLO attainment, not a time
//! series database), so a Prometheus server is optional.

use thiserror::Error;

/// A scrape this large is refused (the router's is a few KiB).
pub const MAX_EXPOSITION_BYTES: usize = 8 << 20;

#[derive(Debug, Error, PartialEq)]
pub enum PromError {
    #[error("line {line}: {why}: {text:?}")]
    Malformed {
        line: usize,
        why: &'static str,
        text: String,
    },
    #[error("the exposition is {0} bytes, over the {MAX_EXPOSITION_BYTES}-byte limit")]
    TooLarge(usize),
}

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Labels,
    pub value: f64,
}

impl Sample {
    fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn matches(&self, name: &str, filter: &[(&str, &str)]) -> bool {
        self.name == name && filter.iter().all(|(k, v)| self.label(k) == Some(v))
    }
}

/// A parsed scrape.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Exposition {
    pub samples: Vec<Sample>,
}

impl Exposition {
    pub fn parse(text: &str) -> Result<Self, PromError> {
        if text.len() > MAX_EXPOSITION_BYTES {
            return Err(PromError::TooLarge(text.len()));
        }
        let mut samples = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            samples.push(parse_sample(line).map_err(|why| PromError::Malformed {
                line: i + 1,
                why,
                text: line.chars().take(200).collect(),
            })?);
        }
        Ok(Self { samples })
    }

    /// The sum of every `name` sample whose labels include `filter`.
    pub fn sum(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|s| s.matches(name, filter))
            .map(|s| s.value)
            .sum()
    }

    /// Histogram `name` (its `_bucket`, `_count` and `_sum` samples).
    pub fn histogram(&self, name: &str) -> Histogram {
        let mut buckets: Vec<(f64, f64)> = Vec::new();
        let bucket = format!("{name}_bucket");
        for s in self.samples.iter().filter(|s| s.matches(&bucket, &[])) {
            let Some(le) = s.label("le").and_then(|le| parse_value(le).ok()) else {
                continue;
            };
            match buckets.iter_mut().find(|(b, _)| *b == le) {
                Some(b) => b.1 += s.value,
                None => buckets.push((le, s.value)),
            }
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Histogram {
            buckets,
            count: self.sum(&format!("{name}_count"), &[]),
            sum: self.sum(&format!("{name}_sum"), &[]),
        }
    }
}

/// A histogram's cumulative counts: `(upper bound, observations ≤ it)`,
/// ascending, the last usually `+Inf`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
    pub count: f64,
    pub sum: f64,
}

impl Histogram {
    /// What was observed after `earlier` (same bucket bounds; a bound
    /// missing there counts from zero). A count that went down means the
    /// process restarted: everything here is new.
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        if self.count < earlier.count {
            return self.clone();
        }
        let before = |le: f64| {
            earlier
                .buckets
                .iter()
                .find(|(b, _)| *b == le)
                .map_or(0.0, |b| b.1)
        };
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|&(le, n)| (le, (n - before(le)).max(0.0)))
                .collect(),
            count: (self.count - earlier.count).max(0.0),
            sum: (self.sum - earlier.sum).max(0.0),
        }
    }

    /// Adds `other`'s counts (another router replica's).
    pub fn merge(&mut self, other: &Histogram) {
        for &(le, n) in &other.buckets {
            match self.buckets.iter_mut().find(|(b, _)| *b == le) {
                Some(b) => b.1 += n,
                None => self.buckets.push((le, n)),
            }
        }
        self.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        self.count += other.count;
        self.sum += other.sum;
    }

    /// The fraction of observations at most `x`, interpolating linearly
    /// inside the bucket `x` falls in (as `histogram_quantile` does); `None`
    /// when nothing was observed.
    pub fn fraction_at_most(&self, x: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let (mut lower, mut below) = (0.0, 0.0);
        for &(le, n) in &self.buckets {
            if x < le {
                if le.is_infinite() {
                    return Some(below / self.count);
                }
                let within = (x - lower) / (le - lower);
                return Some((below + (n - below) * within.clamp(0.0, 1.0)) / self.count);
            }
            (lower, below) = (le, n);
        }
        Some((below / self.count).min(1.0))
    }
}

fn parse_value(v: &str) -> Result<f64, &'static str> {
    match v {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        v => v.parse().map_err(|_| "not a number"),
    }
}

fn parse_sample(line: &str) -> Result<Sample, &'static str> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .ok_or("no value")?;
    let name = &line[..name_end];
    if name.is_empty() {
        return Err("no metric name");
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(inner) = rest.strip_prefix('{') {
        let (parsed, after) = parse_labels(inner)?;
        labels = parsed;
        rest = after;
    }
    // The value, then an optional timestamp.
    let value = rest.split_whitespace().next().ok_or("no value")?;
    Ok(Sample {
        name: name.to_string(),
        labels,
        value: parse_value(value)?,
    })
}

/// A sample's labels, in order.
type Labels = Vec<(String, String)>;

/// `k="v",...}` → the labels and what follows the `}`.
fn parse_labels(mut s: &str) -> Result<(Labels, &str), &'static str> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start_matches([' ', ',']);
        if let Some(after) = s.strip_prefix('}') {
            return Ok((labels, after));
        }
        let eq = s.find('=').ok_or("a label without '='")?;
        let key = s[..eq].trim().to_string();
        s = s[eq + 1..].trim_start();
        let mut chars = s
            .strip_prefix('"')
            .ok_or("an unquoted label value")?
            .char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next() {
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => return Err("an unterminated label value"),
                },
                Some((_, c)) => value.push(c),
                None => return Err("an unterminated label value"),
            }
        };
        labels.push((key, value));
        s = &s[1 + end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP tandem_router_requests_total Generate requests.
# TYPE tandem_router_requests_total counter
tandem_router_requests_total{outcome="finished"} 10
tandem_router_requests_total{outcome="error"} 2
tandem_router_healthy_workers{role="decode"} 3
tandem_router_healthy_workers{role="prefill"} 1
odd{a="x\"y,}",b="2"} 7 1700000000
tandem_router_time_to_first_token_seconds_bucket{le="0.1"} 2
tandem_router_time_to_first_token_seconds_bucket{le="0.5"} 6
tandem_router_time_to_first_token_seconds_bucket{le="+Inf"} 8
tandem_router_time_to_first_token_seconds_sum 3.5
tandem_router_time_to_first_token_seconds_count 8
"#;

    #[test]
    fn sums_filter_by_label() {
        let e = Exposition::parse(TEXT).expect("parses");
        assert_eq!(e.sum("tandem_router_requests_total", &[]), 12.0);
        assert_eq!(
            e.sum("tandem_router_requests_total", &[("outcome", "finished")]),
            10.0
        );
        assert_eq!(
            e.sum("tandem_router_healthy_workers", &[("role", "prefill")]),
            1.0
        );
        assert_eq!(e.sum("odd", &[("a", "x\"y,}")]), 7.0);
        assert_eq!(e.sum("missing", &[]), 0.0);
    }

    #[test]
    fn histogram_fractions_interpolate_inside_a_bucket() {
        let h = Exposition::parse(TEXT)
            .expect("parses")
            .histogram("tandem_router_time_to_first_token_seconds");
        assert_eq!(h.count, 8.0);
        assert_eq!(h.fraction_at_most(0.1), Some(2.0 / 8.0));
        // Half way through (0.1, 0.5]: 2 + 4/2 = 4 of 8.
        assert_eq!(h.fraction_at_most(0.3), Some(0.5));
        assert_eq!(h.fraction_at_most(0.05), Some(1.0 / 8.0));
        // Beyond the last finite bound, only what is known below it.
        assert_eq!(h.fraction_at_most(9.0), Some(6.0 / 8.0));
        assert_eq!(Histogram::default().fraction_at_most(1.0), None);
    }

    #[test]
    fn a_histograms_interval_is_the_difference_of_two_scrapes() {
        let e = Exposition::parse(TEXT).expect("parses");
        let later = e.histogram("tandem_router_time_to_first_token_seconds");
        let earlier = Histogram {
            buckets: vec![(0.1, 2.0), (0.5, 2.0), (f64::INFINITY, 2.0)],
            count: 2.0,
            sum: 0.1,
        };
        let d = later.since(&earlier);
        assert_eq!(d.count, 6.0);
        assert_eq!(d.fraction_at_most(0.1), Some(0.0));
        assert_eq!(d.fraction_at_most(0.5), Some(4.0 / 6.0));
        let mut merged = d.clone();
        merged.merge(&d);
        assert_eq!(merged.count, 12.0);
        assert_eq!(merged.fraction_at_most(0.5), Some(4.0 / 6.0));
    }

    #[test]
    fn malformed_lines_are_refused_with_their_number() {
        for bad in [
            "x{a=1} 2",
            "x{a=\"1} 2",
            "x 1e",
            "x{a\"1\"} 2",
            "{a=\"1\"} 2",
        ] {
            let err = Exposition::parse(&format!("ok 1\n{bad}\n")).expect_err(bad);
            assert!(
                matches!(err, PromError::Malformed { line: 2, .. }),
                "{bad}: {err}"
            );
        }
    }
}
