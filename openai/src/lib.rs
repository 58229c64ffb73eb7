//! The OpenAI-compatible HTTP API: `POST /v1/completions`,
//! `POST /v1/chat/completions`, `POST /v1/responses`, `GET /v1/models` and
//! `GET /health`, plus Anthropic's `POST /v1/messages` and
//! `POST /v1/messages/count_tokens` (module `anthropic`).
//!
//! Chat, Responses and Messages render the conversation with the same chat
//! template and parse the output the same way ([`tools`]: tool calls
//! constrained by their schemas, `<think>` reasoning), so every endpoint's
//! stream reassembles into its unstreamed answer.
//!
//! It is a translator in front of any [`Backend`], a `tandem.v1.Generation`
//! service called in-process: the router's (which routes over a cluster) or
//! the colocated server's. Each OpenAI request becomes one `GenerateRequest`
//! per prompt, so greedy outputs are the gRPC path's by construction.
//!
//! * Completions send text prompts as text (the backend tokenizes them, with
//!   the tokenizer's special tokens, as on gRPC); chat renders the messages
//!   with the model's chat template ([`chat`]) and sends the token ids of
//!   the rendered text.
//! * `stream: true` answers with server-sent events, one chunk per token
//!   delta, ending with `data: [DONE]`; with
//!   `stream_options.include_usage` a last chunk carries the usage.
//! * Cancellation: the backend stream lives inside the HTTP response (the
//!   SSE body, or the handler future of a non-streamed call). When the
//!   client goes away hyper drops it, which cancels the backend call, and
//!   the engine frees the request's KV blocks, as a cancelled gRPC call does.
//! * Errors have OpenAI's JSON shape and status codes ([`ApiError`]).
//! * API keys ([`OpenAiBuilder::api_keys`]): every `/v1/*` route wants
//!   `Authorization: Bearer KEY`, checked in constant time by
//!   [`tandem_security::ApiKeys`] before the body is read; a missing or wrong
//!   key is a 401 `invalid_api_key`. `/health` stays open (probes carry no
//!   key).
//! * Size limits: a body over [`OpenAiBuilder::max_body_bytes`] (default
//!   [`DEFAULT_MAX_BODY_BYTES`]) is a 413 in OpenAI's shape; prompt and
//!   output lengths are the backend's to refuse (the engine's context limit
//!   and the router's prompt limit), which arrive here as 400s.
//!
//! **Architecture Invariant:** this crate knows the `Generation` API and the
//! tokenizer, never the engine's scheduler or the cluster: anything that
//! serves `tandem.v1.Generation` can sit behind it.

mod adapters;
mod anthropic;
pub mod chat;
mod chat_output;
mod error;
mod grpc_chat;
mod info;
pub mod params;
mod response;
mod responses;
mod serve;
mod single;
pub mod tools;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use futures_util::stream::{self, SelectAll};
use futures_util::{Stream, StreamExt};
use serde_json::{json, Value};
use tandem_proto::v1;
use tandem_tokenizer::Tokenizer;

pub use adapters::Adapters;
pub use chat::ChatTemplate;
pub use error::ApiError;
pub use grpc_chat::ChatService;
pub use serve::{DEFAULT_LIMITS, DEFAULT_MAX_CONNECTIONS};
pub use tandem_security::ApiKeys;
pub use tandem_telemetry::http::{ConnectionLimits, DEFAULT_HEADER_TIMEOUT};

/// The default limit on a request body: 1 MiB is far beyond any prompt the
/// context windows we serve can hold.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1 << 20;
use params::{ChatRequest, CompletionRequest, Plan};
use response::{Chunker, Collector, EchoPrompt, Endpoint, Header};
use tools::parse::{OutputFormat, ReasoningMarkers};
use tools::ToolSyntax;

/// The backend's token stream.
pub type GenerateStream =
    Pin<Box<dyn Stream<Item = Result<v1::GenerateResponse, tonic::Status>> + Send>>;

