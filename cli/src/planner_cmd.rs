//! `tandem planner`: the SLA planner (tandem-planner) on the command line.
//!
//! * `tandem planner profile` turns two `tandem bench sweep` results (one
//!   loading the prefill pool, one the decode pool) into the throughput
//!   profile the planner sizes with.
//! * `tandem planner run` plans for running routers (their `/metrics`) and
//!   scales the Kubernetes Deployments (`deploy/overlays/cpu-planner`).
//! * `tandem up --planner` runs the same planner inside `up`, which starts,
//!   stops and switches its own worker processes (`up_cmd::supervisor`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use tandem_discovery::Role;
use tandem_planner::profile::PoolCapacity;
use tandem_planner::{
    Actuator, ControlLoop, Limits, Planner, PlannerConfig, Predictor, Profile, Scraper, Sizes, Slo,
};

#[derive(Args, Debug)]
pub struct PlannerArgs {
    #[command(subcommand)]
    command: PlannerCommand,
}

#[derive(Subcommand, Debug)]
enum PlannerCommand {
    /// Write a planner profile from a prefill-bound and a decode-bound
    /// `tandem bench sweep`.
    Profile(ProfileArgs),
    /// Plan for running routers and scale the Kubernetes Deployments.
    Run(RunArgs),
}

#[derive(Args, Debug)]
struct ProfileArgs {
    /// `sweep.json` of a sweep whose load is prompts (long prompts, a few
    /// output tokens) with a TTFT objective.
    #[arg(long)]
    prefill_sweep: PathBuf,
    /// Prefill workers in the swept cluster.
    #[arg(long, default_value_t = 1)]
    prefill_workers: usize,
    /// `sweep.json` of a sweep whose load is generation (short prompts,
    /// long answers) with a TPOT objective.
    #[arg(long)]
    decode_sweep: PathBuf,
    /// Decode workers in the swept cluster.
    #[arg(long, default_value_t = 1)]
    decode_workers: usize,
    #[arg(long, default_value = "planner-profile.json")]
    out: PathBuf,
}

/// How the next interval's load is predicted.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum PredictorArg {
    /// The last interval's.
    Last,
    /// A line through the last four intervals, one step ahead.
    Trend,
}

/// The planner's settings, shared by `tandem planner run` and
/// `tandem up --planner`.
#[derive(Args, Debug, Clone)]
pub struct PlanningArgs {
    /// The throughput profile (`tandem planner profile`).
    #[arg(long, value_name = "FILE")]
    pub planner_profile: Option<PathBuf>,
    /// TTFT objective (ms); default: the profile's.
    #[arg(long)]
    pub slo_ttft_ms: Option<f64>,
    /// TPOT objective (ms); default: the profile's.
    #[arg(long)]
    pub slo_tpot_ms: Option<f64>,
    /// Seconds between plans.
    #[arg(long, default_value_t = 10.0)]
    pub planner_interval_s: f64,
    #[arg(long, value_enum, default_value_t = PredictorArg::Trend)]
    pub predictor: PredictorArg,
    /// Fewest prefill workers.
    #[arg(long, default_value_t = 1)]
    pub min_prefill: usize,
    /// Fewest decode workers.
    #[arg(long, default_value_t = 1)]
    pub min_decode: usize,
    /// Most workers in all.
    #[arg(long, default_value_t = 4)]
    pub max_workers: usize,
    /// Plan each worker for this share of its profiled capacity.
    #[arg(long, default_value_t = 0.8)]
    pub utilisation: f64,
    /// Intervals in a row a pool must want fewer workers before one goes.
    #[arg(long, default_value_t = 3)]
    pub scale_down_after: u32,
    /// Append every decision to this file as a JSON line.
    #[arg(long, value_name = "FILE")]
    pub planner_log: Option<PathBuf>,
}

impl PlanningArgs {
    /// The planner's configuration, the profile read and checked.
    pub fn config(&self) -> Result<PlannerConfig> {
        let path = self.planner_profile.as_ref().context(
            "the planner needs --planner-profile (write one with `tandem planner profile`)",
        )?;
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the profile {}", path.display()))?;
        let profile =
            Profile::from_json(&text).with_context(|| format!("the profile {}", path.display()))?;
        let slo = Slo {
            ttft_s: self.slo_ttft_ms.map_or(profile.slo.ttft_s, |ms| ms / 1e3),
            tpot_s: self.slo_tpot_ms.map_or(profile.slo.tpot_s, |ms| ms / 1e3),
        };
        if slo.ttft_s < profile.slo.ttft_s || slo.tpot_s < profile.slo.tpot_s {
            tracing::warn!(
                ?slo,
                profiled = ?profile.slo,
                "objectives tighter than the profile's: its capacities are optimistic until corrected"
            );
        }
        if !(0.05..=1.0).contains(&self.utilisation) {
            bail!(
                "--utilisation must be in [0.05, 1], not {}",
                self.utilisation
            );
        }
        if self.min_prefill + self.min_decode > self.max_workers || self.min_decode == 0 {
            bail!(
                "--min-prefill {} + --min-decode {} must fit in --max-workers {}, with a decode worker",
                self.min_prefill,
                self.min_decode,
                self.max_workers
            );
        }
        if self.planner_interval_s.is_nan() || self.planner_interval_s < 1.0 {
            bail!("--planner-interval-s must be at least 1");
        }
        Ok(PlannerConfig {
            profile,
            slo,
            predictor: match self.predictor {
                PredictorArg::Last => Predictor::Last,
                PredictorArg::Trend => Predictor::DEFAULT,
            },
            limits: Limits {
                min: Sizes {
                    prefill: self.min_prefill,
                    decode: self.min_decode,
                },
                max: Sizes {
                    prefill: self.max_workers - self.min_decode,
                    decode: self.max_workers - self.min_prefill,
                },
                max_total: self.max_workers,
            },
            utilisation: self.utilisation,
            scale_down_after: self.scale_down_after,
            attainment_target: tandem_planner::profile::GOODPUT_ATTAINMENT,
        })
    }

