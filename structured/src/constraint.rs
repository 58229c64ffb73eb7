//! One sequence's grammar state and its next-token mask.

use std::time::{Duration, Instant};

use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;

use crate::error::{Result, StructuredError};

/// The tokens allowed next: a bitset over the vocabulary.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenMask {
    vob: SimpleVob,
    allowed: usize,
}

impl std::fmt::Debug for TokenMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenMask")
            .field("len", &self.vob.len())
            .field("allowed", &self.allowed)
            .finish()
    }
}

impl TokenMask {
    pub(crate) fn from_vob(vob: SimpleVob) -> Self {
        let allowed = vob.num_set();
        Self { vob, allowed }
    }

    /// A mask allowing exactly `tokens` out of `len`.
    pub fn from_tokens(len: usize, tokens: &[u32]) -> Self {
        let mut vob = SimpleVob::alloc(len);
        for &t in tokens {
            if (t as usize) < len {
                vob.allow_token(t);
            }
        }
        Self::from_vob(vob)
    }

    /// Whether `token` may come next.
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.vob.len() && self.vob.is_allowed(token)
    }

    /// How many tokens may come next.
    pub fn num_allowed(&self) -> usize {
        self.allowed
    }

    /// The allowed ids, ascending.
    pub fn allowed_tokens(&self) -> Vec<u32> {
        self.vob.to_list()
    }

    /// Sets every disallowed logit (and any past the mask) to −∞.
    pub fn apply(&self, logits: &mut [f32]) {
        let words = self.vob.as_slice();
        for (chunk, w) in logits.chunks_mut(32).enumerate() {
            let word = words.get(chunk).copied().unwrap_or(0);
            if word == u32::MAX {
                continue;
            }
            if word == 0 {
                w.fill(f32::NEG_INFINITY);
                continue;
            }
            for (bit, v) in w.iter_mut().enumerate() {
                if word & (1 << bit) == 0 {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// What committing a token did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    /// The grammar is complete and nothing may follow: end the sequence
    /// (finish reason `stop`).
    pub stopped: bool,
}

/// One sequence's place in its grammar: a private parser and the mask of
/// its next token (computed once per token, possibly on another thread).
pub struct Constraint {
    matcher: Matcher,
    /// The mask for the next token; `None` after a commit until computed.
    mask: Option<TokenMask>,
    /// Tokens committed so far.
    committed: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("committed", &self.committed)
            .field("mask", &self.mask)
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

fn matcher_err(e: &dyn std::fmt::Display) -> StructuredError {
    StructuredError::Matcher(e.to_string())
}

impl Constraint {
    pub(crate) fn new(matcher: Matcher, first_mask: TokenMask) -> Self {
        Self {
            matcher,
            mask: Some(first_mask),
            committed: 0,
        }
    }

    /// The mask for the next token, if computed.
    pub fn mask(&self) -> Option<&TokenMask> {
        self.mask.as_ref()
    }

    /// Whether the next token's mask still has to be computed.
    pub fn needs_mask(&self) -> bool {
        self.mask.is_none()
    }

    /// Computes the next token's mask unless it is known; returns the time
    /// spent. A mask that allows nothing is [`StructuredError::DeadEnd`].
    pub fn compute_mask(&mut self) -> Result<Duration> {
        if self.mask.is_some() {
            return Ok(Duration::ZERO);
        }
        let t0 = Instant::now();
        let vob = self.matcher.compute_mask().map_err(|e| matcher_err(&e))?;
        let mask = TokenMask::from_vob(vob);
        if mask.num_allowed() == 0 {
            return Err(StructuredError::DeadEnd);
        }
        self.mask = Some(mask);
        Ok(t0.elapsed())
    }

    /// Advances over one sampled token (which the mask allowed).
    pub fn commit(&mut self, token: u32) -> Result<Commit> {
        if let Some(m) = &self.mask {
            if !m.allows(token) {
                return Err(StructuredError::Matcher(format!(
                    "token {token} is not allowed by the grammar here"
                )));
            }
        }
        self.mask = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| matcher_err(&e))?;
        self.committed += 1;
        Ok(Commit {
            stopped: self.matcher.is_stopped(),
        })
    }

    /// The speculative-decoding seam: commits the longest prefix of
    /// `drafted` the grammar accepts and returns its length. The caller
    /// keeps that many drafted tokens (plus one it samples itself from the
    /// masked distribution at the first rejected position).
    pub fn accept_prefix(&mut self, drafted: &[u32]) -> Result<usize> {
        if drafted.is_empty() {
            return Ok(0);
        }
        self.mask = None;
        let n = self
            .matcher
            .try_consume_tokens(drafted)
            .map_err(|e| matcher_err(&e))?;
        self.committed += n;
        Ok(n)
    }

    /// Undoes the last `n` committed tokens (drafted tokens the target model
    /// rejected).
    pub fn rollback(&mut self, n: usize) -> Result<()> {
        if n > self.committed {
            return Err(StructuredError::Matcher(format!(
                "cannot roll back {n} tokens, only {} committed",
                self.committed
            )));
        }
        if n == 0 {
            return Ok(());
        }
        self.mask = None;
        self.matcher.rollback(n).map_err(|e| matcher_err(&e))?;
        self.committed -= n;
        Ok(())
    }

    /// Whether the grammar is complete and nothing may follow.
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Tokens committed so far.
    pub fn committed(&self) -> usize {
        self.committed
    }

    /// An independent copy (parallel samples of one prompt): same place in
    /// the grammar, same pending mask, its own parser and lexer cache.
    pub fn fork(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            mask: self.mask.clone(),
            committed: self.committed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_set_disallowed_logits_to_minus_infinity() {
        let m = TokenMask::from_tokens(70, &[0, 33, 64, 69, 500]);
        assert_eq!(m.num_allowed(), 4);
        assert!(m.allows(33) && !m.allows(34) && !m.allows(500));
        let mut logits = vec![1.0f32; 75];
        m.apply(&mut logits);
        for (i, v) in logits.iter().enumerate() {
            let want = [0, 33, 64, 69].contains(&i);
            assert_eq!(v.is_finite(), want, "logit {i}");
        }
        assert_eq!(m.allowed_tokens(), vec![0, 33, 64, 69]);
    }
}
