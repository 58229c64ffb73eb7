//! PNG line charts of benchmark results (SLO attainment against rate,
//! latency CDFs, roofline curves), drawn with plotters.
//!
//! Text needs a TrueType font; the first of a few standard system paths is
//! used (Debian: `fonts-dejavu-core`).

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;

/// Why a chart could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("no TrueType font found (looked in {0}); install fonts-dejavu-core")]
    NoFont(String),
    #[error("drawing {path}: {message}")]
    Draw { path: String, message: String },
}

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Registers a system font as plotters' "sans-serif" once.
fn font() -> Result<(), PlotError> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        for p in FONT_PATHS {
            if let Ok(bytes) = std::fs::read(p) {
                // Fonts live as long as the process; leaking one file is the
                // price of plotters' `'static` font registry.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return Ok(());
                }
            }
        }
        Err(FONT_PATHS.join(", "))
    })
    .clone()
    .map_err(PlotError::NoFont)
}

/// One named curve.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

impl Series {
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            name: name.into(),
            points,
        }
    }
}

/// A line chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    /// Logarithmic x axis (e.g. batch sizes).
    pub x_log: bool,
    pub series: Vec<Series>,
}

/// The empirical CDF of `values`: `(value, fraction <= value)` points.
pub fn cdf(values: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.into_iter()
        .enumerate()
        .map(|(i, x)| (x, (i + 1) as f64 / n))
        .collect()
}

fn bounds(series: &[Series], pick: impl Fn(&(f64, f64)) -> f64) -> (f64, f64) {
    let (lo, hi) = series
        .iter()
        .flat_map(|s| s.points.iter().map(&pick))
        .filter(|x| x.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
            (lo.min(x), hi.max(x))
        });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if hi <= lo {
        return (lo - 0.5, hi + 0.5);
    }
    (lo, hi)
}

/// Draws `chart` into a 900×560 PNG at `path`.
pub fn line_chart(path: &Path, chart: &Chart) -> Result<(), PlotError> {
    font()?;
    let err = |e: &dyn std::fmt::Display| PlotError::Draw {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (x0, x1) = bounds(&chart.series, |p| p.0);
    let (y0, y1) = bounds(&chart.series, |p| p.1);
    let y0 = y0.min(0.0);
    let y1 = y1 + (y1 - y0) * 0.05;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(&chart.title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64);
    let colors = [&BLUE, &RED, &GREEN, &MAGENTA, &CYAN, &BLACK];
    macro_rules! draw {
        ($ctx:expr) => {{
            let mut ctx = $ctx.map_err(|e| err(&e))?;
            ctx.configure_mesh()
                .x_desc(chart.x_label.as_str())
                .y_desc(chart.y_label.as_str())
                .label_style(("sans-serif", 14))
                .draw()
                .map_err(|e| err(&e))?;
            for (i, s) in chart.series.iter().enumerate() {
                let color = colors[i % colors.len()];
                ctx.draw_series(LineSeries::new(
                    s.points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(|e| err(&e))?
                .label(s.name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
                if s.points.len() <= 40 {
                    ctx.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                        .map_err(|e| err(&e))?;
                }
            }
            ctx.configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 14))
                .draw()
                .map_err(|e| err(&e))?;
        }};
    }
    if chart.x_log && x0 > 0.0 {
        draw!(builder.build_cartesian_2d((x0..x1).log_scale(), y0..y1));
    } else {
        draw!(builder.build_cartesian_2d(x0..x1, y0..y1));
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_steps_to_one() {
        let c = cdf(&[3.0, 1.0, 2.0, f64::NAN]);
        assert_eq!(c, vec![(1.0, 1.0 / 3.0), (2.0, 2.0 / 3.0), (3.0, 1.0)]);
    }

    #[test]
    fn draws_a_png() {
        if FONT_PATHS.iter().all(|p| !Path::new(p).exists()) {
            // CI installs fonts-dejavu-core; say so instead of passing silently.
            panic!("no font: install fonts-dejavu-core");
        }
        let dir = std::env::temp_dir().join(format!("tandem-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("c.png");
        let chart = Chart {
            title: "t".into(),
            x_label: "batch".into(),
            y_label: "ms".into(),
            x_log: true,
            series: vec![
                Series::new("a", vec![(1.0, 1.0), (8.0, 2.0), (64.0, 9.0)]),
                Series::new("b", cdf(&[1.0, 2.0, 3.0])),
            ],
        };
        line_chart(&path, &chart).expect("draws");
        let bytes = std::fs::read(&path).expect("written");
        assert_eq!(&bytes[1..4], b"PNG");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
