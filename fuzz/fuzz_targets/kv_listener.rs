//! Arbitrary bytes from a peer into a real KV-transfer TCP listener.
//!
//! One listener (its own tokio runtime) lives for the whole run; every input
//! is one connection. The first input byte picks what is fuzzed: even, the
//! raw bytes are the connection (the hello and proof parsers); odd, the
//! harness first completes the handshake as an honest peer (hello, the
//! HMAC proof over the listener's challenge) and the rest are frames
//! (WRITE/FINISH/ABORT parsing, payload reads, the per-transfer
//! bookkeeping) — the fuzzer could never forge the proof on its own.
//!
//! The sink is the oracle: a write the receiver lets through must name a
//! block and layer inside the pool, with K and V of exactly one
//! block-layer. The connection must end (the
//! receiver closes it or answers our half-close) within the read timeout:
//! a listener that hangs on some input is a failure too.

#![no_main]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tandem_kv_transfer::tcp::TcpTransport;
use tandem_kv_transfer::{
    KvDtype, KvLayoutDescriptor, KvSink, Listener, TransferFailure, TransferId, Transport,
    WriteRefused,
};

const TOKEN: &[u8] = b"fuzz-token";
const NUM_BLOCKS: u32 = 8;

fn layout() -> KvLayoutDescriptor {
    KvLayoutDescriptor {
        rows: tandem_kv_transfer::KvRows::PerHead,
        num_layers: 2,
        num_kv_heads: 1,
        head_dim: 4,
        block_size: 2,
        dtype: KvDtype::F32,
        sliding_window: 0,
        windowed_layers: 0,
    }
}

struct CheckingSink;

impl KvSink for CheckingSink {
    fn num_blocks(&self) -> u32 {
        NUM_BLOCKS
    }

    fn write(
        &self,
        _: TransferId,
        layer: u32,
        block: u32,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), WriteRefused> {
        let l = layout();
        assert!(layer < l.num_layers, "write to layer {layer}");
        assert!(block < NUM_BLOCKS, "write to block {block}");
        assert_eq!(k.len(), l.block_layer_bytes());
        assert_eq!(v.len(), l.block_layer_bytes());
        Ok(())
    }

    fn finish(&self, _: TransferId, _: Result<(), TransferFailure>) {}
}

struct Server {
    _rt: tokio::runtime::Runtime,
    _listener: Listener,
    endpoint: String,
}

fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let transport = TcpTransport::new(String::from_utf8_lossy(TOKEN).into_owned());
        let sink: Arc<dyn KvSink> = Arc::new(CheckingSink);
        let listener = rt
            .block_on(transport.listen("127.0.0.1:0", layout(), sink))
            .expect("listen");
        let endpoint = listener.endpoint().to_string();
        Server {
            _rt: rt,
            _listener: listener,
            endpoint,
        }
    })
}

const MAGIC: &[u8; 8] = b"TDMKVXF1";

/// The honest sender's side of the version-3 handshake
/// (`kv-transfer/src/protocol.rs`); false if the listener refused it.
fn handshake(conn: &mut TcpStream) -> std::io::Result<bool> {
    let nonce = [7u8; 32];
    let layout = layout().encode();
    let mut hello = Vec::new();
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&3u16.to_le_bytes());
    hello.extend_from_slice(&0u16.to_le_bytes());
    hello.extend_from_slice(&layout);
    hello.extend_from_slice(&nonce);
    conn.write_all(&hello)?;
    let mut challenge = [0u8; 8 + 2 + 32];
    conn.read_exact(&mut challenge)?;
    let mut signed = Vec::new();
    signed.extend_from_slice(b"tandem-kv sender");
    signed.extend_from_slice(MAGIC);
    signed.extend_from_slice(&nonce);
    signed.extend_from_slice(&challenge[10..]);
    signed.extend_from_slice(&layout);
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, TOKEN);
    conn.write_all(ring::hmac::sign(&key, &signed).as_ref())?;
    let mut reply = [0u8; 8 + 2 + 1 + 1 + KvLayoutDescriptor::ENCODED_LEN + 4 + 32];
    conn.read_exact(&mut reply)?;
    Ok(reply[10] == 0)
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut conn = TcpStream::connect(&server().endpoint).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    if mode % 2 == 1 {
        let accepted = handshake(&mut conn).expect("the handshake completes");
        assert!(accepted, "the listener refused an honest handshake");
    }
    // The receiver may close early on a protocol error: a failed write is
    // an answer, not a failure.
    let _ = conn.write_all(rest);
    let _ = conn.shutdown(Shutdown::Write);
    let mut sink = [0u8; 4096];
    loop {
        match conn.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            // libFuzzer's timers interrupt blocking reads.
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => panic!("the listener did not end the connection: {e}"),
        }
    }
});
