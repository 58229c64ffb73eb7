//! What to send: prompt and output lengths from distributions, shared-prefix
//! groups, or prompts read from a JSONL file.
//!
//! Synthetic prompts are random token ids, so a prompt of length `n` is `n`
//! tokens exactly, whatever the tokenizer. Every request sets `ignore_eos`
//! so it generates exactly its drawn output length (as vLLM's and aiperf's
//! synthetic benchmarks do).

use std::path::Path;
use std::str::FromStr;

use serde::Deserialize;

use crate::rng::Rng;
use crate::LoadgenError;

/// A length distribution: `fixed:N`, `uniform:LO-HI`, or
/// `lognormal:MEAN,SIGMA` (MEAN the distribution's mean in tokens, SIGMA
/// the standard deviation of its logarithm).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LengthDist {
    Fixed(u32),
    Uniform { lo: u32, hi: u32 },
    Lognormal { mean: f64, sigma: f64 },
}

impl LengthDist {
    /// One draw, at least 1.
    pub fn sample(&self, rng: &mut Rng) -> u32 {
        let x = match *self {
            Self::Fixed(n) => n,
            Self::Uniform { lo, hi } => rng.range(u64::from(lo), u64::from(hi)) as u32,
            Self::Lognormal { mean, sigma } => {
                // E[exp(mu + sigma Z)] = exp(mu + sigma^2 / 2) = mean.
                let mu = mean.ln() - sigma * sigma / 2.0;
                (mu + sigma * rng.normal()).exp().round() as u32
            }
        };
        x.max(1)
    }
}

impl FromStr for LengthDist {
    type Err = LoadgenError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            LoadgenError::Spec(format!(
                "length distribution {s:?}: want fixed:N, uniform:LO-HI or lognormal:MEAN,SIGMA"
            ))
        };
        let (kind, args) = s.split_once(':').unwrap_or(("fixed", s));
        match kind {
            "fixed" => args.trim().parse().map(Self::Fixed).map_err(|_| bad()),
            "uniform" => {
                let (lo, hi) = args.split_once('-').ok_or_else(bad)?;
                let (lo, hi): (u32, u32) = (
                    lo.trim().parse().map_err(|_| bad())?,
                    hi.trim().parse().map_err(|_| bad())?,
                );
                if lo > hi || lo == 0 {
                    return Err(bad());
                }
                Ok(Self::Uniform { lo, hi })
            }
            "lognormal" => {
                let (m, sd) = args.split_once(',').ok_or_else(bad)?;
                let (mean, sigma): (f64, f64) = (
                    m.trim().parse().map_err(|_| bad())?,
                    sd.trim().parse().map_err(|_| bad())?,
                );
                if !(mean >= 1.0 && sigma >= 0.0) {
                    return Err(bad());
                }
                Ok(Self::Lognormal { mean, sigma })
            }
            _ => Err(bad()),
        }
    }
}

/// Prompts that share a prefix: `groups` distinct prefixes of `len` tokens,
/// each request drawing one (the shape of multi-turn chat and of system
/// prompts, where prefix-aware routing pays).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SharedPrefix {
    pub len: u32,
    pub groups: u32,
}

/// A synthetic workload.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadSpec {
    /// Prompt length (the part after any shared prefix).
    pub input: LengthDist,
    pub output: LengthDist,
    pub shared_prefix: Option<SharedPrefix>,
    /// Token ids are drawn from `[0, vocab_size)`.
    pub vocab_size: u32,
    pub seed: u64,
}

/// One request to send.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkItem {
    pub prompt: Prompt,
    pub max_tokens: u32,
    /// Shared-prefix group, if any.
    pub group: Option<u32>,
}

/// A prompt: token ids (synthetic) or text (from a file).
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Tokens(Vec<u32>),
    Text(String),
}

impl WorkloadSpec {
    /// `count` requests, the same for the same spec.
    pub fn generate(&self, count: usize) -> Result<Vec<WorkItem>, LoadgenError> {
        if self.vocab_size == 0 {
            return Err(LoadgenError::Spec("vocab_size must be positive".into()));
        }
        let mut rng = Rng::new(self.seed);
        let vocab = u64::from(self.vocab_size) - 1;
        let prefixes: Vec<Vec<u32>> = match self.shared_prefix {
            Some(p) if p.groups == 0 => {
                return Err(LoadgenError::Spec(
                    "shared prefix groups must be positive".into(),
                ))
            }
            Some(p) => (0..p.groups)
                .map(|_| (0..p.len).map(|_| rng.range(0, vocab) as u32).collect())
                .collect(),
            None => Vec::new(),
        };
        Ok((0..count)
            .map(|_| {
                let group =
                    (!prefixes.is_empty()).then(|| rng.range(0, prefixes.len() as u64 - 1) as u32);
                let mut prompt = group.map_or_else(Vec::new, |g| prefixes[g as usize].clone());
                let n = self.input.sample(&mut rng);
                prompt.extend((0..n).map(|_| rng.range(0, vocab) as u32));
                WorkItem {
                    prompt: Prompt::Tokens(prompt),
                    max_tokens: self.output.sample(&mut rng),
                    group,
                }
            })
            .collect())
    }
}

