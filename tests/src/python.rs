//! A Python gRPC client of `tandem.v1`, for end-to-end tests of `tandem serve`.
//!
//! The acceptance tests talk to the server the way a user would: with stubs
//! generated from `proto/proto/tandem/v1/generate.proto` by grpcio-tools, plus
//! the stock gRPC health and reflection clients. [`grpc_python`] makes that
//! environment once and returns a [`GrpcPython`] that runs
//! `tests/python/client.py` and parses its JSON lines.
//!
//! # The environment
//!
//! A venv lives under the cargo target directory, at
//! `<target>/py-grpc-venv-<key>`, where `<key>` hashes the pinned packages
//! ([`REQUIREMENTS`]) and the interpreter, so changing a pin builds a fresh
//! venv instead of reusing a stale one. Building means `python3 -m venv`,
//! `pip install` of the pins, and writing the [`COMPLETE_MARKER`] file last.
//! All of that happens in a private `*.partial-<pid>-<n>` directory which is
//! renamed into place only when complete, so a half-built venv (pip failed,
//! the test was killed) is never mistaken for a complete one, and concurrent
//! test processes never see each other's work in progress: when two build at
//! once, the first rename wins and the loser deletes its copy. Within one
//! process a mutex makes the work happen once.
//!
//! The Python stubs are regenerated into `<venv>/stubs-<hash of the .proto>`
//! (also built aside and renamed), so editing the `.proto` never leaves stale
//! stubs behind. The venv is not relocated after its rename: only
//! `bin/python` is used (never the `pip` script, whose shebang names the
//! partial path), and Python finds its venv from `pyvenv.cfg` next to it.
//!
//! # Where things come from
//!
//! * the target directory: `$CARGO_TARGET_DIR`, else the directory above the
//!   running test binary's `deps/`, else `<workspace>/target`;
//! * the interpreter: `$TANDEM_PYTHON`, else `python3` (3.9 or newer, with
//!   the `venv` module; on Debian that is the `python3-venv` package);
//! * the packages: PyPI, so building the venv needs network access once.

use std::ffi::OsStr;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The pinned Python packages of the client venv.
pub const REQUIREMENTS: &[&str] = &[
    "grpcio==1.85.1",
    "grpcio-tools==1.85.1",
    "grpcio-health-checking==1.85.1",
    "grpcio-reflection==1.85.1",
    "protobuf==7.36.2",
    // The official OpenAI SDK, for the HTTP API's tests.
    "openai==3.57.0",
    // The official Anthropic SDK (the Messages API) and a JSON-schema
    // validator for tool-call arguments, for the agent API's tests.
    "anthropic==2.17.0",
    "jsonschema==4.26.0",
];

/// Written last into a venv; its presence means the venv is complete.
pub const COMPLETE_MARKER: &str = "tandem-complete";

/// The `.proto` files the stubs are generated from, relative to
/// [`proto_include_dir`].
pub const PROTO_FILES: &[&str] = &["tandem/v1/generate.proto"];

/// How long [`GrpcPython::run_client`] waits by default.
pub const DEFAULT_CLIENT_TIMEOUT: Duration = Duration::from_secs(120);

/// Why the Python environment could not be made or a script failed.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A filesystem operation failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// A program could not be started at all.
    #[error("could not run {program}: {source} (is it installed and on PATH?)")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    /// A setup step (venv, pip, protoc) exited unsuccessfully.
    #[error("{step} failed ({status}); its output:\n{output}")]
    SetupStep {
        step: String,
        status: ExitStatus,
        output: String,
    },
    /// A script exited unsuccessfully.
    #[error("{script} {args} exited with {status}\nstderr:\n{stderr}\nstdout:\n{stdout}")]
    ScriptFailed {
        script: String,
        args: String,
        status: ExitStatus,
        stdout: String,
        stderr: String,
    },
    /// A script ran past its deadline and was killed.
    #[error("{script} {args} did not finish within {timeout:?} and was killed\nstderr:\n{stderr}\nstdout:\n{stdout}")]
    Timeout {
        script: String,
        args: String,
        timeout: Duration,
        stdout: String,
        stderr: String,
    },
    /// A line of a script's stdout was not a JSON value.
    #[error("line {line_no} of {script}'s stdout is not JSON ({source}): {line}")]
    BadJson {
        script: String,
        line_no: usize,
        line: String,
        source: serde_json::Error,
    },
}

