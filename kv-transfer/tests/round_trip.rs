//! Blocks arrive byte-exact and in order, over TCP and in-process; many
//! transfers interleave on one session; abort and sink refusals end a
//! transfer with an error on both sides.

mod common;

use std::sync::Arc;

use common::{assert_delivered, block, layout, RecordingSink, WAIT};
use tandem_kv_transfer::inproc::InProcTransport;
use tandem_kv_transfer::tcp::TcpTransport;
use tandem_kv_transfer::{
    BlockWrite, Session, TransferError, TransferFailure, TransferId, Transport,
};

const TOKEN: &str = "cluster-a";

/// Both transports, each with the bind address it listens on.
fn transports() -> Vec<(Box<dyn Transport>, &'static str)> {
    #[allow(unused_mut)]
    let mut all: Vec<(Box<dyn Transport>, &'static str)> = vec![
        (Box::new(TcpTransport::new(TOKEN)), "127.0.0.1:0"),
        (Box::new(InProcTransport::new(TOKEN)), "inproc://"),
    ];
    #[cfg(feature = "ucx")]
    all.extend(common::ucx_transports(TOKEN));
    all
}

async fn finish(session: &dyn Session, transfer: TransferId) -> Result<(), TransferError> {
    tokio::time::timeout(WAIT, session.finish(transfer))
        .await
        .expect("finish did not resolve in time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_blocks_across_layers_arrive_byte_exact() {
    let l = layout();
    for (transport, bind) in transports() {
        let sink = RecordingSink::new(1024);
        let (_listener, session) = common::open(transport.as_ref(), bind, l, sink.clone()).await;
        assert_eq!(session.peer_num_blocks(), 1024);
        let t = TransferId(1);
        // Many small writes, then one big enough to be split into several frames.
        let mut expected = Vec::new();
        for chunk in 0..10u32 {
            let blocks: Vec<BlockWrite> = (0..l.num_layers)
                .flat_map(|layer| (0..8).map(move |b| (layer, chunk * 8 + b)))
                .map(|(layer, dst)| block(&l, 1, layer, dst))
                .collect();
            expected.extend(blocks.clone());
            session.write(t, blocks).await.expect("write");
        }
        let big: Vec<BlockWrite> = (0..l.num_layers)
            .flat_map(|layer| (100..850).map(move |dst| (layer, dst)))
            .map(|(layer, dst)| block(&l, 1, layer, dst))
            .collect();
        expected.extend(big.clone());
        session.write(t, big).await.expect("write big");
        finish(session.as_ref(), t).await.expect("finish");
        // The sender's finish resolves only after the sink's finish(Ok).
        assert_eq!(sink.finishes(), vec![(t, Ok(()))]);
        assert_delivered(&sink, t, &expected);
    }
}

/// A latent layout (multi-head latent attention: one row per token, no V)
/// moves its rows and nothing else, byte-exact, over every transport.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latent_rows_arrive_byte_exact_with_no_v() {
    let l = tandem_kv_transfer::KvLayoutDescriptor {
        rows: tandem_kv_transfer::KvRows::Latent,
        num_kv_heads: 1,
        head_dim: 576,
        ..layout()
    };
    for (transport, bind) in transports() {
        let sink = RecordingSink::new(64);
        let (_listener, session) = common::open(transport.as_ref(), bind, l, sink.clone()).await;
        let t = TransferId(3);
        let blocks: Vec<BlockWrite> = (0..l.num_layers)
            .flat_map(|layer| (0..40).map(move |dst| (layer, dst)))
            .map(|(layer, dst)| block(&l, 3, layer, dst))
            .collect();
        assert!(blocks.iter().all(|b| b.v.is_empty()));
        session.write(t, blocks.clone()).await.expect("write");
        finish(session.as_ref(), t).await.expect("finish");
        assert_delivered(&sink, t, &blocks);
        // A block carrying a V is refused before it is sent.
        let mut with_v = block(&l, 4, 0, 0);
        with_v.v = with_v.k.clone();
        let refused = session.write(TransferId(4), vec![with_v]).await;
        assert!(refused.is_err(), "a latent block with a V");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interleaved_transfers_on_one_session() {
    let l = layout();
    for (transport, bind) in transports() {
        let sink = RecordingSink::new(64);
        let listener = transport
            .listen(bind, l, sink.clone())
            .await
            .expect("listen");
        let session: Arc<dyn Session> = Arc::from(
            transport
                .connect(listener.endpoint(), l)
                .await
                .expect("connect"),
        );
        let ids = [TransferId(10), TransferId(11), TransferId(12)];
        let mut expected = vec![Vec::new(); ids.len()];
        for round in 0..5u32 {
            for (i, t) in ids.iter().enumerate() {
                let blocks: Vec<BlockWrite> = (0..l.num_layers)
                    .map(|layer| block(&l, t.0, layer, (i as u32 * 16 + round) % 64))
                    .collect();
                expected[i].extend(blocks.clone());
                session.write(*t, blocks).await.expect("write");
            }
        }
        // Finish them concurrently from separate tasks, in reverse order.
        let mut tasks = Vec::new();
        for t in ids.iter().rev().copied() {
            let session = session.clone();
            tasks.push(tokio::spawn(async move {
                tokio::time::timeout(WAIT, session.finish(t)).await
            }));
        }
        for task in tasks {
            task.await.expect("task").expect("timely").expect("finish");
        }
        for (i, t) in ids.iter().enumerate() {
            assert_delivered(&sink, *t, &expected[i]);
            assert_eq!(sink.wait_finish(*t).await, Ok(()));
        }
        // An id may be reused once finished.
        session
            .write(ids[0], vec![block(&l, 99, 0, 1)])
            .await
            .expect("write");
        finish(session.as_ref(), ids[0])
            .await
            .expect("finish reused id");
    }
}

/// Many sessions to one listener, each driving transfers from its own
/// tasks at once (what a prefill worker serving concurrent requests does):
/// every block lands once, in order, in the right transfer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sessions_each_with_concurrent_transfers() {
    let l = layout();
    for (transport, bind) in transports() {
        let transport: Arc<dyn Transport> = Arc::from(transport);
        let sink = RecordingSink::new(1024);
        let listener = transport
            .listen(bind, l, sink.clone())
            .await
            .expect("listen");
        let mut tasks = Vec::new();
        for s in 0..6u64 {
            let session: Arc<dyn Session> = Arc::from(
                transport
                    .connect(listener.endpoint(), l)
                    .await
                    .expect("connect"),
            );
            for j in 0..3u64 {
                let session = session.clone();
                let t = TransferId(s * 10 + j);
                tasks.push(tokio::spawn(async move {
                    let mut sent = Vec::new();
                    for round in 0..4u32 {
                        let blocks: Vec<BlockWrite> = (0..l.num_layers)
                            .flat_map(|layer| {
                                (0..3u32)
                                    .map(move |b| (layer, (t.0 as u32 * 16 + round * 3 + b) % 1024))
                            })
                            .map(|(layer, dst)| block(&l, t.0, layer, dst))
                            .collect();
                        sent.extend(blocks.clone());
                        session.write(t, blocks).await?;
                        tokio::task::yield_now().await;
                    }
                    tokio::time::timeout(WAIT, session.finish(t))
                        .await
                        .map_err(|_| TransferError::Protocol("finish timed out".into()))??;
                    Ok::<_, TransferError>((t, sent))
                }));
            }
        }
        for task in tasks {
            let (t, sent) = task.await.expect("task").expect("transfer");
            assert_delivered(&sink, t, &sent);
        }
        drop(listener);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_fails_the_transfer_on_both_sides() {
    let l = layout();
    for (transport, bind) in transports() {
        let sink = RecordingSink::new(64);
        let (_listener, session) = common::open(transport.as_ref(), bind, l, sink.clone()).await;
        let (aborted, kept) = (TransferId(1), TransferId(2));
        session
            .write(aborted, vec![block(&l, 1, 0, 3)])
            .await
            .expect("write");
        session
            .write(kept, vec![block(&l, 2, 0, 4)])
            .await
            .expect("write");
        session.abort(aborted).await.expect("abort");
        let outcome = sink.wait_finish(aborted).await;
        assert_eq!(outcome, Err(TransferFailure::Aborted));
        // The other transfer on the session is untouched.
        finish(session.as_ref(), kept).await.expect("finish");
        assert_eq!(sink.wait_finish(kept).await, Ok(()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_refusal_fails_only_that_transfer() {
    let l = layout();
    for (transport, bind) in transports() {
        let sink = RecordingSink::refusing(64, 13);
        let (_listener, session) = common::open(transport.as_ref(), bind, l, sink.clone()).await;
        let (bad, good) = (TransferId(1), TransferId(2));
        let blocks = vec![
            block(&l, 1, 0, 12),
            block(&l, 1, 0, 13),
            block(&l, 1, 0, 14),
        ];
        session.write(bad, blocks).await.expect("write");
        // Writes after the failure are skipped, not delivered.
        session
            .write(bad, vec![block(&l, 1, 1, 15)])
            .await
            .expect("write");
        session
            .write(good, vec![block(&l, 2, 0, 1)])
            .await
            .expect("write");
        let err = finish(session.as_ref(), bad).await;
        assert!(
            matches!(&err, Err(TransferError::Failed { reason, .. }) if reason.contains("block 13")),
            "{err:?}"
        );
        assert_eq!(sink.writes_of(bad).len(), 1);
        assert!(sink.wait_finish(bad).await.is_err());
        finish(session.as_ref(), good).await.expect("good transfer");
    }
}

#[tokio::test]
async fn sender_refuses_bad_block_writes_before_sending() {
    let l = layout();
    for (transport, bind) in transports() {
        let sink = RecordingSink::new(8);
        let (_listener, session) = common::open(transport.as_ref(), bind, l, sink.clone()).await;
        let t = TransferId(5);
        let mut short = block(&l, 5, 0, 1);
        short.v = short.v.slice(1..);
        for (bad, needle) in [
            (block(&l, 5, 4, 1), "layer 4"),
            (block(&l, 5, 0, 8), "block 8"),
            (short, "V 1023 bytes"),
        ] {
            let err = session.write(t, vec![bad]).await;
            assert!(
                matches!(&err, Err(TransferError::InvalidBlock(m)) if m.contains(needle)),
                "{err:?}"
            );
        }
        finish(session.as_ref(), t)
            .await
            .expect("an empty transfer finishes");
        assert!(sink.writes_of(t).is_empty());
    }
}

/// Large batches cross UCX by rendezvous — UCX tcp's automatic data path,
/// and forced on shared memory — and by puts (shared memory's automatic
/// path), landing byte-exact in a receive ring that wraps many times,
/// between small eager batches; blocks each in their own memory (staged
/// into one buffer for a rendezvous) and back to back in one buffer (sent
/// as they are; puts merged).
#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_batches_cross_ucx_by_rendezvous_byte_exact() {
    use tandem_kv_transfer::ucx::UcxDataPath;
    use tandem_kv_transfer::{KvDtype, KvLayoutDescriptor};
    // 32 KiB of K and of V per block-layer: a batch of 12 slots is 768 KiB,
    // far above both wires' rendezvous thresholds (20 KiB tcp, 8 KiB sm).
    let l = KvLayoutDescriptor {
        rows: tandem_kv_transfer::KvRows::PerHead,
        num_layers: 2,
        num_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        dtype: KvDtype::F16,
        sliding_window: 0,
        windowed_layers: 0,
    };
    let wires: [(&[(&str, &str)], UcxDataPath); 3] = [
        (&[("TLS", "tcp"), ("NET_DEVICES", "lo")], UcxDataPath::Auto),
        (&[("TLS", "sm")], UcxDataPath::Rendezvous),
        (&[("TLS", "sm")], UcxDataPath::Auto),
    ];
    for (settings, data_path) in wires {
        let transport =
            common::ucx_transport(TOKEN, settings, data_path, 24 * 2 * l.block_layer_bytes());
        let sink = RecordingSink::new(256);
        let (_listener, session) = common::open(&transport, "127.0.0.1:0", l, sink.clone()).await;
        let t = TransferId(9);
        let mut expected = Vec::new();
        for (i, (from, to)) in [(0u32, 3u32), (3, 120), (120, 200), (200, 201), (201, 256)]
            .into_iter()
            .enumerate()
        {
            let blocks: Vec<BlockWrite> = (0..l.num_layers)
                .flat_map(|layer| (from..to).map(move |dst| (layer, dst)))
                .map(|(layer, dst)| block(&l, 9, layer, dst))
                .collect();
            let blocks = if i % 2 == 0 {
                blocks
            } else {
                back_to_back(blocks)
            };
            expected.extend(blocks.clone());
            session.write(t, blocks).await.expect("write");
        }
        finish(session.as_ref(), t).await.expect("finish");
        assert_eq!(sink.finishes(), vec![(t, Ok(()))], "{settings:?}");
        assert_delivered(&sink, t, &expected);
    }
}

/// The same blocks, K₀ V₀ K₁ V₁ … in one buffer, as the prefill worker
/// exports a layer.
#[cfg(feature = "ucx")]
fn back_to_back(blocks: Vec<BlockWrite>) -> Vec<BlockWrite> {
    let whole = bytes::Bytes::from(
        blocks
            .iter()
            .flat_map(|b| b.k.iter().chain(b.v.iter()).copied())
            .collect::<Vec<u8>>(),
    );
    let mut at = 0;
    blocks
        .into_iter()
        .map(|b| {
            let (k, v) = (b.k.len(), b.v.len());
            let out = BlockWrite {
                k: whole.slice(at..at + k),
                v: whole.slice(at + k..at + k + v),
                ..b
            };
            at += k + v;
            out
        })
        .collect()
}
