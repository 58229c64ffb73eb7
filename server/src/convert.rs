//! Between `tandem.v1` messages and the engine's request and event types.
//!
//! The wire format has proto3 defaults (0 for an absent number), so fields
//! whose zero is meaningful are `optional` in the .proto and defaulted here:
//! temperature, top_p and repetition_penalty default to 1, `n` 0 means 1, an
//! absent `max_tokens` means "up to the context limit". Range checks are the
//! engine's (one place, one wording); this layer only reports what the wire
//! cannot express, such as a missing prompt.

use std::time::Duration;

use tandem_engine::serving::{
    BeamSearch, ChoiceSummary, EarlyStopping, PrefillMode, Prompt, Request, RequestEvent,
    RequestFailure, RequestSummary, ResponseFormat, TokenDelta,
};
use tandem_engine::{FinishReason, SamplingParams, TokenLogprob};
use tandem_proto::v1;

/// A request the wire format allows but the API does not.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadRequest(pub String);

/// The engine request for a `GenerateRequest`.
pub fn request_from_proto(req: v1::GenerateRequest) -> Result<Request, BadRequest> {
    let prompt = match req.prompt {
        Some(v1::generate_request::Prompt::Text(t)) => Prompt::Text(t),
        Some(v1::generate_request::Prompt::TokenIds(ids)) => Prompt::Tokens(ids.ids),
        None => {
            return Err(BadRequest(
                "prompt: one of prompt.text or prompt.token_ids is required".into(),
            ))
        }
    };
    let s = req.sampling.unwrap_or_default();
    let beam = req.beam_search.map(|b| beam_from_proto(b, req.n));
    let sampling = SamplingParams {
        // Beam search does not sample: its default temperature is 0.
        temperature: s
            .temperature
            .unwrap_or(if beam.is_some() { 0.0 } else { 1.0 }),
        top_k: s.top_k as usize,
        top_p: s.top_p.unwrap_or(1.0),
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        seed: s.seed,
        logprobs: req.logprobs.map(|n| n as usize),
    };
    Ok(Request {
        request_id: req.request_id,
        prompt,
        sampling,
        max_tokens: req.max_tokens.map(|n| n as usize),
        n: (req.n as usize).max(1),
        stop: req.stop,
        stop_token_ids: req.stop_token_ids,
        ignore_eos: req.ignore_eos,
        prefill: PrefillMode::Local,
        response_format: req.response_format.map(format_from_proto).transpose()?,
        prompt_logprobs: req
            .prompt_logprobs
            .map(|n| tandem_engine::serving::PromptLogprobs::top(n as usize)),
        beam,
        lora: (!req.lora.is_empty()).then_some(req.lora),
        resume: None,
        span: tracing::Span::none(),
    })
}

/// The engine's beam search for a `BeamSearch` (width 0 means `n`).
fn beam_from_proto(b: v1::BeamSearch, n: u32) -> BeamSearch {
    let early_stopping = match v1::EarlyStopping::try_from(b.early_stopping) {
        Ok(v1::EarlyStopping::WhenFull) => EarlyStopping::WhenFull,
        Ok(v1::EarlyStopping::Never) => EarlyStopping::Never,
        Ok(v1::EarlyStopping::Heuristic) | Err(_) => EarlyStopping::Heuristic,
    };
    let width = if b.width == 0 { n.max(1) } else { b.width };
    BeamSearch {
        width: width as usize,
        length_penalty: b.length_penalty.unwrap_or(1.0),
        early_stopping,
    }
}

