//! A forged KV-transfer peer cannot write into a receiver's pool: without
//! the cluster secret it does not get past the handshake (whether it guesses,
//! skips the proof, replays a recorded handshake or speaks the old plaintext
//! protocol), the secret never crosses the wire, and a listener that does
//! not hold the secret is never sent a block.

mod common;

use std::sync::{Arc, Mutex};

use common::{
    block, layout, raw_handshake, raw_hello_v1, test_nonce, RecordingSink, CHALLENGE_LEN,
    REPLY_LEN, WAIT,
};
use tandem_kv_transfer::tcp::TcpTransport;
use tandem_kv_transfer::{TransferError, TransferId, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const SECRET: &str = "cluster-secret-4f1c9a";

/// A listener of the cluster whose sink records everything.
async fn receiver() -> (tandem_kv_transfer::Listener, Arc<RecordingSink>) {
    let sink = RecordingSink::new(64);
    let listener = TcpTransport::new(SECRET)
        .listen("127.0.0.1:0", layout(), sink.clone())
        .await
        .expect("listen");
    (listener, sink)
}

/// A WRITE frame of one block into block 0 under `transfer`.
fn write_frame(transfer: u64) -> Vec<u8> {
    let l = layout();
    let b = block(&l, transfer, 0, 0);
    let mut body = Vec::new();
    body.extend_from_slice(&transfer.to_le_bytes());
    body.extend_from_slice(&1u32.to_le_bytes());
    body.extend_from_slice(&0u32.to_le_bytes());
    body.extend_from_slice(&0u32.to_le_bytes());
    body.extend_from_slice(&b.k);
    body.extend_from_slice(&b.v);
    let mut f = vec![1u8];
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(&body);
    f
}

/// Reads until the listener closes (bounded); a reset ends it too.
async fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let read_all = async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(WAIT, read_all)
        .await
        .expect("the listener must close a refused connection");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_with_another_secret_is_refused_and_writes_nothing() {
    let (listener, sink) = receiver().await;
    let err = TcpTransport::new("a-guess")
        .connect(listener.endpoint(), layout())
        .await
        .expect_err("a sender without the secret must be refused");
    assert_eq!(err, TransferError::BadToken);
    let errors = sink.wait_peer_error().await;
    assert_eq!(errors, vec![TransferError::BadToken.to_string()]);
    assert_eq!(sink.write_count(), 0);
    // The cluster's own sender still gets in.
    let session = TcpTransport::new(SECRET)
        .connect(listener.endpoint(), layout())
        .await
        .expect("accepted");
    let blocks = vec![block(&layout(), 1, 0, 3)];
    session
        .write(TransferId(1), blocks.clone())
        .await
        .expect("write");
    session.finish(TransferId(1)).await.expect("finish");
    common::assert_delivered(&sink, TransferId(1), &blocks);
}

/// A raw forger that fakes the proof and sends WRITE frames right behind
/// it: refused with status 2, the connection closed, nothing delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_faked_proof_with_frames_behind_it_delivers_nothing() {
    let (listener, sink) = receiver().await;
    let mut s = TcpStream::connect(listener.endpoint())
        .await
        .expect("connect");
    s.write_all(&common::raw_hello(&layout(), &test_nonce(3)))
        .await
        .expect("hello");
    let mut challenge = [0u8; CHALLENGE_LEN];
    s.read_exact(&mut challenge).await.expect("challenge");
    let mut attack = vec![0x5a; 32];
    attack.extend_from_slice(&write_frame(7));
    attack.extend_from_slice(&write_frame(8));
    // The listener may close before reading all of it.
    let _ = s.write_all(&attack).await;
    let reply = read_to_close(&mut s).await;
    assert!(
        reply.len() >= REPLY_LEN,
        "a reply before closing: {reply:?}"
    );
    assert_eq!(reply[10], 2, "status: bad proof");
    assert!(
        reply[56..REPLY_LEN].iter().all(|b| *b == 0),
        "no receiver proof"
    );
    assert_eq!(reply.len(), REPLY_LEN, "nothing after the refusal");
    sink.wait_peer_error().await;
    assert_eq!(sink.write_count(), 0);
    assert!(sink.finishes().is_empty(), "no transfer was ever opened");
}

/// Replaying every byte of a recorded, accepted handshake fails: the
/// listener's nonce is fresh, so the recorded proof no longer fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_handshake_is_refused() {
    let (listener, sink) = receiver().await;
    let mut s = TcpStream::connect(listener.endpoint())
        .await
        .expect("connect");
    let recorded = raw_handshake(&mut s, &layout(), SECRET, test_nonce(4)).await;
    assert_eq!(recorded.reply[10], 0, "the original handshake is accepted");
    drop(s);

    let mut replay = TcpStream::connect(listener.endpoint())
        .await
        .expect("connect");
    let mut bytes = recorded.sent.clone();
    bytes.extend_from_slice(&write_frame(9));
    let _ = replay.write_all(&bytes).await;
    let answer = read_to_close(&mut replay).await;
    assert!(answer.len() >= CHALLENGE_LEN + REPLY_LEN, "{answer:?}");
    assert_ne!(
        &answer[10..CHALLENGE_LEN],
        &recorded.receiver_nonce[..],
        "a fresh challenge"
    );
    assert_eq!(answer[CHALLENGE_LEN + 10], 2, "status: bad proof");
    sink.wait_peer_error().await;
    assert_eq!(sink.write_count(), 0);
}

