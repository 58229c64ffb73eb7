//! One step's layer loop on the stream: embedding, each layer's attention
//! and MLP kernels, the head over the rows whose logits were asked for.
//! Every argument is a fixed buffer or a count, so the loop can be captured
//! into a CUDA graph.

use super::*;

/// What a step's kernels need besides the fixed buffers: its row and tile
/// counts, the attention split and kernel.
#[derive(Clone, Copy)]
struct StepPlan {
    rows: usize,
    tiles: usize,
    tile_rows: usize,
    splits: usize,
    attn_kernel: &'static str,
}

/// A one-dimensional grid of 256-thread blocks over `n` elements.
fn ew_grid(n: usize) -> (u32, u32, u32) {
    (n.div_ceil(256).clamp(1, 65535) as u32, 1, 1)
}

impl CudaModel {
    /// The layer loop over `rows` uploaded rows (graph-capturable: every
    /// argument is a fixed buffer or a count).
    pub(super) fn run(
        &self,
        rows: usize,
        tiles: usize,
        tile_rows: usize,
        splits: usize,
        logit_rows: usize,
    ) -> Result<()> {
        let s = &self.scratch;
        let plan = StepPlan {
            rows,
            tiles,
            tile_rows,
            splits,
            attn_kernel: attention_kernel(self.opts.kv, self.config.head_dim, tile_rows <= 1)?,
        };
        self.gpu.launch(
            if self.embed_ty() == DeviceDType::F32 {
                "embed_f32"
            } else {
                "embed_bf16"
            },
            (rows as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(s.tokens.ptr),
                Arg::Ptr(self.weights.embed.buf.ptr),
                Arg::Ptr(s.x.ptr),
                Arg::I32(self.config.hidden_size as i32),
            ],
        )?;
        for (li, layer) in self.weights.layers.iter().enumerate() {
            self.attention_layer(li, layer, &plan)?;
            self.mlp_layer(layer, &plan)?;
        }
        // Only the rows whose logits were asked for go through the head.
        self.rms_norm(
            &self.weights.final_norm,
            s.final_h.ptr,
            logit_rows,
            s.logit_rows.ptr,
        )?;
        self.matmul(s.final_h.ptr, self.head(), s.logits.ptr, logit_rows, 0.0)
    }

    /// `y[r, ..n] += b` for the step's rows (row stride `stride`), if the
    /// layer has the bias.
    fn bias(
        &self,
        plan: &StepPlan,
        y: u64,
        b: &Option<DevBuf>,
        n: usize,
        stride: usize,
    ) -> Result<()> {
        let Some(b) = b else {
            return Ok(());
        };
        self.gpu.launch(
            "bias_add",
            ew_grid(plan.rows * n),
            256,
            0,
            &[
                Arg::Ptr(y),
                Arg::Ptr(b.ptr),
                Arg::I32(plan.rows as i32),
                Arg::I32(n as i32),
                Arg::I32(stride as i32),
            ],
        )
    }