/// What the API calls: one `Generate` per prompt, within the caller's
/// `timeout` when it has one (a gRPC `Chat` call's deadline; the
/// backend ends the stream with `DEADLINE_EXCEEDED` past it).
#[async_trait::async_trait]
pub trait Backend: Send + Sync + 'static {
    async fn generate(
        &self,
        req: v1::GenerateRequest,
        timeout: Option<Duration>,
    ) -> Result<GenerateStream, tonic::Status>;
}

#[async_trait::async_trait]
impl<S: v1::generation_server::Generation> Backend for S {
    async fn generate(
        &self,
        req: v1::GenerateRequest,
        timeout: Option<Duration>,
    ) -> Result<GenerateStream, tonic::Status> {
        let mut request = tonic::Request::new(req);
        if let Some(t) = timeout {
            request.set_timeout(t);
        }
        let response = v1::generation_server::Generation::generate(self, request).await?;
        Ok(Box::pin(response.into_inner()))
    }
}

/// The API over one backend serving one model.
#[derive(Clone)]
pub struct OpenAi {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Arc<dyn Backend>,
    tokenizer: Arc<Tokenizer>,
    chat: Option<ChatTemplate>,
    /// How this model writes tool calls (`None`: tools are refused).
    tool_syntax: Option<ToolSyntax>,
    /// Whether `<think>…</think>` is split into `reasoning_content`.
    reasoning: bool,
    model: String,
    created: u64,
    next_id: AtomicU64,
    api_keys: ApiKeys,
    max_body_bytes: usize,
    connections: ConnectionLimits,
    /// LoRA adapters `model` may name (`None`: the base model only).
    adapters: Option<Arc<dyn Adapters>>,
}

impl std::fmt::Debug for OpenAi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAi")
            .field("model", &self.inner.model)
            .field("chat_template", &self.inner.chat.is_some())
            .finish_non_exhaustive()
    }
}

/// Builds an [`OpenAi`].
#[derive(Debug)]
pub struct OpenAiBuilder {
    tokenizer: Arc<Tokenizer>,
    chat: Option<ChatTemplate>,
    tool_syntax: Option<Option<ToolSyntax>>,
    reasoning: Option<bool>,
    model: String,
    api_keys: ApiKeys,
    max_body_bytes: usize,
    connections: ConnectionLimits,
    adapters: Option<Arc<dyn Adapters>>,
}

impl std::fmt::Debug for dyn Adapters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl OpenAiBuilder {
    /// The LoRA adapters `model` may name, listed by `/v1/models` and
    /// managed by the admin routes (see [`Adapters`]).
    pub fn adapters(mut self, adapters: Arc<dyn Adapters>) -> Self {
        self.adapters = Some(adapters);
        self
    }

    /// Connection bounds of [`OpenAi::serve`] (default
    /// [`DEFAULT_LIMITS`]).
    pub fn connection_limits(mut self, limits: ConnectionLimits) -> Self {
        self.connections = limits;
        self
    }

    /// The keys `/v1/*` callers must present (default: none, open API).
    pub fn api_keys(mut self, keys: ApiKeys) -> Self {
        self.api_keys = keys;
        self
    }

