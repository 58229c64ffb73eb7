//! The request bodies of `/v1/completions` and `/v1/chat/completions`, and
//! their translation into `tandem.v1.GenerateRequest`.
//!
//! Ranges are OpenAI's (temperature in [0, 2], penalties in [-2, 2], ...);
//! the engine checks its own limits (context length, vocabulary) and its
//! errors come back as 400s too. vLLM's extensions `top_k`, `min_p`,
//! `repetition_penalty`, `ignore_eos` and `stop_token_ids` are accepted.
//! Unknown fields are ignored, as vLLM ignores them.

use serde::Deserialize;
use tandem_proto::v1;

use crate::error::ApiError;

mod chat;

pub use chat::{ChatMessageIn, ChatRequest, Content, ContentPart};

/// Most choices per prompt.
pub const MAX_N: u32 = 128;
/// Most top alternatives per token: the engine's limit, checked here so the
/// 400 names the field (a test keeps the two equal; this crate does not
/// depend on the engine).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// OpenAI's `response_format`: `{"type": "text" | "json_object" |
/// "json_schema", "json_schema": {"name", "schema", "strict"}}`.
#[derive(Debug, Clone, Deserialize)]
pub struct ResponseFormatIn {
    #[serde(rename = "type")]
    pub kind: String,
    pub json_schema: Option<JsonSchemaIn>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct JsonSchemaIn {
    pub name: Option<String>,
    pub schema: Option<serde_json::Value>,
    pub strict: Option<bool>,
}

/// vLLM's `structured_outputs`: exactly one of `json` (a schema),
/// `regex`, `choice`, `grammar` (Lark), or `json_object: true`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StructuredOutputsIn {
    pub json: Option<serde_json::Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    pub grammar: Option<String>,
    pub json_object: Option<bool>,
}

/// Parameters both endpoints share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub n: Option<i64>,
    #[serde(default)]
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub stop: Option<Stop>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    pub user: Option<String>,
    // vLLM's extensions.
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub ignore_eos: Option<bool>,
    pub stop_token_ids: Option<Vec<u32>>,
    /// vLLM's prompt scoring: each prompt token's logprob (after the
    /// first) with this many top alternatives, in `choices[].prompt_logprobs`.
    pub prompt_logprobs: Option<i64>,
    /// Structured output, OpenAI's way.
    pub response_format: Option<ResponseFormatIn>,
    /// Structured output, vLLM's way (regex, choice, grammar too).
    pub structured_outputs: Option<StructuredOutputsIn>,
    /// Beam search (vLLM's): the `n` best of `best_of` beams (default `n`).
    pub use_beam_search: Option<bool>,
    /// Beams kept with `use_beam_search`; without it, must equal `n`.
    pub best_of: Option<i64>,
    /// Beam search: a hypothesis scores `sum / len ^ length_penalty`.
    pub length_penalty: Option<f32>,
    /// Beam search: `false` (default), `true` or `"never"`, as in
    /// transformers.
    pub early_stopping: Option<serde_json::Value>,
}

/// `prompt` of `/v1/completions`: text, texts, token ids, or lists of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptInput,
    /// Top alternatives per token (0: only the chosen token's logprob).
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub common: CommonParams,
}

/// What a parsed request asks of the backend, besides the prompt.
#[derive(Debug, Clone)]
pub struct Plan {
    pub template: v1::GenerateRequest,
    pub n: u32,
    pub stream: bool,
    pub include_usage: bool,
    /// Completions' `echo`: the prompt leads each choice's text (and, with
    /// `logprobs`, its tokens lead the logprobs).
    pub echo: bool,
    /// `prompt_logprobs` was asked for (reported per choice).
    pub report_prompt_logprobs: bool,
    /// The request's name for its output limit (`max_tokens`, or chat's
    /// `max_completion_tokens`): what an engine refusal of it is called.
    pub max_tokens_param: &'static str,
}

fn in_range(
    param: &'static str,
    v: Option<f32>,
    lo: f32,
    hi: f32,
) -> Result<Option<f32>, ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::bad_param(
            param,
            format!("{param} must be between {lo} and {hi}, got {x}"),
        )),
        other => Ok(other),
    }
}