/// The engine's format for a `ResponseFormat` (compiled, and checked, by the
/// engine at admission).
fn format_from_proto(f: v1::ResponseFormat) -> Result<ResponseFormat, BadRequest> {
    use v1::response_format::Format;
    Ok(match f.format {
        Some(Format::JsonSchema(s)) => ResponseFormat::JsonSchema(s),
        Some(Format::JsonObject(_)) => ResponseFormat::JsonObject,
        Some(Format::Regex(r)) => ResponseFormat::Regex(r),
        Some(Format::Choice(c)) => ResponseFormat::Choice(c.choices),
        Some(Format::Grammar(g)) => ResponseFormat::Grammar(g),
        None => {
            return Err(BadRequest(
                "response_format: one of json_schema, json_object, regex, choice or grammar \
                 is required"
                    .into(),
            ))
        }
    })
}

fn finish_to_proto(f: Option<FinishReason>) -> i32 {
    let r = match f {
        None => v1::FinishReason::Unspecified,
        Some(FinishReason::Stop) => v1::FinishReason::Stop,
        Some(FinishReason::Length) => v1::FinishReason::Length,
        Some(FinishReason::Abort) => v1::FinishReason::Abort,
    };
    r as i32
}

/// An engine logprob report on the wire.
pub fn logprob_to_proto(lp: TokenLogprob) -> v1::TokenLogprob {
    v1::TokenLogprob {
        token_id: lp.token,
        logprob: lp.logprob,
        top: lp
            .top
            .into_iter()
            .map(|(token_id, logprob)| v1::TopLogprob { token_id, logprob })
            .collect(),
    }
}

/// A logprob report from the wire (a prefill worker's prompt scores).
pub fn logprob_from_proto(lp: v1::TokenLogprob) -> TokenLogprob {
    TokenLogprob {
        token: lp.token_id,
        logprob: lp.logprob,
        top: lp
            .top
            .into_iter()
            .map(|t| (t.token_id, t.logprob))
            .collect(),
    }
}

fn delta_to_proto(d: TokenDelta) -> v1::TokenDelta {
    v1::TokenDelta {
        index: d.index,
        token_ids: d.token_ids,
        text: d.text,
        logprobs: d.logprobs.into_iter().map(logprob_to_proto).collect(),
        finish_reason: finish_to_proto(d.finish_reason),
    }
}

fn secs(d: Option<Duration>) -> f64 {
    d.map_or(0.0, |d| d.as_secs_f64())
}

fn choice_to_proto(c: ChoiceSummary) -> v1::ChoiceSummary {
    v1::ChoiceSummary {
        index: c.index,
        finish_reason: finish_to_proto(Some(c.finish_reason)),
        matched_stop: c.matched_stop.unwrap_or_default(),
        completion_tokens: c.completion_tokens as u32,
    }
}

fn summary_to_proto(s: RequestSummary) -> v1::Finished {
    v1::Finished {
        choices: s.choices.into_iter().map(choice_to_proto).collect(),
        usage: Some(v1::Usage {
            prompt_tokens: s.usage.prompt_tokens as u32,
            cached_tokens: s.usage.cached_tokens as u32,
            completion_tokens: s.usage.completion_tokens as u32,
        }),
        timings: Some(v1::Timings {
            queue_time_s: s.timings.queue.as_secs_f64(),
            ttft_s: secs(s.timings.ttft),
            tpot_s: secs(s.timings.tpot),
            e2e_s: s.timings.e2e.as_secs_f64(),
        }),
        speculation: (s.speculation.drafted > 0).then(|| v1::Speculation {
            drafted_tokens: s.speculation.drafted,
            accepted_tokens: s.speculation.accepted,
            verifications: s.speculation.verifications,
            acceptance_rate: s.speculation.acceptance_rate(),
            mean_accepted_length: s.speculation.mean_accepted_len(),
        }),
    }
}