    /// The largest request body accepted (default
    /// [`DEFAULT_MAX_BODY_BYTES`]).
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }

    /// The name clients pass as `model` (default `tandem`).
    pub fn model_name(mut self, name: impl Into<String>) -> Self {
        self.model = name.into();
        self
    }

    /// The chat template; without one, chat completions answer 400.
    pub fn chat_template(mut self, template: Option<ChatTemplate>) -> Self {
        self.chat = template;
        self
    }

    /// The syntax tool calls are parsed in, `None` to refuse tools
    /// (default: recognised from the chat template's source).
    pub fn tool_syntax(mut self, syntax: Option<ToolSyntax>) -> Self {
        self.tool_syntax = Some(syntax);
        self
    }

    /// Whether `<think>…</think>` is split into `reasoning_content`
    /// (default: when the chat template mentions `<think>`).
    pub fn reasoning(mut self, on: bool) -> Self {
        self.reasoning = Some(on);
        self
    }

    pub fn build(self, backend: Arc<dyn Backend>) -> OpenAi {
        let source = self.chat.as_ref().map_or("", ChatTemplate::source);
        let tool_syntax = self
            .tool_syntax
            .unwrap_or_else(|| ToolSyntax::detect(source));
        let reasoning = self.reasoning.unwrap_or_else(|| source.contains("<think>"));
        OpenAi {
            inner: Arc::new(Inner {
                backend,
                tokenizer: self.tokenizer,
                chat: self.chat,
                tool_syntax,
                reasoning,
                model: self.model,
                created: unix_now(),
                next_id: AtomicU64::new(0),
                api_keys: self.api_keys,
                max_body_bytes: self.max_body_bytes,
                connections: self.connections,
                adapters: self.adapters,
            }),
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl OpenAi {
    /// `tokenizer` names tokens in logprobs and tokenizes chat prompts.
    pub fn builder(tokenizer: Arc<Tokenizer>) -> OpenAiBuilder {
        OpenAiBuilder {
            tokenizer,
            chat: None,
            tool_syntax: None,
            reasoning: None,
            model: "tandem".to_string(),
            api_keys: ApiKeys::default(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            connections: DEFAULT_LIMITS,
            adapters: None,
        }
    }

    /// The served model name.
    pub fn model_name(&self) -> &str {
        &self.inner.model
    }

    /// The axum router of the API.
    pub fn router(&self) -> axum::Router {
        axum::Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(info::models))
            .route("/v1/models/{*model}", get(info::model))
            .route("/tokenize", post(info::tokenize))
            .route("/detokenize", post(info::detokenize))
            .route("/v1/responses", post(responses::create))
            .route("/v1/messages", post(anthropic::messages))
            .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
            .route("/v1/load_lora_adapter", post(adapters::load))
            .route("/v1/unload_lora_adapter", post(adapters::unload))
            // Everything above wants a key; everything below is open.
            .route_layer(axum::middleware::from_fn_with_state(
                self.inner.api_keys.clone(),
                require_api_key,
            ))
            .route("/health", get(health))
            .layer(DefaultBodyLimit::max(self.inner.max_body_bytes))
            .fallback(|uri: Uri| async move { ApiError::no_route(uri.path()) })
            .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
                ApiError {
                    status: StatusCode::METHOD_NOT_ALLOWED,
                    message: format!("{method} is not allowed on {}.", uri.path()),
                    param: None,
                    code: None,
                    retry_after: None,
                }
            })
            .with_state(self.inner.clone())
    }

    /// Serves the API on `listener` until `shutdown` completes, within
    /// the builder's connection limits (see `serve.rs`).
    pub async fn serve(
        &self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        serve::serve(self.router(), listener, self.inner.connections, shutdown).await
    }
}

impl Inner {
    /// The name responses give as `model`: the adapter's, or the base
    /// model's for `lora` empty.
    fn served_name<'a>(&'a self, lora: &'a str) -> &'a str {
        match lora.is_empty() {
            true => &self.model,
            false => lora,
        }
    }

    /// The LoRA adapter `model` names: empty for the base model (or no
    /// `model`), else one of the adapters served.
    fn check_model(&self, model: Option<&str>) -> Result<String, ApiError> {
        match model {
            None => Ok(String::new()),
            Some(m) if m == self.model => Ok(String::new()),
            Some(m) => match &self.adapters {
                Some(a) if a.names().iter().any(|n| n == m) => Ok(m.to_string()),
                _ => Err(ApiError::model_not_found(m)),
            },
        }
    }

