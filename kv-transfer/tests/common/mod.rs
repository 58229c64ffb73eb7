//! Shared helpers of the kv-transfer integration tests: a sink that records
//! everything, deterministic block contents, bounded waits.

#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tandem_kv_transfer::{
    BlockWrite, KvDtype, KvLayoutDescriptor, KvSink, Listener, Session, TransferError,
    TransferFailure, TransferId, Transport, WriteRefused,
};

/// Listens on `bind` with `sink` and connects one session to the listener
/// (keep the listener: dropping it stops accepting).
pub async fn open(
    transport: &dyn Transport,
    bind: &str,
    layout: KvLayoutDescriptor,
    sink: Arc<dyn KvSink>,
) -> (Listener, Box<dyn Session>) {
    let listener = transport.listen(bind, layout, sink).await.expect("listen");
    let session = transport
        .connect(listener.endpoint(), layout)
        .await
        .expect("connect");
    (listener, session)
}

/// Upper bound on any wait in the tests.
pub const WAIT: Duration = Duration::from_secs(10);

pub fn layout() -> KvLayoutDescriptor {
    KvLayoutDescriptor {
        rows: tandem_kv_transfer::KvRows::PerHead,
        num_layers: 4,
        num_kv_heads: 2,
        head_dim: 8,
        block_size: 16,
        dtype: KvDtype::F32,
        sliding_window: 0,
        windowed_layers: 0,
    }
}

/// One delivered block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivered {
    pub transfer: TransferId,
    pub layer: u32,
    pub block: u32,
    pub k: Vec<u8>,
    pub v: Vec<u8>,
}

#[derive(Debug, Default)]
struct State {
    writes: Vec<Delivered>,
    finishes: Vec<(TransferId, Result<(), TransferFailure>)>,
    peer_errors: Vec<String>,
}

/// Records every call; optionally refuses writes to one block.
#[derive(Debug)]
pub struct RecordingSink {
    num_blocks: u32,
    refuse_block: Option<u32>,
    state: Mutex<State>,
}

impl RecordingSink {
    pub fn new(num_blocks: u32) -> Arc<Self> {
        Arc::new(Self {
            num_blocks,
            refuse_block: None,
            state: Mutex::default(),
        })
    }

