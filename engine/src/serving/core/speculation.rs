//! Speculative decoding in the engine step.
//!
//! Before scheduling, [`EngineCore::propose_drafts`] asks the drafter for
//! tokens for every running decode that may speculate, each with its own
//! `k` (adaptive, cut so the step's decode rows stay under
//! [`SpeculativeConfig::max_batch_rows`], and never past the request's
//! `max_tokens` or the context). The scheduler runs them with the pending
//! token; the forward pass returns logits for every row of those sequences;
//! [`EngineCore::emit_verified`] keeps what verification accepts, rolls the
//! rest of the KV back and streams the tokens one by one through the normal
//! stop checks.
//!
//! Requests that speculate: no grammar (its mask depends on each token),
//! no repetition/presence/frequency penalty (they depend on every earlier
//! token), not prefill-only. Others decode one token per step as before.

use crate::error::Result;
use crate::speculative::{
    verify, Draft, DraftRequest, Drafter, Residual, SpecCounts, SpeculativeConfig,
};

use super::{EngineCore, SeqId};

/// An engine's drafter and its settings.
#[derive(Debug)]
pub(super) struct Speculation {
    drafter: Box<dyn Drafter>,
    config: SpeculativeConfig,
    /// Always lossless outside tests of the statistical check.
    pub(super) residual: Residual,
}

impl EngineCore {
    /// Turns speculative decoding on with `drafter`.
    pub fn enable_speculation(
        &mut self,
        drafter: Box<dyn Drafter>,
        config: SpeculativeConfig,
    ) -> Result<()> {
        config.validate()?;
        tracing::info!(
            drafter = drafter.name(),
            k = config.num_speculative_tokens,
            adaptive = config.adaptive,
            max_batch_rows = config.max_batch_rows,
            "speculative decoding on"
        );
        self.spec = Some(Speculation {
            drafter,
            config,
            residual: Residual::Lossless,
        });
        Ok(())
    }

