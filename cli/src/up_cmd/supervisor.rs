//! `tandem up --planner`: the planner runs in a thread of `up`, and `up`
//! itself is its actuator. Workers are `tandem worker --role ROLE`
//! processes (they register in `up`'s etcd, so the router follows them):
//! growing a pool starts one, shrinking it sends the newest SIGTERM (it
//! leaves etcd and drains: a decode worker hands its requests over), and a
//! switch sends one SIGUSR1 (it drains, then joins the other pool with its
//! model still loaded; `tandem worker`'s docs).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tandem_discovery::Role;
use tandem_planner::{Actuator, ActuatorError, Sizes};

use super::process::{spawn, Children};
use super::StopFlag;

/// A worker the supervisor started or adopted.
#[derive(Debug, Clone)]
struct Managed {
    pid: u32,
    role: Role,
    /// Not picked again for a switch or a stop before this (it is
    /// draining its last role's work).
    busy_until: Instant,
}

/// How long a switched worker is left alone.
const SWITCH_SETTLE: Duration = Duration::from_secs(30);

/// Starts, stops and switches `up`'s workers.
pub(super) struct Supervisor {
    pub children: Arc<Children>,
    pub stop: StopFlag,
    pub env: Vec<(&'static str, String)>,
    /// `tandem worker --role ROLE ...` for each pool (prefill, decode).
    pub commands: [Vec<String>; 2],
    workers: Mutex<Vec<Managed>>,
    switchable: bool,
}

impl Supervisor {
    /// `started`: the workers `up` started, as (pid, role).
    pub fn new(
        children: Arc<Children>,
        stop: StopFlag,
        env: Vec<(&'static str, String)>,
        commands: [Vec<String>; 2],
        started: &[(u32, Role)],
        switchable: bool,
    ) -> Self {
        let now = Instant::now();
        Self {
            children,
            stop,
            env,
            commands,
            workers: Mutex::new(
                started
                    .iter()
                    .map(|&(pid, role)| Managed {
                        pid,
                        role,
                        busy_until: now,
                    })
                    .collect(),
            ),
            switchable,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Managed>> {
        self.workers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The newest live worker of `role`, preferring one that is not busy.
    fn pick(&self, role: Role) -> Option<u32> {
        let now = Instant::now();
        let workers = self.lock();
        let of_role = || workers.iter().rev().filter(|w| w.role == role);
        of_role()
            .find(|w| w.busy_until <= now)
            .or_else(|| of_role().next())
            .map(|w| w.pid)
    }

    fn start(&self, role: Role) -> Result<(), ActuatorError> {
        let command = &self.commands[match role {
            Role::Prefill => 0,
            Role::Decode => 1,
        }];
        // `spawn` blocks until the worker listens: this thread is the
        // planner's own, which has nothing else to do meanwhile.
        let started = spawn(&self.children, &self.stop, command, &self.env)
            .map_err(|e| ActuatorError::Failed(format!("starting a {role} worker: {e:#}")))?;
        eprintln!(
            "planner: started a {role} worker on {} (pid {}{})",
            started.addr,
            started.pid,
            started
                .metrics
                .map(|m| format!(", metrics {m}"))
                .unwrap_or_default()
        );
        self.lock().push(Managed {
            pid: started.pid,
            role,
            busy_until: Instant::now(),
        });
        Ok(())
    }

    fn stop_one(&self, role: Role) -> Result<(), ActuatorError> {
        let pid = self
            .pick(role)
            .ok_or_else(|| ActuatorError::Failed(format!("no {role} worker to stop")))?;
        self.children.retire(pid);
        self.children
            .signal(pid, "TERM")
            .map_err(|e| ActuatorError::Failed(format!("{e:#}")))?;
        self.lock().retain(|w| w.pid != pid);
        eprintln!("planner: stopping {role} worker pid {pid} (it drains first)");
        Ok(())
    }
}

#[async_trait]
impl Actuator for Supervisor {
    async fn sizes(&self) -> Result<Sizes, ActuatorError> {
        let children = self.children.clone();
        self.lock().retain(|w| children.alive(w.pid));
        let workers = self.lock();
        let count = |role: Role| workers.iter().filter(|w| w.role == role).count();
        Ok(Sizes {
            prefill: count(Role::Prefill),
            decode: count(Role::Decode),
        })
    }

    async fn scale(&self, role: Role, workers: usize) -> Result<(), ActuatorError> {
        let have = self.lock().iter().filter(|w| w.role == role).count();
        for _ in have..workers {
            self.start(role)?;
        }
        for _ in workers..have {
            self.stop_one(role)?;
        }
        Ok(())
    }

    async fn switch(&self, to: Role) -> Result<(), ActuatorError> {
        let from = to.other();
        let pid = self
            .pick(from)
            .ok_or_else(|| ActuatorError::Failed(format!("no {from} worker to switch")))?;
        self.children
            .signal(pid, "USR1")
            .map_err(|e| ActuatorError::Failed(format!("{e:#}")))?;
        if let Some(w) = self.lock().iter_mut().find(|w| w.pid == pid) {
            w.role = to;
            w.busy_until = Instant::now() + SWITCH_SETTLE;
        }
        eprintln!("planner: switching worker pid {pid} from {from} to {to}");
        Ok(())
    }

    fn can_switch(&self) -> bool {
        self.switchable
    }
}

/// The planner's thread: stopped and joined when dropped, before `up`'s
/// children are (it holds them too).
pub(super) struct PlannerThread {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for PlannerThread {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Checks `up --planner`'s flags before anything starts: the planner's
/// configuration, its profile read (`None` without `--planner`).
pub(super) fn check(args: &super::UpArgs) -> anyhow::Result<Option<tandem_planner::PlannerConfig>> {
    if !args.planner {
        return Ok(None);
    }
    if args.no_etcd || args.no_metrics {
        anyhow::bail!(
            "--planner needs etcd (workers come and go) and metrics (the router's are its input): \
             drop --no-etcd / --no-metrics"
        );
    }
    args.planning.config().map(Some)
}

/// Starts the planner over the router's metrics (`router_metrics`,
/// `HOST:PORT`) with `supervisor` as its hands.
pub(super) fn start(
    planning: &crate::planner_cmd::PlanningArgs,
    config: tandem_planner::PlannerConfig,
    router_metrics: &str,
    supervisor: Supervisor,
) -> anyhow::Result<PlannerThread> {
    let scraper = tandem_planner::Scraper::new(vec![format!("http://{router_metrics}/metrics")]);
    let control = planning.control_loop(config, scraper, Arc::new(supervisor))?;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = stop.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let thread = std::thread::Builder::new()
        .name("planner".into())
        .spawn(move || {
            rt.block_on(control.run(async move {
                while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }));
        })?;
    eprintln!(
        "planner: sizing the pools every {} s",
        planning.planner_interval_s
    );
    Ok(PlannerThread {
        stop,
        thread: Some(thread),
    })
}