    /// A fresh response id: `prefix`, then the server's start time, the
    /// clock's nanoseconds and a counter, in hex.
    fn next_request_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        // Chat and completion ids are `chatcmpl-…`; Responses' and
        // Anthropic's are `resp_…` and `msg_…`.
        let sep = if matches!(prefix, "msg" | "resp") {
            '_'
        } else {
            '-'
        };
        format!("{prefix}{sep}{:x}{nanos:08x}{n:06x}", self.created)
    }

    fn header(
        &self,
        endpoint: Endpoint,
        output: OutputFormat,
        echo: Option<Vec<EchoPrompt>>,
        report_prompt_logprobs: bool,
    ) -> Header {
        let prefix = match endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        };
        Header {
            id: self.next_request_id(prefix),
            created: unix_now(),
            model: self.model.clone(),
            endpoint,
            tokenizer: self.tokenizer.clone(),
            output,
            echo,
            report_prompt_logprobs,
        }
    }

    /// Starts one backend call per prompt (within `timeout`, if any). A
    /// failure of any cancels the others (their streams are dropped).
    async fn start(
        &self,
        id: &str,
        plan: &Plan,
        prompts: Vec<v1::generate_request::Prompt>,
        timeout: Option<Duration>,
    ) -> Result<SelectAll<IndexedStream>, ApiError> {
        let many = prompts.len() > 1;
        let calls = prompts.into_iter().enumerate().map(|(i, prompt)| {
            let mut req = plan.template.clone();
            req.request_id = if many {
                format!("{id}-{i}")
            } else {
                id.to_string()
            };
            req.prompt = Some(prompt);
            let backend = self.backend.clone();
            async move {
                let s = backend.generate(req, timeout).await?;
                Ok::<IndexedStream, tonic::Status>(Box::pin(s.map(move |r| (i, r))))
            }
        });
        let streams = futures_util::future::try_join_all(calls).await?;
        Ok(stream::select_all(streams))
    }
}

type IndexedStream =
    Pin<Box<dyn Stream<Item = (usize, Result<v1::GenerateResponse, tonic::Status>)> + Send>>;

/// Refuses a `/v1/*` call without a valid API key (401), before its body
/// is read. The key comes as `Authorization: Bearer KEY` or, as Anthropic's
/// clients send it, `x-api-key: KEY`; the Messages API answers in
/// Anthropic's error shape.
async fn require_api_key(State(keys): State<ApiKeys>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let bearer = match (
        headers.get(axum::http::header::AUTHORIZATION),
        headers.get("x-api-key"),
    ) {
        (Some(auth), _) => Some(auth.as_bytes().to_vec()),
        (None, Some(key)) => Some([b"Bearer ".as_slice(), key.as_bytes()].concat()),
        (None, None) => None,
    };
    match keys.check_bearer(bearer.as_deref()) {
        Ok(()) => next.run(request).await,
        Err(e) => {
            let path = request.uri().path();
            tracing::debug!(reason = %e, path = %path, "refused: API key");
            let error = ApiError::unauthorized(&e);
            if path.starts_with("/v1/messages") {
                error.into_anthropic_response()
            } else {
                error.into_response()
            }
        }
    }
}

/// The body, or the error for one that could not be read (over the size
/// limit: 413 in OpenAI's shape).
fn body_bytes(api: &Inner, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::body_too_large(api.max_body_bytes),
        status => ApiError {
            status,
            message: format!("We could not read the body of your request: {e}"),
            param: None,
            code: None,
            retry_after: None,
        },
    })
}

/// Parses a JSON body; malformed JSON and wrong types are 400s (axum's
/// extractor would answer 422 in its own shape).
fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "We could not parse the JSON body of your request: {e}"
        ))
    })
}

/// Prompts × `n` in one call: each is a sequence the engine runs, so one
/// HTTP call must not fan out past what `n` alone may ask for.
pub const MAX_CHOICES_PER_CALL: usize = params::MAX_N as usize;

fn check_choices(prompts: usize, n: u32) -> Result<(), ApiError> {
    let choices = prompts.saturating_mul(n as usize);
    if choices > MAX_CHOICES_PER_CALL {
        return Err(ApiError::bad_param(
            "prompt",
            format!(
                "{prompts} prompts × n={n} is {choices} choices; at most {MAX_CHOICES_PER_CALL} per request"
            ),
        ));
    }
    Ok(())
}

