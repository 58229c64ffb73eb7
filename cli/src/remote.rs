//! `tandem generate --server ADDR`: the same request, sent to a running
//! `tandem serve` (or router) over the public gRPC API — over mTLS with
//! `--tls-cert/--tls-key/--tls-ca`, with `--api-key` as a bearer token.

use std::io::Write;

use anyhow::{bail, Context, Result};
use serde_json::json;
use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tonic::metadata::{Ascii, MetadataValue};

use crate::generate_cmd::GenerateArgs;

/// The endpoint of `server` (`host:port`, or a URL whose scheme is
/// dropped), over mTLS when `tls` names certificates; with its `host:port`.
pub(crate) fn endpoint(
    tls: &crate::security_args::TlsArgs,
    server: &str,
) -> Result<(tonic::transport::Endpoint, String)> {
    let host_port = server
        .split_once("://")
        .map_or(server, |(_, rest)| rest)
        .trim_end_matches('/');
    let endpoint = tandem_security::tls::endpoint(tls.load()?.as_ref(), host_port)?;
    Ok((endpoint, host_port.to_string()))
}

/// `authorization: Bearer KEY` as a metadata value.
pub(crate) fn bearer(key: &str) -> Result<MetadataValue<Ascii>> {
    format!("Bearer {key}")
        .parse()
        .context("the API key must be printable ASCII")
}

/// The finish reason of a `Finished` message's first choice, as the
/// OpenAI API names it.
pub(crate) fn finish_reason(f: &v1::Finished) -> &'static str {
    f.choices
        .first()
        .and_then(|c| v1::FinishReason::try_from(c.finish_reason).ok())
        .map_or("unknown", |r| match r {
            v1::FinishReason::Stop => "stop",
            v1::FinishReason::Length => "length",
            v1::FinishReason::Abort => "abort",
            v1::FinishReason::Unspecified => "unknown",
        })
}

pub fn run(args: &GenerateArgs, server: &str) -> Result<()> {
    let (endpoint, _) = endpoint(&args.tls, server)?;
    let url = endpoint.uri().to_string();
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => v1::generate_request::Prompt::TokenIds(v1::TokenIds { ids: ids.clone() }),
        (Some(text), None) => v1::generate_request::Prompt::Text(text.clone()),
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    let req = v1::GenerateRequest {
        prompt: Some(prompt),
        sampling: Some(v1::SamplingParams {
            temperature: Some(args.temperature),
            top_p: Some(args.top_p),
            top_k: u32::try_from(args.top_k)?,
            min_p: args.min_p,
            repetition_penalty: Some(args.repetition_penalty),
            presence_penalty: args.presence_penalty,
            frequency_penalty: args.frequency_penalty,
            seed: args.seed,
        }),
        max_tokens: Some(u32::try_from(args.max_tokens)?),
        stop_token_ids: args.stop_token_ids.clone(),
        ignore_eos: args.ignore_eos,
        logprobs: args.logprobs.map(u32::try_from).transpose()?,
        ..Default::default()
    };
    let mut req = tonic::Request::new(req);
    if let Some(key) = &args.api_key {
        req.metadata_mut().insert("authorization", bearer(key)?);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let channel = endpoint
            .connect()
            .await
            .with_context(|| format!("connecting to {url}"))?;
        let mut client = GenerationClient::new(channel);
        let mut stream = client
            .generate(req)
            .await
            .map_err(|s| anyhow::anyhow!("{}: {}", s.code(), s.message()))?
            .into_inner();
        let mut stdout = std::io::stdout().lock();
        let (mut ids, mut text, mut finished) = (Vec::<u32>::new(), String::new(), None);
        while let Some(msg) = stream
            .message()
            .await
            .map_err(|s| anyhow::anyhow!("{}: {}", s.code(), s.message()))?
        {
            match msg.event {
                Some(v1::generate_response::Event::Delta(d)) => {
                    ids.extend(&d.token_ids);
                    text.push_str(&d.text);
                    if !args.json {
                        let _ = stdout
                            .write_all(d.text.as_bytes())
                            .and_then(|()| stdout.flush());
                    }
                }
                Some(v1::generate_response::Event::Finished(f)) => finished = Some(f),
                // `generate` never asks for prompt scores.
                Some(v1::generate_response::Event::PromptLogprobs(_)) | None => {}
            }
        }
        let f = finished.context("the stream ended without a Finished message")?;
        let reason = finish_reason(&f);
        let usage = f.usage.unwrap_or_default();
        let t = f.timings.unwrap_or_default();
        if args.json {
            let obj = json!({
                "output_ids": ids,
                "text": text,
                "finish_reason": reason,
                "usage": {"prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
                          "completion_tokens": usage.completion_tokens},
                "ttft_ms": t.ttft_s * 1e3,
                "tpot_ms": t.tpot_s * 1e3,
            });
            writeln!(stdout, "{obj}")?;
        } else {
            writeln!(stdout)?;
            eprintln!(
                "[{} tokens, finish: {reason}, prompt {} ({} cached), ttft {:.1} ms, tpot {:.2} ms]",
                usage.completion_tokens,
                usage.prompt_tokens,
                usage.cached_tokens,
                t.ttft_s * 1e3,
                t.tpot_s * 1e3
            );
        }
        Ok(())
    })
}
