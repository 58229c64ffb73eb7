//! `tandem`: the command line for people. The commands live in the library
//! (`src/lib.rs`); this parses, sets up logging and runs one.

use clap::Parser;
use tandem_cli::Cli;

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
    if let Err(e) = tandem_cli::run(cli.command) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
