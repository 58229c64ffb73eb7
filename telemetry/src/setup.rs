//! Installing the process's `tracing` subscriber from one config struct.
//!
//! Always: a log layer on stderr, as text or as JSON lines, behind an env
//! filter (`RUST_LOG` or the configured filter, default `info`). JSON lines
//! carry the current span and the span list, so every line logged inside a
//! request's span names its `request_id`. With an OTLP endpoint, also an
//! OpenTelemetry layer with a filter of its own (every span at `info`
//! and above, whatever the log level) whose spans leave through a batch
//! processor and the tonic OTLP exporter. The exporter runs on a small runtime of its own, so
//! it works whatever runtime (or none) the process uses, and never competes
//! with request handling for the server's workers. Without an endpoint no
//! OpenTelemetry code runs at all.
//!
//! The returned [`Telemetry`] shuts the exporter down (flushing what is
//! queued) when dropped; [`flush`] does the same from anywhere, for exit
//! paths that never unwind to `main`.

use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// How log lines look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines (ANSI colours on a terminal).
    #[default]
    Text,
    /// One JSON object per line, with the current span and span list.
    Json,
}

impl FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(format!("unknown log format {other:?} (text, json)")),
        }
    }
}

impl std::fmt::Display for LogFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Text => "text",
            Self::Json => "json",
        })
    }
}

/// Everything about a process's logs and traces.
#[derive(Debug, Clone)]
pub struct TelemetryConfig {
    /// `service.name` of exported spans (e.g. `tandem-router`).
    pub service_name: String,
    pub log_format: LogFormat,
    /// An `EnvFilter` directive; `None` reads `RUST_LOG`, else `info`.
    pub log_filter: Option<String>,
    /// OTLP/gRPC collector (`http://host:4317`); `None` exports nothing.
    pub otlp_endpoint: Option<String>,
    /// How long finished spans wait before a batch leaves.
    pub export_delay: Duration,
    /// Where log lines are written: stderr, or a writer that keeps them
    /// clear of a progress bar drawn there (the command line's).
    pub log_writer: fn() -> Box<dyn std::io::Write>,
}

fn stderr_writer() -> Box<dyn std::io::Write> {
    Box::new(std::io::stderr())
}

impl TelemetryConfig {
    /// Text logs at `RUST_LOG` (or `info`), no export.
    pub fn new(service_name: impl Into<String>) -> Self {
        Self {
            service_name: service_name.into(),
            log_format: LogFormat::Text,
            log_filter: None,
            otlp_endpoint: None,
            export_delay: Duration::from_millis(500),
            log_writer: stderr_writer,
        }
    }
}

/// Errors setting up telemetry.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("log filter {filter:?}: {message}")]
    Filter { filter: String, message: String },
    #[error("OTLP exporter for {endpoint}: {message}")]
    Exporter { endpoint: String, message: String },
    #[error("telemetry runtime: {0}")]
    Runtime(#[from] std::io::Error),
    #[error("a tracing subscriber is already installed: {0}")]
    AlreadyInstalled(String),
}

/// The installed exporter; shuts down (and flushes) when dropped.
#[derive(Debug)]
pub struct Telemetry {
    exporting: bool,
}

static EXPORT: Mutex<Option<Export>> = Mutex::new(None);

/// The tracer provider and the runtime its exporter lives on.
#[derive(Debug)]
struct Export {
    provider: SdkTracerProvider,
    runtime: tokio::runtime::Runtime,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.exporting
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        shutdown();
    }
}

/// Exports every finished span now (call before `process::exit`).
pub fn flush() {
    let export = EXPORT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = export.as_ref() {
        if let Err(err) = e.provider.force_flush() {
            eprintln!("telemetry: flushing spans: {err}");
        }
    }
}

fn shutdown() {
    let export = EXPORT.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(e) = export {
        if let Err(err) = e.provider.shutdown_with_timeout(Duration::from_secs(5)) {
            eprintln!("telemetry: shutting the exporter down: {err}");
        }
        e.runtime.shutdown_timeout(Duration::from_secs(1));
    }
}

fn filter(config: &TelemetryConfig) -> Result<EnvFilter, TelemetryError> {
    let directive = match &config.log_filter {
        Some(f) => f.clone(),
        None => std::env::var(EnvFilter::DEFAULT_ENV).unwrap_or_else(|_| "info".into()),
    };
    EnvFilter::try_new(&directive).map_err(|e| TelemetryError::Filter {
        filter: directive,
        message: e.to_string(),
    })
}

fn provider(
    config: &TelemetryConfig,
    endpoint: &str,
) -> Result<(SdkTracerProvider, tokio::runtime::Runtime), TelemetryError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("tandem-otlp")
        .enable_all()
        .build()?;
    // The tonic channel spawns onto the runtime it is built in.
    let exporter = {
        let _guard = runtime.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .with_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| TelemetryError::Exporter {
                endpoint: endpoint.to_string(),
                message: e.to_string(),
            })?
    };
    let batch = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_scheduled_delay(config.export_delay)
                .build(),
        )
        .build();
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(config.service_name.clone())
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(batch)
        .with_resource(resource)
        .build();
    Ok((provider, runtime))
}

/// Installs the global subscriber `config` describes.
pub fn init(config: &TelemetryConfig) -> Result<Telemetry, TelemetryError> {
    let filter = filter(config)?;
    let logs = match config.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(config.log_writer)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(config.log_writer)
            .with_current_span(true)
            .with_span_list(true)
            .boxed(),
    };
    let export = match config.otlp_endpoint.as_deref().filter(|e| !e.is_empty()) {
        Some(endpoint) => Some(provider(config, endpoint)?),
        None => None,
    };
    let otel = export.as_ref().map(|(provider, _)| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("tandem"))
            .with_threads(false)
            .with_location(false)
            .with_filter(tracing_subscriber::filter::LevelFilter::INFO)
    });
    let exporting = export.is_some();
    tracing_subscriber::registry()
        .with(logs.with_filter(filter))
        .with(otel)
        .try_init()
        .map_err(|e| TelemetryError::AlreadyInstalled(e.to_string()))?;
    if let Some((provider, runtime)) = export {
        *EXPORT.lock().unwrap_or_else(|e| e.into_inner()) = Some(Export { provider, runtime });
    }
    Ok(Telemetry { exporting })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse() {
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert_eq!("text".parse::<LogFormat>(), Ok(LogFormat::Text));
        assert!("xml".parse::<LogFormat>().is_err());
        assert_eq!(LogFormat::Json.to_string(), "json");
    }

    #[test]
    fn a_bad_filter_is_an_error_naming_it() {
        let mut c = TelemetryConfig::new("t");
        c.log_filter = Some("info,[".into());
        let e = filter(&c).expect_err("bad directive");
        assert!(e.to_string().contains("info,["), "{e}");
    }
}
