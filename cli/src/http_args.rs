//! The OpenAI-compatible HTTP API beside a gRPC server (`router` and
//! `serve`): its flags and its start.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use tandem_openai::tools::ToolSyntax;
use tandem_openai::{Backend, ChatTemplate, OpenAi};

#[derive(Args, Debug, Clone)]
pub struct HttpArgs {
    /// Serve the OpenAI-compatible HTTP API (`/v1/completions`,
    /// `/v1/chat/completions`, `/v1/models`, `/health`) on this address.
    #[arg(long)]
    pub http_addr: Option<SocketAddr>,
    /// The model name HTTP clients pass (default: the checkpoint
    /// directory's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// HTTP connections open at once; one more gets a 503 and is closed.
    #[arg(long, default_value_t = tandem_openai::DEFAULT_MAX_CONNECTIONS)]
    pub http_max_connections: usize,
    /// Milliseconds a client has to send a request's headers (and an idle
    /// keep-alive connection to start its next request) before it is closed.
    #[arg(long, default_value_t = tandem_openai::DEFAULT_HEADER_TIMEOUT.as_millis() as u64)]
    pub http_header_timeout_ms: u64,
    /// A Jinja chat template file used instead of the checkpoint's (its
    /// special tokens still come from the checkpoint).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// How the model writes tool calls (default: recognised from the chat
    /// template; `none` refuses `tools`).
    #[arg(long, value_enum)]
    pub tool_call_parser: Option<ToolCallParser>,
    /// Split `<think>…</think>` into `reasoning_content` (default: when the
    /// chat template uses `<think>`).
    #[arg(long, value_enum)]
    pub reasoning_parser: Option<ReasoningParser>,
}

/// `--tool-call-parser` (vLLM's names).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallParser {
    /// `<tool_call>{…}</tool_call>` (Hermes, Qwen).
    Hermes,
    /// Bare `{"name", "parameters"}` objects (Llama 3.x).
    #[value(name = "llama3_json")]
    Llama3Json,
    /// `[TOOL_CALLS] [{…}]`.
    Mistral,
    None,
}

/// `--reasoning-parser`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningParser {
    /// `<think>…</think>` (Qwen3, DeepSeek-R1).
    Think,
    None,
}

impl HttpArgs {
    /// The OpenAI translator over `backend`: the chat template, tool-call
    /// syntax and reasoning markers these flags pick, `api_keys` and the
    /// connection limits. It serves HTTP ([`Self::serve`]) and the gRPC
    /// `Chat` service. `None` when the checkpoint has no tokenizer (an
    /// error with `--http-addr`).
    pub fn api(
        &self,
        model_dir: &Path,
        backend: Arc<dyn Backend>,
        api_keys: tandem_openai::ApiKeys,
        adapters: Option<Arc<dyn tandem_openai::Adapters>>,
    ) -> Result<Option<OpenAi>> {
        let loaded = tandem_engine::checkpoint::tokenizer_of(model_dir)
            .with_context(|| format!("loading the tokenizer of {}", model_dir.display()))?;
        let tokenizer = match (loaded, &self.http_addr) {
            (Some(t), _) => Arc::new(t),
            (None, None) => {
                tracing::info!("no tokenizer: no chat API");
                return Ok(None);
            }
            (None, Some(_)) => anyhow::bail!(
                "the chat API needs a tokenizer: {} has no tokenizer.json (or vocabulary)",
                model_dir.display()
            ),
        };
        let source = match &self.chat_template {
            Some(path) => Some(
                std::fs::read_to_string(path)
                    .with_context(|| format!("reading --chat-template {}", path.display()))?,
            ),
            None => None,
        };
        let chat = match ChatTemplate::from_model_dir_with(model_dir, source.as_deref()) {
            Ok(Some(t)) => Some(t),
            Ok(None) => {
                tracing::warn!("the model has no chat template; /v1/chat/completions is off");
                None
            }
            Err(e) => {
                tracing::warn!("chat template unusable ({e}); /v1/chat/completions is off");
                None
            }
        };
        let name = self
            .served_model_name
            .clone()
            .unwrap_or_else(|| tandem_engine::checkpoint::model_name(model_dir));
        let mut builder = OpenAi::builder(tokenizer);
        if let Some(p) = self.tool_call_parser {
            builder = builder.tool_syntax(match p {
                ToolCallParser::Hermes => Some(ToolSyntax::Hermes),
                ToolCallParser::Llama3Json => Some(ToolSyntax::Llama3Json),
                ToolCallParser::Mistral => Some(ToolSyntax::Mistral),
                ToolCallParser::None => None,
            });
        }
        if let Some(a) = adapters {
            builder = builder.adapters(a);
        }
        if let Some(p) = self.reasoning_parser {
            builder = builder.reasoning(p == ReasoningParser::Think);
        }
        let api = builder
            .model_name(name)
            .chat_template(chat)
            .api_keys(api_keys)
            .connection_limits(tandem_openai::ConnectionLimits {
                max_connections: self.http_max_connections,
                header_timeout: std::time::Duration::from_millis(
                    self.http_header_timeout_ms.max(1),
                ),
            })
            .build(backend);
        Ok(Some(api))
    }

    /// Binds the HTTP port and starts serving `api` on it (until a shutdown
    /// signal); prints `http listening on ADDR`. Nothing when no
    /// `--http-addr` was given. `/v1/*` wants one of the API keys (when
    /// any).
    pub async fn serve(&self, api: Option<&OpenAi>) -> Result<()> {
        let (Some(addr), Some(api)) = (self.http_addr, api) else {
            return Ok(());
        };
        let api = api.clone();
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the HTTP API on {addr}"))?;
        let bound = listener.local_addr()?;
        println!("http listening on {bound}");
        tracing::info!(addr = %bound, model = api.model_name(), "OpenAI HTTP API");
        tokio::spawn(async move {
            if let Err(e) = api
                .serve(listener, crate::engine_args::shutdown_signal())
                .await
            {
                tracing::error!("HTTP API: {e}");
            }
        });
        Ok(())
    }
}
