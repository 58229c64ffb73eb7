//! Arbitrary bytes from a peer into a real KV-transfer TCP listener.
//!
//! One listener (its own tokio runtime) lives for the whole run; every input
//! is one connection. The first input byte picks what is fuzzed: even, the
//! raw bytes are the connection (the handshake parser); odd, a valid hello
//! goes first and the rest are frames (WRITE/FINISH/ABORT parsing, payload
//! reads, the per-transfer bookkeeping) — the cluster token is compared in
//! constant time, so the fuzzer could never guess it on its own.
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
use tandem_kv_transfer::{KvDtype, KvLayoutDescriptor, KvSink, Listener, TransferId, Transport};

const TOKEN: &[u8] = b"fuzz-token";
const NUM_BLOCKS: u32 = 8;

fn layout() -> KvLayoutDescriptor {
    KvLayoutDescriptor {
        num_layers: 2,
        num_kv_heads: 1,
        head_dim: 4,
        block_size: 2,
        dtype: KvDtype::F32,
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
    ) -> Result<(), String> {
        let l = layout();
        assert!(layer < l.num_layers, "write to layer {layer}");
        assert!(block < NUM_BLOCKS, "write to block {block}");
        assert_eq!(k.len(), l.block_layer_bytes());
        assert_eq!(v.len(), l.block_layer_bytes());
        Ok(())
    }

    fn finish(&self, _: TransferId, _: Result<(), String>) {}
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

fn hello() -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(b"TDMKVXF1");
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&(TOKEN.len() as u16).to_le_bytes());
    out.extend_from_slice(&layout().encode());
    out.extend_from_slice(TOKEN);
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut bytes = if mode % 2 == 1 { hello() } else { Vec::new() };
    bytes.extend_from_slice(rest);
    let mut conn = TcpStream::connect(&server().endpoint).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    // The receiver may close early on a protocol error: a failed write is
    // an answer, not a failure.
    let _ = conn.write_all(&bytes);
    let _ = conn.shutdown(Shutdown::Write);
    let mut sink = [0u8; 4096];
    loop {
        match conn.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the listener did not end the connection: {e}"),
        }
    }
});
