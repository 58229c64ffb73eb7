//! KV blocks in and out of the device pool (copy-on-write copies, transfers,
//! export reads) and the `ComputeBackend` seam the engine drives.

use super::*;

impl CudaModel {
    /// Bytes of one block's K (or V) in one layer's pool.
    fn layer_block_bytes(&self) -> usize {
        self.config.num_kv_heads * self.opts.block_size * self.config.head_dim * self.opts.kv.size()
    }

    fn check_block(&self, block: BlockId) -> Result<usize> {
        let b = block as usize;
        if b >= self.opts.num_blocks {
            return Err(CudaError::InvalidBatch(format!(
                "block id {block} is outside the pool ({} blocks)",
                self.opts.num_blocks
            )));
        }
        Ok(b)
    }

    /// Copies one block's K/V (every layer) onto another (copy-on-write of a
    /// shared partial block).
    pub fn copy_block(&self, copy: BlockCopy) -> Result<()> {
        let (src, dst) = (self.check_block(copy.src)?, self.check_block(copy.dst)?);
        let bb = self.layer_block_bytes();
        for (k, v) in &self.kv {
            self.gpu.copy(k.at(dst * bb), k.at(src * bb), bb)?;
            self.gpu.copy(v.at(dst * bb), v.at(src * bb), bb)?;
        }
        Ok(())
    }

    /// Reads one layer's K and V of a block to the host as f32
    /// (`[kv_head][slot][dim]`, the CPU pool's block layout).
    pub fn read_block(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut Vec<f32>,
        v: &mut Vec<f32>,
    ) -> Result<()> {
        let b = self.check_block(block)?;
        let (kp, vp) = self
            .kv
            .get(layer)
            .ok_or_else(|| CudaError::InvalidBatch(format!("no layer {layer}")))?;
        let n = self.config.num_kv_heads * self.opts.block_size * self.config.head_dim;
        let bb = self.layer_block_bytes();
        for (pool, out) in [(kp, k), (vp, v)] {
            out.resize(n, 0.0);
            match self.opts.kv {
                DeviceDType::F32 => self.gpu.download(&mut out[..], pool.at(b * bb))?,
                DeviceDType::Bf16 => {
                    let mut raw = vec![0u16; n];
                    self.gpu.download(&mut raw, pool.at(b * bb))?;
                    for (o, r) in out.iter_mut().zip(raw) {
                        *o = half::bf16::from_bits(r).to_f32();
                    }
                }
            }
        }
        Ok(())
    }

    /// Writes one layer's K and V of a block from host f32 data.
    pub fn write_block(&self, layer: usize, block: BlockId, k: &[f32], v: &[f32]) -> Result<()> {
        let b = self.check_block(block)?;
        let (kp, vp) = self
            .kv
            .get(layer)
            .ok_or_else(|| CudaError::InvalidBatch(format!("no layer {layer}")))?;
        let n = self.config.num_kv_heads * self.opts.block_size * self.config.head_dim;
        if k.len() != n || v.len() != n {
            return Err(CudaError::InvalidBatch(format!(
                "a block holds {n} K and V values, got {} and {}",
                k.len(),
                v.len()
            )));
        }
        let bb = self.layer_block_bytes();
        for (pool, src) in [(kp, k), (vp, v)] {
            match self.opts.kv {
                DeviceDType::F32 => self.gpu.upload(pool.at(b * bb), bb, src)?,
                DeviceDType::Bf16 => {
                    let raw: Vec<u16> = src
                        .iter()
                        .map(|&x| half::bf16::from_f32(x).to_bits())
                        .collect();
                    self.gpu.upload(pool.at(b * bb), bb, &raw)?;
                }
            }
        }
        self.gpu.sync()
    }
}

impl KvBlocks for CudaModel {
    fn read_block(
        &self,
        layer: usize,
        block: BlockId,
    ) -> tandem_engine::Result<tandem_engine::BlockKv<'_>> {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        CudaModel::read_block(self, layer, block, &mut k, &mut v)?;
        Ok((Cow::Owned(k), Cow::Owned(v)))
    }
}

/// The engine's seam: the serving engine (scheduler, prefix cache, KV
/// transfer) runs unchanged on top of the GPU. Logits come back to the host
/// for the engine's sampler (penalties, grammars, logprobs); blocks cross in
/// f32, so transfers to and from CPU workers need no conversion.
impl ComputeBackend for CudaModel {
    fn device(&self) -> &'static str {
        "cuda"
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            rows: tandem_engine::KvRows::PerHead,
            num_layers: self.config.num_layers,
            num_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            block_size: self.opts.block_size,
            // The device cache keeps every layer's blocks (no groups).
            sliding: SlidingLayers::NONE,
        }
    }

    fn num_blocks(&self) -> usize {
        self.opts.num_blocks
    }

    fn kv_blocks(&self) -> Option<&dyn KvBlocks> {
        Some(self)
    }

    fn block_bytes(&self) -> usize {
        kv_block_bytes(&self.config, self.opts.block_size, self.opts.kv)
    }

    fn set_matmul_policy(&mut self, policy: MatmulPolicy) -> tandem_engine::Result<()> {
        match policy {
            MatmulPolicy::Fastest | MatmulPolicy::VectorOnly => Ok(()),
            // The decode GEMV and cuBLAS sum in different orders.
            MatmulPolicy::BatchInvariant => Err(EngineError::Unsupported(
                "batch-invariant matmuls on the CUDA backend".into(),
            )),
            // Activations follow `--gpu-dtype` there.
            MatmulPolicy::Bf16Activations => Err(EngineError::Unsupported(
                "--activations bf16 on the CUDA backend (use --gpu-dtype bf16)".into(),
            )),
        }
    }

    fn forward(
        &mut self,
        batch: &[SeqInput<'_>],
        after_layer: &mut dyn FnMut(usize, &dyn KvBlocks),
    ) -> tandem_engine::Result<Logits> {
        let out = CudaModel::forward(self, batch)?;
        let logits = self.logits(&out)?;
        // The pass ran as a whole; every layer's K/V is final now.
        for layer in 0..self.config.num_layers {
            after_layer(layer, &*self);
        }
        Ok(logits)
    }

    fn copy_block(&mut self, copy: BlockCopy) -> tandem_engine::Result<()> {
        Ok(CudaModel::copy_block(self, copy)?)
    }

    fn write_block(
        &mut self,
        layer: usize,
        block: BlockId,
        k: &[f32],
        v: &[f32],
    ) -> tandem_engine::Result<()> {
        Ok(CudaModel::write_block(self, layer, block, k, v)?)
    }
}
