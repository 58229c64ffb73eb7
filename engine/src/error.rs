//! The engine's error type.
//!
//! Every failure a user can cause (a missing file, an unsupported model, a bad
//! token id, a prompt that is too long, running out of KV blocks) is a variant
//! with a message that says what to fix; nothing on these paths panics.

use std::path::PathBuf;

/// Errors from loading a model, running it, or sampling from it.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A file the checkpoint needs is absent.
    #[error("missing file {path}: {what}")]
    MissingFile { path: PathBuf, what: &'static str },
    /// Reading a file failed.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file did not parse.
    #[error("cannot parse {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// The config names an architecture, rope type or option we do not run.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// The config or the weights contradict each other or themselves.
    #[error("invalid checkpoint: {0}")]
    InvalidCheckpoint(String),
    /// The tokenizer failed or is absent.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A request is malformed (token id outside the vocabulary, prompt too
    /// long, bad sampling parameter).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The compute backend (a GPU, say) failed.
    #[error("{device} backend: {message}")]
    Backend {
        device: &'static str,
        message: String,
    },
    /// The engine's queue is full: the request was not taken. Try again
    /// after `retry_after` (servers answer RESOURCE_EXHAUSTED / HTTP 429).
    #[error(
        "the engine is full ({queued} requests queued, limit {limit}); retry in {retry_after:?}"
    )]
    Overloaded {
        queued: usize,
        limit: usize,
        retry_after: std::time::Duration,
    },
    /// The engine cannot run any more (its backend failed for good: a
    /// tensor-parallel rank died, a device was lost). Servers answer
    /// UNAVAILABLE, and the worker leaves the cluster.
    #[error("the engine has stopped: {0}")]
    Stopped(String),
    /// The KV cache pool cannot satisfy an allocation.
    #[error(transparent)]
    Kv(#[from] crate::kv_cache::KvError),
}

impl From<tandem_tokenizer::TokenizerError> for EngineError {
    fn from(e: tandem_tokenizer::TokenizerError) -> Self {
        Self::Tokenizer(e.to_string())
    }
}

/// The engine's result type.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
