//! Observability flags: log format and trace export for every command
//! (global flags, so `tandem --log-format json up` and `tandem up
//! --log-format json` both work), and the `/metrics` listener of each
//! serving process.

use std::net::SocketAddr;

use anyhow::{Context, Result};
use clap::Args;
use tandem_telemetry::{LogFormat, Registry, TelemetryConfig};

#[derive(Args, Debug, Clone)]
pub struct TelemetryArgs {
    /// Log lines as `text` or `json` (one object per line, with the
    /// request's span fields, e.g. `request_id`). `RUST_LOG` sets the level.
    #[arg(long, global = true, env = "TANDEM_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
    /// Export trace spans over OTLP/gRPC to this collector (e.g.
    /// `http://127.0.0.1:4317`). Off when unset.
    #[arg(long, global = true, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// No progress bars (they are drawn only when stderr is a terminal and
    /// logs are text anyway).
    #[arg(long, global = true)]
    pub no_progress: bool,
}

impl TelemetryArgs {
    /// The telemetry of a process that names itself `service_name`.
    pub fn config(&self, service_name: &str) -> TelemetryConfig {
        let mut c = TelemetryConfig::new(service_name);
        c.log_format = self.log_format;
        c.otlp_endpoint = self.otlp_endpoint.clone().filter(|e| !e.is_empty());
        c.log_writer = crate::progress::log_writer;
        c
    }

    /// The same flags for a child process, which draws no progress bars
    /// (its parent shows its own).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            "--log-format".to_string(),
            self.log_format.to_string(),
            "--no-progress".to_string(),
        ];
        if let Some(e) = &self.otlp_endpoint {
            a.extend(["--otlp-endpoint".to_string(), e.clone()]);
        }
        a
    }
}

#[derive(Args, Debug, Clone)]
pub struct MetricsArgs {
    /// Serve Prometheus metrics at `http://ADDR/metrics` (port 0 picks a
    /// free port; the bound address is printed as `metrics listening on
    /// ADDR`).
    #[arg(long, env = "TANDEM_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
}

impl MetricsArgs {
    /// Binds the metrics port and serves `registry` on it until a shutdown
    /// signal; prints `metrics listening on ADDR`. Nothing without
    /// `--metrics-addr`.
    pub async fn start(&self, registry: &Registry) -> Result<()> {
        let Some(addr) = self.metrics_addr else {
            return Ok(());
        };
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the metrics endpoint on {addr}"))?;
        let bound = listener.local_addr()?;
        println!("metrics listening on {bound}");
        tracing::info!(addr = %bound, "Prometheus metrics at /metrics");
        let registry = registry.clone();
        tokio::spawn(async move {
            if let Err(e) = tandem_telemetry::http::serve(
                listener,
                registry,
                tandem_telemetry::http::METRICS_LIMITS,
                crate::engine_args::shutdown_signal(),
            )
            .await
            {
                tracing::error!("metrics endpoint: {e}");
            }
        });
        Ok(())
    }
}