impl CommonParams {
    /// The constraint on the output, from `response_format` or
    /// `structured_outputs` (not both). The engine compiles it and answers
    /// 400 with the grammar engine's message when it is invalid.
    fn response_format(&self) -> Result<Option<v1::ResponseFormat>, ApiError> {
        use v1::response_format::Format;
        let from_openai = match &self.response_format {
            None => None,
            Some(r) => match r.kind.as_str() {
                "text" => None,
                "json_object" => Some(Format::JsonObject(v1::JsonObject {})),
                "json_schema" => {
                    let schema = r
                        .json_schema
                        .as_ref()
                        .and_then(|j| j.schema.as_ref())
                        .ok_or_else(|| {
                            ApiError::bad_param(
                                "response_format",
                                "response_format.json_schema.schema is required",
                            )
                        })?;
                    Some(Format::JsonSchema(schema.to_string()))
                }
                other => {
                    return Err(ApiError::bad_param(
                        "response_format",
                        format!(
                            "response_format.type must be text, json_object or json_schema, got `{other}`"
                        ),
                    ))
                }
            },
        };
        let from_vllm = match &self.structured_outputs {
            None => None,
            Some(so) => {
                let mut given = Vec::new();
                if let Some(j) = &so.json {
                    // A schema may come as an object or as its JSON text.
                    given.push(Format::JsonSchema(match j {
                        serde_json::Value::String(text) => text.clone(),
                        other => other.to_string(),
                    }));
                }
                if let Some(r) = &so.regex {
                    given.push(Format::Regex(r.clone()));
                }
                if let Some(c) = &so.choice {
                    given.push(Format::Choice(v1::Choice { choices: c.clone() }));
                }
                if let Some(g) = &so.grammar {
                    given.push(Format::Grammar(g.clone()));
                }
                if so.json_object == Some(true) {
                    given.push(Format::JsonObject(v1::JsonObject {}));
                }
                if given.len() > 1 {
                    return Err(ApiError::bad_param(
                        "structured_outputs",
                        "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                    ));
                }
                given.pop()
            }
        };
        match (from_openai, from_vllm) {
            (Some(_), Some(_)) => Err(ApiError::bad_param(
                "response_format",
                "give response_format or structured_outputs, not both",
            )),
            (f, None) | (None, f) => Ok(f.map(|format| v1::ResponseFormat {
                format: Some(format),
            })),
        }
    }

    /// Checks the shared parameters and fills everything of a
    /// `GenerateRequest` but its prompt and logprobs.
    pub fn plan(&self) -> Result<Plan, ApiError> {
        let temperature = in_range("temperature", self.temperature, 0.0, 2.0)?;
        let top_p = match self.top_p {
            Some(p) if !(p > 0.0 && p <= 1.0) => {
                return Err(ApiError::bad_param(
                    "top_p",
                    format!("top_p must be in (0, 1], got {p}"),
                ))
            }
            p => p,
        };
        let presence = in_range("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        let frequency = in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        let min_p = in_range("min_p", self.min_p, 0.0, 1.0)?;
        let n = match self.n {
            None => 1,
            Some(n) if (1..=i64::from(MAX_N)).contains(&n) => n as u32,
            Some(n) => {
                return Err(ApiError::bad_param(
                    "n",
                    format!("n must be between 1 and {MAX_N}, got {n}"),
                ))
            }
        };
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => Some(("max_completion_tokens", m)),
            (None, Some(m)) => Some(("max_tokens", m)),
            (None, None) => None,
        };
        let max_tokens_param = max_tokens.map_or("max_tokens", |(param, _)| param);
        let max_tokens = match max_tokens {
            None => None,
            Some((_, m)) if m >= 1 && m <= i64::from(u32::MAX) => Some(m as u32),
            Some((param, m)) => {
                return Err(ApiError::bad_param(
                    param,
                    format!("{param} must be at least 1, got {m}"),
                ))
            }
        };
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 && k <= i64::from(u32::MAX) => k as u32,
            Some(k) => {
                return Err(ApiError::bad_param(
                    "top_k",
                    format!("top_k must be -1 (off) or positive, got {k}"),
                ))
            }
        };
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return Err(ApiError::bad_param(
                "logit_bias",
                "logit_bias is not supported",
            ));
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::bad_param(
                "stop",
                "stop strings must not be empty",
            ));
        }
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ApiError::bad_param(
                "stream_options",
                "stream_options is only allowed when stream is true",
            ));
        }
        let prompt_logprobs = match self.prompt_logprobs {
            None => None,
            Some(k) if (0..=i64::from(MAX_TOP_LOGPROBS)).contains(&k) => Some(k as u32),
            Some(k) => {
                return Err(ApiError::bad_param(
                    "prompt_logprobs",
                    format!("prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
                ))
            }
        };
        let beam_search = self.beam_search(n)?;
        Ok(Plan {
            echo: false,
            report_prompt_logprobs: prompt_logprobs.is_some(),
            max_tokens_param,
            template: v1::GenerateRequest {
                request_id: String::new(),
                prompt: None,
                sampling: Some(v1::SamplingParams {
                    // OpenAI's default temperature is 1.
                    temperature,
                    top_p,
                    top_k,
                    min_p: min_p.unwrap_or(0.0),
                    repetition_penalty: self.repetition_penalty,
                    presence_penalty: presence.unwrap_or(0.0),
                    frequency_penalty: frequency.unwrap_or(0.0),
                    seed: self.seed.map(|s| s as u64),
                }),
                max_tokens,
                n,
                stop,
                stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
                ignore_eos: self.ignore_eos.unwrap_or(false),
                logprobs: None,
                response_format: self.response_format()?,
                prompt_logprobs,
                beam_search,
                lora: String::new(),
            },
            n,
            stream,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
        })
    }
}

