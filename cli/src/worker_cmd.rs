//! `tandem prefill-worker`, `tandem decode-worker` and `tandem router`: the
//! cluster's processes (`tandem up` starts them for you).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use tandem_decode_worker::DecodeWorkerConfig;
use tandem_prefill_worker::PrefillWorkerConfig;
use tandem_proto::v1;
use tandem_router::{Cluster, PolicyKind, Role, RouterService};
use tandem_server::{Bound, Services};

use crate::engine_args::{runtime, shutdown_signal, start_engine, EngineArgs};

#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// Hugging Face checkpoint directory (default: the built-in model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// gRPC address (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    addr: SocketAddr,
    /// Shared secret every KV transfer handshake must present.
    #[arg(long, env = "TANDEM_CLUSTER_TOKEN", default_value = "tandem-local")]
    cluster_token: String,
    /// Name in membership and logs (default: role and address).
    #[arg(long)]
    id: Option<String>,
    /// Exit when standard input closes (set by `tandem up`, so workers die
    /// with it).
    #[arg(long, hide = true)]
    exit_on_stdin_eof: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Args, Debug)]
pub struct DecodeWorkerArgs {
    #[command(flatten)]
    worker: WorkerArgs,
    /// Where prefill workers push KV blocks (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    transfer_addr: String,
    /// Prefill remotely only when at least this many prompt tokens are not
    /// cached here.
    #[arg(long, default_value_t = 256)]
    remote_prefill_threshold: usize,
}

/// Exits the process once stdin reaches end of file.
pub fn exit_on_stdin_eof() {
    std::thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
        std::process::exit(0);
    });
}

pub fn run_prefill(args: WorkerArgs) -> Result<()> {
    if args.exit_on_stdin_eof {
        exit_on_stdin_eof();
    }
    let engine = start_engine(args.model.as_deref(), &args.engine)?;
    runtime()?.block_on(async move {
        let bound = Bound::bind(args.addr).await?;
        let addr = bound.local_addr();
        println!("listening on {addr}");
        let config = PrefillWorkerConfig {
            id: args.id.unwrap_or_else(|| format!("prefill-{addr}")),
            model: engine.model_name,
            cluster_token: args.cluster_token,
        };
        tandem_prefill_worker::run(
            engine.handle,
            engine.kv_layout,
            bound,
            config,
            shutdown_signal(),
        )
        .await?;
        Ok(())
    })
}

pub fn run_decode(args: DecodeWorkerArgs) -> Result<()> {
    let w = args.worker;
    if w.exit_on_stdin_eof {
        exit_on_stdin_eof();
    }
    let engine = start_engine(w.model.as_deref(), &w.engine)?;
    runtime()?.block_on(async move {
        let bound = Bound::bind(w.addr).await?;
        let addr = bound.local_addr();
        println!("listening on {addr}");
        let config = DecodeWorkerConfig {
            id: w.id.unwrap_or_else(|| format!("decode-{addr}")),
            model: engine.model_name,
            cluster_token: w.cluster_token,
            transfer_bind: args.transfer_addr,
            remote_prefill_threshold: args.remote_prefill_threshold,
        };
        tandem_decode_worker::run(
            engine.handle,
            engine.kv_layout,
            bound,
            config,
            shutdown_signal(),
        )
        .await?;
        Ok(())
    })
}

#[derive(Args, Debug)]
pub struct RouterArgs {
    /// Public gRPC address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    addr: SocketAddr,
    /// Decode workers (`host:port`, comma-separated).
    #[arg(long, value_delimiter = ',', required = true)]
    decode: Vec<String>,
    /// Prefill workers (`host:port`, comma-separated); none means decode
    /// workers prefill everything themselves.
    #[arg(long, value_delimiter = ',')]
    prefill: Vec<String>,
    /// Checkpoint directory, for its tokenizer (prefix-aware routing of text
    /// prompts). Default: the built-in model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// kv, least-loaded, round-robin or random.
    #[arg(long, default_value = "kv")]
    decode_policy: PolicyKind,
    #[arg(long, default_value = "least-loaded")]
    prefill_policy: PolicyKind,
    /// Use a prefill worker only from this many uncached prompt tokens.
    #[arg(long, default_value_t = 256)]
    remote_prefill_threshold: usize,
    /// How often each worker is probed (ms).
    #[arg(long, default_value_t = 500)]
    probe_interval_ms: u64,
    /// Exit when standard input closes (set by `tandem up`).
    #[arg(long, hide = true)]
    exit_on_stdin_eof: bool,
}

pub fn run_router(args: RouterArgs) -> Result<()> {
    if args.exit_on_stdin_eof {
        exit_on_stdin_eof();
    }
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => crate::default_model::default_model_dir()?,
    };
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = if tok_path.is_file() {
        Some(Arc::new(
            tandem_engine::tokenizer::Tokenizer::from_file(&tok_path)
                .with_context(|| format!("loading {}", tok_path.display()))?,
        ))
    } else {
        None
    };
    runtime()?.block_on(async move {
        let cluster = Cluster::new(Duration::from_millis(args.probe_interval_ms));
        for d in &args.decode {
            cluster.add(Role::Decode, d).map_err(anyhow::Error::msg)?;
        }
        for p in &args.prefill {
            cluster.add(Role::Prefill, p).map_err(anyhow::Error::msg)?;
        }
        cluster.wait_probed(Duration::from_secs(10)).await;
        let service = RouterService::new(
            cluster,
            tokenizer,
            args.decode_policy.build(),
            args.prefill_policy.build(),
            args.remote_prefill_threshold,
        );
        let bound = Bound::bind(args.addr).await?;
        println!("listening on {}", bound.local_addr());
        let mut services = Services::default();
        services.add(
            v1::generation_server::GenerationServer::new(service),
            v1::GENERATION_SERVICE,
            v1::FILE_DESCRIPTOR_SET,
        );
        tandem_server::serve_services(bound, services, shutdown_signal()).await?;
        Ok(())
    })
}