async fn completions(
    State(api): State<Arc<Inner>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = async {
        let body = body_bytes(&api, body)?;
        let req: CompletionRequest = parse(&body)?;
        let lora = api.check_model(req.common.model.as_deref())?;
        let mut plan = req.plan()?;
        plan.template.lora = lora;
        let mut prompts = req.prompts()?;
        check_choices(prompts.len(), plan.n)?;
        let echo = if plan.echo {
            Some(api.echo_prompts(&mut prompts)?)
        } else {
            None
        };
        Ok::<_, ApiError>((plan, prompts, echo))
    };
    match run.await {
        Ok((plan, prompts, echo)) => {
            let output = OutputFormat::default();
            respond(&api, Endpoint::Completions, output, echo, plan, prompts).await
        }
        Err(e) => e.into_response(),
    }
}

async fn chat_completions(
    State(api): State<Arc<Inner>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    // Parsing, rendering the template and tokenizing a long conversation
    // take milliseconds of CPU: on the blocking pool, not the async threads.
    let inner = api.clone();
    let run = move || {
        let api = inner;
        let body = body_bytes(&api, body)?;
        let req: ChatRequest = parse(&body)?;
        let lora = api.check_model(req.common.model.as_deref())?;
        let mut plan = req.plan()?;
        plan.template.lora = lora;
        let messages = req.messages()?;
        let tools = req.tool_set()?;
        let (ids, output) = api.chat_prompt(
            &messages,
            tools.as_ref(),
            req.add_generation_prompt.unwrap_or(true),
            &mut plan,
        )?;
        let prompt = v1::generate_request::Prompt::TokenIds(v1::TokenIds { ids });
        Ok::<_, ApiError>((plan, vec![prompt], output))
    };
    let prepared = tokio::task::spawn_blocking(run).await.unwrap_or_else(|e| {
        Err(ApiError::internal(format!(
            "preparing the chat prompt failed: {e}"
        )))
    });
    match prepared {
        Ok((plan, prompts, output)) => {
            respond(&api, Endpoint::Chat, output, None, plan, prompts).await
        }
        Err(e) => e.into_response(),
    }
}

impl Inner {
    /// What `echo` repeats of each prompt. Text prompts are tokenized here
    /// (as the backend would, with special tokens) and sent as ids, so the
    /// echoed tokens are known.
    fn echo_prompts(
        &self,
        prompts: &mut [v1::generate_request::Prompt],
    ) -> Result<Vec<EchoPrompt>, ApiError> {
        use v1::generate_request::Prompt;
        let bad =
            |e: tandem_tokenizer::TokenizerError| ApiError::bad_param("prompt", e.to_string());
        prompts
            .iter_mut()
            .map(|p| {
                let echo = match p {
                    Prompt::Text(text) => EchoPrompt {
                        ids: self.tokenizer.encode(text).map_err(bad)?,
                        text: text.clone(),
                    },
                    Prompt::TokenIds(ids) => EchoPrompt {
                        text: self.tokenizer.decode(&ids.ids).map_err(bad)?,
                        ids: ids.ids.clone(),
                    },
                };
                *p = Prompt::TokenIds(v1::TokenIds {
                    ids: echo.ids.clone(),
                });
                Ok(echo)
            })
            .collect()
    }

    /// Renders and tokenizes a conversation; with tools, constrains the
    /// plan's output to calls as `tool_choice` asks (a 400 on `tools` when
    /// this model has no tool-call syntax, on `response_format` when both
    /// constrain the output). Returns the prompt's ids and what its output
    /// is parsed for.
    fn chat_prompt(
        &self,
        messages: &[chat::Message],
        tools: Option<&tools::ToolSet>,
        add_generation_prompt: bool,
        plan: &mut Plan,
    ) -> Result<(Vec<u32>, OutputFormat), ApiError> {
        let template = self.chat.as_ref().ok_or_else(|| {
            ApiError::bad_request("this model has no chat template; use /v1/completions")
        })?;
        let mut output = OutputFormat::default();
        let template_tools = tools.map(tools::ToolSet::template_tools);
        if let Some(set) = tools.filter(|s| s.may_call()) {
            let syntax = self.tool_syntax.ok_or_else(|| {
                ApiError::bad_param(
                    "tools",
                    "this model's chat template shows no tool-call syntax; start the server with --tool-call-parser",
                )
            })?;
            output.tools = Some(syntax);
            if let Some(lark) = tools::grammar::grammar(set, syntax) {
                if plan.template.response_format.is_some() {
                    return Err(ApiError::bad_param(
                        "response_format",
                        "response_format cannot be combined with tool_choice other than none",
                    ));
                }
                plan.template.response_format = Some(v1::ResponseFormat {
                    format: Some(v1::response_format::Format::Grammar(lark)),
                });
            }
        }
        let text = template
            .render_with_tools(messages, template_tools.as_deref(), add_generation_prompt)
            .map_err(|e| ApiError::bad_param("messages", e.to_string()))?;
        if self.reasoning {
            output.reasoning = Some(ReasoningMarkers::think(&text));
        }
        let ids = self
            .tokenizer
            .encode_plain(&text)
            .map_err(|e| ApiError::bad_param("messages", e.to_string()))?;
        Ok((ids, output))
    }
}

