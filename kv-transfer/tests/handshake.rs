//! The handshake refuses a layout mismatch or a wrong cluster token on both
//! sides, with errors that name the problem.

mod common;

use common::{layout, raw_handshake, test_nonce, RecordingSink, WAIT};
use tandem_kv_transfer::inproc::InProcTransport;
use tandem_kv_transfer::tcp::TcpTransport;
use tandem_kv_transfer::{KvDtype, KvLayoutDescriptor, TransferError, Transport};
use tokio::io::AsyncWriteExt;

fn block_size_32() -> KvLayoutDescriptor {
    KvLayoutDescriptor {
        block_size: 32,
        ..layout()
    }
}

#[tokio::test]
async fn tcp_layout_mismatch_is_refused_on_both_sides() {
    let transport = TcpTransport::new("t");
    let sink = RecordingSink::new(16);
    let listener = transport
        .listen("127.0.0.1:0", layout(), sink.clone())
        .await
        .expect("listen");
    let err = transport
        .connect(listener.endpoint(), block_size_32())
        .await
        .expect_err("a block size of 32 against 16 must be refused");
    assert_eq!(
        err.to_string(),
        "KV layout mismatch: block_size 32 here, 16 at the peer"
    );
    assert!(matches!(
        err,
        TransferError::LayoutMismatch {
            field: "block_size",
            ..
        }
    ));
    let errors = sink.wait_peer_error().await;
    assert_eq!(
        errors,
        vec!["KV layout mismatch: block_size 16 here, 32 at the peer".to_string()]
    );
}

#[tokio::test]
async fn tcp_dtype_mismatch_names_dtype() {
    let transport = TcpTransport::new("t");
    let sink = RecordingSink::new(16);
    let listener = transport
        .listen("127.0.0.1:0", layout(), sink.clone())
        .await
        .expect("listen");
    let bf16 = KvLayoutDescriptor {
        dtype: KvDtype::Bf16,
        ..layout()
    };
    let err = transport
        .connect(listener.endpoint(), bf16)
        .await
        .expect_err("refused");
    assert!(
        err.to_string().contains("dtype bf16 here, f32 at the peer"),
        "{err}"
    );
}

/// A latent layout (one row per token, no V) against a per-head one of the
/// same width: the handshake names the rows.
#[tokio::test]
async fn tcp_latent_against_per_head_rows_is_refused_by_name() {
    let transport = TcpTransport::new("t");
    let sink = RecordingSink::new(16);
    let listener = transport
        .listen("127.0.0.1:0", layout(), sink.clone())
        .await
        .expect("listen");
    let latent = KvLayoutDescriptor {
        rows: tandem_kv_transfer::KvRows::Latent,
        ..layout()
    };
    let err = transport
        .connect(listener.endpoint(), latent)
        .await
        .expect_err("refused");
    assert!(
        err.to_string()
            .contains("rows latent here, per-head K and V at the peer"),
        "{err}"
    );
}

#[tokio::test]
async fn tcp_wrong_cluster_token_is_refused_on_both_sides() {
    let sink = RecordingSink::new(16);
    let listener = TcpTransport::new("cluster-a")
        .listen("127.0.0.1:0", layout(), sink.clone())
        .await
        .expect("listen");
    let err = TcpTransport::new("cluster-b")
        .connect(listener.endpoint(), layout())
        .await
        .expect_err("another cluster's token must be refused");
    assert_eq!(err, TransferError::BadToken);
    assert!(sink.wait_peer_error().await[0].contains("cluster token mismatch"));
    // The right token still gets in afterwards.
    TcpTransport::new("cluster-a")
        .connect(listener.endpoint(), layout())
        .await
        .expect("the right token is accepted");
}

#[tokio::test]
async fn inproc_refuses_mismatches_on_both_sides() {
    let transport = InProcTransport::new("a");
    let sink = RecordingSink::new(16);
    let listener = transport
        .listen("inproc://decode-0", layout(), sink.clone())
        .await
        .expect("listen");
    assert_eq!(listener.endpoint(), "inproc://decode-0");
    let err = transport
        .connect(listener.endpoint(), block_size_32())
        .await
        .expect_err("refused");
    assert_eq!(
        err.to_string(),
        "KV layout mismatch: block_size 32 here, 16 at the peer"
    );
    let err = transport
        .with_token("b")
        .connect(listener.endpoint(), layout())
        .await
        .expect_err("refused");
    assert_eq!(err, TransferError::BadToken);
    assert_eq!(
        sink.peer_errors(),
        vec![
            "KV layout mismatch: block_size 16 here, 32 at the peer".to_string(),
            TransferError::BadToken.to_string(),
        ]
    );
    drop(listener);
    let err = transport
        .connect("inproc://decode-0", layout())
        .await
        .expect_err("gone");
    assert!(matches!(err, TransferError::BadEndpoint { .. }));
}

