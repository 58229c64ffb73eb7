//! `tandem`: the command line for people, as a library so tests can parse
//! arguments with the binary's own definitions (`Cli::try_parse_from`).
//! `main.rs` parses, sets up logging and calls [`run`].
//!
//! Subcommands: `up` (a local cluster), `serve` (the colocated server: one
//! process, the public gRPC API), `prefill-worker`, `decode-worker` and
//! `router` (the cluster's processes), `generate` (run one prompt through a
//! model), `chat` (talk to a model from the terminal), `gen-model` (write a deterministic random checkpoint), `plan` (KV
//! pool and concurrency for a memory budget) and `bench serve`, and
//! `certs` (a development CA and certificates for `--tls-*`).

mod bench_cmd;
mod bench_report;
mod chat;
mod default_model;
mod engine_args;
mod generate_cmd;
mod http_args;
mod kv_disk_args;
mod lora_args;
mod membership;
mod parallel_args;
mod plan_cmd;
mod planner_cmd;
pub mod progress;
mod remote;
pub mod security_args;
mod serve_cmd;
mod speculative_args;
pub mod telemetry_args;
mod up_cmd;
mod worker_cmd;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// The `tandem` command line.
#[derive(Parser, Debug)]
#[command(
    name = "tandem",
    version,
    about = "Disaggregated prefill/decode LLM serving"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    #[command(flatten)]
    pub telemetry: telemetry_args::TelemetryArgs,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Start a local cluster (router, prefill and decode workers).
    Up(up_cmd::UpArgs),
    /// Serve the gRPC API from one process doing prefill and decode.
    Serve(serve_cmd::ServeArgs),
    /// Run a prefill worker.
    PrefillWorker(worker_cmd::WorkerArgs),
    /// Run a decode worker.
    DecodeWorker(worker_cmd::DecodeWorkerArgs),
    /// Run a worker that switches between the prefill and decode pools on
    /// SIGUSR1, its model kept loaded (what `up --planner` starts).
    Worker(worker_cmd::SwitchableWorkerArgs),
    /// Run the router.
    Router(worker_cmd::RouterArgs),
    /// Generate a continuation of one prompt.
    Generate(generate_cmd::GenerateArgs),
    /// Chat with a model from the terminal: in-process, or through a
    /// running router (gRPC or HTTP).
    Chat(chat::ChatArgs),
    /// Write a deterministic random-weight checkpoint in Hugging Face format.
    GenModel(default_model::GenModelArgs),
    /// Size the KV pool and the concurrency for a memory budget.
    Plan(plan_cmd::PlanArgs),
    /// The SLA planner: write a throughput profile, or size the pools of
    /// a Kubernetes deployment from its routers' metrics.
    Planner(planner_cmd::PlannerArgs),
    /// Benchmarks against a running server (`bench serve`).
    Bench(bench_cmd::BenchArgs),
    /// Write a development CA and certificates for mTLS (`--tls-*`).
    Certs(security_args::CertsArgs),
    /// Run one rank of a `--tp`/`--pp` worker (its leader starts these, or
    /// the deploy manifests do).
    Rank(parallel_args::RankArgs),
}

impl Command {
    /// The `service.name` of the command's exported spans.
    pub fn service_name(&self) -> &'static str {
        match self {
            Self::Up(_) => "tandem-up",
            Self::Serve(_) => "tandem-serve",
            Self::PrefillWorker(_) => "tandem-prefill-worker",
            Self::DecodeWorker(_) => "tandem-decode-worker",
            Self::Worker(_) => "tandem-worker",
            Self::Router(_) => "tandem-router",
            Self::Rank(_) => "tandem-rank",
            _ => "tandem",
        }
    }
}

/// Runs one parsed command.
pub fn run(command: Command, telemetry: &telemetry_args::TelemetryArgs) -> Result<()> {
    match command {
        Command::Up(args) => up_cmd::run(args, telemetry),
        Command::Serve(args) => serve_cmd::run(args),
        Command::PrefillWorker(args) => worker_cmd::run_prefill(args),
        Command::DecodeWorker(args) => worker_cmd::run_decode(args),
        Command::Worker(args) => worker_cmd::run_switchable(args),
        Command::Router(args) => worker_cmd::run_router(args),
        Command::Generate(args) => generate_cmd::run(args),
        Command::Chat(args) => chat::run(args),
        Command::GenModel(args) => default_model::run_gen_model(args),
        Command::Plan(args) => plan_cmd::run(args),
        Command::Planner(args) => planner_cmd::run(args),
        Command::Bench(args) => bench_cmd::run(args),
        Command::Certs(args) => security_args::run_certs(args),
        Command::Rank(args) => parallel_args::run_rank(args),
    }
}