    /// The drafter's name, when speculation is on.
    pub fn speculation(&self) -> Option<&'static str> {
        self.spec.as_ref().map(|s| s.drafter.name())
    }

    /// Drafts for this step's decodes (nothing when speculation is off or
    /// the batch is too large for it to pay).
    pub(super) fn propose_drafts(&mut self) {
        let Some(spec) = self.spec.as_mut() else {
            return;
        };
        let decodes = self.scheduler.running_decodes();
        if decodes.is_empty() {
            return;
        }
        // Every decode row beyond the first per sequence is a draft.
        let cap = (spec.config.max_batch_rows / decodes.len())
            .saturating_sub(1)
            .min(spec.config.num_speculative_tokens);
        let max_model_len = self.limits.max_model_len;
        let (draft_cost, verify_cost) =
            (spec.drafter.cost_per_token(), spec.config.verify_row_cost);
        let mut requests: Vec<DraftRequest<'_>> = Vec::new();
        for (id, seq) in self.scheduler.seqs_mut(&decodes) {
            seq.draft.clear();
            if cap == 0
                || seq.export.is_some()
                || seq.constraint.is_some()
                || seq.sampler.has_penalties()
            {
                continue;
            }
            let Some(group) = self.groups.get(&seq.group) else {
                continue;
            };
            if group.beam.is_some() {
                continue; // beams take one token per step, by their own rule
            }
            // The step emits up to k + 1 tokens and writes K/V up to
            // position len - 1 + k.
            let produced = seq.tokens.len() - seq.prompt_len;
            let room = group
                .max_tokens
                .saturating_sub(produced + 1)
                .min(max_model_len.saturating_sub(seq.tokens.len() + 1));
            let k_max = cap.min(room);
            if k_max == 0 {
                continue;
            }
            let k = if spec.config.adaptive {
                seq.adaptive.choose(k_max, draft_cost, verify_cost)
            } else {
                k_max
            };
            if k == 0 {
                continue;
            }
            requests.push(DraftRequest {
                seq: id,
                tokens: &seq.tokens,
                k,
                sampler: &mut seq.sampler,
                draft: Draft::default(),
            });
        }
        if requests.is_empty() {
            return;
        }
        if let Err(e) = spec.drafter.propose(&mut requests) {
            // Speculation is an optimisation: decode plainly this step.
            tracing::warn!(error = %e, drafter = spec.drafter.name(), "drafting failed");
            return;
        }
        let drafts: Vec<(SeqId, Draft)> = requests
            .into_iter()
            .map(|r| {
                let mut d = r.draft;
                d.truncate(r.k);
                (r.seq, d)
            })
            .collect();
        for (id, draft) in drafts {
            if let Some(seq) = self.scheduler.seq_mut(id) {
                seq.draft = draft;
            }
        }
    }

    /// Verifies a sequence's drafts against its `rows` of logits (one per
    /// input token), rolls rejected K/V back and emits the kept tokens.
    pub(super) fn emit_verified(&mut self, seq_id: SeqId, rows: &[f32], vocab: usize) {
        let bs = self.scheduler.block_size();
        let Some(spec) = self.spec.as_mut() else {
            return;
        };
        let Some(seq) = self.scheduler.seq_mut(seq_id) else {
            return;
        };
        let draft = std::mem::take(&mut seq.draft);
        let verified = verify(rows, vocab, &draft, &mut seq.sampler, spec.residual);
        seq.adaptive.observe(draft.len(), verified.accepted);
        self.stats.speculation.add(draft.len(), verified.accepted);
        if let Some(g) = self.groups.get_mut(&seq.group) {
            g.speculation.add(draft.len(), verified.accepted);
        }
        self.scheduler
            .rollback(seq_id, draft.len() - verified.accepted);
        for (j, &token) in verified.tokens.iter().enumerate() {
            // A stop condition may end the choice part-way.
            let Some(seq) = self.scheduler.seq_mut(seq_id) else {
                break;
            };
            let sampled = seq.sampler.accept(&rows[j * vocab..(j + 1) * vocab], token);
            seq.push_token(token, bs);
            self.emit_token(seq_id, sampled, false);
        }
        if let (Some(seq), Some(spec)) = (self.scheduler.seq(seq_id), self.spec.as_mut()) {
            spec.drafter.rollback(seq_id, &seq.tokens);
        }
    }

    /// Drops the drafter's state for a sequence that left.
    pub(super) fn release_draft_state(&mut self, seq_id: SeqId) {
        if let Some(spec) = self.spec.as_mut() {
            spec.drafter.release(seq_id);
        }
    }

    /// Blocks the drafter holds in its own pool.
    pub(super) fn spec_held_blocks(&self) -> usize {
        self.spec.as_ref().map_or(0, |s| s.drafter.held_blocks())
    }

    /// Engine-wide speculation counters.
    pub fn speculation_counts(&self) -> SpecCounts {
        self.stats.speculation
    }
}