/// The version-1 hello carried the token in clear; even with the right
/// token it is refused (status 1), and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plaintext_token_protocol_is_refused() {
    let (listener, sink) = receiver().await;
    let mut s = TcpStream::connect(listener.endpoint())
        .await
        .expect("connect");
    let mut bytes = raw_hello_v1(&layout(), SECRET);
    bytes.extend_from_slice(&write_frame(5));
    let _ = s.write_all(&bytes).await;
    let reply = read_to_close(&mut s).await;
    assert!(reply.len() >= 11, "{reply:?}");
    assert_eq!(reply[10], 1, "status: version");
    let errors = sink.wait_peer_error().await;
    assert!(errors[0].contains("version 1 at the peer"), "{errors:?}");
    assert_eq!(sink.write_count(), 0);
}

/// Everything on the wire of a real session, both ways, through a
/// recording proxy: the secret is not in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_secret_never_crosses_the_wire() {
    let (listener, sink) = receiver().await;
    let proxy = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let proxy_addr = proxy.local_addr().expect("addr").to_string();
    let upstream = listener.endpoint().to_string();
    let wire = Arc::new(Mutex::new(Vec::<u8>::new()));
    let recorded = wire.clone();
    let relay = tokio::spawn(async move {
        let (client, _) = proxy.accept().await.expect("accept");
        let server = TcpStream::connect(upstream).await.expect("upstream");
        let (cr, cw) = client.into_split();
        let (sr, sw) = server.into_split();
        let copy = |mut from: tokio::net::tcp::OwnedReadHalf,
                    mut to: tokio::net::tcp::OwnedWriteHalf,
                    wire: Arc<Mutex<Vec<u8>>>| async move {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = match from.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                wire.lock().expect("wire").extend_from_slice(&buf[..n]);
                if to.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        };
        let up = tokio::spawn(copy(cr, sw, recorded.clone()));
        let down = tokio::spawn(copy(sr, cw, recorded));
        let _ = (up.await, down.await);
    });
    let session = TcpTransport::new(SECRET)
        .connect(&proxy_addr, layout())
        .await
        .expect("accepted through the proxy");
    let blocks = vec![block(&layout(), 2, 1, 4)];
    session
        .write(TransferId(2), blocks.clone())
        .await
        .expect("write");
    session.finish(TransferId(2)).await.expect("finish");
    common::assert_delivered(&sink, TransferId(2), &blocks);
    drop(session);
    let _ = tokio::time::timeout(WAIT, relay).await;
    let wire = wire.lock().expect("wire").clone();
    assert!(
        wire.len() > 2 * layout().block_layer_bytes(),
        "the block went through"
    );
    assert!(
        !wire.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()),
        "the cluster secret appeared on the wire"
    );
}

/// A listener that does not hold the secret (it answers the handshake with
/// "accepted" but cannot prove the secret) is never sent a block: the
/// sender refuses it before its first frame.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_without_the_secret_is_sent_nothing() {
    let impostor = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = impostor.local_addr().expect("addr").to_string();
    let received_after_handshake = Arc::new(Mutex::new(Vec::<u8>::new()));
    let after = received_after_handshake.clone();
    let server = tokio::spawn(async move {
        let (mut s, _) = impostor.accept().await.expect("accept");
        // Magic, version, 0, the 40-byte layout, the nonce.
        let mut hello = [0u8; 84];
        s.read_exact(&mut hello).await.expect("hello");
        let mut challenge = b"TDMKVXF1".to_vec();
        challenge.extend_from_slice(&3u16.to_le_bytes());
        challenge.extend_from_slice(&[7u8; 32]);
        s.write_all(&challenge).await.expect("challenge");
        let mut proof = [0u8; 32];
        s.read_exact(&mut proof).await.expect("proof");
        // "Accepted", with our layout, 64 blocks, and a made-up proof.
        let mut reply = b"TDMKVXF1".to_vec();
        reply.extend_from_slice(&3u16.to_le_bytes());
        reply.extend_from_slice(&[0, 0]);
        reply.extend_from_slice(&layout().encode());
        reply.extend_from_slice(&64u32.to_le_bytes());
        reply.extend_from_slice(&[0x33; 32]);
        s.write_all(&reply).await.expect("reply");
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(WAIT, s.read_to_end(&mut rest)).await;
        after.lock().expect("after").extend_from_slice(&rest);
    });
    let err = TcpTransport::new(SECRET)
        .connect(&addr, layout())
        .await
        .expect_err("an impostor listener must be refused");
    assert_eq!(err, TransferError::BadToken);
    tokio::time::timeout(WAIT, server)
        .await
        .expect("the impostor sees the connection close")
        .expect("impostor task");
    assert!(
        received_after_handshake.lock().expect("after").is_empty(),
        "the sender wrote after an unproven reply"
    );
}