impl CommonParams {
    /// `use_beam_search` with its `best_of`, `length_penalty` and
    /// `early_stopping`; the engine checks that the sampling settings
    /// allow it.
    fn beam_search(&self, n: u32) -> Result<Option<v1::BeamSearch>, ApiError> {
        let best_of = match self.best_of {
            None => n,
            Some(b) if (1..=i64::from(MAX_N)).contains(&b) => b as u32,
            Some(b) => {
                return Err(ApiError::bad_param(
                    "best_of",
                    format!("best_of must be between 1 and {MAX_N}, got {b}"),
                ))
            }
        };
        if self.use_beam_search != Some(true) {
            if best_of != n {
                return Err(ApiError::bad_param(
                    "best_of",
                    "best_of other than n needs use_beam_search (sampled best_of is not supported)",
                ));
            }
            for (set, param) in [
                (self.length_penalty.is_some(), "length_penalty"),
                (self.early_stopping.is_some(), "early_stopping"),
            ] {
                if set {
                    return Err(ApiError::bad_param(
                        param,
                        format!("{param} needs use_beam_search"),
                    ));
                }
            }
            return Ok(None);
        }
        if best_of < n {
            return Err(ApiError::bad_param(
                "best_of",
                format!("best_of ({best_of}) must be at least n ({n})"),
            ));
        }
        let early_stopping = match &self.early_stopping {
            None | Some(serde_json::Value::Bool(false)) => v1::EarlyStopping::Heuristic,
            Some(serde_json::Value::Bool(true)) => v1::EarlyStopping::WhenFull,
            Some(serde_json::Value::String(s)) if s == "never" => v1::EarlyStopping::Never,
            Some(other) => {
                return Err(ApiError::bad_param(
                    "early_stopping",
                    format!("early_stopping must be true, false or \"never\", got {other}"),
                ))
            }
        };
        if self.length_penalty.is_some_and(|l| !l.is_finite()) {
            return Err(ApiError::bad_param(
                "length_penalty",
                "length_penalty must be a finite number",
            ));
        }
        Ok(Some(v1::BeamSearch {
            width: best_of,
            length_penalty: self.length_penalty,
            early_stopping: early_stopping as i32,
        }))
    }
}

