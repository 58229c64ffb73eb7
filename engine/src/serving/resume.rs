//! Continuing a request begun on another worker, exactly (migration).
//!
//! A choice's state is a function of the tokens it has emitted: the
//! penalties count them, the grammar's matcher consumed them, the stop
//! strings' automaton and the detokenizer saw their text, and the random
//! stream of the next draw is keyed by their number (see
//! [`crate::sampling`]). So a request carries, per choice, the tokens its
//! client has received ([`Resume`]); the engine replays them into a fresh
//! choice (nothing is streamed for them) and goes on sampling from there.
//! The continuation emits what the first worker would have emitted: the
//! text a stop string held back comes out when it is certain, the token
//! count against `max_tokens` and the usage include the replayed tokens,
//! and the timings count from the request's first arrival.

use std::time::Duration;

use crate::error::{EngineError, Result};

/// Where a request begun elsewhere stands.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resume {
    /// Each choice's emitted tokens; a choice not listed has none.
    pub choices: Vec<ResumedChoice>,
    /// Time since the request first arrived: the timings count from there.
    pub elapsed: Duration,
    /// When its first token went out, after that arrival (`None`: before).
    pub first_token_after: Option<Duration>,
}

/// One choice's tokens so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResumedChoice {
    pub index: u32,
    pub tokens: Vec<u32>,
}

impl Resume {
    /// The tokens of choice `index` (none if it is not listed).
    pub fn tokens_of(&self, index: u32) -> &[u32] {
        self.choices
            .iter()
            .find(|c| c.index == index)
            .map_or(&[], |c| c.tokens.as_slice())
    }
}

/// What validation checks a resume against.
pub(crate) struct ResumeBounds {
    pub n: usize,
    pub max_tokens: usize,
    pub vocab_size: usize,
    /// The request searches beams, scores its prompt or only exports it.
    pub refused_by: Option<&'static str>,
}

/// Checks `resume` against the request; errors name the field.
pub(crate) fn check(resume: &Resume, b: &ResumeBounds) -> Result<()> {
    let invalid = |m: String| Err(EngineError::InvalidRequest(m));
    if let Some(field) = b.refused_by {
        return invalid(format!(
            "resume: a request with {field} cannot be resumed (send it again from its prompt)"
        ));
    }
    if resume.choices.len() > b.n {
        return invalid(format!(
            "resume.choices: {} choices for a request of n = {}",
            resume.choices.len(),
            b.n
        ));
    }
    for (i, c) in resume.choices.iter().enumerate() {
        if c.index as usize >= b.n {
            return invalid(format!(
                "resume.choices[{i}].index: {} is not below n = {}",
                c.index, b.n
            ));
        }
        if resume.choices[..i].iter().any(|o| o.index == c.index) {
            return invalid(format!(
                "resume.choices[{i}].index: choice {} is listed twice",
                c.index
            ));
        }
        if c.tokens.len() > b.max_tokens {
            return invalid(format!(
                "resume.choices[{i}].tokens: {} tokens, more than max_tokens ({})",
                c.tokens.len(),
                b.max_tokens
            ));
        }
        if let Some(&bad) = c.tokens.iter().find(|&&t| t as usize >= b.vocab_size) {
            return invalid(format!(
                "resume.choices[{i}].tokens: token id {bad} is outside the vocabulary (size {})",
                b.vocab_size
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds() -> ResumeBounds {
        ResumeBounds {
            n: 2,
            max_tokens: 4,
            vocab_size: 10,
            refused_by: None,
        }
    }

    fn choice(index: u32, tokens: Vec<u32>) -> ResumedChoice {
        ResumedChoice { index, tokens }
    }

    fn error(r: &Resume, b: &ResumeBounds) -> String {
        match check(r, b) {
            Err(EngineError::InvalidRequest(m)) => m,
            other => panic!("expected an invalid request, got {other:?}"),
        }
    }

    #[test]
    fn a_resume_must_fit_its_request() {
        let ok = Resume {
            choices: vec![choice(1, vec![3]), choice(0, vec![1, 2, 3, 4])],
            ..Resume::default()
        };
        assert!(check(&ok, &bounds()).is_ok());
        assert_eq!(ok.tokens_of(1), &[3]);
        let cases = [
            (vec![choice(2, vec![])], "resume.choices[0].index"),
            (vec![choice(0, vec![]), choice(0, vec![])], "listed twice"),
            (vec![choice(0, vec![1; 5])], "more than max_tokens"),
            (vec![choice(1, vec![10])], "outside the vocabulary"),
            (
                vec![choice(0, vec![]), choice(1, vec![]), choice(1, vec![])],
                "3 choices",
            ),
        ];
        for (choices, want) in cases {
            let r = Resume {
                choices,
                ..Resume::default()
            };
            let m = error(&r, &bounds());
            assert!(m.contains(want), "{m}");
        }
        let beams = ResumeBounds {
            refused_by: Some("beam search"),
            ..bounds()
        };
        assert!(error(&ok, &beams).contains("beam search"));
    }
}

/// Why a request's choices could not be set up: a resumed choice whose
/// tokens do not replay (the request fails; nothing was streamed).
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The request's sampling parameters were refused.
    #[error("sampling: {0}")]
    Sampler(#[source] EngineError),
    /// A replayed token the grammar or the detokenizer refused.
    #[error("resume: choice {index}, token {at}: {source}")]
    Token {
        index: u32,
        at: usize,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The choice ended before its last replayed token.
    #[error("resume: choice {index}, token {at}: the choice ended here, before its last token")]
    EndedEarly { index: u32, at: usize },
}
