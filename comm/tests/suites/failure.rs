//! The failure model: lost peers and timeouts surface quickly, and a failed
//! communicator fails every later call instead of hanging.

use std::thread;
use std::time::{Duration, Instant};

use crate::common;
use crate::common::{config, world, world_with};
use tandem_comm::{CommError, Communicator, TcpComm};

/// Ranks 0..3 all-reduce `len` floats while rank 3 drops its communicator
/// (a killed rank) instead of joining.
fn killed_rank_mid_all_reduce(len: usize) {
    let comms = world(4);
    let start = Instant::now();
    let results: Vec<(Result<(), CommError>, Duration, CommError)> = thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                s.spawn(move || {
                    if c.rank() == 3 {
                        thread::sleep(Duration::from_millis(200));
                        drop(c);
                        return None;
                    }
                    let mut buf = vec![1.0f32; len];
                    let r = c.all_reduce_sum(&[0, 1, 2, 3], &mut buf);
                    let took = start.elapsed();
                    let after = c
                        .all_reduce_sum(&[0, 1, 2, 3], &mut buf)
                        .expect_err("after");
                    Some((r, took, after))
                })
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().expect("rank thread"))
            .collect()
    });
    assert_eq!(results.len(), 3);
    for (rank, (r, took, after)) in results.into_iter().enumerate() {
        match r {
            Err(CommError::PeerLost { .. }) => {}
            other => panic!("rank {rank}: expected PeerLost, got {other:?}"),
        }
        assert!(took < Duration::from_secs(5), "rank {rank} took {took:?}");
        assert!(matches!(after, CommError::Poisoned), "rank {rank}: {after}");
    }
}

#[test]
fn killed_rank_mid_small_all_reduce_is_peer_lost() {
    killed_rank_mid_all_reduce(1024);
}

#[test]
fn killed_rank_mid_large_all_reduce_is_peer_lost() {
    killed_rank_mid_all_reduce(8 << 20);
}

fn short_op() -> tandem_comm::CommConfig {
    config().with_op_timeout(Duration::from_millis(300))
}

#[test]
fn silent_peer_times_out_and_poisons() {
    let mut comms = world_with(2, |_| short_op());
    let mut silent = comms.pop().expect("rank 1");
    let mut c = comms.pop().expect("rank 0");
    let start = Instant::now();
    let err = c
        .all_reduce_sum(&[0, 1], &mut [1.0; 16])
        .expect_err("timeout");
    let took = start.elapsed();
    match err {
        CommError::Timeout { peer: 1, after } => assert_eq!(after, Duration::from_millis(300)),
        other => panic!("expected Timeout from rank 1, got {other}"),
    }
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(2),
        "{took:?}"
    );
    // Every later call fails fast.
    let start = Instant::now();
    assert!(matches!(c.recv(1), Err(CommError::Poisoned)));
    assert!(matches!(c.send(1, b"x"), Err(CommError::Poisoned)));
    assert!(matches!(c.recv_idle(1), Err(CommError::Poisoned)));
    assert!(matches!(
        c.broadcast(&[0, 1], 0, &mut vec![1]),
        Err(CommError::Poisoned)
    ));
    assert!(start.elapsed() < Duration::from_millis(100));
    // The silent rank learns of it too: rank 0 closed its links when it failed
    // (its all_reduce contribution arrived first and is read, then EOF).
    let mut buf = [1.0f32; 16];
    let err = silent.all_reduce_sum(&[0, 1], &mut buf).err();
    assert!(
        matches!(err, Some(CommError::PeerLost { peer: 0, .. })) || err.is_none(),
        "{err:?}"
    );
    assert!(silent.recv(0).is_err());
}

#[test]
fn recv_times_out() {
    let mut comms = world_with(2, |_| short_op());
    let start = Instant::now();
    let err = comms[0].recv(1).expect_err("timeout");
    assert!(matches!(err, CommError::Timeout { peer: 1, .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(matches!(comms[0].recv(1), Err(CommError::Poisoned)));
}

#[test]
fn send_to_a_peer_that_never_reads_times_out() {
    let mut comms = world_with(2, |_| short_op());
    let start = Instant::now();
    let err = comms[0]
        .send(1, &vec![0u8; 64 << 20])
        .expect_err("the peer never reads");
    assert!(matches!(err, CommError::Timeout { peer: 1, .. }), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn recv_idle_waits_past_the_op_timeout_then_sees_the_peer_go() {
    let mut comms = world_with(2, |_| short_op());
    let peer: TcpComm = comms.pop().expect("rank 1");
    let mut c = comms.pop().expect("rank 0");
    let peer_thread = thread::spawn(move || {
        let mut peer = peer;
        thread::sleep(Duration::from_millis(800));
        peer.send(0, b"next command").expect("send");
        thread::sleep(Duration::from_millis(300));
        drop(peer);
    });
    let msg = c.recv_idle(1).expect("recv_idle outlasts op_timeout");
    assert_eq!(msg, b"next command");
    let start = Instant::now();
    let err = c.recv_idle(1).expect_err("peer gone");
    assert!(matches!(err, CommError::PeerLost { peer: 1, .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2));
    peer_thread.join().expect("peer thread");
}

#[test]
fn a_failure_spreads_to_the_other_ranks_quickly() {
    // Rank 1 fails a protocol check; ranks 0 and 2, waiting in an all_reduce
    // with it, see PeerLost well before their 20 s operation timeout.
    let mut comms = world(3);
    let start = Instant::now();
    let results = common::run(&mut comms, |c| {
        if c.rank() == 1 {
            let _ = c.all_gather(&[0, 1, 2], &[1.0], &mut [0.0; 2]);
        } else {
            let err = c
                .all_reduce_sum(&[0, 1, 2], &mut [1.0; 8])
                .expect_err("spread");
            assert!(matches!(err, CommError::PeerLost { .. }), "{err}");
        }
        start.elapsed()
    });
    for took in results {
        assert!(took < Duration::from_secs(5), "{took:?}");
    }
}
