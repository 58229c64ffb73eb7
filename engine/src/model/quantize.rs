//! Weights in forms of their own: quantized at load (`--quantize int4`),
//! kept in GGUF blocks, packed into panels for bf16 activations; and what
//! they weigh.

use super::linear::Linear;
use super::{HeadForm, Layer, LinearWeight, Model};
use crate::error::Result;
use crate::kernels::Panels;
use crate::quant::{Int4Config, ResidualInt4};
use crate::weights::Matrix;

impl Model {
    /// Bytes of weights read per forward pass (every matrix once).
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.linears().map(|(_, lin)| lin.w.bytes()).sum::<usize>() + l.mlp.routing_bytes()
            })
            .sum();
        let head = match self.shard.computes_logits() {
            true => match &self.head_form {
                Some(HeadForm::Int4(h)) => h.bytes(),
                Some(HeadForm::Blocks(h)) => h.bytes(),
                Some(HeadForm::Panels(h)) => h.bytes(),
                None => self.head().bytes(),
            },
            false => 0,
        };
        layers + head
    }

    /// Quantizes every dense linear layer (attention and MLP projections)
    /// to INT4 in place, and the output head to about 8 bits
    /// ([`ResidualInt4`]); the embedding stays as stored (a tied head gets
    /// its own copy). Decode reads the head every step, so it is quantized
    /// too, unlike AWQ/GPTQ checkpoints, which keep it dense (and load so);
    /// at 4 bits it cost a real small model 4.4 points of perplexity, at 8
    /// bits within noise (bench/RESULTS.md). Layers already INT4 are kept.
    pub fn quantize_int4(&mut self, config: Int4Config) -> Result<()> {
        let steps = self.layers.len() + usize::from(self.shard.computes_logits());
        let task = crate::progress::Task::begin("quantizing to INT4", steps as u64);
        for (i, l) in self.layers.iter_mut().enumerate() {
            for (name, lin) in l.linears_mut() {
                lin.quantize(config, &format!("layer {i} {name}"))?;
            }
            task.step();
        }
        if self.shard.computes_logits() {
            let head = ResidualInt4::quantize(self.head(), config)?;
            self.head_form = Some(HeadForm::Int4(head));
            task.step();
        }
        Ok(())
    }

    /// Decodes every weight kept in GGUF blocks (linear layers and the
    /// head) to f16, for the dense kernels: f32 activations against the
    /// exact weights, at 16 bits a weight. Returns how many matrices it
    /// decoded.
    pub fn decode_gguf_blocks(&mut self) -> usize {
        let mut decoded = 0;
        for l in &mut self.layers {
            for (_, lin) in l.linears_mut() {
                decoded += usize::from(lin.decode_blocks());
            }
        }
        if let Some(HeadForm::Blocks(_)) = self.head_form {
            // The dense head (or tied embedding) is already loaded.
            self.head_form = None;
            decoded += 1;
        }
        decoded
    }

    /// How many of the linear layers' matrices are kept in GGUF blocks.
    pub fn gguf_block_matrices(&self) -> usize {
        self.count_linears(|w| matches!(w, LinearWeight::Ggml(_)))
    }

    /// How many of the linear layers' matrices are INT4 (out of
    /// [`linear_matrices`](Self::linear_matrices)).
    pub fn int4_matrices(&self) -> usize {
        self.count_linears(|w| matches!(w, LinearWeight::Int4(_)))
    }

    /// Packs every dense bf16 linear layer, and the head unless it has a
    /// form of its own, into panels, all in one region on huge pages
    /// ([`Panels::pack_all`]); a tied embedding stays as stored for its
    /// lookups.
    pub(super) fn pack_weights(&mut self) {
        let mut linears: Vec<&mut Linear> = self
            .layers
            .iter_mut()
            .flat_map(|l| l.linears_mut().map(|(_, lin)| lin))
            .filter(|lin| lin.dense_bf16().is_some())
            .collect();
        let head = match (&self.head_form, self.shard.computes_logits()) {
            (None, true) => Some(self.lm_head.as_ref().unwrap_or(&self.embed)),
            _ => None,
        };
        let with_head = head.is_some();
        let matrices: Vec<&Matrix> = linears
            .iter()
            .filter_map(|lin| lin.dense_bf16())
            .chain(head)
            .collect();
        let mut packed = Panels::pack_all(&matrices).into_iter();
        drop(matrices);
        // A packed matrix read from a mapped file leaves the pages packing
        // read in the resident set (SmolLM2: 279 MB beside the 258 MB
        // packed copy) until the kernel reclaims them: dropped here.
        for lin in &mut linears {
            if let Some(Some(p)) = packed.next() {
                if let Some(dense) = lin.dense_bf16() {
                    dense.release_pages();
                }
                lin.w = LinearWeight::Panels(p);
            }
        }
        if let (true, Some(Some(p))) = (with_head, packed.next()) {
            // A separate head is read no more; a tied one still serves
            // embedding lookups, and a row's page comes back when a token
            // reads it (SmolLM2's tied 57 MB: ~2 MB back after a request).
            self.lm_head.as_ref().unwrap_or(&self.embed).release_pages();
            self.head_form = Some(HeadForm::Panels(p));
        }
        let count = self.packed_matrices();
        if count > 0 {
            tracing::info!(matrices = count, "bf16 weights packed into panels");
        }
    }

    /// Unpacks whatever [`Self::pack_weights`] packed.
    pub(super) fn unpack_weights(&mut self) {
        for l in &mut self.layers {
            for (_, lin) in l.linears_mut() {
                if let LinearWeight::Panels(p) = &lin.w {
                    lin.w = LinearWeight::Dense(p.to_matrix());
                }
            }
        }
        if let Some(HeadForm::Panels(_)) = self.head_form {
            self.head_form = None;
        }
    }

    /// How many of the linear layers' matrices are packed into panels
    /// ([`MatmulPolicy::packs_weights`](crate::kernels::MatmulPolicy::packs_weights)),
    /// the output head counted when it is.
    pub fn packed_matrices(&self) -> usize {
        let head = matches!(self.head_form, Some(HeadForm::Panels(_)));
        self.count_linears(|w| matches!(w, LinearWeight::Panels(_))) + usize::from(head)
    }

    fn count_linears(&self, is: impl Fn(&LinearWeight) -> bool) -> usize {
        self.layers
            .iter()
            .flat_map(Layer::linears)
            .filter(|(_, lin)| is(&lin.w))
            .count()
    }

    /// How many linear layers' matrices the model has: seven per dense
    /// layer, four plus three per expert per sparse one (the router stays
    /// dense and is not counted).
    pub fn linear_matrices(&self) -> usize {
        self.layers.iter().map(|l| l.linears().count()).sum()
    }
}
