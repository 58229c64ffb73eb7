//! A strict parser of the Prometheus text exposition format (0.0.4), for
//! tests that scrape `/metrics`: anything a Prometheus server would refuse,
//! or that breaks the conventions tandem holds itself to, is an error.
//!
//! Checked: every line is a `# HELP`, `# TYPE`, other comment, blank or
//! sample line; a family's `# TYPE` comes once, before its samples, which
//! are contiguous; sample names are the family's (histograms: `_bucket`,
//! `_sum`, `_count`); counters end in `_total`; label names are valid and
//! unique, values properly escaped; values are floats (`+Inf`, `-Inf`,
//! `NaN` allowed); no series repeats; each histogram series has
//! increasing `le` bounds ending at `+Inf`, cumulative counts that never
//! decrease, the `+Inf` count equal to `_count`, and a `_sum`.

use std::collections::{BTreeMap, HashMap, HashSet};

/// Label name → value.
pub type Labels = BTreeMap<String, String>;

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Labels,
    pub value: f64,
}

/// A `# TYPE`d family and its samples.
#[derive(Debug, Clone, PartialEq)]
pub struct Family {
    pub name: String,
    pub kind: String,
    pub help: String,
    pub samples: Vec<Sample>,
}

/// A parsed scrape.
#[derive(Debug, Clone, Default)]
pub struct Scrape {
    pub families: Vec<Family>,
}

impl Scrape {
    pub fn family(&self, name: &str) -> Option<&Family> {
        self.families.iter().find(|f| f.name == name)
    }

    /// The value of sample `name` whose labels include `labels`; `None`
    /// when none matches.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.families
            .iter()
            .flat_map(|f| &f.samples)
            .find(|s| {
                s.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
    }

    /// Sum of every sample named `name` whose labels include `labels`.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.families
            .iter()
            .flat_map(|f| &f.samples)
            .filter(|s| {
                s.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
            .sum()
    }
}

fn valid_name(s: &str, colon: bool) -> bool {
    !s.is_empty()
        && s.chars().enumerate().all(|(i, c)| {
            c.is_ascii_alphabetic()
                || c == '_'
                || (colon && c == ':')
                || (i > 0 && c.is_ascii_digit())
        })
}

fn parse_value(s: &str) -> Result<f64, String> {
    match s {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s.parse::<f64>().map_err(|_| format!("bad value {s:?}")),
    }
}

/// `name{a="x",b="y"} value [timestamp]`.
fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line
        .find(['{', ' '])
        .ok_or_else(|| format!("no value in {line:?}"))?;
    let name = &line[..name_end];
    if !valid_name(name, true) {
        return Err(format!("bad metric name {name:?}"));
    }
    let mut rest = &line[name_end..];
    let mut labels = Labels::new();
    if let Some(r) = rest.strip_prefix('{') {
        let mut chars = r.char_indices().peekable();
        let end = loop {
            // Label name up to '='.
            let Some(&(start, c)) = chars.peek() else {
                return Err(format!("unterminated labels in {line:?}"));
            };
            if c == '}' {
                break start + 1;
            }
            let mut eq = None;
            for (i, c) in chars.by_ref() {
                if c == '=' {
                    eq = Some(i);
                    break;
                }
            }
            let eq = eq.ok_or_else(|| format!("label without '=' in {line:?}"))?;
            let lname = &r[start..eq];
            if !valid_name(lname, false) || lname.starts_with("__") {
                return Err(format!("bad label name {lname:?} in {line:?}"));
            }
            if chars.next().map(|x| x.1) != Some('"') {
                return Err(format!("label value not quoted in {line:?}"));
            }
            let mut value = String::new();
            let mut closed = false;
            while let Some((_, c)) = chars.next() {
                match c {
                    '\\' => match chars.next().map(|x| x.1) {
                        Some('\\') => value.push('\\'),
                        Some('"') => value.push('"'),
                        Some('n') => value.push('\n'),
                        other => return Err(format!("bad escape {other:?} in {line:?}")),
                    },
                    '"' => {
                        closed = true;
                        break;
                    }
                    '\n' => return Err(format!("raw newline in {line:?}")),
                    c => value.push(c),
                }
            }
            if !closed {
                return Err(format!("unterminated label value in {line:?}"));
            }
            if labels.insert(lname.to_string(), value).is_some() {
                return Err(format!("label {lname} repeated in {line:?}"));
            }
            match chars.next() {
                Some((_, ',')) => {}
                Some((i, '}')) => break i + 1,
                other => return Err(format!("expected ',' or '}}', got {other:?} in {line:?}")),
            }
        };
        rest = &r[end..];
    }
    let mut parts = rest.split(' ').filter(|p| !p.is_empty());
    if !rest.starts_with(' ') {
        return Err(format!("no space before the value in {line:?}"));
    }
    let value = parse_value(
        parts
            .next()
            .ok_or_else(|| format!("no value in {line:?}"))?,
    )?;
    if let Some(ts) = parts.next() {
        ts.parse::<i64>()
            .map_err(|_| format!("bad timestamp {ts:?} in {line:?}"))?;
    }
    if parts.next().is_some() {
        return Err(format!("trailing text in {line:?}"));
    }
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// The family a sample of `name` belongs to, given the families declared.
fn owner<'a>(name: &str, kinds: &'a HashMap<String, String>) -> Option<(&'a str, String)> {
    if let Some((k, kind)) = kinds.get_key_value(name) {
        if kind != "histogram" && kind != "summary" {
            return Some((k.as_str(), kind.clone()));
        }
    }
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix) {
            if let Some((k, kind)) = kinds.get_key_value(base) {
                if kind == "histogram" || (kind == "summary" && suffix != "_bucket") {
                    return Some((k.as_str(), kind.clone()));
                }
            }
        }
    }
    None
}