/// A ready Python environment with grpcio and the `tandem.v1` stubs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcPython {
    /// The venv's root directory.
    pub venv: PathBuf,
    /// The venv's interpreter (`<venv>/bin/python`).
    pub python: PathBuf,
    /// The directory to put on `PYTHONPATH`: it holds the `tandem.v1`
    /// package (`tandem/v1/generate_pb2.py`, `generate_pb2_grpc.py`).
    pub stubs: PathBuf,
    /// `tests/python/`, where `client.py` lives.
    pub scripts: PathBuf,
}

impl GrpcPython {
    /// `tests/python/client.py`.
    pub fn client_script(&self) -> PathBuf {
        self.scripts.join("client.py")
    }

    /// A command running the venv's interpreter with the stubs importable
    /// (`PYTHONPATH`), unbuffered output, and no user site-packages. Add the
    /// script and its arguments.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.python);
        cmd.env("PYTHONPATH", &self.stubs)
            .env("PYTHONUNBUFFERED", "1")
            .env("PYTHONNOUSERSITE", "1")
            .env_remove("PYTHONHOME");
        cmd
    }

    /// Runs `tests/python/client.py` with `args` (for example
    /// `["health", "--addr", "127.0.0.1:50051"]`) and returns its stdout, one
    /// JSON value per non-empty line. Fails with the script's stderr when it
    /// exits non-zero or outlives [`DEFAULT_CLIENT_TIMEOUT`].
    pub fn run_client<I, S>(&self, args: I) -> Result<Vec<serde_json::Value>, HarnessError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.run_script_json(&self.client_script(), args, DEFAULT_CLIENT_TIMEOUT)
    }

    /// Runs `script` with the venv's interpreter and parses its stdout as
    /// JSON lines; kills it after `timeout`.
    pub fn run_script_json<I, S>(
        &self,
        script: &Path,
        args: I,
        timeout: Duration,
    ) -> Result<Vec<serde_json::Value>, HarnessError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let args: Vec<_> = args
            .into_iter()
            .map(|a| a.as_ref().to_os_string())
            .collect();
        let shown_args = args
            .iter()
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ");
        let script_name = script.display().to_string();
        let mut cmd = self.command();
        cmd.arg(script).args(&args);
        let out = run_with_timeout(cmd, &script_name, timeout)?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        match out.status {
            None => Err(HarnessError::Timeout {
                script: script_name,
                args: shown_args,
                timeout,
                stdout,
                stderr,
            }),
            Some(status) if !status.success() => Err(HarnessError::ScriptFailed {
                script: script_name,
                args: shown_args,
                status,
                stdout,
                stderr,
            }),
            Some(_) => parse_json_lines(&script_name, &stdout),
        }
    }
}

/// Parses one JSON value per non-empty line.
pub fn parse_json_lines(
    script: &str,
    stdout: &str,
) -> Result<Vec<serde_json::Value>, HarnessError> {
    stdout
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            serde_json::from_str(line).map_err(|source| HarnessError::BadJson {
                script: script.to_string(),
                line_no: i + 1,
                line: line.to_string(),
                source,
            })
        })
        .collect()
}

/// Returns the Python environment, building the venv and the stubs on first
/// use (see the module doc). Safe to call from many tests and processes.
pub fn grpc_python() -> Result<GrpcPython, HarnessError> {
    static READY: Mutex<Option<GrpcPython>> = Mutex::new(None);
    // A panic while holding the lock leaves nothing half-done behind (all work
    // happens aside and is renamed), so a poisoned lock is still usable.
    let mut ready = READY.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(env) = ready.as_ref() {
        return Ok(env.clone());
    }
    let env = build(&target_dir())?;
    *ready = Some(env.clone());
    Ok(env)
}

/// The directory holding the `.proto` tree (`proto/proto/`).
pub fn proto_include_dir() -> PathBuf {
    workspace_dir().join("proto").join("proto")
}

fn workspace_dir() -> PathBuf {
    // This crate lives at `<workspace>/tests`.
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("python")
}

/// The cargo target directory this test build uses.
pub fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        let dir = PathBuf::from(dir);
        return if dir.is_absolute() {
            dir
        } else {
            workspace_dir().join(dir)
        };
    }
    // Test binaries run from `<target>/[<triple>/]<profile>/deps/`; the
    // profile directory is the one holding `deps`, and its parent (or the
    // triple's parent) holds `CACHEDIR.TAG`.
    if let Ok(exe) = std::env::current_exe() {
        if let Some(found) = exe
            .ancestors()
            .skip(1)
            .find(|d| d.join("CACHEDIR.TAG").is_file())
        {
            return found.to_path_buf();
        }
    }
    workspace_dir().join("target")
}