#[tokio::test]
async fn tcp_connecting_to_something_else_fails_cleanly() {
    // A server that answers with junk instead of a handshake reply.
    let junk = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = junk.local_addr().expect("addr").to_string();
    let server = tokio::spawn(async move {
        let (mut s, _) = junk.accept().await.expect("accept");
        let _ = s.write_all(&[0x47; 64]).await;
        tokio::time::sleep(WAIT).await;
    });
    let err = TcpTransport::new("t")
        .connect(&addr, layout())
        .await
        .expect_err("junk");
    assert!(err.to_string().contains("bad magic"), "{err}");
    server.abort();
}

#[tokio::test]
async fn tcp_raw_handshake_gets_the_documented_challenge_and_reply() {
    let transport = TcpTransport::new("tok");
    let sink = RecordingSink::new(77);
    let listener = transport
        .listen("127.0.0.1:0", layout(), sink.clone())
        .await
        .expect("listen");
    let mut s = tokio::net::TcpStream::connect(listener.endpoint())
        .await
        .expect("connect");
    let h = raw_handshake(&mut s, &layout(), "tok", test_nonce(9)).await;
    let reply = h.reply;
    assert_eq!(&reply[..8], b"TDMKVXF1");
    assert_eq!(u16::from_le_bytes([reply[8], reply[9]]), 3, "version");
    assert_eq!(reply[10], 0, "status accepted");
    assert_eq!(&reply[12..52], &layout().encode());
    assert_eq!(
        u32::from_le_bytes([reply[52], reply[53], reply[54], reply[55]]),
        77
    );
    // The receiver's proof covers both nonces and the reply before it.
    let expected = common::hmac(
        "tok",
        &[
            b"tandem-kv receiver",
            b"TDMKVXF1",
            &h.sender_nonce,
            &h.receiver_nonce,
            &reply[..56],
        ],
    );
    assert_eq!(&reply[56..], &expected[..]);
}

/// A UCX worker and a TCP worker (different `--kv-transport`) refuse each
/// other with an error naming the transport; a wrong token and a layout
/// mismatch are refused over UCX as over TCP.
#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_refuses_tcp_peers_wrong_tokens_and_other_layouts() {
    use common::{assert_delivered, block};
    use tandem_kv_transfer::ucx::UcxTransport;
    let ucx = |token: &str| UcxTransport::new(token).expect("UCX starts");
    // UCX sender → TCP listener.
    let tcp_sink = RecordingSink::new(16);
    let tcp_listener = TcpTransport::new("a")
        .listen("127.0.0.1:0", layout(), tcp_sink.clone())
        .await
        .expect("listen");
    let err = ucx("a")
        .connect(tcp_listener.endpoint(), layout())
        .await
        .expect_err("a TCP listener must refuse a UCX sender");
    assert!(err.to_string().contains("ucx"), "{err}");
    assert!(tcp_sink.wait_peer_error().await[0].contains("--kv-transport"));
    // TCP sender → UCX listener.
    let sink = RecordingSink::new(16);
    let listener = ucx("a")
        .listen("127.0.0.1:0", layout(), sink.clone())
        .await
        .expect("listen");
    let err = TcpTransport::new("a")
        .connect(listener.endpoint(), layout())
        .await
        .expect_err("a UCX listener must refuse a TCP sender");
    assert!(err.to_string().contains("tcp"), "{err}");
    assert!(sink.wait_peer_error().await[0].contains("--kv-transport"));
    // Wrong token, other layout.
    let err = ucx("b")
        .connect(listener.endpoint(), layout())
        .await
        .expect_err("another cluster's token must be refused");
    assert_eq!(err, TransferError::BadToken);
    let err = ucx("a")
        .connect(listener.endpoint(), block_size_32())
        .await
        .expect_err("another layout must be refused");
    assert!(
        matches!(&err, TransferError::LayoutMismatch { field, .. } if *field == "block_size"),
        "{err:?}"
    );
    // The right peer still gets in, and a transfer goes through. (Finishing
    // it also lets UCX's endpoint wireup complete before anything is torn
    // down: UCX 1.13 aborts the process when a worker is destroyed while
    // its peer still has a wireup reply in flight.)
    let sender = ucx("a");
    let session = sender
        .connect(listener.endpoint(), layout())
        .await
        .expect("accepted");
    let blocks = vec![block(&layout(), 7, 0, 3)];
    let id = tandem_kv_transfer::TransferId(7);
    session.write(id, blocks.clone()).await.expect("write");
    session.finish(id).await.expect("finish");
    assert_delivered(&sink, id, &blocks);
    drop(session);
    drop(sender);
}