/// One histogram series: `(le, cumulative count)` buckets, sum, count.
type Series = (Vec<(f64, f64)>, Option<f64>, Option<f64>);

fn check_histogram(f: &Family) -> Result<(), String> {
    // Series by labels without `le`.
    let mut series: BTreeMap<Vec<(String, String)>, Series> = BTreeMap::new();
    for s in &f.samples {
        let mut key: Vec<(String, String)> = s
            .labels
            .iter()
            .filter(|(k, _)| k.as_str() != "le")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        key.sort();
        let e = series.entry(key).or_default();
        if s.name.ends_with("_bucket") {
            let le = s
                .labels
                .get("le")
                .ok_or_else(|| format!("{}: bucket without le", f.name))?;
            e.0.push((parse_value(le)?, s.value));
        } else if s.name.ends_with("_sum") {
            e.1 = Some(s.value);
        } else if s.name.ends_with("_count") {
            e.2 = Some(s.value);
        }
    }
    for (key, (buckets, sum, count)) in series {
        let count = count.ok_or_else(|| format!("{} {key:?}: no _count", f.name))?;
        sum.ok_or_else(|| format!("{} {key:?}: no _sum", f.name))?;
        let last = buckets
            .last()
            .ok_or_else(|| format!("{} {key:?}: no buckets", f.name))?;
        if last.0 != f64::INFINITY {
            return Err(format!("{} {key:?}: last bucket is not +Inf", f.name));
        }
        if last.1 != count {
            return Err(format!(
                "{} {key:?}: +Inf bucket {} != _count {count}",
                f.name, last.1
            ));
        }
        for w in buckets.windows(2) {
            if w[0].0 >= w[1].0 {
                return Err(format!("{} {key:?}: le bounds not increasing", f.name));
            }
            if w[0].1 > w[1].1 {
                return Err(format!("{} {key:?}: buckets not cumulative", f.name));
            }
        }
    }
    Ok(())
}

/// Parses and checks one scrape.
pub fn parse(text: &str) -> Result<Scrape, String> {
    let mut families: Vec<Family> = Vec::new();
    let mut kinds: HashMap<String, String> = HashMap::new();
    let mut helps: HashMap<String, String> = HashMap::new();
    let mut closed: HashSet<String> = HashSet::new();
    let mut series: HashSet<(String, Vec<(String, String)>)> = HashSet::new();
    let mut current: Option<String> = None;
    for (n, line) in text.lines().enumerate() {
        let at = |e: String| format!("line {}: {e}", n + 1);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('#') {
            let rest = rest.trim_start();
            let mut words = rest.splitn(3, ' ');
            match words.next() {
                Some("HELP") => {
                    let name = words
                        .next()
                        .ok_or_else(|| at("HELP without a name".into()))?;
                    if helps
                        .insert(
                            name.to_string(),
                            words.next().unwrap_or_default().to_string(),
                        )
                        .is_some()
                    {
                        return Err(at(format!("second HELP for {name}")));
                    }
                }
                Some("TYPE") => {
                    let name = words
                        .next()
                        .ok_or_else(|| at("TYPE without a name".into()))?;
                    let kind = words.next().unwrap_or_default();
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                        return Err(at(format!("unknown type {kind:?}")));
                    }
                    if !valid_name(name, true) {
                        return Err(at(format!("bad metric name {name:?}")));
                    }
                    if kinds.contains_key(name) {
                        return Err(at(format!("second TYPE for {name}")));
                    }
                    if kind == "counter" && !name.ends_with("_total") {
                        return Err(at(format!("counter {name} does not end in _total")));
                    }
                    if families.iter().flat_map(|f| &f.samples).any(|s| {
                        owner(
                            &s.name,
                            &HashMap::from([(name.to_string(), kind.to_string())]),
                        )
                        .is_some()
                    }) {
                        return Err(at(format!("TYPE for {name} after its samples")));
                    }
                    kinds.insert(name.to_string(), kind.to_string());
                    if let Some(c) = current.take() {
                        closed.insert(c);
                    }
                    current = Some(name.to_string());
                    families.push(Family {
                        name: name.to_string(),
                        kind: kind.to_string(),
                        help: String::new(),
                        samples: Vec::new(),
                    });
                }
                _ => {} // a comment
            }
            continue;
        }
        let sample = parse_sample(line).map_err(at)?;
        let (family, _) = owner(&sample.name, &kinds)
            .ok_or_else(|| at(format!("sample {} has no TYPE before it", sample.name)))?;
        let family = family.to_string();
        if closed.contains(&family) || current.as_deref() != Some(family.as_str()) {
            return Err(at(format!("samples of {family} are not contiguous")));
        }
        let key = (
            sample.name.clone(),
            sample
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        );
        if !series.insert(key) {
            return Err(at(format!(
                "series {} {:?} repeated",
                sample.name, sample.labels
            )));
        }
        if let Some(f) = families.last_mut() {
            f.samples.push(sample);
        }
    }
    for f in &mut families {
        f.help = helps.get(&f.name).cloned().unwrap_or_default();
        if f.kind == "histogram" {
            check_histogram(f)?;
        }
    }
    Ok(Scrape { families })
}

