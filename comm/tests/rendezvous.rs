//! Setup: bad rendezvous inputs fail with `Setup` errors, quickly, everywhere.

/// Setup is the same on both paths; links may use shared memory.
const SHARED_MEMORY: bool = true;

mod common;

use std::net::TcpListener;
use std::thread;
use std::time::{Duration, Instant};

use common::localhost;
use tandem_comm::{CommConfig, CommError, Communicator, Rendezvous, TcpComm};

fn short() -> CommConfig {
    CommConfig::default()
        .with_op_timeout(Duration::from_secs(5))
        .with_setup_timeout(Duration::from_secs(3))
}

fn assert_setup(r: &Result<TcpComm, CommError>, what: &str) {
    match r {
        Err(CommError::Setup(_)) => {}
        Err(e) => panic!("{what}: expected a Setup error, got {e}"),
        Ok(_) => panic!("{what}: expected a Setup error, got a communicator"),
    }
}

/// Runs a leader for `world` ranks and followers `(rank, world)`; returns
/// the leader's result, the followers' results and how long it all took.
fn attempt(
    world: usize,
    followers: &[(usize, usize)],
) -> (
    Result<TcpComm, CommError>,
    Vec<Result<TcpComm, CommError>>,
    Duration,
) {
    let start = Instant::now();
    let rendezvous = Rendezvous::bind(localhost()).expect("bind");
    let addr = rendezvous.local_addr().expect("address");
    thread::scope(|s| {
        let handles: Vec<_> = followers
            .iter()
            .map(|&(rank, w)| s.spawn(move || TcpComm::connect(addr, rank, w, short())))
            .collect();
        let leader = rendezvous.accept(world, short());
        let results = handles
            .into_iter()
            .map(|h| h.join().expect("follower thread"))
            .collect();
        (leader, results, start.elapsed())
    })
}

#[test]
fn duplicate_rank_fails_setup_everywhere() {
    let (leader, followers, took) = attempt(3, &[(1, 3), (1, 3)]);
    assert_setup(&leader, "leader");
    let msg = leader.expect_err("leader").to_string();
    assert!(msg.contains("duplicate rank 1"), "{msg}");
    for (i, f) in followers.iter().enumerate() {
        assert_setup(f, &format!("follower {i}"));
    }
    assert!(took < Duration::from_secs(2), "took {took:?}");
}

#[test]
fn mismatched_world_size_fails_setup_everywhere() {
    let (leader, followers, took) = attempt(3, &[(1, 3), (2, 4)]);
    assert_setup(&leader, "leader");
    let msg = leader.expect_err("leader").to_string();
    assert!(msg.contains("world size mismatch"), "{msg}");
    for (i, f) in followers.iter().enumerate() {
        assert_setup(f, &format!("follower {i}"));
    }
    assert!(took < Duration::from_secs(2), "took {took:?}");
}

#[test]
fn rank_out_of_range_is_refused() {
    let addr = localhost();
    assert_setup(&TcpComm::connect(addr, 3, 3, short()), "rank == world");
    assert_setup(&TcpComm::connect(addr, 0, 3, short()), "rank 0 as follower");
    // A follower whose own world is larger than the leader's: the leader refuses.
    let (leader, followers, _) = attempt(2, &[(5, 6)]);
    assert_setup(&leader, "leader");
    assert_setup(&followers[0], "follower");
}

#[test]
fn missing_rank_times_out_setup_everywhere() {
    let start = Instant::now();
    let (leader, followers, took) = attempt(3, &[(1, 3)]);
    assert_setup(&leader, "leader");
    assert_setup(&followers[0], "follower");
    assert!(took >= Duration::from_secs(3), "took {took:?}");
    assert!(start.elapsed() < Duration::from_secs(6), "took {took:?}");
}

#[test]
fn follower_without_leader_gives_up_after_setup_timeout() {
    let port = {
        let l = TcpListener::bind(localhost()).expect("bind");
        l.local_addr().expect("address")
    };
    let start = Instant::now();
    let config = short().with_setup_timeout(Duration::from_millis(300));
    assert_setup(&TcpComm::connect(port, 1, 2, config), "no leader");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn follower_started_before_the_leader_retries() {
    let addr = {
        let l = TcpListener::bind(localhost()).expect("bind");
        l.local_addr().expect("address")
    };
    let follower = thread::spawn(move || TcpComm::connect(addr, 1, 2, short()));
    thread::sleep(Duration::from_millis(300));
    let rendezvous = Rendezvous::bind(addr).expect("bind the freed port");
    let mut leader = rendezvous.accept(2, short()).expect("leader");
    let mut follower = follower.join().expect("thread").expect("follower");
    leader.send(1, b"hi").expect("send");
    assert_eq!(follower.recv(0).expect("recv"), b"hi");
}

#[test]
fn mixed_shared_memory_settings_fall_back_to_tcp_per_link() {
    // Rank 1 turns shared memory off: its links use TCP, 0 <-> 2 uses shm
    // (world_with checks the per-link choice); collectives work across both.
    let mut comms = common::world_with(3, |r| common::config().with_shared_memory(r != 1));
    let sums = common::run(&mut comms, |c| {
        let mut buf = vec![c.rank() as f32 + 1.0; 100_000];
        c.all_reduce_sum(&[0, 1, 2], &mut buf).expect("all_reduce");
        buf.iter().all(|&x| x == 6.0)
    });
    assert_eq!(sums, vec![true; 3]);
}
