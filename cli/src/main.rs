//! `tandem`: the command line for people.
//!
//! Subcommands today: `serve` (the colocated server: one process, the public
//! gRPC API), `generate` (run one prompt through a model), `gen-model` (write
//! a deterministic random checkpoint) and `plan` (KV pool and concurrency for
//! a memory budget). Later: `up`, `bench`.

mod bench_cmd;
mod default_model;
mod engine_args;
mod generate_cmd;
mod http_args;
mod plan_cmd;
mod remote;
mod serve_cmd;
mod up_cmd;
mod worker_cmd;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "tandem",
    version,
    about = "Disaggregated prefill/decode LLM serving"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start a local cluster (router, prefill and decode workers).
    Up(up_cmd::UpArgs),
    /// Serve the gRPC API from one process doing prefill and decode.
    Serve(serve_cmd::ServeArgs),
    /// Run a prefill worker.
    PrefillWorker(worker_cmd::WorkerArgs),
    /// Run a decode worker.
    DecodeWorker(worker_cmd::DecodeWorkerArgs),
    /// Run the router.
    Router(worker_cmd::RouterArgs),
    /// Generate a continuation of one prompt.
    Generate(generate_cmd::GenerateArgs),
    /// Write a deterministic random-weight checkpoint in Hugging Face format.
    GenModel(default_model::GenModelArgs),
    /// Size the KV pool and the concurrency for a memory budget.
    Plan(plan_cmd::PlanArgs),
    /// Benchmarks against a running server (`bench serve`).
    Bench(bench_cmd::BenchArgs),
}

fn main() {
    let cli = Cli::parse();
    // Logs go to stderr; RUST_LOG overrides the level (default: info).
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let result: Result<()> = match cli.command {
        Command::Up(args) => up_cmd::run(args),
        Command::Serve(args) => serve_cmd::run(args),
        Command::PrefillWorker(args) => worker_cmd::run_prefill(args),
        Command::DecodeWorker(args) => worker_cmd::run_decode(args),
        Command::Router(args) => worker_cmd::run_router(args),
        Command::Generate(args) => generate_cmd::run(args),
        Command::GenModel(args) => default_model::run_gen_model(args),
        Command::Plan(args) => plan_cmd::run(args),
        Command::Bench(args) => bench_cmd::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