/// The statistical check of losslessness: it needs the broken residual,
/// which only this crate can switch on.
#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use tokio::sync::mpsc::unbounded_channel;

    use super::*;
    use crate::backend::CpuBackend;
    use crate::sampling::SamplingParams;
    use crate::serving::{EngineConfig, KvPoolSize, Prompt, Request, RequestEvent};
    use crate::speculative::DraftModelDrafter;
    use crate::{synth, DType, Model};

    const SAMPLES: u64 = 20_000;

    /// The tiny target, and as its draft its own first layer (close to it,
    /// not equal: drafts are often rejected, so the residual step matters).
    fn engine(dir: &std::path::Path, residual: Option<Residual>) -> EngineCore {
        let config = EngineConfig {
            kv_pool: KvPoolSize::Blocks(4096),
            max_num_seqs: 256,
            ..EngineConfig::default()
        };
        let model = Model::load(dir).expect("load");
        let target = model.config().clone();
        let mut core = EngineCore::new(model, None, Vec::new(), &config).expect("core");
        if let Some(residual) = residual {
            let mut draft = Model::load(dir).expect("load");
            draft.truncate_layers(1).expect("truncate");
            let backend = CpuBackend::new(draft, 16, 4096);
            let drafter = DraftModelDrafter::new(Box::new(backend), &target).expect("drafter");
            let spec = SpeculativeConfig {
                num_speculative_tokens: 2,
                adaptive: false,
                max_batch_rows: usize::MAX,
                ..SpeculativeConfig::default()
            };
            core.enable_speculation(Box::new(drafter), spec)
                .expect("speculation");
            if let Some(s) = core.spec.as_mut() {
                s.residual = residual;
            }
        }
        core
    }

    /// Counts of the first three generated tokens over `SAMPLES` requests.
    fn sample(core: &mut EngineCore, seed0: u64) -> HashMap<[u32; 3], u64> {
        let mut counts = HashMap::new();
        let mut next = 0;
        while next < SAMPLES {
            let wave = (SAMPLES - next).min(256);
            let mut streams = Vec::new();
            for i in next..next + wave {
                // Four tokens, so the first decode step may draft two.
                let mut req = Request::new(Prompt::Tokens(vec![3, 14, 15, 92, 65]), 4);
                req.ignore_eos = true;
                req.sampling = SamplingParams {
                    temperature: 1.0,
                    top_k: 3,
                    seed: Some(seed0 + i),
                    ..SamplingParams::default()
                };
                let (tx, rx) = unbounded_channel();
                core.add_request(i, req, tx).expect("valid");
                streams.push(rx);
            }
            let mut steps = 0;
            while core.has_work() {
                core.step();
                core.check_accounting().expect("block books");
                steps += 1;
                assert!(steps < 100, "requests did not finish");
            }
            for mut rx in streams {
                let mut tokens = Vec::new();
                while let Ok(ev) = rx.try_recv() {
                    if let RequestEvent::Delta(d) = ev {
                        tokens.extend(d.token_ids);
                    }
                }
                let key: [u32; 3] = tokens[..3].try_into().expect("three tokens");
                *counts.entry(key).or_insert(0) += 1;
            }
            next += wave;
        }
        counts
    }

    /// Upper tail of the chi-square distribution: Q(df / 2, x / 2), the
    /// regularised upper incomplete gamma (series below a + 1, continued
    /// fraction above, as in Numerical Recipes).
    fn chi_square_p(x: f64, df: f64) -> f64 {
        let (a, x) = (df / 2.0, x / 2.0);
        let ln_gamma_a = ln_gamma(a);
        if x < a + 1.0 {
            let (mut sum, mut term, mut n) = (1.0 / a, 1.0 / a, a);
            for _ in 0..10_000 {
                n += 1.0;
                term *= x / n;
                sum += term;
                if term < sum * 1e-15 {
                    break;
                }
            }
            1.0 - sum * (-x + a * x.ln() - ln_gamma_a).exp()
        } else {
            let tiny = 1e-300;
            let mut b = x + 1.0 - a;
            let mut c = 1.0 / tiny;
            let mut d = 1.0 / b;
            let mut h = d;
            for i in 1..10_000 {
                let an = -(i as f64) * (i as f64 - a);
                b += 2.0;
                d = an * d + b;
                d = if d.abs() < tiny { tiny } else { d };
                c = b + an / c;
                c = if c.abs() < tiny { tiny } else { c };
                d = 1.0 / d;
                let delta = d * c;
                h *= delta;
                if (delta - 1.0).abs() < 1e-15 {
                    break;
                }
            }
            (-x + a * x.ln() - ln_gamma_a).exp() * h
        }
    }

    /// Lanczos approximation of ln Γ(x), x > 0.
    fn ln_gamma(x: f64) -> f64 {
        const G: [f64; 6] = [
            76.180_091_729_471_46,
            -86.505_320_329_416_77,
            24.014_098_240_830_91,
            -1.231_739_572_450_155,
            0.120_865_097_386_617_9e-2,
            -0.539_523_938_495_3e-5,
        ];
        let mut y = x;
        let tmp = x + 5.5;
        let tmp = tmp - (x + 0.5) * tmp.ln();
        let mut ser = 1.000_000_000_190_015;
        for g in G {
            y += 1.0;
            ser += g / y;
        }
        -tmp + (2.506_628_274_631_000_5 * ser / x).ln()
    }

    /// Two-sample chi-square test of homogeneity; cells expected below 5
    /// in either sample are pooled. Returns (statistic, df, p).
    fn homogeneity(a: &HashMap<[u32; 3], u64>, b: &HashMap<[u32; 3], u64>) -> (f64, f64, f64) {
        let (na, nb) = (
            a.values().sum::<u64>() as f64,
            b.values().sum::<u64>() as f64,
        );
        let mut keys: Vec<&[u32; 3]> = a.keys().chain(b.keys()).collect();
        keys.sort();
        keys.dedup();
        let mut cells: Vec<(f64, f64)> = Vec::new();
        let mut pooled = (0.0, 0.0);
        for k in keys {
            let (x, y) = (
                a.get(k).copied().unwrap_or(0) as f64,
                b.get(k).copied().unwrap_or(0) as f64,
            );
            let total = x + y;
            if total * na.min(nb) / (na + nb) < 5.0 {
                pooled = (pooled.0 + x, pooled.1 + y);
            } else {
                cells.push((x, y));
            }
        }
        if pooled.0 + pooled.1 > 0.0 {
            cells.push(pooled);
        }
        let mut stat = 0.0;
        for &(x, y) in &cells {
            let total = x + y;
            let (ea, eb) = (total * na / (na + nb), total * nb / (na + nb));
            stat += (x - ea).powi(2) / ea + (y - eb).powi(2) / eb;
        }
        let df = (cells.len() - 1) as f64;
        (stat, df, chi_square_p(stat, df))
    }

    #[test]
    fn the_p_value_function_matches_known_quantiles() {
        // chi-square(1) 95% quantile 3.841; chi-square(10) 99% quantile 23.209.
        assert!((chi_square_p(3.841, 1.0) - 0.05).abs() < 1e-3);
        assert!((chi_square_p(23.209, 10.0) - 0.01).abs() < 1e-4);
        assert!((chi_square_p(0.5, 30.0) - 1.0).abs() < 1e-6);
    }

    /// Speculative sampling cannot be told from plain sampling over 20k
    /// requests (p > 0.01 on the joint of the first three tokens); the
    /// same test tells a broken residual step apart (p < 0.01).
    #[test]
    fn speculative_sampling_is_lossless_and_the_test_catches_a_broken_residual() {
        let tmp = tempfile::tempdir().expect("tempdir");
        synth::preset("tiny")
            .expect("preset")
            .write(tmp.path(), 5, DType::F32)
            .expect("write");
        let plain = sample(&mut engine(tmp.path(), None), 0);
        let mut spec_core = engine(tmp.path(), Some(Residual::Lossless));
        let spec = sample(&mut spec_core, 1 << 32);
        let counts = spec_core.speculation_counts();
        let rate = counts.acceptance_rate();
        assert!(
            counts.drafted > SAMPLES * 3 / 2 && (0.2..0.95).contains(&rate),
            "drafts must be both accepted and rejected often: {counts:?}"
        );
        let (stat, df, p) = homogeneity(&plain, &spec);
        eprintln!("lossless: chi2 {stat:.1} df {df} p {p:.4}; acceptance {rate:.3}");
        assert!(
            p > 0.01,
            "speculative differs from plain: chi2 {stat} df {df} p {p}"
        );
        let broken = sample(&mut engine(tmp.path(), Some(Residual::FromTarget)), 2 << 32);
        let (stat, df, p) = homogeneity(&plain, &broken);
        eprintln!("broken residual: chi2 {stat:.1} df {df} p {p:.2e}");
        assert!(
            p < 0.01,
            "the test should catch a broken residual: chi2 {stat} df {df} p {p}"
        );
    }
}
