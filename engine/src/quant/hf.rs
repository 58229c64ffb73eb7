//! Pre-quantized AWQ and GPTQ checkpoints in their Hugging Face layouts.
//!
//! `config.json` names the method in `quantization_config`; each quantized
//! linear layer `P` then has `P.qweight`, `P.qzeros` and `P.scales` (GPTQ
//! also `P.g_idx`) instead of `P.weight`. Both pack eight 4-bit values per
//! int32, value `i` in bits `4i..4i + 4`, and both mean `w = s · (q − z)`
//! with `in_features / group_size` groups along the input dimension; they
//! differ in which dimension is packed and in what order:
//!
//! | tensor    | AWQ (GEMM, AutoAWQ)                  | GPTQ (AutoGPTQ / GPTQModel)      |
//! |-----------|--------------------------------------|----------------------------------|
//! | `qweight` | `[in, out/8]`, packed along `out`    | `[in/8, out]`, packed along `in` |
//! | `qzeros`  | `[in/g, out/8]`, as `qweight`        | `[in/g, out/8]`, along `out`     |
//! | `scales`  | `[in/g, out]` f16                    | `[in/g, out]` f16                |
//! | order     | nibble `i` is column `8c + [0,2,4,6,1,3,5,7][i]` | sequential               |
//! | zeros     | stored as is                         | `gptq` (v1) stores `z − 1`; `gptq_v2` stores `z` |
//!
//! (AutoAWQ `pack` with `order_map = [0, 2, 4, 6, 1, 3, 5, 7]`, undone by
//! `AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]`; AutoGPTQ's `pack`
//! subtracts one from the zeros and its dequantization adds it back.)
//! The codes are unpacked and re-packed into [`Int4Matrix`]'s own layout, so
//! both run on the same kernels. GPTQ's activation reordering (`desc_act`
//! with a `g_idx` that is not `i / group_size`) is refused: it would need a
//! permutation of the activations in every layer.

use std::path::Path;

use serde_json::Value;

use super::{Int4Matrix, GROUP_SIZES};
use crate::config::read_json;
use crate::error::{EngineError, Result};
use crate::weights::WeightStore;

/// AWQ's nibble order: nibble `i` of an int32 holds column `8c + AWQ_ORDER[i]`.
pub const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

/// Which packing a checkpoint uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfMethod {
    /// AutoAWQ's GEMM layout.
    Awq,
    /// GPTQ; `zeros_minus_one` for the v1 `gptq` checkpoint format.
    Gptq { zeros_minus_one: bool },
}

/// A checkpoint's `quantization_config`, as far as the engine runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HfQuantization {
    pub method: HfMethod,
    /// `None` for GPTQ's `group_size: -1` (one group per input row).
    pub group_size: Option<usize>,
}

fn unsupported(what: String) -> EngineError {
    EngineError::Unsupported(format!("quantization_config: {what}"))
}

