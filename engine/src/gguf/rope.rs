//! Llama 3.1's RoPE scaling, which a GGUF file stores as its result: one
//! divisor per frequency (`rope_freqs.weight`, computed by llama.cpp's
//! converter from `factor`, `low_freq_factor`, `high_freq_factor` and
//! `original_max_position_embeddings`).
//!
//! The divisors depend on those four numbers only through three: the
//! plateau `factor`, and the line `s = A·x − B` (over `x = 1/wavelength`)
//! along which the divisor blends from 1 to `factor`. Those three are
//! fitted from the divisors, turned back into one set of the four
//! parameters (`low_freq_factor = 1`), and accepted only if recomputing the
//! divisors from them reproduces the file's.

use std::f64::consts::PI;

use serde_json::{json, Value};

/// The converter's divisors for these parameters (`generate_extra_tensors`
/// of its Llama model).
fn divisors(base: f64, dim: usize, p: [f64; 4]) -> Vec<f64> {
    let [factor, low, high, original] = p;
    (0..dim / 2)
        .map(|i| {
            let freq = 1.0 / base.powf(2.0 * i as f64 / dim as f64);
            let wavelen = 2.0 * PI / freq;
            if wavelen < original / high {
                1.0
            } else if wavelen > original / low {
                factor
            } else {
                let smooth = (original / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// `rope_parameters` of type `llama3` reproducing `stored` (the file's
/// `rope_freqs.weight`), or `None` when no such parameters do.
pub(super) fn llama3_parameters(base: f64, dim: usize, stored: &[f32]) -> Option<Value> {
    if stored.len() != dim / 2 || dim < 4 {
        return None;
    }
    let f: Vec<f64> = stored.iter().map(|&v| f64::from(v)).collect();
    let factor = f.iter().copied().fold(1.0, f64::max);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1.0);
    let x = |i: usize| 1.0 / (2.0 * PI * base.powf(2.0 * i as f64 / dim as f64));
    // (x, s) of the blended frequencies; the last unscaled and the first
    // fully scaled x bound the blend.
    let mut blended = Vec::new();
    let (mut unscaled_x, mut scaled_x) = (None::<f64>, None::<f64>);
    for (i, &d) in f.iter().enumerate() {
        if close(d, 1.0) {
            unscaled_x = Some(unscaled_x.map_or(x(i), |u| u.min(x(i))));
        } else if close(d, factor) {
            scaled_x = Some(scaled_x.map_or(x(i), |s| s.max(x(i))));
        } else {
            blended.push((x(i), (1.0 / d - 1.0 / factor) / (1.0 - 1.0 / factor)));
        }
    }
    // Two points fix the line: the two blended ones farthest apart
    // (against the divisors' f32 rounding), else a blended one and a
    // bound of the blend (s = 0 where scaling is whole, 1 where it is
    // none), else both bounds. The first line that reproduces every
    // divisor is taken.
    blended.sort_by(|p, q| p.0.total_cmp(&q.0));
    let bounds: Vec<(f64, f64)> = [scaled_x.map(|x| (x, 0.0)), unscaled_x.map(|x| (x, 1.0))]
        .into_iter()
        .flatten()
        .collect();
    let pairs: Vec<((f64, f64), (f64, f64))> = match blended.as_slice() {
        [first, .., last] => vec![(*first, *last)],
        [one] => bounds.iter().map(|b| (*one, *b)).collect(),
        [] => bounds
            .first()
            .zip(bounds.get(1))
            .map(|(a, b)| (*a, *b))
            .into_iter()
            .collect(),
    };
    if factor <= 1.0 {
        return None;
    }
    let params = pairs.into_iter().find_map(|((x0, s0), (x1, s1))| {
        if (x1 - x0).abs() < f64::EPSILON {
            return None;
        }
        let a = (s1 - s0) / (x1 - x0);
        let b = a * x0 - s0;
        if a <= 0.0 || b <= 0.0 {
            return None;
        }
        // low = 1: original = A/B, high = 1 + 1/B.
        let params = [factor, 1.0, 1.0 + 1.0 / b, a / b];
        let again = divisors(base, dim, params);
        again
            .iter()
            .zip(&f)
            .all(|(&r, &s)| close(r, s))
            .then_some(params)
    })?;
    Some(json!({
        "rope_type": "llama3",
        "factor": params[0],
        "low_freq_factor": params[1],
        "high_freq_factor": params[2],
        "original_max_position_embeddings": params[3],
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_3_1s_published_parameters_are_recovered_as_an_equivalent_set() {
        // Llama 3.1 8B: theta 500000, head 128, factor 8, 1, 4, 8192.
        let stored: Vec<f32> = divisors(500_000.0, 128, [8.0, 1.0, 4.0, 8192.0])
            .iter()
            .map(|&v| v as f32)
            .collect();
        let p = llama3_parameters(500_000.0, 128, &stored).expect("fits");
        let get = |k: &str| p[k].as_f64().expect("number");
        let again = divisors(
            500_000.0,
            128,
            [
                get("factor"),
                get("low_freq_factor"),
                get("high_freq_factor"),
                get("original_max_position_embeddings"),
            ],
        );
        for (a, b) in again.iter().zip(&stored) {
            assert!((a - f64::from(*b)).abs() < 1e-5 * a.abs(), "{a} vs {b}");
        }
        assert!((get("original_max_position_embeddings") / 8192.0 - 1.0).abs() < 1e-3);
        assert!((get("high_freq_factor") / 4.0 - 1.0).abs() < 1e-3);
    }

    #[test]
    fn divisors_no_llama3_parameters_make_are_refused() {
        let mut stored = vec![1.0f32; 64];
        stored[10] = 3.0;
        stored[40] = 2.0;
        assert_eq!(llama3_parameters(500_000.0, 128, &stored), None);
    }
}
