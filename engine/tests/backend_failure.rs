//! A backend that fails for good (a lost tensor-parallel rank, a dead
//! device) stops the engine: every request fails, their blocks go back, and
//! new requests are refused with `EngineError::Stopped` — instead of the
//! engine failing step after step.

use std::time::{Duration, Instant};

use tandem_engine::kv_cache::{BlockCopy, BlockId, KvLayout};
use tandem_engine::serving::{
    EngineConfig, EngineCore, EngineHandle, KvPoolSize, Prompt, Request, RequestEvent,
};
use tandem_engine::{
    synth, ComputeBackend, CpuBackend, DType, EngineError, KvBlocks, Logits, Model, ModelConfig,
    SeqInput,
};

/// The CPU backend until `fail_after` forward passes, then lost for good.
#[derive(Debug)]
struct Dying {
    inner: CpuBackend,
    fail_after: usize,
    passes: usize,
}

impl ComputeBackend for Dying {
    fn device(&self) -> &'static str {
        "cpu"
    }
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn kv_layout(&self) -> KvLayout {
        self.inner.kv_layout()
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn block_bytes(&self) -> usize {
        self.inner.block_bytes()
    }
    fn set_matmul_policy(
        &mut self,
        policy: tandem_engine::kernels::MatmulPolicy,
    ) -> tandem_engine::Result<()> {
        self.inner.set_matmul_policy(policy)
    }
    fn forward(
        &mut self,
        batch: &[SeqInput<'_>],
        after_layer: &mut dyn FnMut(usize, &dyn KvBlocks),
    ) -> tandem_engine::Result<Logits> {
        self.passes += 1;
        if self.passes > self.fail_after {
            return Err(EngineError::Backend {
                device: "cpu",
                message: "rank 1 is gone".into(),
            });
        }
        self.inner.forward(batch, after_layer)
    }
    fn copy_block(&mut self, copy: BlockCopy) -> tandem_engine::Result<()> {
        self.inner.copy_block(copy)
    }
    fn write_block(
        &mut self,
        layer: usize,
        block: BlockId,
        k: &[f32],
        v: &[f32],
    ) -> tandem_engine::Result<()> {
        self.inner.write_block(layer, block, k, v)
    }
    fn failure(&self) -> Option<String> {
        (self.passes > self.fail_after).then(|| "rank 1 is gone".to_string())
    }
}

#[test]
fn a_backend_lost_for_good_fails_every_request_and_refuses_new_ones() {
    let tmp = tempfile::tempdir().expect("tempdir");
    synth::preset("tiny")
        .expect("preset")
        .write(tmp.path(), 2, DType::F32)
        .expect("write");
    let model = Model::load(tmp.path()).expect("load");
    let config = EngineConfig {
        block_size: 4,
        kv_pool: KvPoolSize::Blocks(64),
        // One request admitted per step, so some still wait when it fails.
        max_num_seqs: 2,
        ..EngineConfig::default()
    };
    let backend = Dying {
        inner: CpuBackend::new(model, 4, 64),
        fail_after: 3,
        passes: 0,
    };
    let core = EngineCore::with_backend(Box::new(backend), None, vec![], &config).expect("core");
    let engine = EngineHandle::spawn(core).expect("spawn");
    let mut streams: Vec<_> = (0..4u32)
        .map(|i| {
            let mut r = Request::new(Prompt::Tokens(vec![1 + i, 2, 3]), 50);
            r.ignore_eos = true;
            engine.submit(r).expect("accepted")
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    for s in &mut streams {
        let failed = loop {
            assert!(Instant::now() < deadline, "a request never ended");
            match s.blocking_next() {
                Some(RequestEvent::Error(e)) => break e,
                Some(RequestEvent::Finished(_)) | None => {
                    panic!("50 tokens cannot finish in 3 steps")
                }
                Some(_) => {}
            }
        };
        assert!(failed.message.contains("rank 1 is gone"), "{failed}");
        assert_eq!(failed.scope, tandem_engine::serving::FailureScope::Engine);
    }
    while engine.failure().is_none() {
        assert!(
            Instant::now() < deadline,
            "the engine never reported its failure"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let err = engine
        .submit(Request::new(Prompt::Tokens(vec![5, 6]), 4))
        .expect_err("refused");
    assert!(
        matches!(err, EngineError::Stopped(ref why) if why.contains("rank 1 is gone")),
        "{err}"
    );
    let stats = engine.stats();
    assert_eq!((stats.running, stats.waiting), (0, 0), "{stats:?}");
    assert_eq!(
        stats.free_blocks, stats.num_blocks,
        "every block went back: {stats:?}"
    );
}
