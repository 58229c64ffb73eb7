//! Stop strings, matched in time linear in the generated text.
//!
//! A request's stop strings are compiled once, at validation (on the
//! caller's thread, not the engine's), into one Aho–Corasick automaton
//! ([`StopStrings`]). Each choice then carries only a state of that
//! automaton ([`StopMatcher`]) and feeds it every new byte exactly once:
//! the cost per token is the token's bytes, whatever the number or length
//! of the stop strings. (Scanning the held-back text again for every stop
//! string on every token, as before, made one request with tens of
//! thousands of stop strings stall the engine thread for everyone.)
//!
//! The counts and lengths are capped all the same ([`MAX_STOP_STRINGS`],
//! [`MAX_STOP_STRING_BYTES`]): they bound the automaton's memory and the
//! text a choice holds back while a stop string could still be completing.

use std::sync::Arc;

use aho_corasick::automaton::{Automaton, StateID};
use aho_corasick::nfa::contiguous::NFA;
use aho_corasick::{Anchored, MatchKind};

use crate::error::{EngineError, Result};

/// Stop strings one request may set. OpenAI's API takes four; agent
/// frameworks send a handful more (role markers, tool delimiters).
pub const MAX_STOP_STRINGS: usize = 64;

/// The longest stop string, in UTF-8 bytes. A choice holds back up to this
/// many bytes minus one before releasing text.
pub const MAX_STOP_STRING_BYTES: usize = 512;

/// Stop token ids one request may set (each sampled token is looked up).
pub const MAX_STOP_TOKEN_IDS: usize = 1024;

/// A request's stop strings and the automaton that finds them.
#[derive(Debug)]
pub struct StopStrings {
    patterns: Vec<String>,
    /// The automaton and its unanchored start state; `None` without stop
    /// strings.
    automaton: Option<(NFA, StateID)>,
}

impl StopStrings {
    /// No stop strings.
    pub fn none() -> Arc<Self> {
        Arc::new(Self {
            patterns: Vec::new(),
            automaton: None,
        })
    }

    /// Checks and compiles `patterns`; errors name the `stop` field.
    pub fn new(patterns: Vec<String>) -> Result<Arc<Self>> {
        let invalid = |m: String| Err(EngineError::InvalidRequest(m));
        if patterns.len() > MAX_STOP_STRINGS {
            return invalid(format!(
                "stop: at most {MAX_STOP_STRINGS} stop strings, got {}",
                patterns.len()
            ));
        }
        if let Some((i, s)) = patterns
            .iter()
            .enumerate()
            .find(|(_, s)| s.len() > MAX_STOP_STRING_BYTES)
        {
            return invalid(format!(
                "stop[{i}]: a stop string is at most {MAX_STOP_STRING_BYTES} bytes, got {}",
                s.len()
            ));
        }
        if patterns.iter().any(String::is_empty) {
            return invalid("stop: stop strings must not be empty".into());
        }
        if patterns.is_empty() {
            return Ok(Self::none());
        }
        // Standard semantics: every pattern that ends at a position is
        // reported there (an overlapping search), so the earliest-starting
        // one can be chosen.
        let automaton = NFA::builder()
            .match_kind(MatchKind::Standard)
            .build(&patterns)
            .map_err(|e| EngineError::InvalidRequest(format!("stop: {e}")))?;
        let start = automaton
            .start_state(Anchored::No)
            .map_err(|e| EngineError::InvalidRequest(format!("stop: {e}")))?;
        Ok(Arc::new(Self {
            patterns,
            automaton: Some((automaton, start)),
        }))
    }

    /// The longest stop string's length in bytes (0 without any).
    pub fn longest(&self) -> usize {
        self.patterns.iter().map(String::len).max().unwrap_or(0)
    }

    /// A matcher at the start of a choice's text.
    pub fn matcher(self: &Arc<Self>) -> StopMatcher {
        let state = self.automaton.as_ref().map(|&(_, start)| start);
        StopMatcher {
            stops: self.clone(),
            state,
        }
    }
}

/// One choice's place in the stop-string automaton.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Arc<StopStrings>,
    /// `None` without stop strings.
    state: Option<StateID>,
}

/// A stop string found in the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopMatch {
    /// Byte offset of the match's start in the whole text.
    pub start: usize,
    /// Which stop string.
    pub stop: String,
}

impl StopMatcher {
    /// The stop strings this matcher looks for.
    pub fn stops(&self) -> &Arc<StopStrings> {
        &self.stops
    }

