//! `up`'s child processes: starting one and reading its address, and
//! stopping them all when `up` ends.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

use super::{stopping, StopFlag};

/// Children are stopped when `up` ends, however it ends: SIGTERM first
/// (they leave the membership, drain and flush their spans), SIGKILL for
/// any still running 5 s later. Shared with the planner's supervisor,
/// which adds and retires workers while the cluster runs.
#[derive(Default)]
pub(super) struct Children {
    list: Mutex<Vec<Child>>,
    /// Workers told to stop (scale-down): their exit is no news.
    retired: Mutex<Vec<u32>>,
}

impl Children {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Child>> {
        self.list.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, child: Child) {
        self.lock().push(child);
    }

    /// Sends `signal` (`TERM`, `USR1`) to a child.
    pub(super) fn signal(&self, pid: u32, signal: &str) -> Result<()> {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .context("running kill")?;
        match status.success() {
            true => Ok(()),
            false => bail!("kill -{signal} {pid} failed (the process is gone?)"),
        }
    }

    /// Marks a child whose exit is expected (it was told to stop).
    pub(super) fn retire(&self, pid: u32) {
        self.retired
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(pid);
    }

    /// Whether a child still runs.
    pub(super) fn alive(&self, pid: u32) -> bool {
        self.lock()
            .iter_mut()
            .any(|c| c.id() == pid && matches!(c.try_wait(), Ok(None)))
    }

    /// The children that have exited: pid, status, and whether the exit
    /// was expected.
    pub(super) fn exited(&self) -> Result<Vec<(u32, std::process::ExitStatus, bool)>> {
        let retired = self
            .retired
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut out = Vec::new();
        for c in self.lock().iter_mut() {
            if let Some(status) = c.try_wait()? {
                out.push((c.id(), status, retired.contains(&c.id())));
            }
        }
        Ok(out)
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        let list = self.list.get_mut().unwrap_or_else(|e| e.into_inner());
        for c in list.iter_mut() {
            if let Ok(None) = c.try_wait() {
                let _ = Command::new("kill")
                    .args(["-TERM", &c.id().to_string()])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < deadline
            && list.iter_mut().any(|c| matches!(c.try_wait(), Ok(None)))
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        for c in list.iter_mut() {
            let _ = c.kill();
        }
        for c in list.iter_mut() {
            let _ = c.wait();
        }
    }
}

/// A started child: the address it listens on, its pid, and its HTTP API
/// and metrics addresses if it serves them.
pub(super) struct Spawned {
    pub addr: String,
    pub pid: u32,
    pub http: Option<String>,
    pub metrics: Option<String>,
}

/// The environment of the etcd TLS and auth flags (`MembershipArgs`),
/// which `up` keeps from its children.
const ETCD_SECURITY_ENV: [&str; 6] = [
    "TANDEM_ETCD_CA",
    "TANDEM_ETCD_CERT",
    "TANDEM_ETCD_KEY",
    "TANDEM_ETCD_USER",
    "TANDEM_ETCD_PASSWORD",
    "TANDEM_ETCD_PASSWORD_FILE",
];

/// Starts `tandem <args>` and reads its startup lines up to
/// `listening on ADDR` (`http listening on ADDR` and `metrics listening on
/// ADDR` lines may come first).
///
/// The child gets its own process group: a Ctrl-C in the terminal reaches
/// `up` alone, which then stops the children itself ([`Children`]'s drop),
/// so none is killed by a SIGINT that comes before it has installed its
/// handler, and all stop before etcd does.
pub(super) fn spawn(
    children: &Children,
    stop: &StopFlag,
    args: &[String],
    env: &[(&str, String)],
) -> Result<Spawned> {
    use std::os::unix::process::CommandExt;
    tracing::info!("tandem up: starting {}", args[0]);
    let exe = std::env::current_exe().context("finding the tandem binary")?;
    let mut command = Command::new(exe);
    // `up`'s private etcd is plain HTTP without users: settings for an
    // external etcd exported in this shell would make every child refuse it.
    for var in ETCD_SECURITY_ENV {
        command.env_remove(var);
    }
    let mut child = command
        .process_group(0)
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .arg("--exit-on-stdin-eof")
        // A pipe nobody writes: it closes when `up` dies, however it dies,
        // and the child then exits too.
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        // Under a progress bar the children's log lines come through `up`,
        // which lifts the bar off for each; otherwise they go straight out.
        .stderr(match crate::progress::enabled() {
            true => Stdio::piped(),
            false => Stdio::inherit(),
        })
        .spawn()
        .with_context(|| format!("starting tandem {}", args.join(" ")))?;
    if let Some(stderr) = child.stderr.take() {
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                crate::progress::suspend(|| eprintln!("{line}"));
            }
        });
    }
    let spinner = crate::progress::spinner(&format!("starting {}", args[0]));
    let started = std::time::Instant::now();
    let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
    let pid = child.id();
    children.push(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        for line in lines.by_ref() {
            let last = line
                .as_ref()
                .map_or(true, |l| l.starts_with("listening on "));
            let _ = tx.send(line);
            if last {
                break;
            }
        }
        drop(tx);
        // Keep draining so the child never blocks on a full pipe.
        for _ in lines {}
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    let (mut http, mut metrics) = (None, None);
    loop {
        if stopping(stop) {
            bail!("stopped while tandem {} was starting", args[0]);
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let line = match rx.recv_timeout(left.min(Duration::from_millis(100))) {
            Ok(line) => line?,
            Err(mpsc::RecvTimeoutError::Timeout) if left.is_zero() => {
                bail!("tandem {} did not start", args[0])
            }
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                bail!("tandem {} exited before listening", args[0])
            }
        };
        if let Some(a) = line.strip_prefix("http listening on ") {
            http = Some(a.to_string());
        } else if let Some(a) = line.strip_prefix("metrics listening on ") {
            metrics = Some(a.to_string());
        } else if let Some(a) = line.strip_prefix("listening on ") {
            crate::progress::finish_with_line(&spinner, || {
                let took = started.elapsed().as_secs_f64();
                format!("{} ready on {a} ({took:.1} s)", args[0])
            });
            return Ok(Spawned {
                addr: a.to_string(),
                pid,
                http,
                metrics,
            });
        } else {
            bail!("tandem {} printed {line:?}", args[0]);
        }
    }
}
