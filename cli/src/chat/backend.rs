//! Where `tandem chat`'s answers come from: a model in this process, a
//! router over gRPC, or an OpenAI-compatible HTTP server. Each streams the
//! answer's text through a callback; dropping the future cancels the
//! answer (see the module docs of [`super`]).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use tandem_engine::tokenizer::{StreamDecoder, Tokenizer};
use tandem_engine::{Checkpoint, EngineError, GenerateOptions, GenerateRequest, SamplingParams};
use tandem_openai::chat::Message;
use tandem_openai::ChatTemplate;
use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tokio::sync::mpsc;

use super::http::HttpChat;
use super::{ChatArgs, Settings, TurnStats};

/// How long to wait for a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an answer may go without a new piece before it is given up.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(120);

/// A model in this process, or a server.
pub enum Backend {
    Local(Box<Local>),
    Grpc(Box<Grpc>),
    Http(HttpChat),
}

impl Backend {
    /// The backend `args` ask for.
    pub async fn connect(args: &ChatArgs) -> Result<Self> {
        if let Some(url) = &args.http {
            return Ok(Self::Http(HttpChat::new(
                url,
                args.model_name.clone(),
                args.api_key.clone(),
            )?));
        }
        let dir = match &args.model {
            Some(d) => d.clone(),
            None => crate::default_model::default_model_dir()?,
        };
        match &args.router {
            Some(addr) => Ok(Self::Grpc(Box::new(Grpc::connect(addr, &dir, args).await?))),
            None => {
                let dir2 = dir.clone();
                let ckpt = tokio::task::spawn_blocking(move || Checkpoint::open(&dir2))
                    .await?
                    .with_context(|| format!("loading model from {}", dir.display()))?;
                Ok(Self::Local(Box::new(Local::new(ckpt, &dir)?)))
            }
        }
    }

    /// Names the model and where it runs, for the greeting.
    pub fn describe(&self) -> String {
        match self {
            Self::Local(l) => format!("{} (in this process)", l.name),
            Self::Grpc(g) => format!("{} at {} (gRPC)", g.name, g.addr),
            Self::Http(h) => format!("the model at {} (HTTP)", h.url()),
        }
    }

    /// Streams the answer to `messages` through `show`.
    pub async fn answer(
        &mut self,
        messages: &[Message],
        settings: &Settings,
        show: &mut dyn FnMut(&str),
    ) -> Result<TurnStats> {
        match self {
            Self::Local(l) => l.answer(messages, settings, show).await,
            Self::Grpc(g) => g.answer(messages, settings, show).await,
            Self::Http(h) => h.answer(messages, settings, show).await,
        }
    }
}

/// The checkpoint's chat template: what turns messages into prompt tokens
/// on this side (with the checkpoint's tokenizer).
struct Prompter {
    template: ChatTemplate,
}

impl Prompter {
    fn from_dir(dir: &Path) -> Result<Self> {
        let template = ChatTemplate::from_model_dir(dir)?.with_context(|| {
            format!(
                "{} has no chat template (tokenizer_config.json's chat_template)",
                dir.display()
            )
        })?;
        Ok(Self { template })
    }

    /// The prompt tokens of `messages` with the assistant's turn opened.
    fn prompt(&self, tokenizer: &Tokenizer, messages: &[Message]) -> Result<Vec<u32>> {
        let text = self.template.render(messages, true)?;
        Ok(tokenizer.encode_plain(&text)?)
    }
}

fn model_name(dir: &Path) -> String {
    tandem_engine::checkpoint::model_name(dir)
}

/// A model loaded here; each answer runs on a blocking thread.
pub struct Local {
    ckpt: Arc<Checkpoint>,
    prompter: Prompter,
    name: String,
}

/// Raises the generation's stop flag when the answer's future is dropped.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

impl Local {
    fn new(ckpt: Checkpoint, dir: &Path) -> Result<Self> {
        // Chat is text: refuse a checkpoint without a tokenizer up front.
        ckpt.tokenizer()?;
        Ok(Self {
            prompter: Prompter::from_dir(dir)?,
            ckpt: Arc::new(ckpt),
            name: model_name(dir),
        })
    }

