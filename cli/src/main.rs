//! `tandem`: the command line for people.
//!
//! Subcommands today: `generate` (run one prompt through a model),
//! `gen-model` (write a deterministic random checkpoint) and `plan` (KV pool
//! and concurrency for a memory budget). Later: `up`, `serve`, `bench`.

mod default_model;
mod generate_cmd;
mod plan_cmd;

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
    /// Generate a continuation of one prompt.
    Generate(generate_cmd::GenerateArgs),
    /// Write a deterministic random-weight checkpoint in Hugging Face format.
    GenModel(default_model::GenModelArgs),
    /// Size the KV pool and the concurrency for a memory budget.
    Plan(plan_cmd::PlanArgs),
}

fn main() {
    let cli = Cli::parse();
    let result: Result<()> = match cli.command {
        Command::Generate(args) => generate_cmd::run(args),
        Command::GenModel(args) => default_model::run_gen_model(args),
        Command::Plan(args) => plan_cmd::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
