//! Building a [`CudaModel`]: a checkpoint's weights (or random ones)
//! uploaded in the device dtype, fused as `arch::layer_plan` lists them, the
//! KV pool and the fixed per-step buffers.

use super::*;

/// Converts a checkpoint matrix to the device storage type, row-major.
fn host_elems(m: &Matrix, ty: DeviceDType, out: &mut Vec<u8>) {
    match (ty, &m.data) {
        (DeviceDType::F32, WeightData::F32(b)) => {
            out.extend(b.iter().flat_map(|v| v.to_le_bytes()))
        }
        (DeviceDType::F32, WeightData::Bf16(b)) => {
            out.extend(b.iter().flat_map(|v| v.to_f32().to_le_bytes()))
        }
        (DeviceDType::F32, WeightData::F16(b)) => {
            out.extend(b.iter().flat_map(|v| v.to_f32().to_le_bytes()))
        }
        (DeviceDType::Bf16, WeightData::Bf16(b)) => {
            out.extend(b.iter().flat_map(|v| v.to_bits().to_le_bytes()))
        }
        (DeviceDType::Bf16, WeightData::F32(b)) => out.extend(
            b.iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes()),
        ),
        (DeviceDType::Bf16, WeightData::F16(b)) => out.extend(
            b.iter()
                .flat_map(|v| half::bf16::from_f32(v.to_f32()).to_bits().to_le_bytes()),
        ),
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl CudaModel {
    /// Loads a Hugging Face checkpoint onto the GPU.
    pub fn load(dir: &Path, opts: CudaOptions) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        check_supported(&config)?;
        let ws = WeightStore::open(dir)?;
        let gpu = Gpu::open(opts.device, &opts.ptx_cache)?;
        let c = &config;
        let h = c.hidden_size;
        let ty = opts.weights;
        let upload_fused = |names: &[(&str, usize)], cols: usize| -> Result<DevMatrix> {
            let mut bytes = Vec::new();
            let mut rows = 0;
            for &(name, r) in names {
                let m = ws.matrix(name, r, cols)?;
                host_elems(&m, ty, &mut bytes);
                rows += r;
            }
            let buf = gpu.alloc(bytes.len())?;
            gpu.upload(buf.ptr, buf.bytes, &bytes)?;
            Ok(DevMatrix { buf, rows, cols })
        };
        let upload_f32 = |v: &[f32]| -> Result<DevBuf> {
            let bytes = f32_bytes(v);
            let buf = gpu.alloc(bytes.len())?;
            gpu.upload(buf.ptr, buf.bytes, &bytes)?;
            Ok(buf)
        };
        // A fused bias: present if any part has one, zeros for the others.
        let fused_bias = |names: &[(&str, usize)]| -> Result<Option<DevBuf>> {
            let mut any = false;
            let mut all = Vec::new();
            for &(name, r) in names {
                match ws.optional_vector(name, r)? {
                    Some(b) => {
                        any = true;
                        all.extend(b);
                    }
                    None => all.extend(std::iter::repeat_n(0.0, r)),
                }
            }
            if any {
                Ok(Some(upload_f32(&all)?))
            } else {
                Ok(None)
            }
        };
        let names = c.arch.names(|n| ws.contains(n))?;
        let norm_of = |name: &str, len: usize| -> Result<DevBuf> {
            let mut w = ws.vector(name, len)?;
            w.iter_mut().for_each(|v| *v += c.arch.norm_offset);
            upload_f32(&w)
        };
        let norm = |name: &str| norm_of(name, h);
        let fused = |f: &Fused| -> Result<(DevMatrix, Option<DevBuf>)> {
            let weights = f.weights();
            let parts: Vec<(&str, usize)> = weights.iter().map(|(n, r)| (n.as_str(), *r)).collect();
            let biases = f.biases();
            let bias_parts: Vec<(&str, usize)> =
                biases.iter().map(|(n, r)| (n.as_str(), *r)).collect();
            Ok((upload_fused(&parts, f.cols)?, fused_bias(&bias_parts)?))
        };
        let embed = upload_fused(&[(&names.embed(), c.vocab_size)], h)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let plan = layer_plan(c, &names, i)?;
            let (qkv, qkv_bias) = fused(&plan.qkv)?;
            let (o, o_bias) = fused(&plan.o)?;
            let (gate_up, gate_up_bias) = fused(&plan.gate_up)?;
            let (down, down_bias) = fused(&plan.down)?;
            let qk_norm = match &plan.qk_norm {
                Some((q, k)) => Some((norm_of(q, c.head_dim)?, norm_of(k, c.head_dim)?)),
                None => None,
            };
            layers.push(DevLayer {
                input_norm: norm(&plan.attn_norm)?,
                qk_norm,
                qkv,
                qkv_bias,
                o,
                o_bias,
                post_norm: norm(&plan.mlp_norm)?,
                gate_up,
                gate_up_bias,
                down,
                down_bias,
            });
        }
        let final_norm = norm(&names.final_norm())?;
        let head = names.lm_head();
        let lm_head = if ws.contains(&head) {
            Some(upload_fused(&[(&head, c.vocab_size)], h)?)
        } else if c.tie_word_embeddings {
            None
        } else {
            return Err(CudaError::Unsupported(format!(
                "tensor `{head}` is missing and tie_word_embeddings is false"
            )));
        };
        let weights = DevWeights {
            embed,
            layers,
            final_norm,
            lm_head,
        };
        Self::assemble(gpu, config, opts, weights)
    }

    /// A model of `config`'s shape with uniform random bf16 weights made on
    /// the device (for benchmarks of shapes no checkpoint is at hand for).
    pub fn random(config: ModelConfig, opts: CudaOptions, seed: u64) -> Result<Self> {
        if opts.weights != DeviceDType::Bf16 {
            return Err(CudaError::Unsupported("random models are bf16 only".into()));
        }
        check_supported(&config)?;
        let gpu = Gpu::open(opts.device, &opts.ptx_cache)?;
        let c = &config;
        let (h, d) = (c.hidden_size, c.head_dim);
        let (q_out, kv_out, inter) = (c.num_heads * d, c.num_kv_heads * d, c.intermediate_size);
        let mut n = 0u64;
        let mut rand = |rows: usize, cols: usize| -> Result<DevMatrix> {
            let buf = gpu.alloc(rows * cols * 2)?;
            n += 1;
            let scale = 1.0 / (cols as f32).sqrt();
            let seed = seed.wrapping_mul(0x9E37_79B9).wrapping_add(n);
            gpu.fill_uniform_bf16(buf.ptr, rows * cols, seed, scale)?;
            Ok(DevMatrix { buf, rows, cols })
        };
        let ones = |len: usize| -> Result<DevBuf> {
            let buf = gpu.alloc(len * 4)?;
            gpu.launch(
                "fill_f32",
                (64, 1, 1),
                256,
                0,
                &[Arg::Ptr(buf.ptr), Arg::I64(len as i64), Arg::F32(1.0)],
            )?;
            Ok(buf)
        };
        let embed = rand(c.vocab_size, h)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for _ in 0..c.num_layers {
            layers.push(DevLayer {
                input_norm: ones(h)?,
                qk_norm: match c.arch.qk_norm {
                    tandem_engine::arch::QkNorm::None => None,
                    _ => Some((ones(d)?, ones(d)?)),
                },
                qkv: rand(q_out + 2 * kv_out, h)?,
                qkv_bias: None,
                o: rand(h, q_out)?,
                o_bias: None,
                post_norm: ones(h)?,
                gate_up: rand(2 * inter, h)?,
                gate_up_bias: None,
                down: rand(h, inter)?,
                down_bias: None,
            });
        }
        let final_norm = ones(h)?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(rand(c.vocab_size, h)?)
        };
        let weights = DevWeights {
            embed,
            layers,
            final_norm,
            lm_head,
        };
        Self::assemble(gpu, config, opts, weights)
    }

    fn assemble(
        gpu: Gpu,
        config: ModelConfig,
        opts: CudaOptions,
        weights: DevWeights,
    ) -> Result<Self> {
        let c = &config;
        let d = c.head_dim;
        if !c.num_heads.is_multiple_of(c.num_kv_heads) {
            return Err(CudaError::Unsupported(format!(
                "{} query heads over {} KV heads",
                c.num_heads, c.num_kv_heads
            )));
        }
        let bs = opts.block_size;
        if !(1..=32).contains(&bs) {
            return Err(CudaError::Unsupported(format!(
                "block size {bs} (the attention kernel keeps one key per lane: 1 to 32)"
            )));
        }
        attention_kernel(opts.kv, d, false)?;
        let max_blocks = opts.max_model_len.div_ceil(bs);
        let shape = LayoutShape {
            block_size: bs,
            tile_tokens: (crate::ATTN_WARPS / heads_per_cta(c.num_heads, c.num_kv_heads)).max(1),
            max_blocks,
            num_blocks: opts.num_blocks,
        };
        let hpc = heads_per_cta(c.num_heads, c.num_kv_heads);
        let block_elems = c.num_kv_heads * bs * d;
        let mut kv = Vec::with_capacity(c.num_layers);
        for _ in 0..c.num_layers {
            let bytes = opts.num_blocks * block_elems * opts.kv.size();
            kv.push((gpu.alloc(bytes)?, gpu.alloc(bytes)?));
        }
        let (t, h, inter) = (opts.max_tokens, c.hidden_size, c.intermediate_size);
        let (q_out, kv_out) = (c.num_heads * d, c.num_kv_heads * d);
        let nl = opts.max_logit_rows;
        let split_rows = t.min(SPLIT_ROWS);
        let half = d / 2;
        let workspace = gpu.alloc(32 << 20)?;
        let scratch = Scratch {
            x: gpu.alloc(t * h * 4)?,
            h: gpu.alloc(t * h * 4)?,
            qkv: gpu.alloc(t * (q_out + 2 * kv_out) * 4)?,
            attn: gpu.alloc(t * q_out * 4)?,
            attn_in: gpu.alloc(t * q_out * 2)?,
            gate_up: gpu.alloc(t * 2 * inter * 4)?,
            act: gpu.alloc(t * inter * 4)?,
            final_h: gpu.alloc(nl * h * 4)?,
            logits: gpu.alloc(nl * c.vocab_size * 4)?,
            part_o: gpu.alloc(split_rows * c.num_heads * MAX_SPLITS * d * 4)?,
            part_ml: gpu.alloc(split_rows * c.num_heads * MAX_SPLITS * 2 * 4)?,
            tokens: gpu.alloc(t * 4)?,
            positions: gpu.alloc(t * 4)?,
            slots: gpu.alloc(t * 4)?,
            tiles: gpu.alloc(t * 4 * 4)?,
            block_tables: gpu
                .alloc(opts.max_seqs.max(t.min(opts.graph_max_batch)) * max_blocks * 4)?,
            logit_rows: gpu.alloc(nl * 4)?,
            inv_freq: gpu.alloc(half * 4)?,
            sampled: gpu.alloc(nl * 4)?,
            _blas_workspace: workspace,
        };
        gpu.set_blas_workspace(scratch._blas_workspace.ptr, scratch._blas_workspace.bytes)?;
        let rope = RopeTable::new(&config);
        gpu.upload(
            scratch.inv_freq.ptr,
            scratch.inv_freq.bytes,
            rope.inv_freq(),
        )?;
        let graph_max = opts
            .graph_max_batch
            .min(opts.max_seqs)
            .min(opts.max_logit_rows)
            .min(t);
        let model = Self {
            gpu,
            config,
            weights,
            kv,
            scratch,
            shape,
            hpc,
            graph_sizes: GraphSizes::up_to(graph_max),
            graphs: HashMap::new(),
            opts,
        };
        model.gpu.sync()?;
        Ok(model)
    }
}
