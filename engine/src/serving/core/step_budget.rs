//! The step-time budget: how many prefill tokens may join a step that
//! carries decodes.
//!
//! The token budget (`max_num_batched_tokens`) alone lets a whole long
//! prompt into one step. On a CPU that step lasts seconds, and every decode
//! in the batch waits it out: colocated on a 135M model at 0.1 req/s, TPOT
//! p99 was 6.3x the decode-only figure (1.6x with this budget; RESULTS,
//! "Step-time budget"). Chunked prefill fixes the shape of the problem;
//! this module sizes the chunk in time, not tokens, so one setting fits
//! every model and machine.
//!
//! **The cost model.** A step's time is fitted as a line in its token rows,
//! `t ≈ fixed + per_row · rows`, by exponentially weighted least squares
//! over recent steps that carried decodes (the steps the budget governs;
//! a lone prefill's step runs another kernel regime and bounds nothing).
//! On a CPU both terms mean something: `fixed` is streaming the weights once
//! (what a batch-1 decode costs), `per_row` the compute each token adds.
//! Decode rows and prefill tokens go through the same row kernels, so one
//! slope serves both. The decay (`DECAY` per step, about ten steps of
//! memory) follows the context as it grows.
//!
//! **The bound.** A step with `d` decode rows may take `p` prefill tokens
//! while `fixed + per_row·(d + p)` stays under the bound: a fixed time
//! ([`StepTimeLimit::Fixed`]), or a multiple of the same step without its
//! prefill ([`StepTimeLimit::Relative`], the CPU default), never below a
//! floor (steps shorter than it are not worth cutting: a token every 20 ms
//! is faster than anyone reads, and cutting tiny models' steps would only
//! slow their prefill). At least [`MIN_PREFILL_TOKENS`] join, so a prompt
//! always progresses. Until the line is known (fewer than two distinct row
//! counts seen), [`FIRST_CHUNK`] tokens join: the steps that measure it.
//!
//! Steps with no decodes are not cut: nobody waits on them but the prompt.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// How long a step that carries decodes may take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepTimeLimit {
    /// No limit beyond the token budget.
    Off,
    /// At most this long.
    Fixed(Duration),
    /// At most `stall` times the same step without its prefill chunk, and
    /// never cut below `floor`.
    Relative { stall: f64, floor: Duration },
}

impl StepTimeLimit {
    /// The CPU default: a decode waits at most half as long again for a
    /// prefill chunk (colocated TPOT p99 within 2x of decode-only, with room
    /// for noise), and steps under 20 ms are never cut.
    pub const AUTO: Self = Self::Relative {
        stall: 1.5,
        floor: Duration::from_millis(20),
    };
}

/// Why a `--max-step-ms` value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("max step time `{0}`: expected `off`, `auto` or a positive number of milliseconds")]
pub struct BadStepTimeLimit(String);

impl FromStr for StepTimeLimit {
    type Err = BadStepTimeLimit;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(Self::Off),
            "auto" => Ok(Self::AUTO),
            ms => match ms.parse::<f64>() {
                Ok(v) if v.is_finite() && v > 0.0 && v < 1e9 => {
                    Ok(Self::Fixed(Duration::from_secs_f64(v / 1e3)))
                }
                _ => Err(BadStepTimeLimit(s.to_string())),
            },
        }
    }
}

impl fmt::Display for StepTimeLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Off => f.write_str("off"),
            Self::Fixed(d) => write!(f, "{} ms", d.as_secs_f64() * 1e3),
            Self::Relative { stall, floor } => write!(
                f,
                "{stall}x the step without prefill, at least {} ms",
                floor.as_millis()
            ),
        }
    }
}

/// Fewest prefill tokens a step with decodes takes when a prompt waits.
pub(crate) const MIN_PREFILL_TOKENS: usize = 8;
/// Prefill tokens per step until the cost line is known.
pub(crate) const FIRST_CHUNK: usize = 32;
/// Weight kept by the older steps' sums at each new step.
const DECAY: f64 = 0.9;
/// Below this weighted variance of the row counts (rows²) the slope is not
/// trusted.
const MIN_ROW_VARIANCE: f64 = 1.0;

/// The fitted cost line and the limit it serves.
#[derive(Debug, Clone)]
pub(crate) struct StepBudget {
    limit: StepTimeLimit,
    /// Decayed sums of weight, x, y, x², xy (x = rows, y = seconds).
    sums: [f64; 5],
    /// The last trustworthy `(fixed, per_row)` in seconds.
    line: Option<(f64, f64)>,
}

impl StepBudget {
    pub fn new(limit: StepTimeLimit) -> Self {
        Self {
            limit,
            sums: [0.0; 5],
            line: None,
        }
    }

    /// Most prefill tokens a step with `decode_rows` decode rows may add
    /// (`None`: no limit).
    pub fn prefill_cap(&self, decode_rows: usize) -> Option<usize> {
        if decode_rows == 0 || self.limit == StepTimeLimit::Off {
            return None;
        }
        let Some((fixed, per_row)) = self.line else {
            return Some(FIRST_CHUNK);
        };
        let without = fixed + per_row * decode_rows as f64;
        let bound = match self.limit {
            StepTimeLimit::Off => return None,
            StepTimeLimit::Fixed(d) => d.as_secs_f64(),
            StepTimeLimit::Relative { stall, floor } => (stall * without).max(floor.as_secs_f64()),
        };
        let room = ((bound - without) / per_row).floor();
        // `room` may be negative (decodes alone over a fixed bound) or huge
        // (a slope near zero); both ends are clamped.
        let tokens = if room.is_finite() && room > 0.0 {
            room.min(usize::MAX as f64 / 2.0) as usize
        } else {
            0
        };
        Some(tokens.max(MIN_PREFILL_TOKENS))
    }

