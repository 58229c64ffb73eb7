//! LoRA adapters over the API: `model` names an adapter, `/v1/models`
//! lists them, and vLLM's admin routes load and unload them at run time.
//!
//! `POST /v1/load_lora_adapter` (`{"lora_name", "lora_path"}`) and
//! `POST /v1/unload_lora_adapter` (`{"lora_name"}`) sit behind the API-key
//! check like every `/v1` route, and answer 403 on a server without keys
//! (vLLM keeps them off unless `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is set). What serves them is an [`Adapters`] the
//! server is built with: the colocated engine's registry, or the router's
//! view of its workers (which loads and unloads on every worker).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use crate::{body_bytes, parse, ApiError, Inner};

/// Where the API's adapters come from.
#[async_trait::async_trait]
pub trait Adapters: Send + Sync + 'static {
    /// The adapters requests may name now.
    fn names(&self) -> Vec<String>;

    /// Loads (or replaces) adapter `name` from the directory `path`.
    async fn load(&self, name: &str, path: &str) -> Result<(), ApiError>;

    /// Forgets adapter `name` (running requests finish under it).
    async fn unload(&self, name: &str) -> Result<(), ApiError>;
}

#[derive(Deserialize)]
struct LoadAdapter {
    lora_name: String,
    lora_path: String,
}

#[derive(Deserialize)]
struct UnloadAdapter {
    lora_name: String,
}

/// The adapters to administer, on a server with API keys only: an open
/// server would let anyone make it read directories of its choosing.
fn admin(api: &Inner) -> Result<&Arc<dyn Adapters>, ApiError> {
    let none = || ApiError::not_implemented("this server loads no LoRA adapters");
    let adapters = api.adapters.as_ref().ok_or_else(none)?;
    if api.api_keys.is_empty() {
        return Err(ApiError::forbidden(
            "loading and unloading LoRA adapters needs API keys (--api-key): the admin \
             routes are never open",
        ));
    }
    Ok(adapters)
}

pub(crate) async fn load(
    State(api): State<Arc<Inner>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = async {
        let req: LoadAdapter = parse(&body_bytes(&api, body)?)?;
        if req.lora_name == api.model {
            return Err(ApiError::bad_param(
                "lora_name",
                format!("`{}` is the base model's name", req.lora_name),
            ));
        }
        admin(&api)?.load(&req.lora_name, &req.lora_path).await?;
        Ok::<_, ApiError>(format!(
            "Success: LoRA adapter '{}' added successfully.",
            req.lora_name
        ))
    };
    match run.await {
        Ok(msg) => msg.into_response(),
        Err(e) => e.into_response(),
    }
}

pub(crate) async fn unload(
    State(api): State<Arc<Inner>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = async {
        let req: UnloadAdapter = parse(&body_bytes(&api, body)?)?;
        admin(&api)?.unload(&req.lora_name).await?;
        Ok::<_, ApiError>(format!(
            "Success: LoRA adapter '{}' removed successfully.",
            req.lora_name
        ))
    };
    match run.await {
        Ok(msg) => msg.into_response(),
        Err(e) => e.into_response(),
    }
}
