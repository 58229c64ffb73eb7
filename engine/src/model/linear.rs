//! Linear layers: a dense, INT4 or GGUF-block weight with an optional
//! bias, loaded whole or as one tensor-parallel rank's part.

use crate::error::{EngineError, Result};
use crate::kernels::{
    self, linear, linear_ggml, linear_int4, linear_panels, GgmlMatrix, MatmulPolicy, PanelLinear,
    Panels,
};
use crate::quant::hf::HfQuantization;
use crate::quant::{Int4Config, Int4Matrix};
use crate::weights::{Matrix, WeightStore};

/// A linear layer's weight: dense in the checkpoint's dtype, INT4, a
/// GGUF file's quantized blocks as stored, or bf16 packed in panels for
/// [`MatmulPolicy::Bf16Activations`].
#[derive(Debug)]
pub(super) enum LinearWeight {
    Dense(Matrix),
    Int4(Int4Matrix),
    Ggml(GgmlMatrix),
    Panels(Panels),
}

impl LinearWeight {
    pub(super) fn bytes(&self) -> usize {
        match self {
            Self::Dense(m) => m.bytes(),
            Self::Int4(q) => q.bytes(),
            Self::Ggml(g) => g.bytes(),
            Self::Panels(p) => p.bytes(),
        }
    }

    pub(super) fn is_mapped(&self) -> bool {
        match self {
            Self::Dense(m) => m.is_mapped(),
            Self::Int4(_) | Self::Ggml(_) | Self::Panels(_) => false,
        }
    }

    /// Rows `rows` of a `[total_rows, cols]` weight: its GGUF blocks when
    /// stored so, else dense.
    fn rows(
        ws: &WeightStore,
        name: &str,
        total_rows: usize,
        cols: usize,
        rows: std::ops::Range<usize>,
    ) -> Result<Self> {
        Ok(
            match ws.quantized_rows(name, total_rows, cols, rows.clone())? {
                Some(g) => Self::Ggml(g),
                None => Self::Dense(ws.matrix_rows(name, total_rows, cols, rows)?),
            },
        )
    }
}

/// A weight matrix with an optional bias.
#[derive(Debug)]
pub(super) struct Linear {
    pub(super) w: LinearWeight,
    b: Option<Vec<f32>>,
}

/// Where one projection sits in a fused tensor.
#[derive(Debug, Clone, Copy)]
pub(super) struct FusedPart<'a> {
    /// The fused tensor's module path.
    pub(super) prefix: &'a str,
    /// Rows of the whole fused tensor.
    pub(super) total_rows: usize,
    /// First row of this projection.
    pub(super) offset: usize,
}

/// Which part of a `[out, in]` linear layer a tensor-parallel rank holds.
#[derive(Debug, Clone)]
pub(super) enum Split {
    Whole,
    /// Column-parallel: these output features (weight rows, bias elements).
    Outputs(std::ops::Range<usize>),
    /// Row-parallel: these input features (weight columns); the bias is
    /// added by the rank that `keeps_bias` only, so the all-reduce adds it
    /// once.
    Inputs {
        range: std::ops::Range<usize>,
        keeps_bias: bool,
    },
}

impl Split {
    /// The features of `n` this split keeps (outputs or inputs).
    pub(super) fn range(&self, n: usize) -> std::ops::Range<usize> {
        match self {
            Self::Whole => 0..n,
            Self::Outputs(r) | Self::Inputs { range: r, .. } => r.clone(),
        }
    }

    /// Whether this rank adds the bias of a row-parallel layer.
    pub(super) fn keeps_bias(&self) -> bool {
        !matches!(
            self,
            Self::Inputs {
                keeps_bias: false,
                ..
            }
        )
    }
}

impl Linear {
    /// A dense layer from a weight already loaded.
    pub(super) fn dense(w: Matrix, b: Option<Vec<f32>>) -> Self {
        Self {
            w: LinearWeight::Dense(w),
            b,
        }
    }

    /// Loads a rank's part of the layer (reading only that part):
    /// `prefix.weight`, or the `prefix.qweight` family of a pre-quantized
    /// checkpoint (whole layers only).
    pub(super) fn load_part(
        ws: &WeightStore,
        quant: Option<&HfQuantization>,
        prefix: &str,
        out: usize,
        inp: usize,
        split: Split,
    ) -> Result<Self> {
        let name = format!("{prefix}.weight");
        let bias = format!("{prefix}.bias");
        let packed = quant.filter(|_| ws.contains(&format!("{prefix}.qweight")));
        match (packed, split) {
            (Some(q), Split::Whole) => Ok(Self {
                w: LinearWeight::Int4(q.load_linear(ws, prefix, out, inp)?),
                b: ws.optional_vector(&bias, out)?,
            }),
            (Some(_), _) => Err(EngineError::Unsupported(format!(
                "{prefix}: pre-quantized (AWQ/GPTQ) checkpoints run without tensor parallelism"
            ))),
            (None, Split::Whole) => Ok(Self {
                w: LinearWeight::rows(ws, &name, out, inp, 0..out)?,
                b: ws.optional_vector(&bias, out)?,
            }),
            (None, Split::Outputs(rows)) => Ok(Self {
                w: LinearWeight::rows(ws, &name, out, inp, rows.clone())?,
                b: match ws.contains(&bias) {
                    true => Some(ws.vector_part(&bias, out, rows)?),
                    false => None,
                },
            }),
            (None, Split::Inputs { range, keeps_bias }) => Ok(Self {
                w: match ws.quantized_cols(&name, out, inp, range.clone())? {
                    Some(g) => LinearWeight::Ggml(g),
                    None => LinearWeight::Dense(ws.matrix_cols(&name, out, inp, range)?),
                },
                b: match keeps_bias {
                    true => ws.optional_vector(&bias, out)?,
                    false => None,
                },
            }),
        }
    }

