//! The next interval's load from the last few: the last value, or a
//! least-squares line through a window of them one step ahead (it sees a
//! ramp coming an interval earlier than the last value does; it never
//! predicts below zero). Dynamo's planner offers the same two plus ARIMA
//! and Prophet; a line is what an interval of tens of seconds supports.

use std::collections::VecDeque;

/// How the next interval's load is predicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Predictor {
    /// The last interval's load.
    Last,
    /// A line through the last `window` intervals, one step ahead, and
    /// never below the last value when load is rising.
    Trend { window: usize },
}

impl Predictor {
    pub const DEFAULT: Predictor = Predictor::Trend { window: 4 };
}

/// One load series (prompt tokens/s, or generated tokens/s).
#[derive(Debug, Clone)]
pub struct Forecast {
    predictor: Predictor,
    history: VecDeque<f64>,
}

impl Forecast {
    pub fn new(predictor: Predictor) -> Self {
        Self {
            predictor,
            history: VecDeque::new(),
        }
    }

    pub fn observe(&mut self, value: f64) {
        let keep = match self.predictor {
            Predictor::Last => 1,
            Predictor::Trend { window } => window.max(2),
        };
        self.history.push_back(value.max(0.0));
        while self.history.len() > keep {
            self.history.pop_front();
        }
    }

    /// The next interval's value; 0 before any observation.
    pub fn predict(&self) -> f64 {
        let Some(&last) = self.history.back() else {
            return 0.0;
        };
        if self.history.len() < 2 {
            return last;
        }
        let n = self.history.len() as f64;
        let mean_x = (n - 1.0) / 2.0;
        let mean_y = self.history.iter().sum::<f64>() / n;
        let (mut sxy, mut sxx) = (0.0, 0.0);
        for (x, y) in self.history.iter().enumerate() {
            let dx = x as f64 - mean_x;
            sxy += dx * (y - mean_y);
            sxx += dx * dx;
        }
        let slope = sxy / sxx;
        let next = mean_y + slope * (n - mean_x);
        match slope > 0.0 {
            // Rising: at least what is here now.
            true => next.max(last),
            false => next.max(0.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_sees_a_ramp_one_step_ahead() {
        let mut f = Forecast::new(Predictor::Trend { window: 4 });
        assert_eq!(f.predict(), 0.0);
        for v in [100.0, 200.0, 300.0] {
            f.observe(v);
        }
        assert!((f.predict() - 400.0).abs() < 1e-9, "{}", f.predict());
        // The window forgets: a plateau after the ramp flattens the line.
        for v in [300.0, 300.0, 300.0, 300.0] {
            f.observe(v);
        }
        assert!((f.predict() - 300.0).abs() < 1e-9);
        // Falling: the line goes down but never under zero.
        for v in [200.0, 100.0, 0.0, 0.0] {
            f.observe(v);
        }
        assert_eq!(f.predict(), 0.0);
    }

    #[test]
    fn last_is_the_last_value() {
        let mut f = Forecast::new(Predictor::Last);
        for v in [5.0, 50.0, 20.0] {
            f.observe(v);
        }
        assert_eq!(f.predict(), 20.0);
    }
}
