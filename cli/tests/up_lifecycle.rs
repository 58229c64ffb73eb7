//! How a `tandem up` cluster stops: Ctrl-C in a terminal (SIGINT to the
//! whole process group) lets the workers leave etcd before etcd stops, a
//! Ctrl-C while the cluster is still starting leaves nothing behind, and a
//! `tandem up` killed outright takes its etcd and workers with it.
//!
//! Needs etcd installed (`.ci/run` installs it), like the other cluster
//! tests: `up` only starts etcd when it finds it.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tandem_tests::cluster::Started;

/// A `tandem up` in a process group of its own, as a shell starts a
/// foreground job, with its stderr kept in a file.
struct Up {
    cluster: Started,
    etcd_pid: u32,
    worker_pid: u32,
    stderr: PathBuf,
    _dir: tempfile::TempDir,
}

/// `tandem up` on a tiny model, one decode worker, started but not yet
/// read from; its stderr goes to `dir/stderr.log`.
fn spawn_up(dir: &Path) -> (Child, Vec<String>) {
    let tandem = Path::new(env!("CARGO_BIN_EXE_tandem"));
    let model = dir.join("model");
    tandem_tests::cluster::gen_model(tandem, &model, "tiny");
    let args = [
        "up",
        "--model",
        model.to_str().expect("utf8"),
        "--prefill",
        "0",
        "--decode",
        "1",
        "--addr",
        "127.0.0.1:0",
        "--no-http",
        "--no-metrics",
        "--kv-cache-memory",
        "32MiB",
    ]
    .map(String::from)
    .to_vec();
    let child = Command::new(tandem)
        .args(&args)
        .env("RUST_LOG", "info")
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("stderr.log")).expect("stderr file"))
        .spawn()
        .expect("tandem up starts");
    (child, args)
}

fn start_up() -> Up {
    let dir = tempfile::tempdir().expect("tempdir");
    let (child, args) = spawn_up(dir.path());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let cluster = tandem_tests::cluster::started(child, &args);
    let etcd_pid = cluster
        .etcd_pid
        .expect("`tandem up` starts etcd when it is installed");
    let worker_pid = cluster.pids[&cluster.decode[0]];
    Up {
        cluster,
        etcd_pid,
        worker_pid,
        stderr: dir.path().join("stderr.log"),
        _dir: dir,
    }
}

/// Whether `pid` is a running process (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the parenthesised command name.
        let state = stat.rsplit(')').next().unwrap_or("").trim_start();
        !state.starts_with('Z') && !state.starts_with('X')
    })
}

fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn exited(child: &mut Child) -> bool {
    matches!(child.try_wait(), Ok(Some(_)))
}

#[test]
fn ctrl_c_lets_the_workers_leave_etcd_before_it_stops() {
    let mut up = start_up();
    let group = up.cluster.process.0.id();
    // What a terminal does on Ctrl-C: SIGINT to the foreground group.
    let sent = Command::new("kill")
        .args(["-INT", "--", &format!("-{group}")])
        .status()
        .expect("kill");
    assert!(sent.success());
    wait_for(
        "tandem up exits after Ctrl-C",
        Duration::from_secs(30),
        || exited(&mut up.cluster.process.0),
    );
    let status = up.cluster.process.0.wait().expect("exit status");
    let log = std::fs::read_to_string(&up.stderr).expect("stderr log");
    assert!(status.success(), "tandem up failed: {status}\n{log}");
    assert!(
        log.contains("deregistered from etcd"),
        "the worker did not leave etcd:\n{log}"
    );
    assert!(
        !log.contains("failed revoking"),
        "etcd stopped before the worker left it:\n{log}"
    );
    assert!(!alive(up.etcd_pid), "etcd outlived tandem up");
    assert!(!alive(up.worker_pid), "the worker outlived tandem up");
}

#[test]
fn a_killed_up_takes_its_etcd_and_workers_with_it() {
    let mut up = start_up();
    let up_pid = up.cluster.process.0.id();
    up.cluster.process.0.kill().expect("SIGKILL");
    let _ = up.cluster.process.0.wait();
    wait_for(
        "etcd stops after tandem up is killed",
        Duration::from_secs(10),
        || !alive(up.etcd_pid),
    );
    wait_for(
        "the worker stops after tandem up is killed",
        Duration::from_secs(15),
        || !alive(up.worker_pid),
    );
    // A killed `up` cannot remove etcd's data directory; the test does.
    let prefix = format!("tandem-up-etcd-{up_pid}-");
    for entry in std::fs::read_dir(std::env::temp_dir())
        .expect("temp dir")
        .flatten()
    {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// The pids of processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if String::from_utf8_lossy(&cmdline).contains(needle) && alive(pid) {
            found.push(pid);
        }
    }
    found
}

#[test]
fn ctrl_c_while_starting_leaves_no_process_behind() {
    // Ctrl-C at several points of the start: before etcd, while it or the
    // worker starts, and once the worker is loading the model.
    for delay_ms in [0u64, 150, 400, 900] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (child, _) = spawn_up(dir.path());
        let mut up = tandem_tests::cluster::KillOnDrop(child);
        let up_pid = up.0.id();
        std::thread::sleep(Duration::from_millis(delay_ms));
        let sent = Command::new("kill")
            .args(["-INT", "--", &format!("-{up_pid}")])
            .status()
            .expect("kill");
        assert!(sent.success());
        wait_for(
            "tandem up exits after Ctrl-C during its start",
            Duration::from_secs(30),
            || exited(&mut up.0),
        );
        // The worker's command line names the model directory, etcd's its
        // data directory; `up` stopped both before it exited.
        let model = dir.path().join("model").display().to_string();
        let etcd_dir = format!("tandem-up-etcd-{up_pid}-");
        let left: Vec<u32> = processes_mentioning(&model)
            .into_iter()
            .chain(processes_mentioning(&etcd_dir))
            .collect();
        let log = std::fs::read_to_string(dir.path().join("stderr.log")).unwrap_or_default();
        assert!(
            left.is_empty(),
            "Ctrl-C {delay_ms} ms into the start left {left:?} running\n{log}"
        );
    }
}
