//! A peer that goes away or misbehaves fails transfers, never hangs or
//! panics, and the listener keeps serving everyone else.

mod common;

use std::time::Duration;

use common::{block, layout, raw_handshake, test_nonce, RecordingSink, WAIT};
use tandem_kv_transfer::inproc::InProcTransport;
use tandem_kv_transfer::tcp::{TcpConfig, TcpTransport};
use tandem_kv_transfer::{Session, TransferError, TransferFailure, TransferId, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn transports() -> Vec<(Box<dyn Transport>, &'static str)> {
    #[allow(unused_mut)]
    let mut all: Vec<(Box<dyn Transport>, &'static str)> = vec![
        (Box::new(TcpTransport::new("tok")), "127.0.0.1:0"),
        (Box::new(InProcTransport::new("tok")), "inproc://"),
    ];
    #[cfg(feature = "ucx")]
    all.extend(common::ucx_transports("tok"));
    all
}

async fn finish(session: &dyn Session, transfer: TransferId) -> Result<(), TransferError> {
    tokio::time::timeout(WAIT, session.finish(transfer))
        .await
        .expect("finish did not resolve in time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_dropping_mid_transfer_fails_it_at_the_receiver() {
    let l = layout();
    for (transport, bind) in transports() {
        let sink = RecordingSink::new(64);
        let listener = transport
            .listen(bind, l, sink.clone())
            .await
            .expect("listen");
        let session = transport
            .connect(listener.endpoint(), l)
            .await
            .expect("connect");
        let (done, open) = (TransferId(1), TransferId(2));
        session
            .write(done, vec![block(&l, 1, 0, 0)])
            .await
            .expect("write");
        finish(session.as_ref(), done).await.expect("finish");
        session
            .write(open, vec![block(&l, 2, 0, 1), block(&l, 2, 1, 1)])
            .await
            .expect("write");
        drop(session);
        let outcome = sink.wait_finish(open).await;
        assert!(outcome.is_err(), "{outcome:?}");
        // Blocks written before the drop were still delivered, in order.
        assert_eq!(sink.writes_of(open).len(), 2);
        assert_eq!(sink.wait_finish(done).await, Ok(()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_going_away_fails_pending_finishes() {
    let l = layout();
    for (transport, bind) in transports() {
        let sink = RecordingSink::new(64);
        let listener = transport
            .listen(bind, l, sink.clone())
            .await
            .expect("listen");
        let session = transport
            .connect(listener.endpoint(), l)
            .await
            .expect("connect");
        let t = TransferId(3);
        session
            .write(t, vec![block(&l, 3, 0, 5)])
            .await
            .expect("write");
        // Give the receiver time to see the block, then shut it down.
        common::wait_for(|| (!sink.writes_of(t).is_empty()).then_some(())).await;
        drop(listener);
        assert!(sink.wait_finish(t).await.is_err());
        let err = finish(session.as_ref(), t).await;
        assert!(
            matches!(err, Err(TransferError::ConnectionLost(_))),
            "{err:?}"
        );
        // Later calls fail too, promptly.
        let later =
            tokio::time::timeout(WAIT, session.write(TransferId(4), vec![block(&l, 4, 0, 1)]))
                .await
                .expect("timely");
        assert!(later.is_err());
    }
}

/// Handshakes a raw TCP connection and returns it.
async fn raw_session(endpoint: &str) -> TcpStream {
    let mut s = TcpStream::connect(endpoint).await.expect("connect");
    let h = raw_handshake(&mut s, &layout(), "tok", test_nonce(1)).await;
    assert_eq!(h.reply[10], 0, "handshake accepted");
    s
}

/// Reads until the listener closes the connection (bounded); returns what it sent.
async fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut out))
        .await
        .expect("the listener must close a broken connection")
        .expect("read");
    out
}

/// A WRITE frame header for `count` blocks with a claimed body length.
fn write_header(body_len: u32, transfer: u64, count: u32) -> Vec<u8> {
    let mut f = vec![1u8];
    f.extend_from_slice(&body_len.to_le_bytes());
    f.extend_from_slice(&transfer.to_le_bytes());
    f.extend_from_slice(&count.to_le_bytes());
    f
}

async fn assert_still_serving(transport: &TcpTransport, endpoint: &str, sink: &RecordingSink) {
    let l = layout();
    let session = transport
        .connect(endpoint, l)
        .await
        .expect("connect after abuse");
    let t = TransferId(777);
    session
        .write(t, vec![block(&l, 7, 2, 9)])
        .await
        .expect("write");
    finish(session.as_ref(), t).await.expect("finish");
    assert_eq!(sink.writes_of(t).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_after_handshake_closes_only_that_connection() {
    let transport = TcpTransport::new("tok");
    let sink = RecordingSink::new(64);
    let listener = transport
        .listen("127.0.0.1:0", layout(), sink.clone())
        .await
        .expect("listen");
    let mut raw = raw_session(listener.endpoint()).await;
    raw.write_all(b"\x42this is not a frame at all")
        .await
        .expect("garbage");
    let sent = read_to_close(&mut raw).await;
    assert_eq!(sent.first(), Some(&0x82), "a CLOSE frame explains why");
    assert!(String::from_utf8_lossy(&sent).contains("unknown frame type 0x42"));
    assert!(sink.wait_peer_error().await[0].contains("unknown frame type"));
    assert_still_serving(&transport, listener.endpoint(), &sink).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_length_is_refused_without_allocating() {
    let transport = TcpTransport::new("tok");
    let sink = RecordingSink::new(64);
    let listener = transport
        .listen("127.0.0.1:0", layout(), sink.clone())
        .await
        .expect("listen");
    let mut raw = raw_session(listener.endpoint()).await;
    raw.write_all(&write_header(u32::MAX, 1, 1))
        .await
        .expect("frame");
    read_to_close(&mut raw).await;
    assert!(sink.wait_peer_error().await[0].contains("WRITE frame of 4294967295 bytes"));
    assert_still_serving(&transport, listener.endpoint(), &sink).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_payload_length_is_a_protocol_error_and_fails_open_transfers() {
    let l = layout();
    let transport = TcpTransport::new("tok");
    let sink = RecordingSink::new(64);
    let listener = transport
        .listen("127.0.0.1:0", l, sink.clone())
        .await
        .expect("listen");
    let mut raw = raw_session(listener.endpoint()).await;
    // A valid one-block frame opens transfer 5...
    let blb = l.block_layer_bytes();
    let good_len = (12 + 8 + 2 * blb) as u32;
    let mut frame = write_header(good_len, 5, 1);
    frame.extend_from_slice(&0u32.to_le_bytes());
    frame.extend_from_slice(&3u32.to_le_bytes());
    frame.extend(vec![7u8; 2 * blb]);
    // ...then a frame one byte short of what two blocks need.
    frame.extend(write_header(good_len * 2 - 12 - 1, 5, 2));
    raw.write_all(&frame).await.expect("frames");
    read_to_close(&mut raw).await;
    assert!(sink.wait_peer_error().await[0].contains("the layout needs"));
    let outcome = sink.wait_finish(TransferId(5)).await;
    assert!(
        matches!(&outcome, Err(TransferFailure::ConnectionLost(m)) if m.contains("protocol error")),
        "{outcome:?}"
    );
    assert_eq!(sink.writes_of(TransferId(5)).len(), 1);
    assert_still_serving(&transport, listener.endpoint(), &sink).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_block_from_a_raw_peer_fails_the_transfer_not_the_connection() {
    let l = layout();
    let transport = TcpTransport::new("tok");
    let sink = RecordingSink::new(64);
    let listener = transport
        .listen("127.0.0.1:0", l, sink.clone())
        .await
        .expect("listen");
    let mut raw = raw_session(listener.endpoint()).await;
    let blb = l.block_layer_bytes();
    let mut frame = write_header((12 + 8 + 2 * blb) as u32, 9, 1);
    frame.extend_from_slice(&0u32.to_le_bytes());
    frame.extend_from_slice(&64u32.to_le_bytes()); // the pool has 64 blocks: 0..=63
    frame.extend(vec![1u8; 2 * blb]);
    // FINISH 9: no second DONE, the failure was already reported.
    frame.push(2);
    frame.extend_from_slice(&8u32.to_le_bytes());
    frame.extend_from_slice(&9u64.to_le_bytes());
    raw.write_all(&frame).await.expect("frames");
    let mut done = [0u8; 5 + 11];
    tokio::time::timeout(WAIT, raw.read_exact(&mut done))
        .await
        .expect("timely")
        .expect("DONE");
    assert_eq!(done[0], 0x81);
    assert_eq!(done[13], 1, "failed");
    let outcome = sink.wait_finish(TransferId(9)).await;
    assert_eq!(
        outcome,
        Err(TransferFailure::BlockOutOfRange {
            block: 64,
            blocks: 64
        })
    );
    assert!(sink.writes_of(TransferId(9)).is_empty());
    assert!(
        sink.peer_errors().is_empty(),
        "the connection itself is fine"
    );
}

#[tokio::test]
async fn silent_peer_is_dropped_after_the_handshake_timeout() {
    let transport = TcpTransport::with_config(TcpConfig {
        handshake_timeout: Duration::from_millis(200),
        ..TcpConfig::new("tok")
    });
    let sink = RecordingSink::new(64);
    let listener = transport
        .listen("127.0.0.1:0", layout(), sink.clone())
        .await
        .expect("listen");
    let mut s = TcpStream::connect(listener.endpoint())
        .await
        .expect("connect");
    read_to_close(&mut s).await;
    assert!(sink.wait_peer_error().await[0].contains("timed out"));
}

/// Unauthenticated connections cannot pile up: past `max_connections` a
/// new one is closed at accept, and a slot freed by a closed connection
/// serves a real session again. The counts of open transfers return to
/// zero on both sides once a transfer ends.
#[tokio::test]
async fn a_listener_closes_connections_past_its_cap() {
    let transport = TcpTransport::with_config(TcpConfig {
        max_connections: 2,
        ..TcpConfig::new("tok")
    });
    let l = layout();
    let sink = RecordingSink::new(64);
    let listener = transport
        .listen("127.0.0.1:0", l, sink.clone())
        .await
        .expect("listen");
    // Two silent connections hold both slots (each until its handshake
    // times out, 5 s); the third is closed at once.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(
            TcpStream::connect(listener.endpoint())
                .await
                .expect("connect"),
        );
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut third = TcpStream::connect(listener.endpoint())
        .await
        .expect("the kernel accepts");
    let closed = tokio::time::timeout(Duration::from_secs(2), read_to_close(&mut third)).await;
    assert!(closed.is_ok(), "the connection past the cap was not closed");
    drop(held);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let session = transport
        .connect(listener.endpoint(), l)
        .await
        .expect("a freed slot serves a real session");
    let transfer = TransferId(7);
    session
        .write(transfer, vec![block(&l, 7, 0, 0)])
        .await
        .expect("write");
    let counts = transport.counts();
    assert_eq!(counts.sending, 1, "{counts:?}");
    finish(session.as_ref(), transfer).await.expect("finish");
    let counts = transport.counts();
    assert_eq!((counts.sending, counts.receiving), (0, 0), "{counts:?}");
    assert_eq!(counts.connections_lost, 0, "{counts:?}");
}

#[tokio::test]
async fn connecting_to_nothing_is_a_clear_error() {
    let free = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = free.local_addr().expect("addr").to_string();
    drop(free);
    let err = TcpTransport::new("tok")
        .connect(&addr, layout())
        .await
        .expect_err("nothing there");
    assert!(matches!(err, TransferError::BadEndpoint { .. }), "{err:?}");
}
