//! Token sampling.
//!
//! The order is vLLM's: penalties on the raw logits (repetition over prompt
//! and output, Hugging Face semantics; presence and frequency over output,
//! OpenAI semantics), then temperature, then top-k, top-p and min-p filters,
//! then one draw from the renormalised distribution. Temperature 0 is greedy.
//! Logprobs report the model's raw distribution (log-softmax of unpenalised
//! logits), as vLLM does by default, so they are comparable across settings.
//!
//! A constrained request ([`Sampler::sample_masked`]) first sets the logits
//! of every token its grammar forbids to −∞, before anything else: greedy and
//! sampled draws alike can only pick an allowed token, and logprobs are those
//! of the masked distribution (renormalised over the allowed tokens; the top
//! alternatives list only allowed ones) — as in vLLM V1, which applies the
//! grammar bitmask to the logits the sampler (and its logprobs) then sees.
//!
//! A seed makes the draws reproducible: the generator is xoshiro256** seeded
//! through SplitMix64, owned by the request, independent of batch-mates.
//! Each output position has its own stream, keyed by the seed and the
//! position: what a token's draw uses depends only on the seed and how many
//! tokens came before it, so a request continued on another worker
//! ([`Sampler::replay`]) draws what it would have drawn here.

use std::collections::HashMap;

use tandem_structured::TokenMask;

use crate::error::{EngineError, Result};
use crate::kernels::log_softmax;

mod select;

pub use select::argmax;
pub(crate) use select::top_k_logits;
use select::{exp_nonpositive, keep_top_p, top_n};

/// Per-request sampling settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub min_p: f32,
    /// 1 disables; > 1 discourages tokens already in prompt or output.
    pub repetition_penalty: f32,
    /// Subtracted once from tokens already generated.
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the output.
    pub frequency_penalty: f32,
    /// Makes sampling reproducible.
    pub seed: Option<u64>,
    /// Report the chosen token's logprob plus this many top alternatives.
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Rejects values that have no meaning.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        if !self.presence_penalty.is_finite() || !self.frequency_penalty.is_finite() {
            return bad("presence and frequency penalties must be finite".into());
        }
        Ok(())
    }
}

/// The logprob of a chosen token and the top alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// `(token, logprob)`, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: Option<TokenLogprob>,
}

/// xoshiro256**, seeded by SplitMix64.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator whose stream depends only on `seed`.
    pub fn seeded(seed: u64) -> Self {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^ (x >> 31)
        };
        Self {
            s: [next(), next(), next(), next()],
        }
    }

    /// Seeded from the clock, for requests without a seed.
    pub fn from_entropy() -> Self {
        Self::seeded(entropy())
    }

    /// The stream of output position `position` of the request keyed by
    /// `key`.
    fn for_position(key: u64, position: u64) -> Self {
        Self::seeded(key.rotate_left(17) ^ position.wrapping_mul(0xd1b5_4a32_d192_ed03))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A key from the clock, for requests without a seed.
fn entropy() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ u64::from(std::process::id()).rotate_left(32)
}

/// A request's sampler: its parameters, its random streams and the counts
/// the penalties need.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    /// Keys every position's stream: the seed, or entropy.
    key: u64,
    /// Tokens recorded so far: the position the next draw belongs to.
    position: u64,
    /// The stream of position `stream_at`.
    rng: Rng,
    stream_at: u64,
    /// Occurrences of each token in the output so far.
    output_counts: HashMap<u32, u32>,
    /// Tokens in the prompt (for the repetition penalty).
    prompt_tokens: Vec<u32>,
}

impl Sampler {
    /// A sampler for one request with this prompt.
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Result<Self> {
        params.validate()?;
        let key = params.seed.unwrap_or_else(entropy);
        let mut prompt_tokens = prompt.to_vec();
        prompt_tokens.sort_unstable();
        prompt_tokens.dedup();
        Ok(Self {
            params,
            key,
            position: 0,
            rng: Rng::for_position(key, 0),
            stream_at: 0,
            output_counts: HashMap::new(),
            prompt_tokens,
        })
    }

    /// The request's parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records tokens this choice emitted before (elsewhere), as if sampled
    /// here: the penalties count them and the next draw comes from the
    /// stream of the position after them.
    pub fn replay(&mut self, tokens: &[u32]) {
        for &t in tokens {
            self.record(t);
        }
    }

    fn record(&mut self, token: u32) {
        *self.output_counts.entry(token).or_insert(0) += 1;
        self.position += 1;
    }

