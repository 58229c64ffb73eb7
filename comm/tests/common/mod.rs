//! Helpers: a world of ranks as threads of this process on 127.0.0.1.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::thread;
use std::time::Duration;

use tandem_comm::{CommConfig, Communicator, Rendezvous, TcpComm};

pub fn localhost() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A short setup timeout keeps a broken test from hanging.
/// Links run over shared memory where the test binary's `SHARED_MEMORY` says.
pub fn config() -> CommConfig {
    CommConfig::default()
        .with_shared_memory(crate::SHARED_MEMORY)
        .with_op_timeout(Duration::from_secs(20))
        .with_setup_timeout(Duration::from_secs(10))
}

/// Builds an `n`-rank world, rank `r` with `config(r)`; returns it by rank.
pub fn world_with(n: usize, config: impl Fn(usize) -> CommConfig + Sync) -> Vec<TcpComm> {
    let rendezvous = Rendezvous::bind(localhost()).expect("bind rendezvous");
    let addr = rendezvous.local_addr().expect("rendezvous address");
    thread::scope(|s| {
        let config = &config;
        let followers: Vec<_> = (1..n)
            .map(|r| {
                s.spawn(move || TcpComm::connect(addr, r, n, config(r)).expect("follower setup"))
            })
            .collect();
        let mut comms = vec![rendezvous.accept(n, config(0)).expect("leader setup")];
        for f in followers {
            comms.push(f.join().expect("follower thread"));
        }
        // Check the links really run on the path the configs ask for: shared
        // memory where both ends enable it (all ranks share this host).
        for c in &comms {
            let r = c.rank();
            let expected = (0..n)
                .filter(|&p| p != r && config(p).shared_memory && config(r).shared_memory)
                .count();
            assert_eq!(
                c.shared_memory_links(),
                expected,
                "rank {r}'s shared-memory links"
            );
        }
        comms
    })
}

pub fn world(n: usize) -> Vec<TcpComm> {
    world_with(n, |_| config())
}

/// Runs `f` on every rank concurrently, one thread per rank; results by rank.
pub fn run<T: Send>(comms: &mut [TcpComm], f: impl Fn(&mut TcpComm) -> T + Sync) -> Vec<T> {
    let f = &f;
    thread::scope(|s| {
        let handles: Vec<_> = comms.iter_mut().map(|c| s.spawn(move || f(c))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}