    pub fn refusing(num_blocks: u32, block: u32) -> Arc<Self> {
        Arc::new(Self {
            num_blocks,
            refuse_block: Some(block),
            state: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn writes_of(&self, transfer: TransferId) -> Vec<Delivered> {
        self.lock()
            .writes
            .iter()
            .filter(|w| w.transfer == transfer)
            .cloned()
            .collect()
    }

    pub fn finishes(&self) -> Vec<(TransferId, Result<(), TransferFailure>)> {
        self.lock().finishes.clone()
    }

    pub fn peer_errors(&self) -> Vec<String> {
        self.lock().peer_errors.clone()
    }

    /// How many blocks were delivered, for any transfer.
    pub fn write_count(&self) -> usize {
        self.lock().writes.len()
    }

    /// Waits (bounded) for `transfer`'s finish and checks it came exactly once.
    pub async fn wait_finish(&self, transfer: TransferId) -> Result<(), TransferFailure> {
        let found = wait_for(|| {
            let s = self.lock();
            s.finishes
                .iter()
                .find(|(t, _)| *t == transfer)
                .map(|(_, r)| r.clone())
        })
        .await;
        let outcome = found.unwrap_or_else(|| panic!("no finish for {transfer} within {WAIT:?}"));
        let count = self
            .lock()
            .finishes
            .iter()
            .filter(|(t, _)| *t == transfer)
            .count();
        assert_eq!(count, 1, "finish called {count} times for {transfer}");
        outcome
    }

    /// Waits (bounded) until a peer error has been reported; returns them all.
    pub async fn wait_peer_error(&self) -> Vec<String> {
        wait_for(|| {
            let s = self.lock();
            (!s.peer_errors.is_empty()).then(|| s.peer_errors.clone())
        })
        .await
        .unwrap_or_else(|| panic!("no peer error within {WAIT:?}"))
    }
}

impl KvSink for RecordingSink {
    fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    fn write(
        &self,
        transfer: TransferId,
        layer: u32,
        block: u32,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), WriteRefused> {
        if self.refuse_block == Some(block) {
            return Err(WriteRefused::NotADestination(block));
        }
        let mut s = self.lock();
        s.writes.push(Delivered {
            transfer,
            layer,
            block,
            k: k.to_vec(),
            v: v.to_vec(),
        });
        Ok(())
    }

    fn finish(&self, transfer: TransferId, outcome: Result<(), TransferFailure>) {
        self.lock().finishes.push((transfer, outcome));
    }

    fn peer_error(&self, _peer: &str, error: &TransferError) {
        self.lock().peer_errors.push(error.to_string());
    }
}

/// Polls `probe` every 5 ms until it returns something or [`WAIT`] passes.
pub async fn wait_for<T>(mut probe: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(found) = probe() {
            return Some(found);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Deterministic bytes for (transfer, layer, block, K or V).
pub fn pattern(transfer: u64, layer: u32, block: u32, which: u8, len: usize) -> Vec<u8> {
    let mut x = transfer.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (u64::from(layer) << 40)
        ^ (u64::from(block) << 8)
        ^ u64::from(which)
        ^ 0x2545_F491_4F6C_DD1D;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

pub fn block(layout: &KvLayoutDescriptor, transfer: u64, layer: u32, dst: u32) -> BlockWrite {
    let (len, v_len) = (layout.block_layer_bytes(), layout.value_bytes());
    BlockWrite {
        layer,
        dst_block: dst,
        k: Bytes::from(pattern(transfer, layer, dst, 0, len)),
        v: Bytes::from(pattern(transfer, layer, dst, 1, v_len)),
    }
}

/// Checks the sink got exactly `expected` for `transfer`, in order, byte for byte.
pub fn assert_delivered(sink: &RecordingSink, transfer: TransferId, expected: &[BlockWrite]) {
    let got = sink.writes_of(transfer);
    assert_eq!(
        got.len(),
        expected.len(),
        "number of blocks delivered for {transfer}"
    );
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        assert_eq!(
            (g.layer, g.block),
            (e.layer, e.dst_block),
            "block {i} of {transfer}"
        );
        assert!(
            g.k == e.k.as_ref() && g.v == e.v.as_ref(),
            "content of block {i} of {transfer}"
        );
    }
}

/// The TCP transport's magic.
pub const MAGIC: &[u8; 8] = b"TDMKVXF1";
/// Length of the listener's challenge (magic, version, nonce).
pub const CHALLENGE_LEN: usize = 42;
/// Length of the listener's handshake reply (with its proof).
pub const REPLY_LEN: usize = 88;

/// The TCP hello (version 3) as the protocol defines it, for raw-socket
/// tests: magic, version, 0, layout, the sender's nonce.
pub fn raw_hello(layout: &KvLayoutDescriptor, nonce: &[u8; 32]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&3u16.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&layout.encode());
    out.extend_from_slice(nonce);
    out
}

/// The version-1 hello, which carried the token in clear.
pub fn raw_hello_v1(layout: &KvLayoutDescriptor, token: &str) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&(token.len() as u16).to_le_bytes());
    out.extend_from_slice(&layout.encode());
    out.extend_from_slice(token.as_bytes());
    out
}

/// HMAC-SHA256 of the parts under `token`.
pub fn hmac(token: &str, parts: &[&[u8]]) -> Vec<u8> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
    let mut ctx = ring::hmac::Context::with_key(&key);
    for p in parts {
        ctx.update(p);
    }
    ctx.sign().as_ref().to_vec()
}

/// The sender's proof, as the protocol module documents it.
pub fn raw_proof(
    token: &str,
    sender_nonce: &[u8],
    receiver_nonce: &[u8],
    layout: &KvLayoutDescriptor,
) -> Vec<u8> {
    hmac(
        token,
        &[
            b"tandem-kv sender",
            MAGIC,
            sender_nonce,
            receiver_nonce,
            &layout.encode(),
        ],
    )
}

/// What a raw handshake exchanged.
#[derive(Debug, Clone)]
pub struct RawHandshake {
    /// Every byte the sender wrote (hello, proof).
    pub sent: Vec<u8>,
    pub sender_nonce: [u8; 32],
    pub receiver_nonce: [u8; 32],
    pub reply: [u8; REPLY_LEN],
}

/// Runs the sender's side of the handshake by hand on `s`, proving
/// `token`, with `sender_nonce`.
pub async fn raw_handshake(
    s: &mut tokio::net::TcpStream,
    layout: &KvLayoutDescriptor,
    token: &str,
    sender_nonce: [u8; 32],
) -> RawHandshake {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let hello = raw_hello(layout, &sender_nonce);
    s.write_all(&hello).await.expect("hello");
    let mut challenge = [0u8; CHALLENGE_LEN];
    tokio::time::timeout(WAIT, s.read_exact(&mut challenge))
        .await
        .expect("timely")
        .expect("challenge");
    assert_eq!(&challenge[..8], MAGIC);
    assert_eq!(u16::from_le_bytes([challenge[8], challenge[9]]), 3);
    let mut receiver_nonce = [0u8; 32];
    receiver_nonce.copy_from_slice(&challenge[10..]);
    let proof = raw_proof(token, &sender_nonce, &receiver_nonce, layout);
    s.write_all(&proof).await.expect("proof");
    let mut reply = [0u8; REPLY_LEN];
    tokio::time::timeout(WAIT, s.read_exact(&mut reply))
        .await
        .expect("timely")
        .expect("reply");
    let mut sent = hello;
    sent.extend_from_slice(&proof);
    RawHandshake {
        sent,
        sender_nonce,
        receiver_nonce,
        reply,
    }
}

/// A nonce for raw tests (any 32 bytes; the listener's own nonce is what
/// makes every handshake fresh).
pub fn test_nonce(seed: u8) -> [u8; 32] {
    [seed; 32]
}

/// The UCX transport over UCX's own TCP (loopback only) and over shared
/// memory, each with its automatic data path (puts on shared memory,
/// rendezvous on tcp) and with the other one forced, each with a small
/// receive region (16 slots) so the slot ring wraps many times: what the
/// generic tests run on besides TCP and in-process.
#[cfg(feature = "ucx")]
pub fn ucx_transports(token: &str) -> Vec<(Box<dyn tandem_kv_transfer::Transport>, &'static str)> {
    use tandem_kv_transfer::ucx::UcxDataPath;
    let sm: &[(&str, &str)] = &[("TLS", "sm")];
    let tcp: &[(&str, &str)] = &[("TLS", "tcp"), ("NET_DEVICES", "lo")];
    [
        (sm, UcxDataPath::Auto),
        (tcp, UcxDataPath::Auto),
        (sm, UcxDataPath::Rendezvous),
        (tcp, UcxDataPath::Put),
    ]
    .into_iter()
    .map(|(settings, data_path)| {
        let t = ucx_transport(
            token,
            settings,
            data_path,
            16 * 2 * layout().block_layer_bytes(),
        );
        (
            Box::new(t) as Box<dyn tandem_kv_transfer::Transport>,
            "127.0.0.1:0",
        )
    })
    .collect()
}

/// A UCX transport with `settings` (`UCX_` names without the prefix), a
/// data path and a receive region of `region_bytes` per connection.
#[cfg(feature = "ucx")]
pub fn ucx_transport(
    token: &str,
    settings: &[(&str, &str)],
    data_path: tandem_kv_transfer::ucx::UcxDataPath,
    region_bytes: usize,
) -> tandem_kv_transfer::ucx::UcxTransport {
    use tandem_kv_transfer::ucx::{UcxConfig, UcxTransport};
    let mut config = UcxConfig::new(token);
    config.region_bytes = region_bytes;
    config.data_path = data_path;
    config.ucx_settings = settings
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    UcxTransport::with_config(config).expect("UCX starts")
}