async fn respond(
    api: &Inner,
    endpoint: Endpoint,
    output: OutputFormat,
    echo: Option<Vec<EchoPrompt>>,
    plan: Plan,
    prompts: Vec<v1::generate_request::Prompt>,
) -> Response {
    let mut header = api.header(endpoint, output, echo, plan.report_prompt_logprobs);
    header.model = api.served_name(&plan.template.lora).to_string();
    let count = prompts.len();
    let want_logprobs = plan.template.logprobs.is_some();
    let spelling = error::Spelling {
        fields: match endpoint {
            Endpoint::Completions => error::COMPLETIONS_FIELDS,
            Endpoint::Chat => error::MESSAGES_FIELDS,
        },
        max_tokens: plan.max_tokens_param,
    };
    let mut events = match api.start(&header.id, &plan, prompts, None).await {
        Ok(s) => s,
        Err(e) => return spelling.apply(e).into_response(),
    };
    tracing::debug!(id = %header.id, prompts = count, n = plan.n, stream = plan.stream, "openai request");
    if !plan.stream {
        let mut collector = Collector::new(header, count, plan.n, want_logprobs);
        while let Some((i, item)) = events.next().await {
            let added = item
                .map_err(|s| spelling.apply(ApiError::from(s)))
                .and_then(|msg| collector.add(i, msg));
            if let Err(e) = added {
                return e.into_response();
            }
        }
        return Json(collector.finish()).into_response();
    }
    let chunker = Chunker::new(header, count, plan.n, want_logprobs);
    let opening: Vec<Value> = chunker.opening();
    let state = StreamState {
        events,
        spelling,
        chunker,
        include_usage: plan.include_usage,
        phase: Phase::Events,
    };
    let body = stream::iter(opening.into_iter().map(data))
        .chain(stream::unfold(state, next_events).flat_map(stream::iter));
    Sse::new(body.map(Ok::<_, Infallible>))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

fn data(v: Value) -> Event {
    Event::default().data(v.to_string())
}

enum Phase {
    Events,
    Done,
}

struct StreamState {
    events: SelectAll<IndexedStream>,
    spelling: error::Spelling,
    chunker: Chunker,
    include_usage: bool,
    phase: Phase,
}

/// The next SSE events: chunks while the backend streams, then the usage
/// chunk (if asked for) and `[DONE]`. A backend error mid-stream is sent as
/// an error object and ends the stream (the status line is long gone).
async fn next_events(mut s: StreamState) -> Option<(Vec<Event>, StreamState)> {
    if matches!(s.phase, Phase::Done) {
        return None;
    }
    loop {
        match s.events.next().await {
            Some((i, Ok(msg))) => {
                if let Some(chunk) = s.chunker.chunk(i, msg) {
                    return Some((vec![data(chunk)], s));
                }
            }
            Some((_, Err(status))) => {
                s.phase = Phase::Done;
                let e = s.spelling.apply(ApiError::from(status));
                return Some((vec![data(e.body()), Event::default().data("[DONE]")], s));
            }
            None => {
                s.phase = Phase::Done;
                let mut out = Vec::new();
                if s.include_usage {
                    out.push(data(s.chunker.usage_chunk()));
                }
                out.push(Event::default().data("[DONE]"));
                return Some((out, s));
            }
        }
    }
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}
