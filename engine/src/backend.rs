//! The compute-backend seam: what the serving engine needs from whatever
//! runs the model.
//!
//! Scheduling, block allocation and prefix caching are host code, the same
//! for every backend. A backend owns the weights and the KV pool in its own
//! memory (host RAM for [`CpuBackend`], device memory for the CUDA backend in
//! `tandem-cuda`), runs the flattened-batch forward pass, and moves single
//! blocks in and out of the pool (copy-on-write, KV transfer). Block ids
//! always come from the engine's allocator; a backend only stores what it is
//! told to.
//!
//! Blocks cross the seam in the CPU pool's layout and in f32
//! (`[kv_head][slot][head_dim]` per layer), whatever the backend stores, so
//! a GPU prefill worker can feed a CPU decode worker: mixed pools are legal.

use std::borrow::Cow;

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kernels::MatmulPolicy;
use crate::kv_cache::{BlockCopy, BlockId, KvCache, KvCacheDtype, KvLayout};
use crate::model::{Logits, Model, SeqInput};

/// One layer's K and V of a block, `[kv_head][slot][head_dim]` in f32:
/// borrowed from a host pool, copied out of a device one.
pub type BlockKv<'a> = (Cow<'a, [f32]>, Cow<'a, [f32]>);

/// Read access to the KV pool during a step (for exporting blocks).
pub trait KvBlocks {
    /// One layer's K and V of `block`.
    fn read_block(&self, layer: usize, block: BlockId) -> Result<BlockKv<'_>>;

    /// As `read_block` for a block of a prompt's tail: where the pool keeps
    /// a 16-bit copy of its recent rows (CPU FP8, `kv_cache/recent.rs`),
    /// read from it, so the receiver can keep them at 16 bits too.
    fn read_recent_block(&self, layer: usize, block: BlockId) -> Result<BlockKv<'_>> {
        self.read_block(layer, block)
    }
}

impl KvBlocks for KvCache {
    fn read_block(&self, layer: usize, block: BlockId) -> Result<BlockKv<'_>> {
        check_read(self, layer, block)?;
        Ok(self.block(layer, block))
    }

    fn read_recent_block(&self, layer: usize, block: BlockId) -> Result<BlockKv<'_>> {
        check_read(self, layer, block)?;
        Ok(self.recent_block(layer, block))
    }
}

/// Whether `kv` has `block` of `layer`.
fn check_read(kv: &KvCache, layer: usize, block: BlockId) -> Result<()> {
    if block as usize >= kv.num_blocks() || layer >= kv.layout().num_layers {
        return Err(EngineError::InvalidRequest(format!(
            "block {block} of layer {layer} is outside the KV pool"
        )));
    }
    Ok(())
}

/// Runs the model and holds its KV pool.
pub trait ComputeBackend: Send + std::fmt::Debug {
    /// Where it runs, for logs (`cpu`, `cuda`).
    fn device(&self) -> &'static str;

    /// The model's configuration.
    fn config(&self) -> &ModelConfig;

    /// The pool's block geometry.
    fn kv_layout(&self) -> KvLayout;

    /// Blocks in the pool.
    fn num_blocks(&self) -> usize;

    /// Bytes one block takes in the pool (every layer, K and V).
    fn block_bytes(&self) -> usize;

    /// How the linears trade exactness for speed ([`MatmulPolicy`]:
    /// bit-identical results whatever the batch, bf16 activations); a
    /// backend that cannot honour one refuses it.
    fn set_matmul_policy(&mut self, policy: MatmulPolicy) -> Result<()>;