#[derive(Deserialize)]
struct JsonlLine {
    prompt: Option<String>,
    prompt_ids: Option<Vec<u32>>,
    max_tokens: Option<u32>,
}

/// Requests from a JSONL file: one object per line with `prompt` (text) or
/// `prompt_ids`, and optionally `max_tokens` (else `default_max_tokens`).
/// Lines are reused in order when `count` exceeds them.
pub fn from_jsonl(
    path: &Path,
    count: usize,
    default_max_tokens: u32,
) -> Result<Vec<WorkItem>, LoadgenError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| LoadgenError::Spec(format!("{}: {e}", path.display())))?;
    let mut items = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let l: JsonlLine = serde_json::from_str(line)
            .map_err(|e| LoadgenError::Spec(format!("{}:{}: {e}", path.display(), i + 1)))?;
        let prompt = match (l.prompt, l.prompt_ids) {
            (Some(t), None) => Prompt::Text(t),
            (None, Some(ids)) => Prompt::Tokens(ids),
            _ => {
                return Err(LoadgenError::Spec(format!(
                    "{}:{}: give exactly one of prompt and prompt_ids",
                    path.display(),
                    i + 1
                )))
            }
        };
        items.push(WorkItem {
            prompt,
            max_tokens: l.max_tokens.unwrap_or(default_max_tokens),
            group: None,
        });
    }
    if items.is_empty() {
        return Err(LoadgenError::Spec(format!(
            "{} has no prompts",
            path.display()
        )));
    }
    Ok((0..count).map(|i| items[i % items.len()].clone()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_length_distributions() {
        assert_eq!(
            "fixed:8".parse::<LengthDist>().ok(),
            Some(LengthDist::Fixed(8))
        );
        assert_eq!("8".parse::<LengthDist>().ok(), Some(LengthDist::Fixed(8)));
        assert_eq!(
            "uniform:2-5".parse::<LengthDist>().ok(),
            Some(LengthDist::Uniform { lo: 2, hi: 5 })
        );
        assert_eq!(
            "lognormal:100,0.5".parse::<LengthDist>().ok(),
            Some(LengthDist::Lognormal {
                mean: 100.0,
                sigma: 0.5
            })
        );
        for bad in ["uniform:5-2", "normal:3", "fixed:x", "lognormal:0,1"] {
            assert!(bad.parse::<LengthDist>().is_err(), "{bad}");
        }
    }

    #[test]
    fn lognormal_has_its_mean() {
        let d = LengthDist::Lognormal {
            mean: 200.0,
            sigma: 0.6,
        };
        let mut r = Rng::new(3);
        let n = 100_000;
        let m = (0..n).map(|_| f64::from(d.sample(&mut r))).sum::<f64>() / n as f64;
        assert!((m - 200.0).abs() < 3.0, "{m}");
    }

    #[test]
    fn shared_prefix_groups_share_their_prefix() {
        let spec = WorkloadSpec {
            input: LengthDist::Uniform { lo: 3, hi: 6 },
            output: LengthDist::Fixed(4),
            shared_prefix: Some(SharedPrefix { len: 10, groups: 2 }),
            vocab_size: 50,
            seed: 1,
        };
        let items = spec.generate(40).expect("valid");
        assert_eq!(items, spec.generate(40).expect("valid"), "deterministic");
        let mut first: [Option<Vec<u32>>; 2] = [None, None];
        for it in &items {
            let Prompt::Tokens(t) = &it.prompt else {
                panic!("tokens")
            };
            assert!((13..=16).contains(&t.len()));
            assert!(t.iter().all(|&x| x < 50));
            let g = it.group.expect("group") as usize;
            let p = first[g].get_or_insert_with(|| t[..10].to_vec());
            assert_eq!(&t[..10], p.as_slice());
        }
        assert!(first.iter().all(Option::is_some), "both groups drawn");
        assert_ne!(first[0], first[1]);
    }
}