/// The wire message for an engine event; `Err` carries an engine failure.
pub fn event_to_proto(
    request_id: &str,
    ev: RequestEvent,
) -> Result<v1::GenerateResponse, RequestFailure> {
    let event = match ev {
        RequestEvent::Delta(d) => v1::generate_response::Event::Delta(delta_to_proto(d)),
        RequestEvent::Finished(s) => v1::generate_response::Event::Finished(summary_to_proto(s)),
        RequestEvent::PromptLogprobs(lps) => {
            v1::generate_response::Event::PromptLogprobs(v1::PromptLogprobs {
                logprobs: lps.into_iter().map(logprob_to_proto).collect(),
            })
        }
        RequestEvent::Error(e) => return Err(e),
        // The engine's stream hands remote prefills to the decode worker's
        // prefiller, and without one a remote placement is made local: only
        // an engine core driven directly emits this.
        RequestEvent::RemotePrefill(_) => {
            return Err(RequestFailure::engine(
                "unexpected remote-prefill event on a colocated request",
            ))
        }
    };
    Ok(v1::GenerateResponse {
        request_id: request_id.to_string(),
        event: Some(event),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beam_search_defaults_to_n_beams_and_temperature_zero() {
        let req = v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::Text("x".into())),
            n: 2,
            beam_search: Some(v1::BeamSearch {
                early_stopping: v1::EarlyStopping::WhenFull as i32,
                ..Default::default()
            }),
            ..Default::default()
        };
        let r = request_from_proto(req).expect("valid");
        let beam = r.beam.expect("beam search");
        assert_eq!(beam.width, 2);
        assert_eq!(beam.length_penalty, 1.0);
        assert_eq!(beam.early_stopping, EarlyStopping::WhenFull);
        assert_eq!(r.sampling.temperature, 0.0);
        let plain = request_from_proto(v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::Text("x".into())),
            ..Default::default()
        })
        .expect("valid");
        assert_eq!((plain.beam, plain.sampling.temperature), (None, 1.0));
    }

    #[test]
    fn absent_fields_take_the_api_defaults() {
        let req = v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::Text("hi".into())),
            ..Default::default()
        };
        let r = request_from_proto(req).expect("valid");
        assert_eq!(r.sampling.temperature, 1.0);
        assert_eq!(r.sampling.top_p, 1.0);
        assert_eq!(r.sampling.repetition_penalty, 1.0);
        assert_eq!(r.n, 1);
        assert_eq!(r.max_tokens, None);
        assert_eq!(r.sampling.logprobs, None);
    }

    #[test]
    fn response_formats_map_and_an_empty_one_is_named() {
        use v1::response_format::Format;
        let with = |f: Option<Format>| v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::Text("hi".into())),
            response_format: Some(v1::ResponseFormat { format: f }),
            ..Default::default()
        };
        let r = request_from_proto(with(Some(Format::Choice(v1::Choice {
            choices: vec!["a".into(), "b".into()],
        }))))
        .expect("valid");
        assert_eq!(
            r.response_format,
            Some(ResponseFormat::Choice(vec!["a".into(), "b".into()]))
        );
        let r = request_from_proto(with(Some(Format::JsonObject(v1::JsonObject {})))).expect("ok");
        assert_eq!(r.response_format, Some(ResponseFormat::JsonObject));
        let err = request_from_proto(with(None)).expect_err("empty format");
        assert!(err.0.starts_with("response_format"), "{err}");
        let plain = request_from_proto(v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::Text("hi".into())),
            ..Default::default()
        })
        .expect("valid");
        assert_eq!(plain.response_format, None);
    }

    #[test]
    fn a_missing_prompt_is_named() {
        let err = request_from_proto(v1::GenerateRequest::default()).expect_err("no prompt");
        assert!(err.0.starts_with("prompt"), "{err}");
    }

    #[test]
    fn explicit_zeros_survive() {
        let req = v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
                ids: vec![1, 2],
            })),
            sampling: Some(v1::SamplingParams {
                temperature: Some(0.0),
                top_p: Some(0.0),
                ..Default::default()
            }),
            max_tokens: Some(0),
            ..Default::default()
        };
        let r = request_from_proto(req).expect("converts; the engine rejects");
        assert_eq!(r.sampling.temperature, 0.0);
        assert_eq!(r.sampling.top_p, 0.0);
        assert_eq!(r.max_tokens, Some(0));
    }
}