fn python_program() -> String {
    std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// FNV-1a, 64-bit: a hash that stays the same across Rust versions, for
/// cache keys in directory names.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.iter().chain(&[0xff]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

fn build(target: &Path) -> Result<GrpcPython, HarnessError> {
    let python = python_program();
    let version = run_step(
        "python --version",
        Command::new(&python).args(["-c", "import sys; print(sys.version)"]),
    )?;
    let mut key_parts: Vec<&[u8]> = REQUIREMENTS.iter().map(|r| r.as_bytes()).collect();
    key_parts.push(python.as_bytes());
    key_parts.push(version.as_bytes());
    let venv = target.join(format!("py-grpc-venv-{:016x}", fnv1a(&key_parts)));
    if !venv.join(COMPLETE_MARKER).is_file() {
        make_venv(&python, &venv)?;
    }
    let venv_python = venv.join("bin").join("python");
    let stubs = make_stubs(&venv, &venv_python)?;
    Ok(GrpcPython {
        venv,
        python: venv_python,
        stubs,
        scripts: scripts_dir(),
    })
}

/// A fresh sibling path of `dir` that no other process or thread uses.
fn partial_path(dir: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut name = dir.file_name().unwrap_or(dir.as_os_str()).to_os_string();
    name.push(format!(".partial-{}-{n}", std::process::id()));
    dir.with_file_name(name)
}

/// Renames the finished `partial` onto `dir`. If another process installed
/// `dir` first (and it passes `complete`), ours is discarded and theirs used.
/// An incomplete `dir` (left by an older harness) is replaced.
fn install(
    partial: &Path,
    dir: &Path,
    complete: impl Fn(&Path) -> bool,
) -> Result<(), HarnessError> {
    if std::fs::rename(partial, dir).is_ok() {
        return Ok(());
    }
    if !complete(dir) {
        let _ = std::fs::remove_dir_all(dir);
        if std::fs::rename(partial, dir).is_ok() {
            return Ok(());
        }
    }
    let _ = std::fs::remove_dir_all(partial);
    if complete(dir) {
        Ok(())
    } else {
        Err(HarnessError::Io {
            what: "installing",
            path: dir.to_path_buf(),
            source: std::io::Error::other("could not rename the built directory into place"),
        })
    }
}

fn make_venv(python: &str, venv: &Path) -> Result<(), HarnessError> {
    let parent = venv.parent().unwrap_or(venv);
    std::fs::create_dir_all(parent).map_err(|source| HarnessError::Io {
        what: "creating",
        path: parent.to_path_buf(),
        source,
    })?;
    let partial = partial_path(venv);
    let result = (|| {
        run_step(
            "python3 -m venv",
            Command::new(python).arg("-m").arg("venv").arg(&partial),
        )?;
        let pip = partial.join("bin").join("python");
        run_step(
            "pip install",
            Command::new(&pip)
                .args(["-m", "pip", "install", "--quiet", "--no-input"])
                .args(["--disable-pip-version-check", "--timeout", "60"])
                .args(REQUIREMENTS),
        )?;
        let marker = partial.join(COMPLETE_MARKER);
        std::fs::write(&marker, REQUIREMENTS.join("\n") + "\n").map_err(|source| HarnessError::Io {
            what: "writing",
            path: marker,
            source,
        })
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(e);
    }
    install(&partial, venv, |d| d.join(COMPLETE_MARKER).is_file())
}

fn make_stubs(venv: &Path, python: &Path) -> Result<PathBuf, HarnessError> {
    let include = proto_include_dir();
    let mut sources = Vec::new();
    for file in PROTO_FILES {
        let path = include.join(file);
        let bytes = std::fs::read(&path).map_err(|source| HarnessError::Io {
            what: "reading",
            path: path.clone(),
            source,
        })?;
        sources.push(bytes);
    }
    let mut key_parts: Vec<&[u8]> = PROTO_FILES.iter().map(|f| f.as_bytes()).collect();
    key_parts.extend(sources.iter().map(Vec::as_slice));
    let stubs = venv.join(format!("stubs-{:016x}", fnv1a(&key_parts)));
    let is_complete = |d: &Path| d.join(COMPLETE_MARKER).is_file();
    if is_complete(&stubs) {
        return Ok(stubs);
    }
    let partial = partial_path(&stubs);
    let result = (|| {
        std::fs::create_dir_all(&partial).map_err(|source| HarnessError::Io {
            what: "creating",
            path: partial.clone(),
            source,
        })?;
        let mut cmd = Command::new(python);
        cmd.args(["-m", "grpc_tools.protoc"])
            .arg(format!("-I{}", include.display()))
            .arg(format!("--python_out={}", partial.display()))
            .arg(format!("--pyi_out={}", partial.display()))
            .arg(format!("--grpc_python_out={}", partial.display()))
            .args(PROTO_FILES);
        run_step("grpc_tools.protoc", &mut cmd)?;
        let marker = partial.join(COMPLETE_MARKER);
        std::fs::write(&marker, b"").map_err(|source| HarnessError::Io {
            what: "writing",
            path: marker,
            source,
        })
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(e);
    }
    install(&partial, &stubs, is_complete)?;
    Ok(stubs)
}

/// Runs a setup step to completion; returns its stdout, or an error with all
/// of its output.
fn run_step(step: &str, cmd: &mut Command) -> Result<String, HarnessError> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|source| HarnessError::Spawn {
            program: cmd.get_program().to_string_lossy().into_owned(),
            source,
        })?;
    if !out.status.success() {
        return Err(HarnessError::SetupStep {
            step: step.to_string(),
            status: out.status,
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

struct TimedOutput {
    /// `None` when the process was killed at the deadline.
    status: Option<ExitStatus>,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

/// Runs `cmd` with piped output, killing it after `timeout`. Both pipes are
/// drained on threads so a chatty child cannot block on a full pipe.
fn run_with_timeout(
    mut cmd: Command,
    program: &str,
    timeout: Duration,
) -> Result<TimedOutput, HarnessError> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| HarnessError::Spawn {
            program: program.to_string(),
            source,
        })?;
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let status = wait_deadline(&mut child, timeout).map_err(|source| HarnessError::Io {
        what: "waiting for",
        path: PathBuf::from(program),
        source,
    })?;
    Ok(TimedOutput {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut buf);
        }
        buf
    })
}

/// Waits for `child` until `timeout`; kills and reaps it past the deadline
/// and returns `None`.
fn wait_deadline(child: &mut Child, timeout: Duration) -> std::io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            child.wait()?;
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_lines_skip_blanks_and_report_bad_lines() {
        let values = parse_json_lines("x", "{\"a\":1}\n\n[2]\n").expect("valid lines");
        assert_eq!(
            values,
            vec![serde_json::json!({"a": 1}), serde_json::json!([2])]
        );
        let err = parse_json_lines("x", "{\"a\":1}\nnot json\n").expect_err("bad line");
        assert!(
            matches!(err, HarnessError::BadJson { line_no: 2, .. }),
            "{err}"
        );
    }

    #[test]
    fn cache_keys_are_stable_and_separate_parts() {
        assert_eq!(fnv1a(&[b"ab"]), fnv1a(&[b"ab"]));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }

    #[test]
    fn the_target_dir_holds_this_test_binary() {
        let target = target_dir();
        let exe = std::env::current_exe().expect("current exe");
        assert!(
            std::env::var_os("CARGO_TARGET_DIR").is_some() || exe.starts_with(&target),
            "{} is not under {}",
            exe.display(),
            target.display()
        );
    }

    #[test]
    fn install_discards_the_loser_of_a_race() {
        let dir = tempfile::tempdir().expect("tempdir");
        let done = |d: &Path| d.join("ok").is_file();
        let target = dir.path().join("env");
        for _ in 0..2 {
            let partial = partial_path(&target);
            std::fs::create_dir_all(&partial).expect("mkdir");
            std::fs::write(partial.join("ok"), b"").expect("write");
            std::fs::write(partial.join("other"), b"").expect("write");
            install(&partial, &target, done).expect("install");
            assert!(!partial.exists(), "the partial directory is cleaned up");
        }
        assert!(done(&target));
        let leftover = dir.path().join("stale");
        std::fs::create_dir_all(leftover.join("junk")).expect("mkdir");
        let partial = partial_path(&leftover);
        std::fs::create_dir_all(&partial).expect("mkdir");
        std::fs::write(partial.join("ok"), b"").expect("write");
        install(&partial, &leftover, done).expect("replaces an incomplete dir");
        assert!(done(&leftover) && !leftover.join("junk").exists());
    }
}
