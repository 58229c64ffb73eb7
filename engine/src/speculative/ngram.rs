//! Prompt lookup: draft by copying what followed the last time the
//! sequence's latest n-gram appeared in it (vLLM's `ngram` method).
//!
//! No second model and no state: the drafts are deterministic (probability
//! one each), which pays off on inputs that repeat themselves — code edits,
//! retrieval answers quoting the prompt, summaries — and costs nothing when
//! there is no match (the sequence then decodes one token as usual).

use crate::error::Result;

use super::{DraftRequest, Drafter};

/// Prompt-lookup drafter.
#[derive(Debug, Clone)]
pub struct NgramDrafter {
    min_n: usize,
    max_n: usize,
    /// Only the last `window` tokens are searched (bounds the cost).
    window: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        Self::new(1, 4)
    }
}

impl NgramDrafter {
    /// Matches suffixes of `max_n` tokens down to `min_n` (longest first).
    pub fn new(min_n: usize, max_n: usize) -> Self {
        let min_n = min_n.max(1);
        Self {
            min_n,
            max_n: max_n.max(min_n),
            window: 8192,
        }
    }

    /// The tokens that followed an earlier occurrence of the longest
    /// matching suffix, at most `k`: the most recent occurrence with `k`
    /// tokens after it, else the one with the most.
    pub fn lookup(&self, tokens: &[u32], k: usize) -> Vec<u32> {
        let tokens = &tokens[tokens.len().saturating_sub(self.window)..];
        let len = tokens.len();
        for n in (self.min_n..=self.max_n).rev() {
            if n >= len {
                continue;
            }
            let suffix = &tokens[len - n..];
            // Most recent first: a sequence that loops repeats its latest
            // cycle; but the latest match of a short cycle has few tokens
            // after it, so an older one with a full draft wins.
            let mut best: Option<(usize, usize)> = None;
            for start in (0..len - n).rev() {
                if &tokens[start..start + n] != suffix {
                    continue;
                }
                let from = start + n;
                let got = (len - from).min(k);
                if best.is_none_or(|(_, b)| got > b) {
                    best = Some((from, got));
                }
                if got == k {
                    break;
                }
            }
            if let Some((from, got)) = best.filter(|&(_, got)| got > 0) {
                return tokens[from..from + got].to_vec();
            }
        }
        Vec::new()
    }
}

impl Drafter for NgramDrafter {
    fn name(&self) -> &'static str {
        "ngram"
    }

    fn propose(&mut self, requests: &mut [DraftRequest<'_>]) -> Result<()> {
        for r in requests {
            r.draft.tokens = self.lookup(r.tokens, r.k);
            r.draft.probs.clear();
        }
        Ok(())
    }

    fn rollback(&mut self, _seq: u64, _tokens: &[u32]) {}

    fn release(&mut self, _seq: u64) {}

    fn cost_per_token(&self) -> f64 {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_what_followed_the_latest_match_of_the_longest_suffix() {
        let d = NgramDrafter::new(1, 3);
        // Suffix [7, 8] occurred at 1..3 followed by 9, 10, 11.
        assert_eq!(d.lookup(&[1, 7, 8, 9, 10, 11, 5, 7, 8], 3), vec![9, 10, 11]);
        // Capped at k, and by the end of the sequence.
        assert_eq!(d.lookup(&[1, 7, 8, 9, 10, 11, 5, 7, 8], 1), vec![9]);
        // The latest of two matches wins ...
        assert_eq!(d.lookup(&[4, 1, 4, 2, 4], 1), vec![2]);
        // ... unless an older one has more tokens after it.
        assert_eq!(d.lookup(&[5; 7], 3), vec![5, 5, 5]);
        // No match, no draft.
        assert!(d.lookup(&[1, 2, 3, 4], 3).is_empty());
        assert!(d.lookup(&[], 3).is_empty());
    }

    #[test]
    fn a_looping_sequence_is_drafted_through_its_cycle() {
        let d = NgramDrafter::new(2, 4);
        let seq = [5, 1, 2, 3, 1, 2, 3, 1, 2];
        assert_eq!(d.lookup(&seq, 4), vec![3, 1, 2]);
    }
}