    /// Runs one step (see [`Model::forward`]), calling `after_layer(l, kv)`
    /// once layer `l`'s new K/V are readable. The CPU calls it between
    /// layers, so a prefill worker overlaps the network with compute; a
    /// backend that runs the whole pass at once may call it for every layer
    /// after the pass.
    fn forward(
        &mut self,
        batch: &[SeqInput<'_>],
        after_layer: &mut dyn FnMut(usize, &dyn KvBlocks),
    ) -> Result<Logits>;

    /// Copies one block's K/V (every layer) onto another.
    fn copy_block(&mut self, copy: BlockCopy) -> Result<()>;

    /// Writes one layer's K and V of a block (`[kv_head][slot][head_dim]`, f32).
    fn write_block(&mut self, layer: usize, block: BlockId, k: &[f32], v: &[f32]) -> Result<()>;

    /// Before `blocks` (the tail of a prompt prefilled elsewhere) are
    /// written: a cache with a 16-bit recent window (CPU FP8,
    /// `kv_cache/recent.rs`) keeps their received rows at 16 bits. A
    /// backend without one keeps codes only, which is what it stores.
    fn hold_recent(&mut self, blocks: &[BlockId]) {
        let _ = blocks;
    }

    /// The pool's blocks, readable between steps (a lower tier copies
    /// the blocks the prefix cache names); `None` where the backend cannot
    /// read them outside a forward pass.
    fn kv_blocks(&self) -> Option<&dyn KvBlocks> {
        None
    }

    /// Whether the forward pass runs on rayon's global pool (CPU kernels):
    /// the engine then runs each step on a pool thread, so the kernels'
    /// parallel loops start and end without waking a sleeping thread.
    fn uses_cpu_pool(&self) -> bool {
        false
    }

    /// Why the backend can never run again (a tensor-parallel rank died, a
    /// device was lost), once that has happened. The engine then fails every
    /// request and refuses new ones, rather than failing step after step.
    fn failure(&self) -> Option<String> {
        None
    }

    /// Whether [`SeqInput::lora`] adapters are applied (else a batch must
    /// carry none).
    fn runs_lora(&self) -> bool {
        false
    }

    /// Tokens routed to each expert since load, per sparse layer this
    /// backend counts: `(layer, tokens per expert)` (none for a dense model).
    fn routed_tokens(&self) -> Vec<(usize, Vec<u64>)> {
        Vec::new()
    }
}

/// The CPU engine: [`Model`] and a host [`KvCache`].
#[derive(Debug)]
pub struct CpuBackend {
    model: Model,
    kv: KvCache,
}

impl CpuBackend {
    /// The model with an f32 pool of `num_blocks` blocks of `block_size`
    /// tokens.
    pub fn new(model: Model, block_size: usize, num_blocks: usize) -> Self {
        Self::with_kv_dtype(model, block_size, num_blocks, KvCacheDtype::F32)
    }

    /// As [`new`](Self::new) with the pool storing `dtype`.
    pub fn with_kv_dtype(
        model: Model,
        block_size: usize,
        num_blocks: usize,
        dtype: KvCacheDtype,
    ) -> Self {
        let layout = model.kv_layout(block_size);
        Self::with_kv_layout(model, layout, num_blocks, dtype)
    }

    /// As [`with_kv_dtype`](Self::with_kv_dtype) with `layout`, the model's
    /// own or the same with no layer marked sliding (every block kept).
    pub fn with_kv_layout(
        model: Model,
        layout: KvLayout,
        num_blocks: usize,
        dtype: KvCacheDtype,
    ) -> Self {
        let kv = KvCache::with_dtype(layout, num_blocks, dtype);
        Self { model, kv }
    }
}

impl ComputeBackend for CpuBackend {
    fn device(&self) -> &'static str {
        "cpu"
    }

    fn runs_lora(&self) -> bool {
        self.model.shard().is_full()
    }

    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn kv_layout(&self) -> KvLayout {
        *self.kv.layout()
    }

    fn num_blocks(&self) -> usize {
        self.kv.num_blocks()
    }

    fn block_bytes(&self) -> usize {
        self.kv.block_bytes()
    }

    fn set_matmul_policy(&mut self, policy: MatmulPolicy) -> Result<()> {
        if !policy.runs_here() {
            tracing::warn!(
                ?policy,
                "this CPU lacks the instructions for the matmul policy; running the default"
            );
        }
        self.model.set_matmul_policy(policy);
        Ok(())
    }