    /// Folds in a step that carried `decode_rows` decodes and
    /// `prefill_tokens` prefill tokens and took `took`.
    pub fn observe(&mut self, decode_rows: usize, prefill_tokens: usize, took: Duration) {
        if decode_rows == 0 || self.limit == StepTimeLimit::Off {
            return;
        }
        let (x, y) = ((decode_rows + prefill_tokens) as f64, took.as_secs_f64());
        for (s, v) in self.sums.iter_mut().zip([1.0, x, y, x * x, x * y]) {
            *s = *s * DECAY + v;
        }
        let [w, sx, sy, sxx, sxy] = self.sums;
        let (mx, my) = (sx / w, sy / w);
        let var = sxx / w - mx * mx;
        if var < MIN_ROW_VARIANCE {
            return;
        }
        let per_row = (sxy / w - mx * my) / var;
        if per_row > 0.0 {
            self.line = Some(((my - per_row * mx).max(0.0), per_row));
        }
    }

    /// The fitted `(fixed, per_row)` seconds, once known.
    #[cfg(test)]
    pub fn line(&self) -> Option<(f64, f64)> {
        self.line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1e3)
    }

    /// Steps that cost `fixed + per_row · rows` ms exactly.
    fn fed(limit: StepTimeLimit, fixed: f64, per_row: f64) -> StepBudget {
        let mut b = StepBudget::new(limit);
        for (d, p) in [(4, 0), (4, 32), (5, 0), (5, 20), (4, 8), (6, 0)] {
            b.observe(d, p, ms(fixed + per_row * (d + p) as f64));
        }
        b
    }

    #[test]
    fn limits_parse_and_refuse_nonsense() {
        assert_eq!("off".parse::<StepTimeLimit>(), Ok(StepTimeLimit::Off));
        assert_eq!("auto".parse::<StepTimeLimit>(), Ok(StepTimeLimit::AUTO));
        assert_eq!(
            "50".parse::<StepTimeLimit>(),
            Ok(StepTimeLimit::Fixed(ms(50.0)))
        );
        for bad in ["0", "-3", "NaN", "inf", "fast", ""] {
            let err = bad.parse::<StepTimeLimit>().expect_err(bad);
            assert!(err.to_string().contains("milliseconds"), "{err}");
        }
    }

    #[test]
    fn the_line_is_recovered_from_mixed_steps() {
        let b = fed(StepTimeLimit::AUTO, 20.0, 1.5);
        let (fixed, per_row) = b.line().expect("fitted");
        assert!((fixed - 0.020).abs() < 1e-9, "{fixed}");
        assert!((per_row - 0.0015).abs() < 1e-9, "{per_row}");
    }

    #[test]
    fn relative_limit_holds_the_step_to_its_stall() {
        // 4 decode rows: 26 ms alone; 1.5x allows 13 ms more = 8.67 rows.
        let b = fed(StepTimeLimit::AUTO, 20.0, 1.5);
        assert_eq!(b.prefill_cap(4), Some(8));
        // A step with no decodes is never cut.
        assert_eq!(b.prefill_cap(0), None);
        // Fast steps are not cut below the 20 ms floor: 1 + 0.1·4 ms alone,
        // the floor allows (20 − 1.4) / 0.1 = 186 rows.
        let fast = fed(StepTimeLimit::AUTO, 1.0, 0.1);
        assert_eq!(fast.prefill_cap(4), Some(186));
    }

    #[test]
    fn fixed_limit_and_the_progress_floor() {
        let b = fed(StepTimeLimit::Fixed(ms(50.0)), 20.0, 1.5);
        // (50 − 26) / 1.5 = 16 rows.
        assert_eq!(b.prefill_cap(4), Some(16));
        // Decodes alone already over the bound: the prompt still moves.
        assert_eq!(b.prefill_cap(40), Some(MIN_PREFILL_TOKENS));
    }

    #[test]
    fn unknown_line_takes_the_first_chunk_and_off_takes_everything() {
        let mut b = StepBudget::new(StepTimeLimit::AUTO);
        assert_eq!(b.prefill_cap(3), Some(FIRST_CHUNK));
        // One row count only: the slope is unknown, the chunk stays.
        for _ in 0..5 {
            b.observe(3, 0, ms(25.0));
        }
        assert_eq!(b.line(), None);
        assert_eq!(b.prefill_cap(3), Some(FIRST_CHUNK));
        let off = fed(StepTimeLimit::Off, 20.0, 1.5);
        assert_eq!(off.prefill_cap(4), None);
        assert_eq!(off.line(), None);
    }

    #[test]
    fn the_line_follows_a_slower_machine() {
        let mut b = fed(StepTimeLimit::AUTO, 20.0, 1.5);
        // Twice as slow from now on: within a few dozen steps the cap halves
        // its room accordingly (the same 1.5x of a step twice as long over a
        // slope twice as steep is the same token count).
        for _ in 0..40 {
            for (d, p) in [(4, 0), (4, 8)] {
                b.observe(d, p, ms(2.0 * (20.0 + 1.5 * (d + p) as f64)));
            }
        }
        let (fixed, per_row) = b.line().expect("fitted");
        // The old regime's weight is 0.9^80 ≈ 2e-4 of the sums by now.
        assert!((fixed - 0.040).abs() < 1e-4, "{fixed}");
        assert!((per_row - 0.003).abs() < 1e-5, "{per_row}");
        assert_eq!(b.prefill_cap(4), Some(8));
    }
}
