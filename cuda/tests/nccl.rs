//! `NcclComm` across ranks: one thread per rank, one GPU per rank, bootstrapped
//! over a `TcpComm` on 127.0.0.1.
//!
//! Needs 2 GPUs (3 for the subgroup test) and libnccl: without them every test
//! here says so and passes vacuously. The GPU check is
//! `cargo test --release -p tandem-cuda --features cuda --test nccl` on a lent
//! multi-GPU device (alongside `bench/gpu/run.sh`).
#![cfg(feature = "cuda")]

use std::net::{Ipv4Addr, SocketAddr};
use std::thread;
use std::time::Duration;

use tandem_comm::{CommConfig, Communicator, Rendezvous, TcpComm};
use tandem_cuda::nccl::nccl_available;
use tandem_cuda::{gpu_count, NcclComm};

fn have_gpus(n: usize) -> bool {
    let gpus = gpu_count();
    let nccl = nccl_available();
    if gpus < n || !nccl {
        eprintln!(
            "skipped: needs {n} GPUs (run bench/gpu/… on a lent device): found {gpus} GPU(s), \
             libnccl {}",
            if nccl { "present" } else { "missing" }
        );
        return false;
    }
    true
}

fn config() -> CommConfig {
    CommConfig::default()
        .with_setup_timeout(Duration::from_secs(30))
        .with_op_timeout(Duration::from_secs(30))
}

/// Runs `body(comm)` on `world` ranks (rank r on GPU r) and returns their results in rank order.
fn run_ranks<T: Send + 'static>(
    world: usize,
    body: impl Fn(&mut NcclComm) -> T + Send + Sync + Copy + 'static,
) -> Vec<T> {
    let rendezvous = Rendezvous::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).expect("bind");
    let addr = rendezvous.local_addr().expect("addr");
    let mut handles = Vec::new();
    handles.push(thread::spawn(move || {
        let mut tcp = rendezvous
            .accept(world, config())
            .expect("rank 0 rendezvous");
        let mut comm = NcclComm::new(0, &mut tcp).expect("rank 0 NCCL");
        body(&mut comm)
    }));
    for rank in 1..world {
        handles.push(thread::spawn(move || {
            let mut tcp = TcpComm::connect(addr, rank, world, config()).expect("rendezvous");
            let mut comm = NcclComm::new(rank, &mut tcp).expect("NCCL");
            body(&mut comm)
        }));
    }
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

/// Values whose sum depends on the order of addition.
fn contribution(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as f32 * 0.37 + rank as f32 * 1.91).sin() * 1e4_f32.powi((i % 3) as i32);
            if rank == 1 {
                -x * 0.999
            } else {
                x
            }
        })
        .collect()
}

#[test]
fn all_reduce_sum_is_bit_identical_across_ranks() {
    if !have_gpus(2) {
        return;
    }
    for n in [1usize, 7, 4096, 100_003] {
        let results = run_ranks(2, move |comm| {
            let mut buf = contribution(comm.rank(), n);
            comm.all_reduce_sum(&[0, 1], &mut buf).expect("all_reduce");
            buf.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
        });
        assert_eq!(results[0], results[1], "n = {n}");
        let (a, b) = (contribution(0, n), contribution(1, n));
        for (i, &bits) in results[0].iter().enumerate() {
            let want = a[i] + b[i];
            let got = f32::from_bits(bits);
            assert!(
                (got - want).abs() <= want.abs() * 1e-6 + 1e-6,
                "n = {n}, i = {i}"
            );
        }
    }
}

#[test]
fn all_gather_broadcast_and_point_to_point() {
    if !have_gpus(2) {
        return;
    }
    let results = run_ranks(2, |comm| {
        let rank = comm.rank();
        let mine: Vec<f32> = (0..5).map(|i| (rank * 10 + i) as f32).collect();
        let mut all = vec![0f32; 10];
        comm.all_gather(&[0, 1], &mine, &mut all)
            .expect("all_gather");

        let mut cmd = if rank == 1 {
            b"step 42".to_vec()
        } else {
            Vec::new()
        };
        comm.broadcast(&[0, 1], 1, &mut cmd).expect("broadcast");
        let mut empty = if rank == 0 { Vec::new() } else { vec![9u8; 3] };
        comm.broadcast(&[0, 1], 0, &mut empty)
            .expect("empty broadcast");

        let big: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
        let got = if rank == 0 {
            comm.send(1, b"hello").expect("send");
            comm.send(1, &[]).expect("send empty");
            comm.send(1, &big).expect("send big");
            comm.send_f32(1, &[1.5, -2.25]).expect("send_f32");
            comm.send_f32(1, &[1.0, 2.0, 3.0])
                .expect("send_f32 (mismatched)");
            Vec::new()
        } else {
            let a = comm.recv(0).expect("recv");
            let b = comm.recv_idle(0).expect("recv_idle empty");
            let c = comm.recv(0).expect("recv big");
            assert_eq!(c, big);
            let mut f = [0f32; 2];
            comm.recv_f32(0, &mut f).expect("recv_f32");
            assert_eq!(f, [1.5, -2.25]);
            let mut wrong = [0f32; 2];
            let err = comm.recv_f32(0, &mut wrong).expect_err("length mismatch");
            assert!(err.to_string().contains("expected"), "{err}");
            assert!(comm.is_poisoned());
            vec![a, b]
        };
        (all, cmd, empty, got)
    });
    let want: Vec<f32> = [0., 1., 2., 3., 4., 10., 11., 12., 13., 14.].to_vec();
    for (all, cmd, empty, _) in &results {
        assert_eq!(all, &want);
        assert_eq!(cmd, b"step 42");
        assert!(empty.is_empty());
    }
    assert_eq!(results[1].3, vec![b"hello".to_vec(), Vec::new()]);
}

#[test]
fn subgroups_sum_in_group_order() {
    if !have_gpus(3) {
        return;
    }
    let n = 1000;
    let results = run_ranks(3, move |comm| {
        let rank = comm.rank();
        let group: &[usize] = if rank == 1 { &[1] } else { &[0, 2] };
        let mut buf = contribution(rank, n);
        comm.all_reduce_sum(group, &mut buf)
            .expect("subgroup all_reduce");
        let mut all = vec![0f32; group.len() * 2];
        comm.all_gather(group, &[rank as f32, 0.5], &mut all)
            .expect("subgroup all_gather");
        let mut msg = if rank == 2 {
            b"from 2".to_vec()
        } else {
            Vec::new()
        };
        comm.broadcast(group, group[group.len() - 1], &mut msg)
            .expect("subgroup broadcast");
        (buf, all, msg)
    });
    let (a, c) = (contribution(0, n), contribution(2, n));
    let want: Vec<u32> = a.iter().zip(&c).map(|(x, y)| (x + y).to_bits()).collect();
    for r in [0, 2] {
        let got: Vec<u32> = results[r].0.iter().map(|x| x.to_bits()).collect();
        assert_eq!(
            got, want,
            "rank {r}: the TCP path's group-order sum, bit for bit"
        );
        assert_eq!(results[r].1, vec![0.0, 0.5, 2.0, 0.5]);
        assert_eq!(results[r].2, b"from 2");
    }
    assert_eq!(results[1].0, contribution(1, n));
}