    /// The random stream of the current position.
    fn rng(&mut self) -> &mut Rng {
        if self.stream_at != self.position {
            self.rng = Rng::for_position(self.key, self.position);
            self.stream_at = self.position;
        }
        &mut self.rng
    }

    /// Picks the next token from one row of logits and records it.
    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        self.sample_masked(logits, None)
    }

    /// Picks the next token among those `mask` allows (all without one).
    /// The mask must allow at least one token.
    pub fn sample_masked(&mut self, logits: &[f32], mask: Option<&TokenMask>) -> Sampled {
        let mut z = logits.to_vec();
        if let Some(m) = mask {
            m.apply(&mut z);
        }
        let logprob = self.params.logprobs.map(|n| (n, raw_logprobs(&z)));
        self.apply_penalties(&mut z);
        let token = if self.params.temperature == 0.0 {
            argmax(&z)
        } else {
            self.draw(&z)
        };
        self.record(token);
        let logprob = logprob.map(|(n, lp)| TokenLogprob {
            token,
            logprob: lp[token as usize],
            top: top_n(&lp, n),
        });
        Sampled { token, logprob }
    }

    fn apply_penalties(&self, z: &mut [f32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            // Each seen token once: prompt tokens, then output-only tokens.
            let output_only = self
                .output_counts
                .keys()
                .filter(|t| self.prompt_tokens.binary_search(t).is_err());
            for &t in self.prompt_tokens.iter().chain(output_only) {
                let Some(v) = z.get_mut(t as usize) else {
                    continue;
                };
                *v = if *v > 0.0 {
                    *v / p.repetition_penalty
                } else {
                    *v * p.repetition_penalty
                };
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &n) in &self.output_counts {
                if let Some(v) = z.get_mut(t as usize) {
                    *v -= p.presence_penalty + p.frequency_penalty * n as f32;
                }
            }
        }
    }

    fn draw(&mut self, z: &[f32]) -> u32 {
        let cand = self.candidates(z);
        let total: f64 = cand.iter().map(|c| f64::from(c.1)).sum();
        // No weight to draw by (every logit NaN, say): the argmax, not
        // whichever candidate happens to be last.
        if total.is_nan() || total <= 0.0 {
            return argmax(z);
        }
        let mut u = self.rng().next_f64() * total;
        for &(t, w) in &cand {
            u -= f64::from(w);
            if u < 0.0 {
                return t;
            }
        }
        cand.last().map_or(0, |c| c.0)
    }

    /// The tokens a sampled draw may pick from penalised logits `z`, with
    /// unnormalised weights: temperature, then top-k, top-p and min-p.
    ///
    /// In no particular order: a draw needs none, and sorting a 128k
    /// vocabulary cost more than the rest of the sampler together
    /// (`sampling-bench`). Top-k selects on the logits, before any `exp`.
    fn candidates(&self, z: &[f32]) -> Vec<(u32, f32)> {
        let p = &self.params;
        // Below ~2.9e-39, 1/t overflows to ∞ and the largest logit's
        // `0 · ∞` is NaN (weight 0 for every token: the draw then fell to
        // the last candidate). Capped, the largest weighs exp(0) = 1 and
        // every other logit's scaled gap is −∞ or huge: the t → 0 limit,
        // greedy.
        let inv_t = (1.0 / p.temperature).min(f32::MAX);
        let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weight = |v: f32| exp_nonpositive((v - max) * inv_t);
        // Masked-out tokens (−∞) are never candidates.
        let mut cand: Vec<(u32, f32)> = if p.top_k > 0 && p.top_k < z.len() {
            // `exp` is monotonic: the k largest logits are the k heaviest.
            let mut top = top_k_logits(z, p.top_k);
            for c in &mut top {
                c.1 = weight(c.1);
            }
            top
        } else {
            // A separate pass over a plain array, so it vectorises.
            let w: Vec<f32> = z.iter().map(|&v| weight(v)).collect();
            z.iter()
                .zip(w)
                .enumerate()
                .filter(|&(_, (&v, _))| v > f32::NEG_INFINITY)
                .map(|(i, (_, w))| (i as u32, w))
                .collect()
        };
        if p.top_p < 1.0 {
            keep_top_p(&mut cand, p.top_p);
        }
        if p.min_p > 0.0 {
            let floor = cand.iter().map(|c| c.1).fold(0.0, f32::max) * p.min_p;
            cand.retain(|c| c.1 >= floor);
        }
        cand
    }

    /// Whether [`Sampler::distribution`] describes this request's draws
    /// exactly. Penalties depend on the tokens before each position, so a
    /// penalised request is sampled one token at a time (no speculation).
    pub fn has_penalties(&self) -> bool {
        let p = &self.params;
        p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
    }

    /// The distribution one draw from `logits` follows, as a dense vector
    /// over the vocabulary (one-hot on the argmax when greedy). Penalties
    /// are not applied (see [`Sampler::has_penalties`]). Speculative
    /// decoding verifies drafts against it.
    pub fn distribution(&self, logits: &[f32]) -> Vec<f32> {
        let mut probs = vec![0.0f32; logits.len()];
        if self.params.temperature == 0.0 {
            probs[argmax(logits) as usize] = 1.0;
            return probs;
        }
        let cand = self.candidates(logits);
        let total: f64 = cand.iter().map(|c| f64::from(c.1)).sum();
        if total.is_nan() || total <= 0.0 {
            probs[argmax(logits) as usize] = 1.0;
            return probs;
        }
        for (t, w) in cand {
            probs[t as usize] = (f64::from(w) / total) as f32;
        }
        probs
    }

    /// One draw from a dense distribution (weights need not sum to one),
    /// from this request's random stream. Falls back to the argmax when
    /// every weight is zero.
    pub fn draw_from(&mut self, weights: &[f32]) -> u32 {
        let total: f64 = weights.iter().map(|&w| f64::from(w.max(0.0))).sum();
        if total <= 0.0 {
            return argmax(weights);
        }
        let mut u = self.rng().next_f64() * total;
        let mut last = 0;
        for (t, &w) in weights.iter().enumerate() {
            if w <= 0.0 {
                continue;
            }
            last = t;
            u -= f64::from(w);
            if u < 0.0 {
                return t as u32;
            }
        }
        last as u32
    }

    /// Uniform in [0, 1) from this request's random stream.
    pub fn uniform(&mut self) -> f64 {
        self.rng().next_f64()
    }

    /// Records `token` as emitted after being chosen outside
    /// [`Sampler::sample`] (speculative verification), and returns its
    /// logprob report from the raw `logits` row if the request asked.
    pub fn accept(&mut self, logits: &[f32], token: u32) -> Sampled {
        self.record(token);
        let logprob = self.params.logprobs.map(|n| {
            let lp = raw_logprobs(logits);
            TokenLogprob {
                token,
                logprob: lp.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY),
                top: top_n(&lp, n),
            }
        });
        Sampled { token, logprob }
    }
}

