//! `tandem`: the command line for people. The commands live in the library
//! (`src/lib.rs`); this parses, sets up logging and tracing and runs one.

use clap::Parser;
use tandem_cli::Cli;

fn main() {
    // UCX's transport tuning goes through the environment; set it while
    // this process has one thread (and before it starts any worker).
    #[cfg(feature = "ucx")]
    for (name, value) in tandem_kv_transfer::ucx::tuning_env() {
        std::env::set_var(name, value);
    }
    let cli = Cli::parse();
    tandem_cli::progress::init(cli.telemetry.log_format, cli.telemetry.no_progress);
    // Logs go to stderr (text or JSON); RUST_LOG sets the level (default:
    // info). Spans are exported when an OTLP endpoint is given.
    let telemetry = match tandem_telemetry::init(&cli.telemetry.config(cli.command.service_name()))
    {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let result = tandem_cli::run(cli.command, &cli.telemetry);
    // Flushes queued spans; `exit` would skip it.
    drop(telemetry);
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
