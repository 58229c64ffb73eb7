//! When requests are sent: a Poisson process at a rate, a gamma process
//! with a burstiness (shape; 1 is Poisson, below 1 burstier), or a fixed
//! number in flight (closed loop).

use crate::rng::Rng;

/// The arrival process.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrival {
    /// Open loop: gamma inter-arrival times with mean `1 / rate` and shape
    /// `burstiness` (vLLM's model); an infinite rate sends everything at once.
    Rate { rate: f64, burstiness: f64 },
    /// Closed loop: this many requests in flight, each sent when one ends.
    Concurrency(usize),
}

impl Arrival {
    /// Poisson arrivals.
    pub fn poisson(rate: f64) -> Self {
        Self::Rate {
            rate,
            burstiness: 1.0,
        }
    }

    /// Send offsets (seconds from the start) of `count` open-loop requests;
    /// `None` for a closed loop.
    pub fn schedule(&self, count: usize, seed: u64) -> Option<Vec<f64>> {
        let Self::Rate { rate, burstiness } = *self else {
            return None;
        };
        if !rate.is_finite() {
            return Some(vec![0.0; count]);
        }
        let mut rng = Rng::new(seed ^ 0x5eed);
        let scale = 1.0 / (rate * burstiness);
        let mut t = 0.0;
        Some(
            (0..count)
                .map(|i| {
                    if i > 0 {
                        t += rng.gamma(burstiness, scale);
                    }
                    t
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_has_its_rate() {
        let s = Arrival::poisson(20.0)
            .schedule(20_001, 1)
            .expect("open loop");
        assert_eq!(s[0], 0.0);
        assert!(s.windows(2).all(|w| w[1] >= w[0]));
        let rate = 20_000.0 / s[20_000];
        assert!((rate - 20.0).abs() < 0.6, "{rate}");
    }

    #[test]
    fn burstier_arrivals_vary_more_at_the_same_rate() {
        let cv = |b: f64| {
            let s = Arrival::Rate {
                rate: 10.0,
                burstiness: b,
            }
            .schedule(20_001, 2)
            .expect("open loop");
            let gaps: Vec<f64> = s.windows(2).map(|w| w[1] - w[0]).collect();
            let m = gaps.iter().sum::<f64>() / gaps.len() as f64;
            let sd = (gaps.iter().map(|g| (g - m).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
            assert!((m - 0.1).abs() < 0.005, "mean gap {m} at burstiness {b}");
            sd / m
        };
        // The coefficient of variation of gamma(k) is 1 / sqrt(k).
        assert!((cv(1.0) - 1.0).abs() < 0.05);
        assert!((cv(0.25) - 2.0).abs() < 0.15);
        assert!((cv(4.0) - 0.5).abs() < 0.05);
    }

    #[test]
    fn infinite_rate_and_closed_loop() {
        assert_eq!(
            Arrival::poisson(f64::INFINITY).schedule(3, 0),
            Some(vec![0.0; 3])
        );
        assert_eq!(Arrival::Concurrency(4).schedule(3, 0), None);
    }
}