/// `token`'s logprob under the raw distribution of `logits`, with the `top`
/// most likely tokens (prompt scoring).
pub fn score_token(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    report_token(&raw_logprobs(logits), token, top)
}

/// `token`'s report from a row of logprobs already normalised (beam
/// search keeps them for its scores).
pub(crate) fn report_token(logprobs: &[f32], token: u32, top: usize) -> TokenLogprob {
    TokenLogprob {
        token,
        logprob: logprobs
            .get(token as usize)
            .copied()
            .unwrap_or(f32::NEG_INFINITY),
        top: top_n(logprobs, top),
    }
}

pub(crate) fn raw_logprobs(logits: &[f32]) -> Vec<f32> {
    let mut lp = logits.to_vec();
    log_softmax(&mut lp);
    lp
}

#[cfg(test)]
mod tests {
    use super::select::by_value_desc;
    use super::*;

    fn sampler(p: SamplingParams) -> Sampler {
        Sampler::new(p, &[]).expect("valid params")
    }

    #[test]
    fn greedy_picks_the_argmax_and_reports_logprobs() {
        let mut s = sampler(SamplingParams {
            logprobs: Some(2),
            ..Default::default()
        });
        let out = s.sample(&[0.0, 3.0, 1.0]);
        assert_eq!(out.token, 1);
        let lp = out.logprob.expect("asked for logprobs");
        assert_eq!(lp.top.len(), 2);
        assert_eq!(lp.top[0].0, 1);
        assert_eq!(lp.top[1].0, 2);
        let z: f32 = [0.0f32, 3.0, 1.0].iter().map(|v| v.exp()).sum();
        assert!((lp.logprob - (3.0 - z.ln())).abs() < 1e-6);
    }

