//! The serving engine on the CUDA backend: the same scheduler, prefix cache
//! and KV transfer as on the CPU, and the same greedy tokens.
//!
//! Needs a GPU: without one (or without the `cuda` feature) every test here
//! says so and passes vacuously. The GPU check is `bench/gpu/run.sh` plus
//! `cargo test --release -p tandem-cuda --features cuda` on a GPU machine.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use tandem_cuda::{gpu_count, CudaModel, CudaOptions, DeviceDType};
use tandem_engine::serving::{
    CollectedExport, EngineConfig, EngineCore, PrefillMode, PrefillPlacement, Prompt,
    RemotePrefill, Request, RequestEvent,
};
use tandem_engine::{synth, Checkpoint, DType, ModelConfig};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

fn have_gpu() -> bool {
    let n = gpu_count();
    if n == 0 {
        eprintln!("skipped: no CUDA GPU here (the GPU check is bench/gpu/run.sh and this test on a GPU machine)");
    }
    n > 0
}

fn checkpoint() -> (tempfile::TempDir, Checkpoint) {
    let tmp = tempfile::tempdir().expect("tempdir");
    synth::preset("small")
        .expect("preset")
        .write(tmp.path(), 5, DType::F32)
        .expect("write");
    let ck = Checkpoint::open(tmp.path()).expect("open");
    (tmp, ck)
}

const BLOCKS: usize = 128;

fn config() -> EngineConfig {
    EngineConfig {
        kv_pool: tandem_engine::serving::KvPoolSize::Blocks(BLOCKS),
        max_prefill_chunk: Some(48),
        ..EngineConfig::default()
    }
}

fn cpu_core(ck: &Checkpoint) -> EngineCore {
    let model = tandem_engine::Model::load(&ck.dir).expect("load");
    EngineCore::new(model, None, ck.eos_token_ids.clone(), &config()).expect("core")
}

fn gpu_core(ck: &Checkpoint, dtype: DeviceDType) -> EngineCore {
    let mc = ModelConfig::from_dir(&ck.dir).expect("config");
    let mut opts = CudaOptions::new(&mc, BLOCKS);
    opts.weights = dtype;
    opts.kv = dtype;
    opts.max_tokens = 2048;
    opts.max_seqs = 16;
    opts.max_logit_rows = 16;
    let model = CudaModel::load(&ck.dir, opts).expect("GPU model");
    EngineCore::with_backend(Box::new(model), None, ck.eos_token_ids.clone(), &config())
        .expect("core")
}

fn request(prompt: &[u32], mode: PrefillMode) -> Request {
    let mut r = Request::new(Prompt::Tokens(prompt.to_vec()), 16);
    r.ignore_eos = true;
    r.prefill = mode;
    r
}

/// Steps until idle, checking the books after every step.
fn run_all(
    core: &mut EngineCore,
    rxs: &mut [UnboundedReceiver<RequestEvent>],
) -> Vec<Vec<RequestEvent>> {
    let mut events = vec![Vec::new(); rxs.len()];
    for _ in 0..10_000 {
        core.step();
        core.check_accounting().expect("books");
        for (rx, ev) in rxs.iter_mut().zip(&mut events) {
            while let Ok(e) = rx.try_recv() {
                ev.push(e);
            }
        }
        if !core.has_work() {
            return events;
        }
    }
    panic!("engine did not go idle");
}

fn tokens_of(events: &[RequestEvent]) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            RequestEvent::Delta(d) => Some(d.token_ids.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

fn prompts() -> Vec<Vec<u32>> {
    let shared: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 2000).collect();
    let mut a = shared.clone();
    a.extend((0..30).map(|i| (i * 13 + 1) % 2000));
    let mut b = shared;
    b.extend((0..9).map(|i| (i * 17 + 2) % 2000));
    let c: Vec<u32> = (0..100).map(|i| (i * 31 + 11) % 2000).collect();
    vec![a, b, c]
}

fn serve(core: &mut EngineCore, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let mut rxs = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let (tx, rx) = unbounded_channel();
        core.add_request(i as u64, request(p, PrefillMode::Local), tx)
            .expect("valid");
        rxs.push(rx);
    }
    let events = run_all(core, &mut rxs);
    let s = core.stats();
    assert_eq!(
        s.free_blocks, s.num_blocks,
        "every block back after the run"
    );
    events.iter().map(|e| tokens_of(e)).collect()
}