    /// Layer `li`'s attention: norm and fused q/k/v, q/k norms, RoPE with
    /// the KV write, paged attention (split over KV blocks and reduced when
    /// `splits > 1`), the output projection added to the residual.
    fn attention_layer(&self, li: usize, layer: &DevLayer, plan: &StepPlan) -> Result<()> {
        let c = &self.config;
        let g = &self.gpu;
        let s = &self.scratch;
        let StepPlan {
            rows,
            tiles,
            tile_rows,
            splits,
            attn_kernel,
        } = *plan;
        let (hsz, d) = (c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_heads, c.num_kv_heads);
        let qkv_w = (nh + 2 * nkv) * d;
        let n_u32 = |n: usize| n as u32;
        let rope_kv = match self.opts.kv {
            DeviceDType::F32 => "rope_kv_write_f32",
            DeviceDType::Bf16 => "rope_kv_write_bf16",
        };
        // With bf16 weights attention writes the o-projection's bf16 input.
        let attn_bf16 = match self.opts.weights {
            DeviceDType::F32 => 0,
            DeviceDType::Bf16 => s.attn_in.ptr,
        };
        let scale = c.arch.attn_scale * (c.rope_scaling.attention_factor().powi(2) as f32);
        self.norm_matmul(&layer.input_norm, &layer.qkv, s.qkv.ptr, rows)?;
        self.bias(plan, s.qkv.ptr, &layer.qkv_bias, qkv_w, qkv_w)?;
        if let Some((qn, kn)) = &layer.qk_norm {
            g.launch(
                "qk_head_norm",
                (n_u32(rows), 1, 1),
                256,
                0,
                &[
                    Arg::Ptr(s.qkv.ptr),
                    Arg::Ptr(qn.ptr),
                    Arg::Ptr(kn.ptr),
                    Arg::Ptr(s.positions.ptr),
                    Arg::I32(qkv_w as i32),
                    Arg::I32(nh as i32),
                    Arg::I32(nkv as i32),
                    Arg::I32(d as i32),
                    Arg::F32(c.rms_norm_eps),
                ],
            )?;
        }
        let (kpool, vpool) = &self.kv[li];
        g.launch(
            rope_kv,
            (n_u32(rows), 1, 1),
            512,
            0,
            &[
                Arg::Ptr(s.qkv.ptr),
                Arg::Ptr(s.inv_freq.ptr),
                Arg::Ptr(s.positions.ptr),
                Arg::Ptr(s.slots.ptr),
                Arg::Ptr(kpool.ptr),
                Arg::Ptr(vpool.ptr),
                Arg::I32(qkv_w as i32),
                Arg::I32(nh as i32),
                Arg::I32(nkv as i32),
                Arg::I32(d as i32),
                Arg::I32(self.opts.block_size as i32),
            ],
        )?;
        let window = c.sliding_window[li].unwrap_or(0) as i32;
        g.launch(
            attn_kernel,
            (n_u32(tiles), n_u32(nh / self.hpc), n_u32(splits)),
            // Only as many warps as (row, head) pairs a tile can have.
            (32 * self.hpc * tile_rows.clamp(1, self.shape.tile_tokens)) as u32,
            0,
            &[
                Arg::Ptr(s.qkv.ptr),
                Arg::Ptr(kpool.ptr),
                Arg::Ptr(vpool.ptr),
                Arg::Ptr(s.tiles.ptr),
                Arg::Ptr(s.positions.ptr),
                Arg::Ptr(s.block_tables.ptr),
                Arg::Ptr(s.attn.ptr),
                Arg::Ptr(attn_bf16),
                Arg::Ptr(s.part_o.ptr),
                Arg::Ptr(s.part_ml.ptr),
                Arg::I32(qkv_w as i32),
                Arg::I32(nh as i32),
                Arg::I32(nkv as i32),
                Arg::I32(self.opts.block_size as i32),
                Arg::I32(self.shape.max_blocks as i32),
                Arg::I32(self.hpc as i32),
                Arg::I32(window),
                Arg::I32(splits as i32),
                Arg::F32(scale),
            ],
        )?;
        if splits > 1 {
            g.launch(
                "attn_reduce",
                (n_u32(rows), n_u32(nh), 1),
                n_u32(d.next_multiple_of(32)),
                0,
                &[
                    Arg::Ptr(s.part_o.ptr),
                    Arg::Ptr(s.part_ml.ptr),
                    Arg::Ptr(s.positions.ptr),
                    Arg::Ptr(s.attn.ptr),
                    Arg::Ptr(attn_bf16),
                    Arg::I32(nh as i32),
                    Arg::I32(d as i32),
                    Arg::I32(splits as i32),
                ],
            )?;
        }
        let o_in = match self.opts.weights {
            DeviceDType::F32 => s.attn.ptr,
            DeviceDType::Bf16 => s.attn_in.ptr,
        };
        // x += attn · Woᵀ: the residual add is the GEMM's beta.
        self.matmul(o_in, &layer.o, s.x.ptr, rows, 1.0)?;
        self.bias(plan, s.x.ptr, &layer.o_bias, hsz, hsz)
    }

    /// The layer's MLP: norm and fused gate/up, SiLU-mul, down projection
    /// added to the residual.
    fn mlp_layer(&self, layer: &DevLayer, plan: &StepPlan) -> Result<()> {
        let (hsz, inter) = (self.config.hidden_size, self.config.intermediate_size);
        let s = &self.scratch;
        let rows = plan.rows;
        let silu = match self.opts.weights {
            DeviceDType::F32 => "silu_mul_f32",
            DeviceDType::Bf16 => "silu_mul_bf16",
        };
        self.norm_matmul(&layer.post_norm, &layer.gate_up, s.gate_up.ptr, rows)?;
        self.bias(
            plan,
            s.gate_up.ptr,
            &layer.gate_up_bias,
            2 * inter,
            2 * inter,
        )?;
        self.gpu.launch(
            silu,
            ew_grid(rows * inter),
            256,
            0,
            &[
                Arg::Ptr(s.gate_up.ptr),
                Arg::Ptr(s.act.ptr),
                Arg::I32(rows as i32),
                Arg::I32(inter as i32),
            ],
        )?;
        self.matmul(s.act.ptr, &layer.down, s.x.ptr, rows, 1.0)?;
        self.bias(plan, s.x.ptr, &layer.down_bias, hsz, hsz)
    }
}