    #[test]
    fn tiny_temperatures_behave_as_greedy() {
        // Logits at least 0.01 apart: from t = 1e-4 down every gap over t
        // is past exp's range, so each draw must be the argmax, whatever
        // the filters. t = 1e-40 used to make every weight NaN and draw
        // the last token every step.
        let mut seed = 11u64;
        let logits: Vec<f32> = (0..300)
            .map(|i| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (i as f32) * 0.01 - 1.5 * ((seed >> 40) % 2) as f32
            })
            .collect();
        let best = argmax(&logits);
        let temperatures = [
            1e-4f32,
            1e-10,
            1e-30,
            f32::MIN_POSITIVE,
            1e-40,
            1e-44,
            f32::from_bits(1),
        ];
        for t in temperatures {
            for (top_p, top_k, min_p) in [
                (1.0, 0, 0.0),
                (0.9, 0, 0.0),
                (0.5, 5, 0.0),
                (1.0, 1, 0.0),
                (1.0, 0, 0.1),
                (0.3, 50, 0.5),
            ] {
                let params = SamplingParams {
                    temperature: t,
                    top_p,
                    top_k,
                    min_p,
                    seed: Some(3),
                    logprobs: Some(1),
                    ..Default::default()
                };
                let mut s = sampler(params);
                for _ in 0..20 {
                    let out = s.sample(&logits);
                    assert_eq!(
                        out.token, best,
                        "t={t:e} top_p={top_p} top_k={top_k} min_p={min_p}"
                    );
                }
                let dist = s.distribution(&logits);
                assert_eq!(dist[best as usize], 1.0, "t={t:e}: {:?}", &dist[..4]);
            }
        }
    }

    #[test]
    fn a_replayed_sampler_draws_what_the_original_would_have() {
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(21),
            frequency_penalty: 0.3,
            ..SamplingParams::default()
        };
        let rows: Vec<Vec<f32>> = (0..12)
            .map(|i| {
                (0..50)
                    .map(|t| ((t * 7 + i * 3) % 11) as f32 * 0.3)
                    .collect()
            })
            .collect();
        let mut original = Sampler::new(params.clone(), &[1, 2]).expect("valid");
        let whole: Vec<u32> = rows.iter().map(|r| original.sample(r).token).collect();
        for cut in [0, 1, 5, 11] {
            let mut resumed = Sampler::new(params.clone(), &[1, 2]).expect("valid");
            resumed.replay(&whole[..cut]);
            let rest: Vec<u32> = rows[cut..]
                .iter()
                .map(|r| resumed.sample(r).token)
                .collect();
            assert_eq!(rest, whole[cut..], "resumed after {cut} tokens");
        }
        // Without the replay the penalties and the stream differ.
        let mut fresh = Sampler::new(params, &[1, 2]).expect("valid");
        let rest: Vec<u32> = rows[5..].iter().map(|r| fresh.sample(r).token).collect();
        assert_ne!(rest, whole[5..]);
    }

    #[test]
    fn same_seed_same_draws_and_distribution_is_followed() {
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..Default::default()
        };
        let logits = [0.0f32, (3.0f32).ln()];
        let draw = |p: &SamplingParams| {
            let mut s = sampler(p.clone());
            (0..2000)
                .map(|_| s.sample(&logits).token)
                .collect::<Vec<_>>()
        };
        let a = draw(&params);
        assert_eq!(a, draw(&params));
        let ones = a.iter().filter(|&&t| t == 1).count() as f64 / a.len() as f64;
        assert!((ones - 0.75).abs() < 0.05, "p(1) = {ones}, want 0.75");
        let other = draw(&SamplingParams {
            seed: Some(8),
            ..params
        });
        assert_ne!(a, other);
    }

    #[test]
    fn top_k_and_top_p_and_min_p_restrict_the_support() {
        let logits = [2.0f32, 1.9, 1.8, -5.0];
        for p in [
            SamplingParams {
                temperature: 1.0,
                top_k: 1,
                seed: Some(1),
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.0,
                top_p: 0.01,
                seed: Some(1),
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.0,
                min_p: 0.99,
                seed: Some(1),
                ..Default::default()
            },
        ] {
            let mut s = sampler(p.clone());
            for _ in 0..200 {
                assert_eq!(s.sample(&logits).token, 0, "{p:?}");
            }
        }
        let mut s = sampler(SamplingParams {
            temperature: 1.0,
            top_k: 3,
            seed: Some(3),
            ..Default::default()
        });
        assert!((0..500).all(|_| s.sample(&logits).token != 3));
    }

    /// The nucleus found through the weight buckets is the one a sort of
    /// the whole vocabulary gives, from a handful of tokens to most of it.
    #[test]
    fn top_p_keeps_the_nucleus_a_full_sort_keeps() {
        let mut rng = Rng::seeded(11);
        // Nearly flat logits: the nuclei span thousands of tokens.
        let logits: Vec<f32> = (0..20_000)
            .map(|_| (rng.next_f64() as f32 - 0.5) * 3.0)
            .collect();
        for top_p in [0.001f32, 0.05, 0.3, 0.9, 0.999] {
            let s = sampler(SamplingParams {
                temperature: 0.8,
                top_p,
                ..Default::default()
            });
            let got = s.distribution(&logits);
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut all: Vec<(u32, f32)> = logits
                .iter()
                .enumerate()
                .map(|(i, &v)| (i as u32, ((v - max) / 0.8).exp()))
                .collect();
            all.sort_unstable_by(by_value_desc);
            let total: f64 = all.iter().map(|c| f64::from(c.1)).sum();
            let mut cum = 0.0;
            let keep = 1 + all
                .iter()
                .position(|c| {
                    cum += f64::from(c.1);
                    cum >= f64::from(top_p) * total
                })
                .expect("the target is reached");
            let want: std::collections::HashSet<u32> = all[..keep].iter().map(|c| c.0).collect();
            let support: std::collections::HashSet<u32> = (0..logits.len() as u32)
                .filter(|&t| got[t as usize] > 0.0)
                .collect();
            assert_eq!(support, want, "top_p {top_p}: {keep} tokens");
        }
    }

    #[test]
    fn top_p_breaks_ties_by_token_id() {
        let s = sampler(SamplingParams {
            temperature: 1.0,
            top_p: 0.35,
            ..Default::default()
        });
        let d = s.distribution(&[0.5f32; 10]);
        let kept: Vec<usize> = (0..10).filter(|&t| d[t] > 0.0).collect();
        assert_eq!(kept, [0, 1, 2, 3], "0.1 each: four reach 0.35");
    }

    #[test]
    fn penalties_steer_away_from_repeats() {
        let logits = [1.0f32, 0.9];
        let mut s = sampler(SamplingParams {
            frequency_penalty: 0.5,
            ..Default::default()
        });
        assert_eq!(s.sample(&logits).token, 0);
        assert_eq!(s.sample(&logits).token, 1, "token 0 now costs 0.5");
        let mut r = Sampler::new(
            SamplingParams {
                repetition_penalty: 2.0,
                ..Default::default()
            },
            &[0],
        )
        .expect("valid");
        assert_eq!(r.sample(&logits).token, 1, "prompt token 0 is penalised");
    }

    #[test]
    fn a_mask_restricts_greedy_and_sampled_draws_and_the_logprobs() {
        let logits = [5.0f32, 1.0, 0.0, 2.0];
        let mask = TokenMask::from_tokens(4, &[1, 2]);
        let mut g = sampler(SamplingParams {
            logprobs: Some(3),
            ..Default::default()
        });
        let out = g.sample_masked(&logits, Some(&mask));
        assert_eq!(out.token, 1, "the best allowed token");
        let lp = out.logprob.expect("logprobs");
        let z = 1.0f32.exp() + 1.0;
        assert!((lp.logprob - (1.0 - z.ln())).abs() < 1e-6, "renormalised");
        assert_eq!(lp.top.len(), 2, "only allowed alternatives");
        let mut s = sampler(SamplingParams {
            temperature: 1.0,
            seed: Some(5),
            ..Default::default()
        });
        for _ in 0..500 {
            let t = s.sample_masked(&logits, Some(&mask)).token;
            assert!(t == 1 || t == 2, "{t}");
        }
    }

    /// What speculative verification checks drafts against is what a plain
    /// draw follows: same support, same probabilities.
    #[test]
    fn the_distribution_is_what_draws_follow() {
        let logits = [2.0f32, 1.5, 1.0, 0.2, -1.0, -3.0];
        let params = SamplingParams {
            temperature: 0.7,
            top_k: 4,
            top_p: 0.9,
            seed: Some(3),
            ..Default::default()
        };
        let mut s = sampler(params);
        let p = s.distribution(&logits);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        assert_eq!(p[4], 0.0, "outside top-k");
        let n = 50_000;
        let mut counts = [0usize; 6];
        for _ in 0..n {
            counts[s.sample(&logits).token as usize] += 1;
        }
        for t in 0..6 {
            let f = counts[t] as f32 / n as f32;
            assert!((f - p[t]).abs() < 0.01, "token {t}: {f} vs {}", p[t]);
        }
        let greedy = sampler(SamplingParams::default()).distribution(&logits);
        assert_eq!(greedy, vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn invalid_params_are_rejected() {
        for p in [
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                min_p: 2.0,
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
        ] {
            assert!(Sampler::new(p, &[]).is_err());
        }
    }
}
