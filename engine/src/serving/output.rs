//! Turning one choice's tokens into text: incremental detokenization and
//! stop strings.
//!
//! Text is released as soon as it is certain: a UTF-8 character split across
//! tokens waits for its last byte ([`StreamDecoder`]), and the last
//! `longest stop string - 1` bytes wait until they cannot be the start of a
//! stop string. When a stop string appears, the text is cut before it and
//! the choice ends. Stop strings are found by [`StopMatcher`], which sees
//! each byte once.

use std::sync::Arc;

use super::stop::{StopMatcher, StopStrings};
use crate::error::Result;
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// One choice's text state.
#[derive(Debug)]
pub(crate) struct TextOutput {
    decoder: StreamDecoder,
    stops: StopMatcher,
    /// Bytes that could begin a stop string are held back.
    hold: usize,
    /// All text so far (cut at a matched stop string).
    text: String,
    /// Bytes of `text` already released.
    sent: usize,
}

/// Where a text update leaves the choice.
#[derive(Debug, PartialEq)]
pub(crate) struct TextUpdate {
    /// Newly released text.
    pub delta: String,
    /// The stop string that ended the choice, if one did.
    pub matched_stop: Option<String>,
}

impl TextOutput {
    pub fn new(prompt: &[u32], stops: &Arc<StopStrings>) -> Self {
        let hold = stops.longest().saturating_sub(1);
        Self {
            decoder: StreamDecoder::after_prompt(prompt),
            stops: stops.matcher(),
            hold,
            text: String::new(),
            sent: 0,
        }
    }

    /// The stop strings.
    pub fn stops(&self) -> Arc<StopStrings> {
        self.stops.stops().clone()
    }

    /// Adds one token's text; releases what is certain, or ends the choice
    /// at a stop string.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<TextUpdate> {
        let piece = self.decoder.push(tok, id)?;
        Ok(self.push_text(&piece))
    }

    fn push_text(&mut self, piece: &str) -> TextUpdate {
        let before = self.text.len();
        self.text.push_str(piece);
        if let Some(found) = self.stops.feed(before, piece.as_bytes()) {
            self.text.truncate(found.start);
            return TextUpdate {
                delta: self.flush(),
                matched_stop: Some(found.stop),
            };
        }
        let mut safe = self.text.len().saturating_sub(self.hold).max(self.sent);
        while !self.text.is_char_boundary(safe) {
            safe -= 1;
        }
        let delta = self.text[self.sent..safe.max(self.sent)].to_string();
        self.sent = safe.max(self.sent);
        TextUpdate {
            delta,
            matched_stop: None,
        }
    }

    /// Releases everything held back (the choice ended another way).
    pub fn flush(&mut self) -> String {
        let out = self.text[self.sent.min(self.text.len())..].to_string();
        self.sent = self.text.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(stops: &[&str]) -> TextOutput {
        let stops = StopStrings::new(stops.iter().map(|s| s.to_string()).collect());
        TextOutput::new(&[], &stops.expect("valid stop strings"))
    }

    #[test]
    fn without_stops_text_flows_through() {
        let mut o = out(&[]);
        assert_eq!(o.push_text("Hello").delta, "Hello");
        assert_eq!(o.push_text(" world").delta, " world");
        assert_eq!(o.flush(), "");
    }

    #[test]
    fn a_stop_string_across_pieces_is_cut() {
        let mut o = out(&["END"]);
        let mut seen = String::new();
        for p in ["abc", "E", "N", "Dxyz"] {
            let u = o.push_text(p);
            seen.push_str(&u.delta);
            if let Some(s) = u.matched_stop {
                assert_eq!(s, "END");
                assert_eq!(seen, "abc");
                return;
            }
        }
        panic!("stop string not found");
    }

    #[test]
    fn held_back_text_is_released_when_it_cannot_match() {
        let mut o = out(&["END"]);
        assert_eq!(o.push_text("abE").delta, "a");
        assert_eq!(o.push_text("x").delta, "b");
        assert_eq!(o.flush(), "Ex");
    }

    #[test]
    fn holding_back_never_splits_a_character() {
        let mut o = out(&["xyz"]);
        let u = o.push_text("aé");
        assert!(u.delta.is_empty() || u.delta == "a");
        let rest = o.flush();
        assert_eq!(format!("{}{}", u.delta, rest), "aé");
    }
}