impl CompletionRequest {
    /// The plan, with completions' `logprobs` (an integer) checked.
    pub fn plan(&self) -> Result<Plan, ApiError> {
        let mut plan = self.common.plan()?;
        plan.echo = self.echo == Some(true);
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::bad_param("suffix", "suffix is not supported"));
        }
        plan.template.logprobs = match self.logprobs {
            None => None,
            Some(k) if (0..=i64::from(MAX_TOP_LOGPROBS)).contains(&k) => Some(k as u32),
            Some(k) => {
                return Err(ApiError::bad_param(
                    "logprobs",
                    format!("logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
                ))
            }
        };
        // Echoed tokens carry logprobs too: the prompt is scored with (at
        // least) as many alternatives.
        if let (true, Some(k)) = (plan.echo, plan.template.logprobs) {
            let p = &mut plan.template.prompt_logprobs;
            *p = Some(p.map_or(k, |q| q.max(k)));
        }
        Ok(plan)
    }

    /// One backend prompt per prompt of the request.
    pub fn prompts(&self) -> Result<Vec<v1::generate_request::Prompt>, ApiError> {
        use v1::generate_request::Prompt;
        let prompts: Vec<Prompt> = match &self.prompt {
            PromptInput::Text(t) => vec![Prompt::Text(t.clone())],
            PromptInput::Texts(ts) => ts.iter().cloned().map(Prompt::Text).collect(),
            PromptInput::Tokens(ids) => vec![Prompt::TokenIds(v1::TokenIds { ids: ids.clone() })],
            PromptInput::TokenLists(l) => l
                .iter()
                .map(|ids| Prompt::TokenIds(v1::TokenIds { ids: ids.clone() }))
                .collect(),
        };
        if prompts.is_empty() {
            return Err(ApiError::bad_param("prompt", "prompt must not be empty"));
        }
        let empty = |p: &Prompt| match p {
            Prompt::Text(t) => t.is_empty(),
            Prompt::TokenIds(ids) => ids.ids.is_empty(),
        };
        if prompts.iter().any(empty) {
            return Err(ApiError::bad_param("prompt", "prompt must not be empty"));
        }
        Ok(prompts)
    }
}

