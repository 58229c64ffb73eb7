//! `tandem generate`: one prompt through one model, streamed or as JSON.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use tandem_engine::tokenizer::StreamDecoder;
use tandem_engine::{generate, Checkpoint, GenerateOptions, GenerateRequest, SamplingParams};

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Send the request to a running server or router (`host:port`; also
    /// `--router`) instead of loading a model here.
    #[arg(long, alias = "router", conflicts_with_all = ["model", "block_size"])]
    pub server: Option<String>,
    /// With --server: the API key to send (`authorization: Bearer KEY`).
    #[arg(long, env = "TANDEM_API_KEY")]
    pub api_key: Option<String>,
    /// With --server: connect over mTLS with this certificate, key and CA.
    #[command(flatten)]
    pub tls: crate::security_args::TlsArgs,
    /// Hugging Face checkpoint directory (default: the built-in model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt text (needs tokenizer.json).
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling mass (1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens below min_p × the top probability (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Hugging Face repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repetition_penalty: f32,
    /// OpenAI presence penalty.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// OpenAI frequency penalty.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Seed for reproducible sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Report logprobs of the chosen token and the top N.
    #[arg(long)]
    pub logprobs: Option<usize>,
    /// Extra token ids that stop generation.
    #[arg(long, value_delimiter = ',')]
    pub stop_token_ids: Vec<u32>,
    /// Do not stop at end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// KV cache block size in tokens.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    if let Some(server) = &args.server {
        return crate::remote::run(&args, server);
    }
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => crate::default_model::default_model_dir()?,
    };
    if args.block_size == 0 {
        bail!("--block-size must be positive");
    }
    let ckpt =
        Checkpoint::open(&dir).with_context(|| format!("loading model from {}", dir.display()))?;
    let prompt_ids = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => ckpt.tokenizer()?.encode(text)?,
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    let req = GenerateRequest {
        prompt_ids: prompt_ids.clone(),
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repetition_penalty,
            presence_penalty: args.presence_penalty,
            frequency_penalty: args.frequency_penalty,
            seed: args.seed,
            logprobs: args.logprobs,
        },
        stop_token_ids: args.stop_token_ids.clone(),
        ignore_eos: args.ignore_eos,
    };
    let opts = GenerateOptions {
        block_size: args.block_size,
        ..GenerateOptions::default()
    };
    let stream_text = !args.json && ckpt.tokenizer.is_some();
    let mut decoder = StreamDecoder::after_prompt(&req.prompt_ids);
    let mut stdout = std::io::stdout().lock();
    let out = generate(&ckpt.model, &ckpt.eos_token_ids, &req, opts, |s| {
        if args.json {
            return Ok(());
        }
        let piece = match (&ckpt.tokenizer, stream_text) {
            (Some(tok), true) => decoder.push(tok, s.token)?,
            _ => format!("{} ", s.token),
        };
        // A closed stdout (e.g. `| head`) ends the output, not the process.
        let _ = stdout
            .write_all(piece.as_bytes())
            .and_then(|()| stdout.flush());
        Ok(())
    })?;
    if args.json {
        let text = match &ckpt.tokenizer {
            Some(tok) => tok.decode(&out.output_ids)?,
            None => String::new(),
        };
        let logprobs: Vec<_> = out
            .logprobs
            .iter()
            .map(|lp| {
                json!({
                    "token": lp.token,
                    "logprob": lp.logprob,
                    "top": lp.top.iter().map(|&(t, l)| json!([t, l])).collect::<Vec<_>>(),
                })
            })
            .collect();
        let obj = json!({
            "prompt_ids": prompt_ids,
            "output_ids": out.output_ids,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason.as_str(),
            "ttft_ms": out.ttft.as_secs_f64() * 1e3,
            "tpot_ms": out.tpot.map(|d| d.as_secs_f64() * 1e3),
        });
        writeln!(stdout, "{obj}")?;
    } else {
        writeln!(stdout)?;
        eprintln!(
            "[{} tokens, finish: {}, ttft {:.1} ms, tpot {}]",
            out.output_ids.len(),
            out.finish_reason.as_str(),
            out.ttft.as_secs_f64() * 1e3,
            out.tpot.map_or("-".to_string(), |d| format!(
                "{:.2} ms",
                d.as_secs_f64() * 1e3
            ))
        );
    }
    Ok(())
}