    fn forward(
        &mut self,
        batch: &[SeqInput<'_>],
        after_layer: &mut dyn FnMut(usize, &dyn KvBlocks),
    ) -> Result<Logits> {
        self.model
            .forward_with_layer_hook(batch, &mut self.kv, &mut |l, kv: &KvCache| {
                after_layer(l, kv)
            })
    }

    fn uses_cpu_pool(&self) -> bool {
        true
    }

    fn kv_blocks(&self) -> Option<&dyn KvBlocks> {
        Some(&self.kv)
    }

    fn routed_tokens(&self) -> Vec<(usize, Vec<u64>)> {
        self.model.routed_tokens()
    }

    fn copy_block(&mut self, copy: BlockCopy) -> Result<()> {
        let n = self.kv.num_blocks();
        if copy.src as usize >= n || copy.dst as usize >= n {
            return Err(EngineError::InvalidRequest(format!(
                "block copy {copy:?} is outside the pool ({n} blocks)"
            )));
        }
        self.kv.copy_block(copy);
        Ok(())
    }

    fn hold_recent(&mut self, blocks: &[BlockId]) {
        self.kv.hold_blocks(blocks);
    }

    fn write_block(&mut self, layer: usize, block: BlockId, k: &[f32], v: &[f32]) -> Result<()> {
        self.kv
            .write_block(layer, block, k, v)
            .map_err(|e| EngineError::InvalidRequest(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth;
    use crate::weights::DType;

    fn backend() -> (tempfile::TempDir, CpuBackend) {
        let tmp = tempfile::tempdir().expect("tempdir");
        synth::preset("tiny")
            .expect("preset")
            .write(tmp.path(), 1, DType::F32)
            .expect("write");
        let model = Model::load(tmp.path()).expect("load");
        (tmp, CpuBackend::new(model, 16, 4))
    }

    #[test]
    fn blocks_round_trip_through_the_seam_and_bounds_are_checked() {
        let (_tmp, mut b) = backend();
        let n = b.kv_layout().block_elems();
        let k: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let v: Vec<f32> = (0..n).map(|i| -(i as f32)).collect();
        b.write_block(1, 2, &k, &v).expect("in range");
        b.copy_block(BlockCopy { src: 2, dst: 3 })
            .expect("in range");
        let (rk, rv) = KvBlocks::read_block(&b.kv, 1, 3).expect("in range");
        assert_eq!((&*rk, &*rv), (&k[..], &v[..]));
        assert!(b.write_block(1, 4, &k, &v).is_err(), "block 4 of 4");
        assert!(b.copy_block(BlockCopy { src: 0, dst: 9 }).is_err());
        assert!(KvBlocks::read_block(&b.kv, 2, 0).is_err(), "layer 2 of 2");
        assert_eq!(b.block_bytes(), 2 * 2 * 2 * 16 * 16 * 4);
        assert_eq!(b.device(), "cpu");
    }

    /// An 8-bit pool takes a quarter of the f32 bytes (half of a 16-bit
    /// one) plus its scales (and FP8 its recent window's copies), and its
    /// blocks cross the seam in f32 within a quantization step of what was
    /// written.
    #[test]
    fn eight_bit_pools_round_trip_blocks_and_take_a_quarter_of_the_bytes_plus_scales() {
        for dtype in [KvCacheDtype::Int8, KvCacheDtype::Fp8E4m3] {
            let tmp = tempfile::tempdir().expect("tempdir");
            synth::preset("tiny")
                .expect("preset")
                .write(tmp.path(), 1, DType::F32)
                .expect("write");
            let model = Model::load(tmp.path()).expect("load");
            let mut b = CpuBackend::with_kv_dtype(model, 16, 4, dtype);
            let layout = b.kv_layout();
            let n = layout.block_elems();
            let k: Vec<f32> = (0..n).map(|i| (i % 37) as f32 / 10.0 - 1.8).collect();
            let v: Vec<f32> = k.iter().map(|x| -x * 0.5).collect();
            b.write_block(1, 2, &k, &v).expect("in range");
            b.copy_block(BlockCopy { src: 2, dst: 3 })
                .expect("in range");
            let (rk, rv) = KvBlocks::read_block(&b.kv, 1, 3).expect("in range");
            // Rows are rotated before they are coded, so a row's error is
            // spread over its channels: about a step of the rotated row.
            let tol = if dtype == KvCacheDtype::Int8 {
                0.03
            } else {
                0.2
            };
            for (a, b) in k.iter().chain(&v).zip(rk.iter().chain(rv.iter())) {
                assert!((a - b).abs() <= tol, "{dtype}: {a} vs {b}");
            }
            let f32_bytes = layout.block_bytes();
            // An f16 scale per row (layer, KV head, token), K and V.
            let scales = 2 * layout.num_layers * layout.num_kv_heads * layout.block_size * 2;
            // FP8 adds its share of the recent window's bf16 copies.
            let copies = match dtype {
                KvCacheDtype::Fp8E4m3 => f32_bytes / 4 * 2 / crate::kv_cache::RECENT_SHARE,
                _ => 0,
            };
            assert_eq!(b.block_bytes(), f32_bytes / 4 + scales + copies);
        }
    }
}
