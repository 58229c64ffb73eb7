//! A layer's attention block: per-head q/k/v with paged attention, or
//! latent attention ([`super::mla`]), then the output projection, its
//! all-reduce, norm and residual.

use crate::attention::{paged_attention, Scoring};
use crate::error::Result;
use crate::kernels::rms_norm_in_place;
use crate::kv_cache::KvCache;
use crate::lora::LoraTarget;
use crate::shard::ShardPeers;

use super::linear::Linear;
use super::mla::MlaStep;
use super::step::Step;
use super::{input_norm, AttnProj, Layer, Model};

impl Model {
    /// Norm, attention (per-head or latent), output projection
    /// (all-reduced), output norm, residual add.
    pub(super) fn attention_block(
        &self,
        li: usize,
        layer: &Layer,
        x: &mut [f32],
        s: &mut Step<'_>,
        kv: &mut KvCache,
        peers: &mut dyn ShardPeers,
    ) -> Result<()> {
        let (t, eps) = (s.rows, self.config.rms_norm_eps);
        input_norm(x, layer.attn_norm.as_deref(), eps, &mut s.h);
        match &layer.proj {
            AttnProj::Heads(qkv) => {
                self.head_attention(li, layer, qkv, s, kv);
                layer.o.forward(&s.attn, t, self.matmul, &mut s.proj);
                s.lora.layer(li).apply(LoraTarget::O, &s.attn, &mut s.proj);
            }
            AttnProj::Latent(mla) => {
                let step = MlaStep {
                    layer: li,
                    seqs: &s.seqs,
                    rope: &self.rope,
                    cos: &s.cos,
                    sin: &s.sin,
                    scale: self.config.arch.attn_scale,
                    matmul: self.matmul,
                    form: self.mla_form,
                };
                let attn = mla.forward(&s.h, t, kv, &step);
                layer.o.forward(&attn, t, self.matmul, &mut s.proj);
            }
        }
        if self.shard.tp_size > 1 {
            peers.all_reduce(&mut s.proj)?;
        }
        if let Some(n) = &layer.attn_out_norm {
            rms_norm_in_place(&mut s.proj, n, eps);
        }
        self.residual_add(x, &mut s.proj);
        Ok(())
    }

    /// q/k/v of the normed input `s.h`, q/k norms, RoPE, the K/V write and
    /// paged attention into `s.attn`.
    fn head_attention(
        &self,
        li: usize,
        layer: &Layer,
        [q, k, v]: &[Linear; 3],
        s: &mut Step<'_>,
        kv: &mut KvCache,
    ) {
        let (t, d, eps) = (s.rows, self.config.head_dim, self.config.rms_norm_eps);
        let (q_out, kv_out) = (s.heads.num_heads * d, s.heads.num_kv_heads * d);
        Linear::forward_fused(
            [(q, &mut s.q), (k, &mut s.k), (v, &mut s.v)],
            &s.h,
            t,
            self.matmul,
        );
        let lora = s.lora.layer(li);
        lora.apply(LoraTarget::Q, &s.h, &mut s.q);
        lora.apply(LoraTarget::K, &s.h, &mut s.k);
        lora.apply(LoraTarget::V, &s.h, &mut s.v);
        if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
            rms_norm_in_place(&mut s.q, qn, eps);
            rms_norm_in_place(&mut s.k, kn, eps);
        }
        let (rope, cos, sin) = match (&self.local_rope, layer.attention.local_rope) {
            (Some(local), true) => (local, &s.local_cos, &s.local_sin),
            _ => (&self.rope, &s.cos, &s.sin),
        };
        let half = d / 2;
        for i in 0..t {
            let (cs, sn) = (
                &cos[i * half..(i + 1) * half],
                &sin[i * half..(i + 1) * half],
            );
            rope.apply(&mut s.q[i * q_out..(i + 1) * q_out], d, cs, sn);
            rope.apply(&mut s.k[i * kv_out..(i + 1) * kv_out], d, cs, sn);
        }
        let bs = kv.layout().block_size;
        let (groups, group) = (kv.groups().num_groups(), kv.groups().group(li));
        for seq in &s.seqs {
            for j in 0..seq.len {
                let pos = seq.start_pos + j;
                let row = seq.row + j;
                kv.write(
                    li,
                    seq.blocks[pos / bs * groups + group],
                    pos % bs,
                    &s.k[row * kv_out..(row + 1) * kv_out],
                    &s.v[row * kv_out..(row + 1) * kv_out],
                );
            }
        }
        let scoring = Scoring {
            scale: self.config.arch.attn_scale * rope.score_factor(),
            softcap: self.config.arch.attn_softcap,
            window: layer.attention.window,
            sinks: layer.sinks.as_deref(),
        };
        paged_attention(&s.q, kv, li, &s.seqs, s.heads, scoring, &mut s.attn);
    }
}