/// `GET http://ADDR/metrics` over a plain TCP socket (HTTP/1.1), parsed;
/// panics on anything but a 200 with a valid body.
pub fn scrape(addr: &str) -> Scrape {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("{addr}: {e}"));
    s.write_all(
        format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .expect("request");
    let mut response = String::new();
    s.read_to_string(&mut response).expect("response");
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{addr}: {head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{addr}: {head}"
    );
    parse(body)
        .unwrap_or_else(|e| panic!("{addr}/metrics is not valid Prometheus text: {e}\n{body}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "\
# HELP req_total Requests.
# TYPE req_total counter
req_total{outcome=\"ok\",path=\"a\\\"b\"} 3
req_total{outcome=\"err\"} 1 1700000000000
# TYPE lat_seconds histogram
lat_seconds_bucket{le=\"0.1\"} 1
lat_seconds_bucket{le=\"1\"} 2
lat_seconds_bucket{le=\"+Inf\"} 3
lat_seconds_sum 7.5
lat_seconds_count 3
# a comment
# TYPE up gauge
up NaN
";

    #[test]
    fn parses_a_valid_scrape() {
        let s = parse(GOOD).expect("valid");
        assert_eq!(s.families.len(), 3);
        assert_eq!(s.value("req_total", &[("path", "a\"b")]), Some(3.0));
        assert_eq!(s.sum("req_total", &[]), 4.0);
        assert_eq!(s.value("lat_seconds_count", &[]), Some(3.0));
        assert_eq!(
            s.family("req_total").map(|f| f.help.as_str()),
            Some("Requests.")
        );
        assert!(s.value("up", &[]).is_some_and(f64::is_nan));
    }

    #[test]
    fn refuses_what_prometheus_would() {
        let bad = [
            ("x 1\n", "no TYPE"),
            ("# TYPE x counter\nx_total 1\n", "end in _total"),
            ("# TYPE x gauge\nx{a=\"1\" 2\n", "expected ','"),
            ("# TYPE x gauge\nx{a=1} 2\n", "quoted"),
            ("# TYPE x gauge\nx{a=\"1\",a=\"2\"} 2\n", "repeated"),
            ("# TYPE x gauge\nx abc\n", "bad value"),
            ("# TYPE x gauge\nx 1\nx 2\n", "repeated"),
            ("# TYPE x gauge\n# TYPE x gauge\n", "second TYPE"),
            ("# TYPE x gauge\n# TYPE y gauge\nx 1\n", "contiguous"),
            ("# TYPE x gauge\nx{a=\"\\t\"} 1\n", "escape"),
            (
                "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",
                "cumulative",
            ),
            (
                "# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 3\n",
                "_count",
            ),
            ("# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n", "+Inf"),
            ("# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_count 1\n", "_sum"),
            ("# TYPE x wat\n", "unknown type"),
        ];
        for (text, why) in bad {
            let e = parse(text).expect_err(text);
            assert!(e.contains(why), "{text:?}: {e} (expected {why})");
        }
    }

    #[test]
    fn reads_tandems_own_registry_output() {
        // The format tandem-telemetry writes, verbatim.
        let text = "\
# HELP tandem_kv_cache_blocks KV blocks.
# TYPE tandem_kv_cache_blocks gauge
tandem_kv_cache_blocks{state=\"used\"} 0
tandem_kv_cache_blocks{state=\"free\"} 512
";
        let s = parse(text).expect("valid");
        assert_eq!(s.sum("tandem_kv_cache_blocks", &[]), 512.0);
    }
}
