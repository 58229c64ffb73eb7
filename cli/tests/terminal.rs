//! The person at the terminal, in a real one: tmux runs `tandem chat`
//! against a running `tandem up` (send-keys to type, capture-pane to read
//! the screen), and progress bars show on a terminal but not in a pipe.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use tandem_tests::cluster::Started;
use tandem_tests::prometheus::scrape;

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

/// A private tmux server (its own socket), killed when dropped.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn new(name: &str) -> Self {
        let socket = format!("tandem-{name}-{}", std::process::id());
        let t = Self { socket };
        // A leftover server of the same name would hold stale panes.
        let _ = t.run(&["kill-server"]);
        t
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .args(["-L", &self.socket])
            .args(args)
            .env("TERM", "xterm-256color")
            .stdin(Stdio::null())
            .output()
            .expect("tmux runs (the CI script installs it)")
    }

    /// Starts `command` in a detached 200x50 pane (kept open after it ends).
    fn start(&self, command: &str) {
        let out = self.run(&[
            "new-session",
            "-d",
            "-s",
            "main",
            "-x",
            "200",
            "-y",
            "50",
            &format!("{command}; sleep 600"),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Types `line` and Enter once the prompt is back (rustyline drops
    /// what is typed before it takes the terminal).
    fn line(&self, line: &str) {
        let prompts = |s: &str| s.lines().filter(|l| l.starts_with(">>>")).count();
        let before = prompts(&self.wait_for("prompt", at_prompt));
        self.keys(&[line, "Enter"]);
        // Taken: the line is echoed (the prompt is no longer empty) or
        // already answered (a new prompt below it).
        self.wait_for(line, |s| !at_prompt(s) || prompts(s) > before);
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "main"];
        args.extend_from_slice(keys);
        let out = self.run(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The pane's text, scrollback included.
    fn screen(&self) -> String {
        let out = self.run(&["capture-pane", "-p", "-J", "-S", "-2000", "-t", "main"]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits (bounded) until `done` holds for the screen; returns it.
    fn wait_for(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let screen = self.screen();
            if done(&screen) {
                return screen;
            }
            assert!(Instant::now() < deadline, "no {what} on screen:\n{screen}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}

/// A cache directory of the test's own, for the built-in model.
fn cache() -> tempfile::TempDir {
    tempfile::tempdir().expect("tmp")
}

/// Whether the screen ends at an empty prompt.
fn at_prompt(screen: &str) -> bool {
    screen
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(str::trim_end)
        == Some(">>>")
}

/// `prompt N tokens` of each stats line, in order.
fn prompt_tokens(screen: &str) -> Vec<u64> {
    screen
        .lines()
        .filter_map(|l| {
            l.split_once(" tokens, prompt ")?
                .1
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

fn metric(addr: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape(addr).value(name, labels).unwrap_or(0.0)
}

/// A question gets a streamed answer; Ctrl-C mid-answer cancels it (the
/// decode worker counts a cancelled request and holds no KV block) and the
/// prompt comes back; `/reset` clears the history.
#[test]
fn chat_in_a_terminal_against_a_running_cluster() {
    let cache = cache();
    let cache_dir = cache.path().to_str().expect("utf8");
    let cluster: Started = {
        let child = Command::new(tandem())
            .args(["up", "--addr", "127.0.0.1:0", "--no-http", "--prefill", "0"])
            .args(["--kv-cache-memory", "64MiB"])
            .env("TANDEM_CACHE_DIR", cache_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("up starts");
        tandem_tests::cluster::started(child, &["up"])
    };
    let decode = cluster.decode[0].clone();
    let metrics = cluster
        .metrics_addr("decode-worker", &decode)
        .expect("the decode worker's metrics")
        .to_string();
    let tmux = Tmux::new("chat");
    tmux.start(&format!(
        "TANDEM_CACHE_DIR={cache_dir} {} chat --router {} --temperature 0 --max-tokens 16 --no-history-file",
        tandem().display(),
        cluster.addr
    ));
    tmux.wait_for("prompt", at_prompt);

    // A question, answered: text after it, then the stats line.
    tmux.line("Who art thou?");
    let screen = tmux.wait_for("answer", |s| prompt_tokens(s).len() == 1);
    let answer: String = screen
        .lines()
        .skip_while(|l| !l.contains("Who art thou?"))
        .skip(1)
        .take_while(|l| !l.contains(" tokens, prompt "))
        .collect();
    assert!(!answer.trim().is_empty(), "an answer:\n{screen}");
    let first_prompt = prompt_tokens(&screen)[0];

    // A long answer, cancelled once it is streaming.
    tmux.line("/max-tokens 900");
    tmux.line("Speak on, good sir.");
    let running = Instant::now() + Duration::from_secs(30);
    while metric(&metrics, "tandem_num_requests_running", &[]) < 1.0 {
        assert!(
            Instant::now() < running,
            "the answer never ran:\n{}",
            tmux.screen()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = tmux.wait_for("streamed text", |s| {
        s.lines()
            .skip_while(|l| !l.contains("Speak on, good sir."))
            .nth(1)
            .is_some_and(|l| !l.trim().is_empty())
    });
    assert_eq!(
        prompt_tokens(&before).len(),
        1,
        "still answering:\n{before}"
    );
    tmux.keys(&["C-c"]);
    let screen = tmux.wait_for("cancel and a new prompt", |s| {
        s.contains("(cancelled)") && at_prompt(s)
    });
    assert_eq!(
        prompt_tokens(&screen).len(),
        1,
        "no stats for a cancelled answer:\n{screen}"
    );
    // The worker saw the client leave and gave its blocks back.
    let freed = Instant::now() + Duration::from_secs(20);
    loop {
        let cancelled = metric(
            &metrics,
            "tandem_requests_total",
            &[("outcome", "cancelled")],
        );
        let used = metric(&metrics, "tandem_kv_cache_blocks", &[("state", "used")]);
        let running = metric(&metrics, "tandem_num_requests_running", &[]);
        if cancelled == 1.0 && used == 0.0 && running == 0.0 {
            break;
        }
        assert!(
            Instant::now() < freed,
            "cancelled {cancelled}, used blocks {used}, running {running}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // A second question carries the history; after /reset it does not.
    tmux.line("/max-tokens 4");
    tmux.line("Who art thou?");
    tmux.wait_for("second answer", |s| prompt_tokens(s).len() == 2);
    tmux.line("/reset");
    tmux.wait_for("reset", |s| s.contains("(history cleared)"));
    tmux.line("Who art thou?");
    let screen = tmux.wait_for("answer after reset", |s| prompt_tokens(s).len() == 3);
    let prompts = prompt_tokens(&screen);
    assert!(prompts[1] > first_prompt, "history sent: {prompts:?}");
    assert_eq!(prompts[2], first_prompt, "history cleared: {prompts:?}");
    tmux.line("/bye");
}

/// `serve --quantize int4` loads and quantizes under progress bars on a
/// terminal, whose lines stay on screen below the log lines that follow; not
/// with `--log-format json`; and writes no bar (no carriage returns, no
/// escape sequences) into a pipe.
#[test]
fn progress_on_a_terminal_and_not_in_a_pipe() {
    let cache = cache();
    let cache_dir = cache.path().to_str().expect("utf8");
    let serve = format!(
        "TANDEM_CACHE_DIR={cache_dir} {} serve --addr 127.0.0.1:0 --quantize int4",
        tandem().display()
    );
    let listening = |s: &str| s.matches("listening on").count();
    let tmux = Tmux::new("progress");
    tmux.start(&format!(
        "{serve}; echo text-done; {serve} --log-format json; echo json-done"
    ));
    tmux.wait_for("the server", |s| listening(s) == 1);
    tmux.keys(&["C-c"]);
    tmux.wait_for("the second server", |s| listening(s) == 2);
    tmux.keys(&["C-c"]);
    let screen = tmux.wait_for("the end", |s| s.contains("json-done"));
    let (text, json) = screen.split_once("text-done").expect("in order");
    for line in ["loading layers 6/6", "quantizing to INT4 7/7"] {
        assert!(text.contains(line), "{line:?} on the terminal:\n{screen}");
    }
    assert!(
        text.contains("model loaded"),
        "logs after the bars:\n{screen}"
    );
    assert!(
        !json.contains("loading layers"),
        "no bar among JSON logs:\n{screen}"
    );

    let mut child = Command::new(tandem())
        .args(["serve", "--addr", "127.0.0.1:0", "--quantize", "int4"])
        .env("TANDEM_CACHE_DIR", cache_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("serve runs");
    let stdout = child.stdout.take().expect("stdout");
    let up = std::io::BufRead::lines(std::io::BufReader::new(stdout))
        .map_while(Result::ok)
        .any(|l| l.starts_with("listening on"));
    let _ = child.kill();
    let piped = child.wait_with_output().expect("serve ends");
    let stderr = String::from_utf8_lossy(&piped.stderr);
    assert!(up, "serve listened:\n{stderr}");
    assert!(stderr.contains("model loaded"), "{stderr}");
    assert!(
        !stderr.contains("loading layers"),
        "no bar in a pipe:\n{stderr}"
    );
    assert!(
        !stderr.contains('\r') && !stderr.contains('\u{1b}'),
        "{stderr:?}"
    );
}
