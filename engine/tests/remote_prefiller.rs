//! The remote-prefill seam of [`EngineHandle`]: a request placed on
//! another worker is started through the handle's `RemotePrefiller` by the
//! request's own stream, which owns the prefill's cancel guard. The
//! prefillers here are in-process (an export on a second engine core, or
//! one that never answers); the gRPC one is the decode worker's, tested in
//! `cli/tests/prefill_peers.rs`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_engine::serving::{
    CollectedExport, EngineConfig, EngineCore, EngineHandle, PrefillGuard, PrefillMode,
    PrefillPlacement, Prompt, RemotePrefill, RemotePrefiller, Request, RequestEvent,
};
use tandem_engine::{synth, Checkpoint, DType};
use tokio::sync::mpsc::unbounded_channel;

fn checkpoint() -> (tempfile::TempDir, Checkpoint) {
    let tmp = tempfile::tempdir().expect("tempdir");
    synth::preset("tiny")
        .expect("preset")
        .write(tmp.path(), 5, DType::F32)
        .expect("write");
    let ck = Checkpoint::open(tmp.path()).expect("open");
    (tmp, ck)
}

fn core(ck: &Checkpoint) -> EngineCore {
    let model = tandem_engine::Model::load(&ck.dir).expect("load");
    EngineCore::new(
        model,
        None,
        ck.eos_token_ids.clone(),
        &EngineConfig::default(),
    )
    .expect("core")
}

fn prompt() -> Vec<u32> {
    (0..70).map(|i| (i * 11 + 5) % 256).collect()
}

fn request(mode: PrefillMode) -> Request {
    let mut r = Request::new(Prompt::Tokens(prompt()), 8);
    r.ignore_eos = true;
    r.request_id = "req-1".into();
    r.prefill = mode;
    r
}

fn placed() -> PrefillMode {
    PrefillMode::Remote(PrefillPlacement {
        worker: "prefill-a:1".into(),
        min_uncached: 16,
    })
}

/// Every event of a request, in order (on a plain thread).
fn drain(handle: &EngineHandle, req: Request) -> Vec<RequestEvent> {
    let mut stream = handle.submit(req).expect("submitted");
    std::iter::from_fn(|| stream.blocking_next()).collect()
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

/// Computes the prompt on a second engine core at once and writes its
/// blocks into the asking engine; records what it was asked and whether
/// its guard cancelled.
struct Exporting {
    prefill: Mutex<EngineCore>,
    asked: Mutex<Vec<(String, String)>>,
    cancelled: Arc<AtomicBool>,
}

impl std::fmt::Debug for Exporting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Exporting")
    }
}

impl RemotePrefiller for Exporting {
    fn start(
        &self,
        request_id: &str,
        worker: &str,
        prefill: RemotePrefill,
        engine: EngineHandle,
        _span: &tracing::Span,
    ) -> PrefillGuard {
        self.asked
            .lock()
            .expect("lock")
            .push((request_id.to_string(), worker.to_string()));
        let sink = Arc::new(CollectedExport::default());
        let from_block = prefill.cached_tokens / 16;
        let mut export = Request::new(Prompt::Tokens(prefill.tokens.clone()), 1);
        export.max_tokens = None;
        export.prefill = PrefillMode::Export {
            sink: sink.clone(),
            from_block,
        };
        let mut core = self.prefill.lock().expect("lock");
        let (tx, _rx) = unbounded_channel();
        core.add_request(0, export, tx).expect("valid export");
        while core.has_work() {
            core.step();
        }
        for (layer, logical, k, v) in sink.take() {
            let block = prefill.blocks[logical - from_block];
            engine.write_kv(prefill.transfer, layer, block, k, v);
        }
        engine.finish_remote_prefill(prefill.transfer, Ok(()));
        let cancelled = self.cancelled.clone();
        PrefillGuard::on_drop(move || cancelled.store(true, Ordering::SeqCst))
    }
}

/// Never answers; its guard says when it was cancelled.
#[derive(Debug, Default)]
struct Silent {
    started: AtomicBool,
    cancelled: Arc<AtomicBool>,
}

impl RemotePrefiller for Silent {
    fn start(
        &self,
        _: &str,
        _: &str,
        _: RemotePrefill,
        _: EngineHandle,
        _: &tracing::Span,
    ) -> PrefillGuard {
        self.started.store(true, Ordering::SeqCst);
        let cancelled = self.cancelled.clone();
        PrefillGuard::on_drop(move || cancelled.store(true, Ordering::SeqCst))
    }
}

#[test]
fn a_placed_request_is_prefilled_through_the_handles_prefiller() {
    let (_tmp, ck) = checkpoint();
    let local = EngineHandle::spawn(core(&ck)).expect("engine");
    let want = tokens_of(&drain(&local, request(PrefillMode::Local)));
    assert_eq!(want.len(), 8);

    let prefiller = Arc::new(Exporting {
        prefill: Mutex::new(core(&ck)),
        asked: Mutex::default(),
        cancelled: Arc::default(),
    });
    let decode = EngineHandle::spawn(core(&ck)).expect("engine");
    decode.set_remote_prefiller(prefiller.clone());
    let events = drain(&decode, request(placed()));
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, RequestEvent::RemotePrefill(_))),
        "the stream hands the prefill to the prefiller, not to its reader"
    );
    assert_eq!(tokens_of(&events), want, "the colocated tokens");
    let asked = prefiller.asked.lock().expect("lock").clone();
    assert_eq!(asked, vec![("req-1".into(), "prefill-a:1".into())]);
    match events.last() {
        Some(RequestEvent::Finished(s)) => assert_eq!(s.usage.cached_tokens, 0),
        other => panic!("ended with {other:?}"),
    }
    assert!(
        !prefiller.cancelled.load(Ordering::SeqCst),
        "a finished request lets its prefill end on its own"
    );
    let s = decode.stats();
    assert_eq!(s.parked, 0);
}

#[test]
fn dropping_the_stream_cancels_the_prefill_and_frees_the_blocks() {
    let (_tmp, ck) = checkpoint();
    let prefiller = Arc::new(Silent::default());
    let decode = EngineHandle::spawn(core(&ck)).expect("engine");
    decode.set_remote_prefiller(prefiller.clone());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let mut stream = decode.submit(request(placed())).expect("submitted");
    // The prefill never answers: the stream starts it and waits on.
    let waited = rt
        .block_on(async { tokio::time::timeout(Duration::from_millis(300), stream.next()).await });
    assert!(waited.is_err(), "nothing to read while parked: {waited:?}");
    assert!(prefiller.started.load(Ordering::SeqCst));
    assert!(!prefiller.cancelled.load(Ordering::SeqCst));
    drop(stream);
    assert!(prefiller.cancelled.load(Ordering::SeqCst), "cancelled");
    // The abort reaches the engine thread and frees the parked blocks.
    let freed = (0..200).any(|_| {
        let s = decode.stats();
        let done = s.parked == 0 && s.free_blocks == s.num_blocks;
        if !done {
            std::thread::sleep(Duration::from_millis(10));
        }
        done
    });
    assert!(freed, "{:?}", decode.stats());
}

#[test]
fn without_a_prefiller_a_placed_request_is_prefilled_here() {
    let (_tmp, ck) = checkpoint();
    let handle = EngineHandle::spawn(core(&ck)).expect("engine");
    let want = tokens_of(&drain(&handle, request(PrefillMode::Local)));
    let events = drain(&handle, request(placed()));
    assert!(!events
        .iter()
        .any(|e| matches!(e, RequestEvent::RemotePrefill(_))));
    assert_eq!(tokens_of(&events), want);
}