/// The text of a list of content parts (`{"type", "text"}` objects, as the
/// Anthropic and Responses APIs send them) whose type is one of `kinds`;
/// any other part is a 400 naming `part_field(j)`.
pub(crate) fn join_text_parts(
    parts: &[serde_json::Value],
    kinds: &[&str],
    part_field: impl Fn(usize) -> String,
) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, p) in parts.iter().enumerate() {
        match (p["type"].as_str(), p["text"].as_str()) {
            (Some(kind), Some(t)) if kinds.contains(&kind) => text.push_str(t),
            (kind, _) => {
                return Err(ApiError::bad_param(
                    part_field(j),
                    format!(
                        "expected a text part ({}), got {}",
                        kinds.join(", "),
                        kind.unwrap_or("no type")
                    ),
                ))
            }
        }
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_logprobs_limit_is_the_engines() {
        assert_eq!(
            MAX_TOP_LOGPROBS as usize,
            tandem_engine::serving::MAX_LOGPROBS
        );
    }

    fn common(json: &str) -> CommonParams {
        serde_json::from_str(json).expect("parses")
    }

    #[test]
    fn maps_sampling_parameters() {
        let p = common(
            r#"{"temperature": 0.5, "top_p": 0.9, "n": 3, "max_tokens": 7, "seed": 42,
                "stop": "x", "presence_penalty": 1.0, "top_k": 5, "stream": true,
                "stream_options": {"include_usage": true}}"#,
        )
        .plan()
        .expect("valid");
        let s = p.template.sampling.expect("sampling");
        assert_eq!(s.temperature, Some(0.5));
        assert_eq!(s.top_p, Some(0.9));
        assert_eq!(s.top_k, 5);
        assert_eq!(s.seed, Some(42));
        assert_eq!(s.presence_penalty, 1.0);
        assert_eq!(p.template.max_tokens, Some(7));
        assert_eq!(p.template.stop, vec!["x".to_string()]);
        assert_eq!((p.n, p.stream, p.include_usage), (3, true, true));
    }

    #[test]
    fn maps_beam_search_and_refuses_what_it_cannot_do() {
        let p = common(
            r#"{"use_beam_search": true, "n": 2, "best_of": 4, "length_penalty": 0.5,
                "early_stopping": "never"}"#,
        )
        .plan()
        .expect("valid");
        let b = p.template.beam_search.expect("beam search");
        assert_eq!((b.width, b.length_penalty), (4, Some(0.5)));
        assert_eq!(b.early_stopping, v1::EarlyStopping::Never as i32);
        let b = common(r#"{"use_beam_search": true, "n": 3}"#)
            .plan()
            .expect("valid")
            .template
            .beam_search
            .expect("beam search");
        assert_eq!((b.width, b.early_stopping), (3, 0), "best_of defaults to n");
        assert_eq!(
            common(r#"{"n": 2, "best_of": 2}"#)
                .plan()
                .expect("valid")
                .template
                .beam_search,
            None
        );
        for (body, param) in [
            (r#"{"best_of": 3}"#, "best_of"),
            (
                r#"{"use_beam_search": true, "n": 3, "best_of": 2}"#,
                "best_of",
            ),
            (
                r#"{"use_beam_search": true, "early_stopping": "soon"}"#,
                "early_stopping",
            ),
            (r#"{"length_penalty": 2.0}"#, "length_penalty"),
        ] {
            let err = common(body).plan().expect_err(body);
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {err}");
        }
    }

    #[test]
    fn maps_structured_output_requests() {
        use v1::response_format::Format;
        let format = |json: &str| {
            common(json)
                .plan()
                .map(|p| p.template.response_format.and_then(|r| r.format))
        };
        assert_eq!(
            format(r#"{"response_format": {"type": "text"}}"#).ok(),
            Some(None)
        );
        assert_eq!(
            format(r#"{"response_format": {"type": "json_object"}}"#).ok(),
            Some(Some(Format::JsonObject(v1::JsonObject {})))
        );
        let Ok(Some(Format::JsonSchema(text))) = format(
            r#"{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}}"#,
        ) else {
            panic!("a schema")
        };
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&text).ok(),
            Some(serde_json::json!({"type": "integer"}))
        );
        assert_eq!(
            format(r#"{"structured_outputs": {"choice": ["a", "b"]}}"#).ok(),
            Some(Some(Format::Choice(v1::Choice {
                choices: vec!["a".into(), "b".into()]
            })))
        );
        assert_eq!(
            format(r#"{"structured_outputs": {"regex": "[0-9]+"}}"#).ok(),
            Some(Some(Format::Regex("[0-9]+".into())))
        );
        for bad in [
            r#"{"response_format": {"type": "xml"}}"#,
            r#"{"response_format": {"type": "json_schema"}}"#,
            r#"{"structured_outputs": {"regex": "a", "choice": ["b"]}}"#,
            r#"{"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}"#,
        ] {
            assert_eq!(
                format(bad).map_err(|e| e.status.as_u16()).err(),
                Some(400),
                "{bad}"
            );
        }
    }

    #[test]
    fn max_completion_tokens_wins() {
        let p = common(r#"{"max_tokens": 7, "max_completion_tokens": 9}"#)
            .plan()
            .expect("valid");
        assert_eq!(p.template.max_tokens, Some(9));
    }

    #[test]
    fn rejects_out_of_range_values() {
        for (json, param) in [
            (r#"{"temperature": 2.5}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"n": 0}"#, "n"),
            (r#"{"max_tokens": 0}"#, "max_tokens"),
            (r#"{"max_completion_tokens": -1}"#, "max_completion_tokens"),
            (r#"{"frequency_penalty": -3}"#, "frequency_penalty"),
            (r#"{"top_k": -2}"#, "top_k"),
            (r#"{"stop": ["a", ""]}"#, "stop"),
            (r#"{"logit_bias": {"1": 5}}"#, "logit_bias"),
            (
                r#"{"stream_options": {"include_usage": true}}"#,
                "stream_options",
            ),
        ] {
            let err = common(json).plan().expect_err(json);
            assert_eq!(err.status.as_u16(), 400, "{json}");
            assert_eq!(err.param.as_deref(), Some(param), "{json}");
        }
    }

    #[test]
    fn completion_logprobs_and_prompts() {
        let r: CompletionRequest = serde_json::from_str(
            r#"{"prompt": [[1, 2], [3]], "logprobs": 2, "n": 2, "best_of": 2}"#,
        )
        .expect("parses");
        assert_eq!(r.plan().expect("valid").template.logprobs, Some(2));
        assert_eq!(r.prompts().expect("valid").len(), 2);
        let r: CompletionRequest =
            serde_json::from_str(r#"{"prompt": "", "logprobs": 21}"#).expect("parses");
        assert_eq!(
            r.plan().expect_err("too many").param.as_deref(),
            Some("logprobs")
        );
        assert_eq!(
            r.prompts().expect_err("empty").param.as_deref(),
            Some("prompt")
        );
    }
}