    /// The control loop of `config` (from [`Self::config`]) over the
    /// routers `scraper` reads and `actuator`.
    pub fn control_loop(
        &self,
        config: PlannerConfig,
        scraper: Scraper,
        actuator: Arc<dyn Actuator>,
    ) -> Result<ControlLoop> {
        let decisions = match &self.planner_log {
            Some(path) => Some(Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .with_context(|| format!("opening {}", path.display()))?,
            ) as Box<dyn std::io::Write + Send>),
            None => None,
        };
        Ok(ControlLoop {
            planner: Planner::new(config),
            scraper,
            actuator,
            interval: Duration::from_secs_f64(self.planner_interval_s),
            decisions,
        })
    }
}

#[derive(Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    planning: PlanningArgs,
    /// A router replica's metrics URL (`http://HOST:PORT/metrics`; repeat
    /// for each replica).
    #[arg(long = "router-metrics", required = true)]
    router_metrics: Vec<String>,
    /// Scrape every address a `--router-metrics` host resolves to (a
    /// headless Service names each router replica).
    #[arg(long)]
    scrape_every_address: bool,
    /// The Kubernetes API, e.g. `http://127.0.0.1:8001` through `kubectl
    /// proxy`. Default: in the pod, the service account's.
    #[arg(long)]
    k8s_api: Option<String>,
    /// Namespace of the Deployments (default: the pod's).
    #[arg(long, env = "TANDEM_NAMESPACE")]
    namespace: Option<String>,
    #[arg(long, default_value = "prefill-worker")]
    prefill_deployment: String,
    #[arg(long, default_value = "decode-worker")]
    decode_deployment: String,
}

pub fn run(args: PlannerArgs) -> Result<()> {
    match args.command {
        PlannerCommand::Profile(a) => profile(&a),
        PlannerCommand::Run(a) => run_kubernetes(a),
    }
}

fn profile(args: &ProfileArgs) -> Result<()> {
    let read = |path: &PathBuf| -> Result<serde_json::Value> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))
    };
    let prefill = PoolCapacity::from_sweep(
        &read(&args.prefill_sweep)?,
        Role::Prefill,
        args.prefill_workers,
    )
    .with_context(|| format!("{}", args.prefill_sweep.display()))?;
    let decode = PoolCapacity::from_sweep(
        &read(&args.decode_sweep)?,
        Role::Decode,
        args.decode_workers,
    )
    .with_context(|| format!("{}", args.decode_sweep.display()))?;
    for (capacity, sweep) in [
        (&prefill, &args.prefill_sweep),
        (&decode, &args.decode_sweep),
    ] {
        if capacity.lower_bound {
            eprintln!(
                "warning: {}: the highest rate swept met the objectives, so the pool sustains at \
                 least {:.0} tokens/s, perhaps more: sweep higher rates to find its limit",
                sweep.display(),
                capacity.tokens_per_s
            );
        }
    }
    let profile = Profile::new(prefill, decode)?;
    std::fs::write(&args.out, serde_json::to_string_pretty(&profile)?)
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!(
        "profile {}: a prefill worker takes {:.0} prompt tokens/s within TTFT {:.0} ms; a decode \
         worker streams {:.0} tokens/s within TPOT {:.0} ms",
        args.out.display(),
        profile.prefill_tokens_per_s,
        profile.slo.ttft_s * 1e3,
        profile.decode_tokens_per_s,
        profile.slo.tpot_s * 1e3
    );
    Ok(())
}

fn run_kubernetes(args: RunArgs) -> Result<()> {
    use tandem_planner::kubernetes::{Kubernetes, KubernetesConfig, API_TIMEOUT};
    let config = args.planning.config()?;
    let k8s = match &args.k8s_api {
        Some(api) => Kubernetes::new(
            KubernetesConfig {
                api: api.clone(),
                namespace: args.namespace.clone().unwrap_or_else(|| "default".into()),
                prefill_deployment: args.prefill_deployment.clone(),
                decode_deployment: args.decode_deployment.clone(),
            },
            tandem_planner::http::HttpClient::plain(API_TIMEOUT),
        ),
        None => Kubernetes::in_cluster(
            args.namespace.clone(),
            args.prefill_deployment.clone(),
            args.decode_deployment.clone(),
        )?,
    };
    let mut scraper = Scraper::new(args.router_metrics.clone());
    if args.scrape_every_address {
        scraper = scraper.every_address();
    }
    let control = args.planning.control_loop(config, scraper, Arc::new(k8s))?;
    crate::engine_args::runtime()?.block_on(control.run(crate::engine_args::shutdown_signal()));
    Ok(())
}
