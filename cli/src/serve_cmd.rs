//! `tandem serve`: one process doing prefill and decode (the colocated
//! mode), serving the public gRPC API.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use tandem_server::Bound;

use crate::engine_args::{runtime, shutdown_signal, start_engine, EngineArgs};

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
    let engine = start_engine(args.model.as_deref(), &args.engine)?;
    runtime()?.block_on(async move {
        let bound = Bound::bind(args.addr).await?;
        // Tests and scripts read the bound port (e.g. of 127.0.0.1:0) here.
        println!("listening on {}", bound.local_addr());
        tandem_server::serve(bound, engine.handle, shutdown_signal()).await?;
        Ok(())
    })
}
