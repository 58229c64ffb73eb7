//! `tandem chat`: talk to a model from the terminal, the way `ollama run`
//! and `llama-cli` allow.
//!
//! One loop reads a line (rustyline: editing, and history kept in the
//! cache directory), sends the whole conversation through the model's chat
//! template and streams the answer as it comes. The conversation goes to
//! one of three [`backend::Backend`]s: a router or `tandem serve` over gRPC
//! (`--router`; the template is rendered and tokenized here, from
//! `--model`'s files), an OpenAI-compatible HTTP server (`--http`; the
//! server renders), or a model loaded in this process (`--model`, the
//! default).
//!
//! Ctrl-C during an answer cancels it: the answer's future is dropped,
//! which closes the gRPC stream or the HTTP connection (the server aborts
//! the request and frees its KV blocks) or raises the in-process
//! generation's stop flag; the prompt comes back and the cancelled turn is
//! left out of the history. Ctrl-C at the prompt clears the line; Ctrl-D
//! or `/bye` leaves. Commands: `/system`, `/reset`, `/temperature`,
//! `/max-tokens`, `/help`.

mod backend;
mod http;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use rustyline::error::ReadlineError;
use tandem_openai::chat::Message;

pub use backend::Backend;

#[derive(Args, Debug)]
pub struct ChatArgs {
    /// Talk to a running router or `tandem serve` over gRPC (`host:port`).
    /// The chat template and tokenizer come from --model (default: the
    /// built-in model).
    #[arg(long, conflicts_with = "http")]
    pub router: Option<String>,
    /// Talk to an OpenAI-compatible HTTP API (`http://host:port`, e.g. the
    /// router's); the server applies the chat template.
    #[arg(long)]
    pub http: Option<String>,
    /// Hugging Face checkpoint directory: the model run in this process
    /// when neither --router nor --http is given, the template's source
    /// with --router (default: the built-in model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// With --http: the `model` field to send (default: none, the server's
    /// one model).
    #[arg(long)]
    pub model_name: Option<String>,
    /// The API key to send (`authorization: Bearer KEY`).
    #[arg(long, env = "TANDEM_API_KEY")]
    pub api_key: Option<String>,
    /// With --router: connect over mTLS with this certificate, key and CA.
    #[command(flatten)]
    pub tls: crate::security_args::TlsArgs,
    /// A system prompt to start with (`/system` changes it).
    #[arg(long)]
    pub system: Option<String>,
    /// Sampling temperature (`/temperature` changes it; 0 is greedy).
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f32,
    /// Tokens per answer at most (`/max-tokens` changes it).
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
    /// No history file (history is kept in the cache directory).
    #[arg(long)]
    pub no_history_file: bool,
}

/// What the next answer is asked with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub temperature: f32,
    pub max_tokens: u32,
}

/// How one answer went.
#[derive(Debug, Default)]
pub struct TurnStats {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub finish_reason: String,
    /// From sending to the first piece of text.
    pub ttft: Option<Duration>,
    pub elapsed: Duration,
}

/// The conversation so far.
struct Session {
    system: Option<String>,
    history: Vec<Message>,
    settings: Settings,
}

impl Session {
    /// The messages of a turn that asks `question`.
    fn messages_with(&self, question: &str) -> Vec<Message> {
        let mut m = Vec::with_capacity(self.history.len() + 2);
        if let Some(s) = &self.system {
            m.push(message("system", s));
        }
        m.extend(self.history.iter().cloned());
        m.push(message("user", question));
        m
    }
}

fn message(role: &str, content: &str) -> Message {
    Message::text(role, content)
}

/// What a line typed at the prompt asks for.
#[derive(Debug, PartialEq)]
enum Command<'a> {
    Ask(&'a str),
    System(Option<&'a str>),
    Reset,
    Temperature(f32),
    MaxTokens(u32),
    Help,
    Quit,
    Bad(String),
}

fn parse(line: &str) -> Command<'_> {
    let Some(cmd) = line.strip_prefix('/') else {
        return Command::Ask(line);
    };
    let (name, rest) = cmd.split_once(char::is_whitespace).unwrap_or((cmd, ""));
    let rest = rest.trim();
    match name {
        "system" => Command::System((!rest.is_empty()).then_some(rest)),
        "reset" | "clear" => Command::Reset,
        "temperature" | "temp" => match rest.parse::<f32>() {
            Ok(t) if t.is_finite() && (0.0..=2.0).contains(&t) => Command::Temperature(t),
            _ => Command::Bad(format!(
                "/temperature wants a number in [0, 2], not {rest:?}"
            )),
        },
        "max-tokens" => match rest.parse::<u32>() {
            Ok(n) if n > 0 => Command::MaxTokens(n),
            _ => Command::Bad(format!("/max-tokens wants a positive number, not {rest:?}")),
        },
        "help" | "?" => Command::Help,
        "bye" | "exit" | "quit" => Command::Quit,
        _ => Command::Bad(format!("unknown command /{name} (/help lists them)")),
    }
}

const HELP: &str = "\
  /system TEXT       set the system prompt (/system alone removes it)
  /reset             forget the conversation
  /temperature X     sampling temperature, 0 (greedy) to 2
  /max-tokens N      tokens per answer at most
  /bye               leave (or Ctrl-D); Ctrl-C stops an answer";

