//! Gemma 2 and 3 from GGUF: what their `config.json` says that a GGUF file
//! leaves to llama.cpp's per-family rules (`src/models/gemma{2,3}.cpp`),
//! reproduced here.
//!
//! - The attention scale: `query_pre_attn_scalar` is the head size, except
//!   for the 27B models (told by their layer count), where it is
//!   `hidden / heads`.
//! - Which layers slide: `attention.sliding_window_pattern` (a per-layer
//!   array or a period), else every 2nd layer is global (Gemma 2) or every
//!   6th (Gemma 3); Gemma 2's window is 4096 when the file gives none.
//! - Gemma 3's two RoPE bases: global layers use `rope.freq_base` and the
//!   scaling, sliding ones `rope.freq_base_swa` unscaled.
//!
//! The norms' `1 + w` the converter stored is undone by
//! [`super::TensorMap::shift`].

use serde_json::{json, Map, Value};
use tandem_gguf::Gguf;

use super::gguf_error;
use crate::error::Result;

/// What differs between the two generations.
#[derive(Debug)]
pub(super) struct Gemma {
    /// Every `period`-th layer is global unless the file says otherwise.
    period: u64,
    /// The layer count of the 27B model, whose attention scale differs.
    layers_27b: u64,
    /// The window when the file gives none (`None`: then no layer slides).
    default_window: Option<u64>,
    /// Gemma 3: sliding layers have their own RoPE base.
    local_rope_base: bool,
}

pub(super) const GEMMA2: Gemma = Gemma {
    period: 2,
    layers_27b: 46,
    default_window: Some(4096),
    local_rope_base: false,
};

pub(super) const GEMMA3: Gemma = Gemma {
    period: 6,
    layers_27b: 62,
    default_window: None,
    local_rope_base: true,
};

/// Adds Gemma's keys to `c` (the config built from the common keys).
pub(super) fn config(g: &Gguf, arch: &str, spec: &Gemma, c: &mut Map<String, Value>) -> Result<()> {
    let err = |e| gguf_error(g.path(), e);
    let key = |k: &str| format!("{arch}.{k}");
    let number = |k: &str| {
        g.optional(&key(k), tandem_gguf::Value::as_f64, "a number")
            .map_err(err)
    };
    let get = |k: &str| c.get(k).and_then(Value::as_u64).unwrap_or(0);
    let (layers, hidden, heads, head_dim) = (
        get("num_hidden_layers"),
        get("hidden_size"),
        get("num_attention_heads"),
        get("head_dim"),
    );
    let scalar = match layers == spec.layers_27b && heads > 0 {
        true => hidden / heads,
        false => head_dim,
    };
    c.insert("query_pre_attn_scalar".into(), json!(scalar));
    for (gguf_key, hf_key) in [
        ("attn_logit_softcapping", "attn_logit_softcapping"),
        ("final_logit_softcapping", "final_logit_softcapping"),
    ] {
        c.insert(hf_key.into(), json!(number(gguf_key)?));
    }
    let window = g
        .optional(
            &key("attention.sliding_window"),
            tandem_gguf::Value::as_u64,
            "an integer",
        )
        .map_err(err)?
        .filter(|&w| w > 0)
        .or(spec.default_window);
    let sliding = match window {
        Some(_) => sliding_layers(
            g,
            &key("attention.sliding_window_pattern"),
            spec.period,
            layers,
        )?,
        None => vec![false; layers as usize],
    };
    let types: Vec<&str> = sliding
        .iter()
        .map(|&on| {
            if on {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    c.insert("layer_types".into(), json!(types));
    c.insert("sliding_window".into(), json!(window));
    if spec.local_rope_base {
        let global = c.remove("rope_parameters").unwrap_or_else(|| json!({}));
        let local = number("rope.freq_base_swa")?.unwrap_or(10_000.0);
        c.insert(
            "rope_parameters".into(),
            json!({
                "full_attention": global,
                "sliding_attention": {"rope_type": "default", "rope_theta": local},
            }),
        );
    }
    Ok(())
}

/// Which of `layers` slide: the file's per-layer array, or every layer but
/// each `period`-th (the file's period, else the family's).
fn sliding_layers(g: &Gguf, key: &str, period: u64, layers: u64) -> Result<Vec<bool>> {
    let bad = || {
        crate::error::EngineError::InvalidCheckpoint(format!(
            "{}: `{key}` is neither a period nor one flag per layer",
            g.path().display()
        ))
    };
    match g.get(key) {
        Some(tandem_gguf::Value::Array(flags)) => {
            let flags: Option<Vec<bool>> = flags.iter().map(tandem_gguf::Value::as_bool).collect();
            flags.filter(|f| f.len() as u64 == layers).ok_or_else(bad)
        }
        Some(v) => {
            let n = v.as_u64().ok_or_else(bad)?;
            Ok(pattern(n, layers))
        }
        None => Ok(pattern(period, layers)),
    }
}

/// llama.cpp's `set_swa_pattern`: layer `i` slides unless it is the last
/// of its period (a period of 0: every layer slides).
fn pattern(period: u64, layers: u64) -> Vec<bool> {
    (0..layers)
        .map(|i| period == 0 || i % period < period - 1)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_periodth_layer_is_global() {
        assert_eq!(pattern(2, 4), [true, false, true, false]);
        assert_eq!(pattern(6, 7), [true, true, true, true, true, false, true]);
        assert_eq!(pattern(0, 2), [true, true]);
    }
}
