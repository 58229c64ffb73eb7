//! tandem's SLA planner: it sizes the prefill and decode pools so that the
//! next interval's load meets the TTFT and TPOT objectives with the fewest
//! workers, and moves the cluster there while it serves.
//!
//! The pieces, in the order one interval uses them:
//!
//! * [`prom`] and [`observe`]: the routers' `/metrics` (Prometheus text),
//!   summed over replicas; two scrapes make an [`observe::Interval`] —
//!   prompt and generated tokens per second, and the share of first tokens
//!   and of requests within each objective.
//! * [`predict`]: the next interval's load (the last value, or a line
//!   through the last few).
//! * [`profile`]: what one worker of each pool sustains within the
//!   objectives, from `tandem bench sweep` runs.
//! * [`sizing`]: load over capacity per pool, corrected by the attainment
//!   actually observed, with hysteresis on the way down and role switches
//!   preferred to starts when only the mix is wrong.
//! * [`actuator`]: the trait that carries decisions out — the local
//!   supervisor of `tandem up --planner` (in tandem-cli, it starts, stops and
//!   switches worker processes) and [`kubernetes`] (the Deployments' scale
//!   subresource).
//! * [`control`]: the loop that ties them together.

pub mod actuator;
pub mod control;
pub mod http;
pub mod kubernetes;
pub mod observe;
pub mod predict;
pub mod profile;
pub mod prom;
pub mod sizing;

pub use actuator::{Actuator, ActuatorError};
pub use control::{ControlLoop, Scraper};
pub use observe::{Interval, Slo, Snapshot};
pub use predict::Predictor;
pub use profile::Profile;
pub use sizing::{Action, Decision, Limits, Planner, PlannerConfig, Sizes};