pub fn run(args: ChatArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let mut backend = rt.block_on(Backend::connect(&args))?;
    // Registered before the first answer, so a Ctrl-C never takes the
    // default action (ending the process) once chatting has begun.
    let mut interrupts = {
        let _in_runtime = rt.enter();
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
            .context("installing the Ctrl-C handler")?
    };
    let mut editor = rustyline::DefaultEditor::new().context("opening the terminal")?;
    let history_file = (!args.no_history_file)
        .then(|| crate::default_model::cache_dir().ok())
        .flatten()
        .map(|d| d.join("chat_history"));
    if let Some(f) = &history_file {
        // A first run has no file yet.
        let _ = editor.load_history(f);
    }
    let mut session = Session {
        system: args.system.clone(),
        history: Vec::new(),
        settings: Settings {
            temperature: args.temperature,
            max_tokens: args.max_tokens,
        },
    };
    eprintln!(
        "Chatting with {}. /help for commands; Ctrl-C stops an answer, Ctrl-D leaves.",
        backend.describe()
    );
    loop {
        let line = match editor.readline(">>> ") {
            Ok(line) => line,
            Err(ReadlineError::Interrupted) => continue,
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e).context("reading the terminal"),
        };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let _ = editor.add_history_entry(line);
        match parse(line) {
            Command::Ask(question) => {
                let messages = session.messages_with(question);
                let settings = session.settings.clone();
                let answered =
                    rt.block_on(answer(&mut backend, &messages, &settings, &mut interrupts));
                match answered {
                    Ok(Some((text, stats))) => {
                        session.history.push(message("user", question));
                        session.history.push(message("assistant", &text));
                        print_stats(&stats);
                    }
                    Ok(None) => eprintln!("\n(cancelled)"),
                    Err(e) => {
                        let e = format!("{e:#}");
                        eprintln!("\nerror: {e}");
                        // The conversation outgrew the model's context.
                        if e.contains("max_model_len") || e.contains("context") {
                            eprintln!("(/reset starts over; /max-tokens N asks for less)");
                        }
                    }
                }
            }
            Command::System(text) => {
                session.system = text.map(str::to_string);
                eprintln!(
                    "(system prompt {})",
                    if text.is_some() { "set" } else { "removed" }
                );
            }
            Command::Reset => {
                session.history.clear();
                eprintln!("(history cleared)");
            }
            Command::Temperature(t) => {
                session.settings.temperature = t;
                eprintln!("(temperature {t})");
            }
            Command::MaxTokens(n) => {
                session.settings.max_tokens = n;
                eprintln!("(max tokens {n})");
            }
            Command::Help => eprintln!("{HELP}"),
            Command::Quit => break,
            Command::Bad(why) => eprintln!("{why}"),
        }
    }
    if let Some(f) = &history_file {
        let _ = editor.save_history(f);
    }
    Ok(())
}

/// Streams one answer to stdout; `None` when Ctrl-C cancelled it.
async fn answer(
    backend: &mut Backend,
    messages: &[Message],
    settings: &Settings,
    interrupts: &mut tokio::signal::unix::Signal,
) -> Result<Option<(String, TurnStats)>> {
    use futures_util::FutureExt;
    use std::io::Write;
    // Forget a Ctrl-C that came while no answer was running.
    while let Some(Some(())) = interrupts.recv().now_or_never() {}
    let mut text = String::new();
    let mut stdout = std::io::stdout();
    let mut show = |piece: &str| {
        text.push_str(piece);
        let _ = stdout
            .write_all(piece.as_bytes())
            .and_then(|()| stdout.flush());
    };
    let stats = tokio::select! {
        r = backend.answer(messages, settings, &mut show) => r?,
        _ = interrupts.recv() => return Ok(None),
    };
    println!();
    Ok(Some((text, stats)))
}

fn print_stats(s: &TurnStats) {
    let rate = match s.elapsed.as_secs_f64() {
        secs if secs > 0.0 && s.completion_tokens > 0 => {
            format!(", {:.1} tok/s", s.completion_tokens as f64 / secs)
        }
        _ => String::new(),
    };
    eprintln!(
        "[{} tokens, prompt {} tokens, finish: {}, ttft {}{rate}]",
        s.completion_tokens,
        s.prompt_tokens,
        s.finish_reason,
        s.ttft
            .map_or("-".into(), |t| format!("{:.0} ms", t.as_secs_f64() * 1e3)),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_into_commands() {
        assert_eq!(parse("hello /there"), Command::Ask("hello /there"));
        assert_eq!(parse("/system be brief"), Command::System(Some("be brief")));
        assert_eq!(parse("/system"), Command::System(None));
        assert_eq!(parse("/reset"), Command::Reset);
        assert_eq!(parse("/temperature 0.2"), Command::Temperature(0.2));
        assert!(matches!(parse("/temperature hot"), Command::Bad(_)));
        assert!(matches!(parse("/temperature 9"), Command::Bad(_)));
        assert_eq!(parse("/max-tokens 12"), Command::MaxTokens(12));
        assert!(matches!(parse("/max-tokens 0"), Command::Bad(_)));
        assert_eq!(parse("/bye"), Command::Quit);
        assert!(matches!(parse("/nope"), Command::Bad(_)));
    }

    #[test]
    fn a_turn_carries_the_system_prompt_and_the_history() {
        let mut s = Session {
            system: Some("be brief".into()),
            history: vec![message("user", "hi"), message("assistant", "hello")],
            settings: Settings {
                temperature: 0.0,
                max_tokens: 8,
            },
        };
        let m = s.messages_with("again");
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert_eq!(m[3].content, "again");
        s.system = None;
        s.history.clear();
        assert_eq!(s.messages_with("x").len(), 1);
    }
}