    /// Loads a rank's part of one projection stored inside a fused tensor
    /// (Phi-3's `qkv_proj`, `gate_up_proj`): its rows
    /// `part.offset..part.offset + out` of a `[part.total_rows, inp]`
    /// weight, mapped in place like any row range. Only column-parallel
    /// splits apply (the fused parts are outputs).
    pub(super) fn load_fused_part(
        ws: &WeightStore,
        quant: Option<&HfQuantization>,
        part: FusedPart<'_>,
        out: usize,
        inp: usize,
        split: Split,
    ) -> Result<Self> {
        let FusedPart {
            prefix,
            total_rows,
            offset,
        } = part;
        if quant.is_some() && ws.contains(&format!("{prefix}.qweight")) {
            return Err(EngineError::Unsupported(format!(
                "{prefix}: a fused projection in a pre-quantized (AWQ/GPTQ) checkpoint"
            )));
        }
        let rows = match split {
            Split::Whole => offset..offset + out,
            Split::Outputs(r) => offset + r.start..offset + r.end,
            Split::Inputs { .. } => {
                return Err(EngineError::Unsupported(format!(
                    "{prefix}: a fused tensor split by input features"
                )))
            }
        };
        let name = format!("{prefix}.weight");
        let bias = format!("{prefix}.bias");
        Ok(Self {
            w: LinearWeight::rows(ws, &name, total_rows, inp, rows.clone())?,
            b: match ws.contains(&bias) {
                true => Some(ws.vector_part(&bias, total_rows, rows)?),
                false => None,
            },
        })
    }

    /// Output features (weight rows).
    pub(super) fn out_features(&self) -> usize {
        match &self.w {
            LinearWeight::Dense(m) => m.rows,
            LinearWeight::Int4(q) => q.rows(),
            LinearWeight::Ggml(g) => g.rows(),
            LinearWeight::Panels(p) => p.rows(),
        }
    }

    pub(super) fn forward(&self, x: &[f32], m: usize, policy: MatmulPolicy, out: &mut [f32]) {
        match &self.w {
            LinearWeight::Dense(w) => linear(x, m, w, self.b.as_deref(), policy, out),
            LinearWeight::Int4(w) => linear_int4(x, m, w, self.b.as_deref(), policy, out),
            LinearWeight::Ggml(w) => linear_ggml(x, m, w, self.b.as_deref(), policy, out),
            LinearWeight::Panels(w) => linear_panels(
                x,
                m,
                &mut [PanelLinear {
                    w,
                    bias: self.b.as_deref(),
                    out,
                }],
            ),
        }
    }

    /// `N` linears of the same input `x` into their outputs, in one
    /// parallel region when all are dense and the row kernel runs them
    /// ([`kernels::linear_fused`]); one by one otherwise.
    pub(super) fn forward_fused<const N: usize>(
        parts: [(&Linear, &mut [f32]); N],
        x: &[f32],
        m: usize,
        policy: MatmulPolicy,
    ) {
        if parts
            .iter()
            .all(|(l, _)| matches!(l.w, LinearWeight::Dense(_)))
        {
            let mut fused: Vec<kernels::FusedLinear<'_>> = parts
                .into_iter()
                .filter_map(|(l, out)| match &l.w {
                    LinearWeight::Dense(w) => Some(kernels::FusedLinear {
                        w,
                        bias: l.b.as_deref(),
                        out,
                    }),
                    _ => None,
                })
                .collect();
            kernels::linear_fused(x, m, &mut fused, policy);
            return;
        }
        if parts
            .iter()
            .all(|(l, _)| matches!(l.w, LinearWeight::Panels(_)))
        {
            let mut fused: Vec<PanelLinear<'_>> = parts
                .into_iter()
                .filter_map(|(l, out)| match &l.w {
                    LinearWeight::Panels(w) => Some(PanelLinear {
                        w,
                        bias: l.b.as_deref(),
                        out,
                    }),
                    _ => None,
                })
                .collect();
            linear_panels(x, m, &mut fused);
            return;
        }
        for (l, out) in parts {
            l.forward(x, m, policy, out);
        }
    }

    /// Replaces a GGUF-block weight by its f16 decoding; whether it did.
    pub(super) fn decode_blocks(&mut self) -> bool {
        let LinearWeight::Ggml(g) = &self.w else {
            return false;
        };
        self.w = LinearWeight::Dense(g.to_f16());
        true
    }

    /// The weight, when it is dense bf16 (what [`Panels`] pack).
    pub(super) fn dense_bf16(&self) -> Option<&Matrix> {
        match &self.w {
            LinearWeight::Dense(m) if m.dtype() == crate::weights::DType::Bf16 => Some(m),
            _ => None,
        }
    }

    /// Replaces a dense, GGUF-block or packed weight by its INT4
    /// quantization.
    pub(super) fn quantize(&mut self, config: Int4Config, name: &str) -> Result<()> {
        let decoded;
        let m = match &self.w {
            LinearWeight::Dense(m) => m,
            LinearWeight::Ggml(g) => {
                decoded = g.to_dense();
                &decoded
            }
            LinearWeight::Panels(p) => {
                decoded = p.to_matrix();
                &decoded
            }
            LinearWeight::Int4(_) => return Ok(()),
        };
        let q = Int4Matrix::quantize(m, config).map_err(|e| match e {
            EngineError::Unsupported(msg) => EngineError::Unsupported(format!("{name}: {msg}")),
            other => other,
        })?;
        self.w = LinearWeight::Int4(q);
        Ok(())
    }
}
