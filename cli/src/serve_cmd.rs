//! `tandem serve`: one process doing prefill and decode (the colocated
//! mode), serving the public gRPC API.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use std::sync::Arc;

use tandem_server::{Bound, GenerationService};

use crate::engine_args::{
    engine_stopped, exit_after_engine_failure, runtime, shutdown_signal, start_engine, EngineArgs,
};

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Hugging Face checkpoint directory (default: the built-in model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:50051")]
    addr: SocketAddr,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    http: crate::http_args::HttpArgs,
    #[command(flatten)]
    metrics: crate::telemetry_args::MetricsArgs,
    #[command(flatten)]
    tls: crate::security_args::TlsArgs,
    #[command(flatten)]
    api_keys: crate::security_args::ApiKeyArgs,
}

pub fn run(args: ServeArgs) -> Result<()> {
    let tls = args.tls.load()?;
    let api_keys = args.api_keys.load()?;
    let engine = start_engine(args.model.as_deref(), &args.engine)?;
    runtime()?.block_on(async move {
        let bound = Bound::bind(args.addr).await?;
        let registry = tandem_telemetry::Registry::new();
        tandem_server::register_engine(&registry, engine.handle.clone());
        let service = Arc::new(
            GenerationService::new(engine.handle.clone())
                .with_metrics(tandem_server::ServingMetrics::register(&registry)),
        );
        args.metrics.start(&registry).await?;
        let api = args.http.api(
            &engine.model_dir,
            service.clone(),
            api_keys.clone(),
            engine.adapters(),
        )?;
        args.http.serve(api.as_ref()).await?;
        let signal = shutdown_signal();
        // Tests and scripts read the bound port (e.g. of 127.0.0.1:0) here.
        println!("listening on {}", bound.local_addr());
        let mut services = crate::worker_cmd::public_services(service, api.as_ref(), &api_keys);
        services.with_tls(tls.as_ref().map(|t| t.server()));
        let engine_handle = engine.handle.clone();
        let stop = async move {
            tokio::select! {
                () = signal => {}
                why = engine_stopped(engine_handle) => exit_after_engine_failure(&why),
            }
        };
        tandem_server::serve_services(bound, services, stop).await?;
        Ok(())
    })
}