    /// Feeds `piece`, which begins at byte `offset` of the choice's text.
    /// Of the stop strings that end inside `piece`, the one that starts
    /// earliest (the first listed on a tie).
    pub fn feed(&mut self, offset: usize, piece: &[u8]) -> Option<StopMatch> {
        let (Some((nfa, _)), Some(state)) = (self.stops.automaton.as_ref(), self.state.as_mut())
        else {
            return None;
        };
        let mut best: Option<(usize, usize)> = None;
        for (i, &byte) in piece.iter().enumerate() {
            *state = nfa.next_state(Anchored::No, *state, byte);
            if !nfa.is_match(*state) {
                continue;
            }
            let end = offset + i + 1;
            for k in 0..nfa.match_len(*state) {
                let pattern = nfa.match_pattern(*state, k);
                let start = end - nfa.pattern_len(pattern);
                let candidate = (start, pattern.as_usize());
                if best.is_none_or(|b| candidate < b) {
                    best = Some(candidate);
                }
            }
        }
        best.map(|(start, pattern)| StopMatch {
            start,
            stop: self.stops.patterns[pattern].clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(s: &[&str]) -> Arc<StopStrings> {
        StopStrings::new(s.iter().map(|s| s.to_string()).collect()).expect("valid")
    }

    #[test]
    fn a_match_across_pieces_is_found_where_it_starts() {
        let mut m = stops(&["END"]).matcher();
        assert_eq!(m.feed(0, b"abcE"), None);
        assert_eq!(m.feed(4, b"N"), None);
        let found = m.feed(5, b"Dxyz").expect("match");
        assert_eq!(found.start, 3);
        assert_eq!(found.stop, "END");
    }

    #[test]
    fn of_the_matches_ending_in_a_piece_the_earliest_start_wins() {
        // "bc" ends first, but "abcd" ends in the same piece and starts
        // earlier: the text is cut before "abcd".
        let mut m = stops(&["bc", "abcd"]).matcher();
        let found = m.feed(0, b"xabcd").expect("match");
        assert_eq!((found.start, found.stop.as_str()), (1, "abcd"));
        // Split so "bc" completes first: it ends the choice there.
        let mut m = stops(&["bc", "abcd"]).matcher();
        let found = m.feed(0, b"xabc").expect("match");
        assert_eq!((found.start, found.stop.as_str()), (2, "bc"));
    }

    #[test]
    fn matches_are_found_like_a_naive_search() {
        // Against `str::find` over the whole text, on many random texts and
        // stop sets over a small alphabet (so matches overlap often).
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..2000 {
            let word = |next: &mut dyn FnMut(u64) -> u64, len: u64| -> String {
                (0..1 + next(len))
                    .map(|_| (b'a' + next(3) as u8) as char)
                    .collect()
            };
            let set: Vec<String> = (0..1 + next(4)).map(|_| word(&mut next, 4)).collect();
            let text = word(&mut next, 30);
            let s = StopStrings::new(set.clone()).expect("valid");
            let mut m = s.matcher();
            // Feed in random pieces; the first piece in which some stop
            // string completes must report the earliest start among those
            // complete by then.
            let bytes = text.as_bytes();
            let mut at = 0;
            let mut got = None;
            while at < bytes.len() && got.is_none() {
                let len = (1 + next(4) as usize).min(bytes.len() - at);
                got = m
                    .feed(at, &bytes[at..at + len])
                    .map(|f| (f.start, at + len));
                at += len;
            }
            let naive = |upto: usize| {
                set.iter()
                    .filter_map(|p| text[..upto].find(p.as_str()))
                    .min()
            };
            match got {
                Some((start, upto)) => assert_eq!(Some(start), naive(upto), "{set:?} {text:?}"),
                None => assert_eq!(naive(text.len()), None, "{set:?} {text:?}"),
            }
        }
    }

    #[test]
    fn limits_name_the_field() {
        let many = vec!["x".to_string(); MAX_STOP_STRINGS + 1];
        let e = StopStrings::new(many).expect_err("too many").to_string();
        assert!(e.contains("stop:") && e.contains("at most 64"), "{e}");
        let long = vec!["ok".into(), "y".repeat(MAX_STOP_STRING_BYTES + 1)];
        let e = StopStrings::new(long).expect_err("too long").to_string();
        assert!(
            e.contains("stop[1]") && e.contains("at most 512 bytes"),
            "{e}"
        );
        let e = StopStrings::new(vec![String::new()])
            .expect_err("empty")
            .to_string();
        assert!(e.contains("must not be empty"), "{e}");
    }
}