    async fn answer(
        &mut self,
        messages: &[Message],
        settings: &Settings,
        show: &mut dyn FnMut(&str),
    ) -> Result<TurnStats> {
        let prompt_ids = self.prompter.prompt(self.ckpt.tokenizer()?, messages)?;
        let req = GenerateRequest {
            prompt_ids,
            max_tokens: settings.max_tokens as usize,
            sampling: SamplingParams {
                temperature: settings.temperature,
                ..SamplingParams::default()
            },
            stop_token_ids: Vec::new(),
            ignore_eos: false,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let _stop_on_drop = StopOnDrop(stop.clone());
        let (tx, mut rx) = mpsc::unbounded_channel::<String>();
        let ckpt = self.ckpt.clone();
        let start = Instant::now();
        let prompt_tokens = req.prompt_ids.len() as u64;
        let job = tokio::task::spawn_blocking(move || {
            let tok = ckpt.tokenizer()?;
            let mut decoder = StreamDecoder::after_prompt(&req.prompt_ids);
            let opts = GenerateOptions::default();
            tandem_engine::generate(&ckpt.model, &ckpt.eos_token_ids, &req, opts, |s| {
                if stop.load(Ordering::Relaxed) {
                    return Err(EngineError::Stopped("cancelled at the terminal".into()));
                }
                // A closed receiver means the answer was dropped.
                let _ = tx.send(decoder.push(tok, s.token)?);
                Ok(())
            })
        });
        let mut ttft = None;
        while let Some(piece) = rx.recv().await {
            ttft.get_or_insert_with(|| start.elapsed());
            show(&piece);
        }
        let out = job.await??;
        Ok(TurnStats {
            prompt_tokens,
            completion_tokens: out.output_ids.len() as u64,
            finish_reason: out.finish_reason.as_str().to_string(),
            ttft,
            elapsed: start.elapsed(),
        })
    }
}

/// A router (or `tandem serve`) over the public gRPC API.
pub struct Grpc {
    client: GenerationClient<tonic::transport::Channel>,
    prompter: Prompter,
    tokenizer: Tokenizer,
    api_key: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    addr: String,
    name: String,
}

impl Grpc {
    async fn connect(addr: &str, dir: &Path, args: &ChatArgs) -> Result<Self> {
        let (endpoint, host_port) = crate::remote::endpoint(&args.tls, addr)?;
        let endpoint = endpoint.connect_timeout(CONNECT_TIMEOUT);
        let channel = tokio::time::timeout(CONNECT_TIMEOUT, endpoint.connect())
            .await
            .map_err(|_| anyhow!("connecting to {addr}: no answer in {CONNECT_TIMEOUT:?}"))?
            .with_context(|| format!("connecting to {addr}"))?;
        let api_key = args
            .api_key
            .as_deref()
            .map(crate::remote::bearer)
            .transpose()?;
        Ok(Self {
            client: GenerationClient::new(channel),
            prompter: Prompter::from_dir(dir)?,
            tokenizer: tandem_engine::checkpoint::tokenizer_of(dir)?
                .with_context(|| format!("{} has no tokenizer", dir.display()))?,
            api_key,
            addr: host_port,
            name: model_name(dir),
        })
    }

    async fn answer(
        &mut self,
        messages: &[Message],
        settings: &Settings,
        show: &mut dyn FnMut(&str),
    ) -> Result<TurnStats> {
        let ids = self.prompter.prompt(&self.tokenizer, messages)?;
        let mut req = tonic::Request::new(v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds { ids })),
            sampling: Some(v1::SamplingParams {
                temperature: Some(settings.temperature),
                ..Default::default()
            }),
            max_tokens: Some(settings.max_tokens),
            ..Default::default()
        });
        if let Some(k) = &self.api_key {
            req.metadata_mut().insert("authorization", k.clone());
        }
        let status = |s: tonic::Status| anyhow!("{}: {}", s.code(), s.message());
        let start = Instant::now();
        let mut stream = tokio::time::timeout(IDLE_TIMEOUT, self.client.generate(req))
            .await
            .map_err(|_| anyhow!("no answer in {IDLE_TIMEOUT:?}"))?
            .map_err(status)?
            .into_inner();
        let mut stats = TurnStats::default();
        loop {
            let next = tokio::time::timeout(IDLE_TIMEOUT, stream.message())
                .await
                .map_err(|_| anyhow!("the answer stalled for {IDLE_TIMEOUT:?}"))?
                .map_err(status)?;
            let Some(msg) = next else { break };
            match msg.event {
                Some(v1::generate_response::Event::Delta(d)) if !d.text.is_empty() => {
                    stats.ttft.get_or_insert_with(|| start.elapsed());
                    show(&d.text);
                }
                Some(v1::generate_response::Event::Finished(f)) => {
                    stats.finish_reason = crate::remote::finish_reason(&f).to_string();
                    let usage = f.usage.unwrap_or_default();
                    stats.prompt_tokens = usage.prompt_tokens.into();
                    stats.completion_tokens = usage.completion_tokens.into();
                }
                _ => {}
            }
        }
        if stats.finish_reason.is_empty() {
            bail!("the stream ended without a Finished message");
        }
        stats.elapsed = start.elapsed();
        Ok(stats)
    }
}