#[test]
fn the_engine_on_the_gpu_gives_the_cpu_tokens() {
    if !have_gpu() {
        return;
    }
    let (_tmp, ck) = checkpoint();
    let want = serve(&mut cpu_core(&ck), &prompts());
    let mut gpu = gpu_core(&ck, DeviceDType::F32);
    assert_eq!(serve(&mut gpu, &prompts()), want);
    // Again on the same core: the second run hits the prefix cache.
    assert_eq!(serve(&mut gpu, &prompts()), want);
    // bf16 runs the same schedule; its tokens may differ from f32's.
    let bf16 = serve(&mut gpu_core(&ck, DeviceDType::Bf16), &prompts());
    assert_eq!(bf16.len(), want.len());
    assert!(bf16.iter().all(|t| t.len() == 16));
}

/// Qwen3 (per-head q/k RMSNorm) from transformers' random checkpoints: the
/// GPU's f32 tokens are the CPU engine's (which match transformers').
#[test]
fn qwen3_on_the_gpu_gives_the_cpu_tokens() {
    if !have_gpu() {
        return;
    }
    for case in ["qwen3_gqa_f32", "qwen3_mqa_tied_f32"] {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/golden")
            .join(case);
        let ck = Checkpoint::open(&dir).expect("fixture");
        let vocab = ck.model.config().vocab_size as u32;
        let prompts: Vec<Vec<u32>> = prompts()
            .into_iter()
            .map(|p| p.into_iter().map(|t| 3 + t % (vocab - 3)).collect())
            .collect();
        let want = serve(&mut cpu_core(&ck), &prompts);
        assert_eq!(
            serve(&mut gpu_core(&ck, DeviceDType::F32), &prompts),
            want,
            "{case}"
        );
    }
}

/// Remote prefill from `prefill` into `decode`, returning the decode tokens.
fn disaggregated(decode: &mut EngineCore, prefill: &mut EngineCore, prompt: &[u32]) -> Vec<u32> {
    let (tx, rx) = unbounded_channel();
    decode
        .add_request(
            0,
            request(
                prompt,
                PrefillMode::Remote(PrefillPlacement {
                    worker: "prefill".into(),
                    min_uncached: 16,
                }),
            ),
            tx,
        )
        .expect("valid");
    let mut rxs = vec![rx];
    let events = run_all(decode, &mut rxs);
    let rp: RemotePrefill = match events[0].first() {
        Some(RequestEvent::RemotePrefill(rp)) => rp.clone(),
        other => panic!("expected a remote prefill, got {other:?}"),
    };
    let sink = Arc::new(CollectedExport::default());
    let (ptx, prx) = unbounded_channel();
    let mut req = request(
        &rp.tokens,
        PrefillMode::Export {
            sink: sink.clone(),
            from_block: 0,
        },
    );
    req.max_tokens = None;
    prefill.add_request(1, req, ptx).expect("valid export");
    run_all(prefill, &mut [prx]);
    for (layer, logical, k, v) in sink.take().iter() {
        decode
            .write_kv(rp.transfer, *layer, rp.blocks[*logical], k, v)
            .expect("a destination block");
    }
    decode.finish_remote_prefill(rp.transfer, Ok(()));
    let events = run_all(decode, &mut rxs);
    tokens_of(&events[0])
}

#[test]
fn mixed_pools_move_kv_between_cpu_and_gpu_workers() {
    if !have_gpu() {
        return;
    }
    let (_tmp, ck) = checkpoint();
    let prompt: Vec<u32> = (0..100).map(|i| (i * 7 + 3) % 2000).collect();
    let want = serve(&mut cpu_core(&ck), std::slice::from_ref(&prompt)).remove(0);
    // GPU prefill worker → CPU decode worker (blocks copied out of device memory).
    let got = disaggregated(
        &mut cpu_core(&ck),
        &mut gpu_core(&ck, DeviceDType::F32),
        &prompt,
    );
    assert_eq!(got, want);
    // CPU prefill worker → GPU decode worker (blocks written into device memory).
    let got = disaggregated(
        &mut gpu_core(&ck, DeviceDType::F32),
        &mut cpu_core(&ck),
        &prompt,
    );
    assert_eq!(got, want);
}
