//! Arbitrary bytes as a gRPC `GenerateRequest` body, through the server's
//! conversion and the engine's request validation, on the built-in model.
//!
//! Every request the engine accepts is aborted at once, so the oracle is the
//! engine's own bookkeeping: afterwards nothing is running or waiting, every
//! KV block is free, and `check_accounting` (refcounts, free queue, prefix
//! cache) holds. A panic anywhere on the way — prost decoding, the
//! conversion, tokenizing a text prompt, compiling a `response_format`
//! grammar, the checks — is a finding.

#![no_main]

use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use prost::Message;
use tandem_engine::serving::{EngineConfig, EngineCore, KvPoolSize};
use tandem_engine::Checkpoint;
use tandem_proto::v1::GenerateRequest;
use tandem_server::request_from_proto;

fn engine() -> &'static Mutex<EngineCore> {
    static ENGINE: OnceLock<Mutex<EngineCore>> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/shakespeare-target");
        let ckpt = Checkpoint::open(&dir).expect("the built-in model");
        let config = EngineConfig {
            kv_pool: KvPoolSize::Blocks(64),
            ..EngineConfig::default()
        };
        let core = EngineCore::new(
            ckpt.model,
            ckpt.tokenizer.map(Arc::new),
            ckpt.eos_token_ids,
            &config,
        )
        .expect("engine");
        Mutex::new(core)
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(proto) = GenerateRequest::decode(data) else {
        return;
    };
    let Ok(request) = request_from_proto(proto) else {
        return;
    };
    let mut core = engine()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    if core.add_request(1, request, tx).is_ok() {
        core.abort(1);
    }
    drop(rx);
    assert!(!core.has_work(), "an aborted request left work behind");
    let stats = core.stats();
    assert_eq!(stats.free_blocks, stats.num_blocks, "blocks leaked");
    if let Err(e) = core.check_accounting() {
        panic!("KV accounting broken: {e}");
    }
});
