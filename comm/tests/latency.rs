//! Rough all-reduce latency between 2 ranks on loopback. Prints numbers, asserts
//! nothing about them:
//! `cargo test -p tandem-comm --release --test latency -- --ignored --nocapture`

/// Setup is the same on both paths; links may use shared memory.
const SHARED_MEMORY: bool = true;

mod common;

use std::time::Instant;

use tandem_comm::Communicator;

#[test]
#[ignore = "a measurement, not a test"]
fn all_reduce_latency() {
    for (ranks, shm) in [(2usize, false), (2, true), (4, false), (4, true)] {
        let mut comms = common::world_with(ranks, |_| common::config().with_shared_memory(shm));
        let path = if shm { "shm" } else { "tcp" };
        let group: Vec<usize> = (0..ranks).collect();
        for bytes in [
            1usize << 10,
            15 << 10,
            17 << 10,
            64 << 10,
            1 << 20,
            16 << 20,
        ] {
            let iters = if bytes <= 64 << 10 {
                2000
            } else if bytes <= 1 << 20 {
                200
            } else {
                20
            };
            let times = common::run(&mut comms, |c| {
                let mut buf = vec![1.0f32; bytes / 4];
                for _ in 0..iters / 10 {
                    c.all_reduce_sum(&group, &mut buf).expect("warm-up");
                }
                let start = Instant::now();
                for _ in 0..iters {
                    c.all_reduce_sum(&group, &mut buf).expect("all_reduce");
                }
                start.elapsed() / iters as u32
            });
            println!(
                "all_reduce_sum {path} {ranks} ranks {:>6} KiB: {:?} per call (rank 0)",
                bytes >> 10,
                times[0]
            );
        }
    }
}