impl HfQuantization {
    /// Reads `quantization_config` from a checkpoint's `config.json`;
    /// `None` for an unquantized checkpoint.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join("config.json");
        if !path.is_file() {
            return Ok(None);
        }
        let config = read_json(&path)?;
        let q = config.get("quantization_config").filter(|v| !v.is_null());
        // gpt-oss's MXFP4 experts are not INT4 linear layers: the expert
        // loader dequantizes them (`WeightStore::mxfp4_rows`).
        if q.and_then(|q| q.get("quant_method"))
            .and_then(Value::as_str)
            == Some("mxfp4")
        {
            return Ok(None);
        }
        q.map(Self::from_json).transpose()
    }

    /// Parses a `quantization_config` object.
    pub fn from_json(q: &Value) -> Result<Self> {
        let method = q
            .get("quant_method")
            .and_then(Value::as_str)
            .ok_or_else(|| unsupported("no quant_method".into()))?;
        let bits = q
            .get("bits")
            .or_else(|| q.get("w_bit"))
            .and_then(Value::as_i64);
        if bits != Some(4) {
            return Err(unsupported(format!(
                "{method} with bits {bits:?} (only 4-bit weights are supported)"
            )));
        }
        let group = q
            .get("group_size")
            .or_else(|| q.get("q_group_size"))
            .and_then(Value::as_i64)
            .ok_or_else(|| unsupported(format!("{method} without group_size")))?;
        let group_size = match group {
            -1 => None,
            g if g > 0 => Some(g as usize),
            g => return Err(unsupported(format!("group_size {g}"))),
        };
        let method = match method {
            "awq" => {
                let version = q.get("version").and_then(Value::as_str).unwrap_or("gemm");
                if !version.eq_ignore_ascii_case("gemm") {
                    return Err(unsupported(format!(
                        "AWQ version `{version}` (only the GEMM layout is supported)"
                    )));
                }
                if q.get("zero_point").and_then(Value::as_bool) == Some(false) {
                    return Err(unsupported("AWQ without zero points".into()));
                }
                if group_size.is_none() {
                    return Err(unsupported("AWQ with group_size -1".into()));
                }
                HfMethod::Awq
            }
            "gptq" => {
                let format = q
                    .get("checkpoint_format")
                    .and_then(Value::as_str)
                    .unwrap_or("gptq");
                let zeros_minus_one = match format {
                    "gptq" => true,
                    "gptq_v2" => false,
                    other => {
                        return Err(unsupported(format!(
                            "GPTQ checkpoint_format `{other}` (supported: gptq, gptq_v2)"
                        )))
                    }
                };
                HfMethod::Gptq { zeros_minus_one }
            }
            other => {
                return Err(unsupported(format!(
                    "quant_method `{other}` (supported: awq, gptq)"
                )))
            }
        };
        Ok(Self { method, group_size })
    }

    /// Loads the quantized linear layer `prefix` (`[out, in]` as a dense
    /// layer would be) into the engine's INT4 layout.
    pub fn load_linear(
        &self,
        ws: &WeightStore,
        prefix: &str,
        out: usize,
        inp: usize,
    ) -> Result<Int4Matrix> {
        let g = self.group_size.unwrap_or(inp);
        if !GROUP_SIZES.contains(&g)
            || !inp.is_multiple_of(g)
            || !out.is_multiple_of(8)
            || !inp.is_multiple_of(8)
        {
            return Err(unsupported(format!(
                "`{prefix}`: {out}×{inp} in groups of {g} (the kernels take groups of {GROUP_SIZES:?} dividing the input size, and sizes divisible by 8)"
            )));
        }
        let groups = inp / g;
        let scales_t = ws.matrix(&format!("{prefix}.scales"), groups, out)?;
        let mut scales_in_out = vec![0f32; groups * out];
        for (gi, row) in scales_in_out.chunks_exact_mut(out).enumerate() {
            scales_t.row_to_f32(gi, row);
        }
        let qzeros = ws.tensor_i32(&format!("{prefix}.qzeros"), &[groups, out / 8])?;
        let (order, zero_offset) = match self.method {
            HfMethod::Awq => (AWQ_ORDER, 0u8),
            HfMethod::Gptq { zeros_minus_one } => {
                ([0, 1, 2, 3, 4, 5, 6, 7], u8::from(zeros_minus_one))
            }
        };
        // Zeros and scales into the engine's [out, groups] orientation.
        let mut zeros = vec![0u8; out * groups];
        let mut scales = vec![0f32; out * groups];
        for gi in 0..groups {
            for pc in 0..out / 8 {
                let word = qzeros[gi * (out / 8) + pc] as u32;
                for (i, &col) in order.iter().enumerate() {
                    let o = pc * 8 + col;
                    let z = ((word >> (4 * i)) & 0xf) as u8 + zero_offset;
                    if z > 15 {
                        return Err(EngineError::InvalidCheckpoint(format!(
                            "`{prefix}.qzeros` holds zero point {z} (after GPTQ's +1), outside 0..=15"
                        )));
                    }
                    zeros[o * groups + gi] = z;
                    scales[o * groups + gi] = scales_in_out[gi * out + o];
                }
            }
        }
        let mut codes = vec![0u8; out * inp];
        match self.method {
            HfMethod::Awq => {
                let qweight = ws.tensor_i32(&format!("{prefix}.qweight"), &[inp, out / 8])?;
                for i in 0..inp {
                    for pc in 0..out / 8 {
                        let word = qweight[i * (out / 8) + pc] as u32;
                        for (n, &col) in AWQ_ORDER.iter().enumerate() {
                            codes[(pc * 8 + col) * inp + i] = ((word >> (4 * n)) & 0xf) as u8;
                        }
                    }
                }
            }
            HfMethod::Gptq { .. } => {
                let qweight = ws.tensor_i32(&format!("{prefix}.qweight"), &[inp / 8, out])?;
                let g_idx_name = format!("{prefix}.g_idx");
                if ws.contains(&g_idx_name) {
                    let g_idx = ws.tensor_i32(&g_idx_name, &[inp])?;
                    if let Some(i) = (0..inp).find(|&i| g_idx[i] as usize != i / g) {
                        return Err(unsupported(format!(
                            "`{g_idx_name}`[{i}] = {} is not {i} / {g}: GPTQ act-order (desc_act) checkpoints are not supported",
                            g_idx[i]
                        )));
                    }
                }
                for pr in 0..inp / 8 {
                    for o in 0..out {
                        let word = qweight[pr * out + o] as u32;
                        for n in 0..8 {
                            codes[o * inp + pr * 8 + n] = ((word >> (4 * n)) & 0xf) as u8;
                        }
                    }
                }
            }
        }
        Int4Matrix::from_codes(out, inp, g, &codes, &scales, &zeros)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_awq_and_gptq_configs_and_refuses_others() {
        let awq = HfQuantization::from_json(&json!({
            "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"
        }))
        .expect("awq");
        assert_eq!(awq.method, HfMethod::Awq);
        assert_eq!(awq.group_size, Some(128));
        let gptq = HfQuantization::from_json(&json!({
            "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": false, "sym": true
        }))
        .expect("gptq");
        assert_eq!(
            gptq.method,
            HfMethod::Gptq {
                zeros_minus_one: true
            }
        );
        for bad in [
            json!({"quant_method": "awq", "bits": 8, "group_size": 128}),
            json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}),
            json!({"quant_method": "bitsandbytes", "bits": 4, "group_size": 64}),
            json!({"quant_method": "gptq", "bits": 4, "group_size": 64, "checkpoint_format": "marlin"}),
            json!({"bits": 4}),
        ] {
            let err = HfQuantization::from_json(&bad).expect_err("refused");
            assert!(err.to_string().contains("quantization_config"), "{err}");
        }
    }
}
