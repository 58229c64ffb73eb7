//! `tandem serve`: one process doing prefill and decode (the colocated
//! mode), serving the public gRPC API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use tandem_engine::serving::{EngineCore, EngineHandle};
use tandem_engine::Checkpoint;
use tandem_server::Bound;

use crate::engine_args::EngineArgs;

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
}

pub fn run(args: ServeArgs) -> Result<()> {
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => crate::default_model::default_model_dir()?,
    };
    let config = args.engine.config()?;
    let ckpt =
        Checkpoint::open(&dir).with_context(|| format!("loading model from {}", dir.display()))?;
    let core = EngineCore::new(
        ckpt.model,
        ckpt.tokenizer.map(Arc::new),
        ckpt.eos_token_ids,
        &config,
    )?;
    tracing::info!(model = %dir.display(), "model loaded");
    let engine = EngineHandle::spawn(core)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let bound = Bound::bind(args.addr).await?;
        // Tests and scripts read the bound port (e.g. of 127.0.0.1:0) here.
        println!("listening on {}", bound.local_addr());
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        tandem_server::serve(bound, engine, shutdown).await?;
        Ok(())
    })
}
