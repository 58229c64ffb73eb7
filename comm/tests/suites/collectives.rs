//! The collectives and point-to-point operations on healthy worlds.

use crate::common;
use crate::common::{run, world, world_with};
use tandem_comm::{CommError, Communicator};

/// Rank `r`'s contribution: magnitudes chosen so that the summation order
/// changes the rounded result.
fn contribution(r: usize, len: usize) -> Vec<f32> {
    let scales = [1e8f32, 1.0, -1e8, 0.5, 3e7, -7.25];
    (0..len)
        .map(|k| {
            let s = scales[(r + k) % scales.len()];
            s * (1.0 + (k % 7) as f32 * 0.125) + r as f32 * 1e-3
        })
        .collect()
}

/// The sum in group order, as every member must compute it.
fn sum_in_order(group: &[usize], len: usize) -> Vec<f32> {
    let mut acc = contribution(group[0], len);
    for &r in &group[1..] {
        for (a, b) in acc.iter_mut().zip(contribution(r, len)) {
            *a += b;
        }
    }
    acc
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn all_reduce_sum_is_exact_and_identical_for_2_3_4_ranks() {
    for n in 2..=4 {
        let mut comms = world(n);
        let group: Vec<usize> = (0..n).collect();
        let len = 1000;
        let results = run(&mut comms, |c| {
            let mut buf = contribution(c.rank(), len);
            c.all_reduce_sum(&group, &mut buf).expect("all_reduce");
            buf
        });
        let expected = sum_in_order(&group, len);
        for (r, got) in results.iter().enumerate() {
            assert_eq!(bits(got), bits(&expected), "rank {r} of {n}");
        }
    }
}

#[test]
fn all_reduce_sums_in_group_order() {
    // (1e8 + 1) - 1e8 == 0 in f32; any other order gives 1.
    let mut comms = world(3);
    let results = run(&mut comms, |c| {
        let mut buf = vec![[1e8f32, 1.0, -1e8][c.rank()]];
        c.all_reduce_sum(&[0, 1, 2], &mut buf).expect("all_reduce");
        buf[0]
    });
    assert_eq!(results, vec![0.0, 0.0, 0.0]);
}

#[test]
fn concurrent_subgroup_all_reduces() {
    let mut comms = world(4);
    let len = 4096;
    let results = run(&mut comms, |c| {
        let r = c.rank();
        let first: &[usize] = if r < 2 { &[0, 1] } else { &[2, 3] };
        let mut a = contribution(r, len);
        c.all_reduce_sum(first, &mut a).expect("first all_reduce");
        let second: &[usize] = if r % 2 == 0 { &[0, 2] } else { &[1, 3] };
        let mut b = contribution(r, len);
        c.all_reduce_sum(second, &mut b).expect("second all_reduce");
        (a, b)
    });
    for (r, (a, b)) in results.iter().enumerate() {
        let first: &[usize] = if r < 2 { &[0, 1] } else { &[2, 3] };
        let second: &[usize] = if r % 2 == 0 { &[0, 2] } else { &[1, 3] };
        assert_eq!(bits(a), bits(&sum_in_order(first, len)), "rank {r} first");
        assert_eq!(bits(b), bits(&sum_in_order(second, len)), "rank {r} second");
    }
}

fn large_all_reduce(n: usize) {
    const LEN: usize = 16 << 20; // 16M floats = 64 MiB
    let mut comms = world(n);
    let group: Vec<usize> = (0..n).collect();
    let ok = run(&mut comms, |c| {
        let r = c.rank() as f32;
        let mut buf: Vec<f32> = (0..LEN).map(|k| (k % 1024) as f32 + r).collect();
        c.all_reduce_sum(&group, &mut buf)
            .expect("large all_reduce");
        let base: f32 = (0..n).map(|r| r as f32).sum();
        buf.iter()
            .enumerate()
            .all(|(k, &x)| x == (k % 1024) as f32 * n as f32 + base)
    });
    assert!(ok.iter().all(|&b| b), "{ok:?}");
}

#[test]
fn large_all_reduce_2_ranks() {
    large_all_reduce(2);
}

#[test]
fn large_all_reduce_4_ranks() {
    large_all_reduce(4);
}

#[test]
fn all_reduce_on_a_single_member_group_and_empty_buffer() {
    let mut comms = world(2);
    run(&mut comms, |c| {
        let r = c.rank();
        let mut buf = vec![1.5f32, 2.5];
        c.all_reduce_sum(&[r], &mut buf)
            .expect("single-member group");
        assert_eq!(buf, vec![1.5, 2.5]);
        let mut empty: Vec<f32> = Vec::new();
        c.all_reduce_sum(&[0, 1], &mut empty).expect("empty buffer");
        let mut one = vec![1.0f32];
        c.all_reduce_sum(&[0, 1], &mut one).expect("after empty");
        assert_eq!(one, vec![2.0]);
    });
}

#[test]
fn all_gather_concatenates_in_group_order() {
    let mut comms = world(4);
    let results = run(&mut comms, |c| {
        let r = c.rank();
        let mine: Vec<f32> = (0..5).map(|k| (r * 10 + k) as f32).collect();
        let mut all = vec![0f32; 20];
        c.all_gather(&[0, 1, 2, 3], &mine, &mut all)
            .expect("all_gather");
        // A subgroup, and a large gather that needs the threaded path.
        let group: &[usize] = if r % 2 == 1 { &[1, 3] } else { &[0, 2] };
        let big: Vec<f32> = vec![r as f32; 1 << 20];
        let mut big_out = vec![0f32; 2 << 20];
        c.all_gather(group, &big, &mut big_out)
            .expect("large all_gather");
        let ok = big_out[..1 << 20].iter().all(|&x| x == group[0] as f32)
            && big_out[1 << 20..].iter().all(|&x| x == group[1] as f32);
        let mut none = Vec::new();
        c.all_gather(&[0, 1, 2, 3], &[], &mut none)
            .expect("empty all_gather");
        (all, ok)
    });
    let expected: Vec<f32> = (0..4)
        .flat_map(|r| (0..5).map(move |k| (r * 10 + k) as f32))
        .collect();
    for (all, ok) in results {
        assert_eq!(all, expected);
        assert!(ok);
    }
}

#[test]
fn all_gather_rejects_a_wrong_output_length() {
    let mut comms = world(2);
    let err = comms[0]
        .all_gather(&[0, 1], &[1.0, 2.0], &mut [0.0; 3])
        .expect_err("wrong out length");
    assert!(matches!(err, CommError::Protocol(_)), "{err}");
}

#[test]
fn broadcast_bytes_of_several_sizes_from_a_non_zero_root() {
    let mut comms = world(4);
    let sizes = [0usize, 1, 1000, 100_000, 3 << 20];
    let payload = |size: usize| -> Vec<u8> { (0..size).map(|i| (i * 31 % 251) as u8).collect() };
    let results = run(&mut comms, |c| {
        let mut got = Vec::new();
        for &size in &sizes {
            let mut buf = if c.rank() == 2 {
                payload(size)
            } else {
                vec![0xAA; 7]
            };
            c.broadcast(&[0, 1, 2, 3], 2, &mut buf).expect("broadcast");
            got.push(buf);
        }
        // A subgroup with its last member as root.
        let group: &[usize] = if c.rank() % 2 == 1 { &[1, 3] } else { &[0, 2] };
        let mut buf = if c.rank() == group[1] {
            vec![c.rank() as u8; 10]
        } else {
            Vec::new()
        };
        c.broadcast(group, group[1], &mut buf)
            .expect("subgroup broadcast");
        got.push(buf);
        got
    });
    for (r, got) in results.iter().enumerate() {
        for (i, &size) in sizes.iter().enumerate() {
            assert_eq!(got[i], payload(size), "rank {r}, size {size}");
        }
        let root = if r % 2 == 1 { 3u8 } else { 2 };
        assert_eq!(got[sizes.len()], vec![root; 10], "rank {r} subgroup");
    }
}

#[test]
fn send_recv_keeps_order_in_both_directions() {
    let mut comms = world(3);
    let msg = |from: usize, i: usize| -> Vec<u8> { vec![(from * 100 + i) as u8; i * 20] };
    run(&mut comms, |c| {
        let r = c.rank();
        // 0 -> 1 and 1 -> 0 at the same time, and 2 -> 1.
        match r {
            0 => {
                for i in 0..50 {
                    c.send(1, &msg(0, i)).expect("send");
                }
                for i in 0..50 {
                    assert_eq!(c.recv(1).expect("recv"), msg(1, i));
                }
            }
            1 => {
                for i in 0..50 {
                    c.send(0, &msg(1, i)).expect("send");
                }
                for i in 0..50 {
                    assert_eq!(c.recv(0).expect("recv"), msg(0, i));
                }
                for i in 0..50 {
                    assert_eq!(c.recv(2).expect("recv"), msg(2, i));
                }
            }
            _ => {
                for i in 0..50 {
                    c.send(1, &msg(2, i)).expect("send");
                }
            }
        }
    });
}

#[test]
fn send_f32_recv_f32_round_trip_and_length_mismatch() {
    let mut comms = world(2);
    let results = run(&mut comms, |c| {
        if c.rank() == 0 {
            c.send_f32(1, &[1.0, -2.5, f32::MAX]).expect("send_f32");
            c.send_f32(1, &[1.0; 5]).expect("send_f32");
            None
        } else {
            let mut out = [0f32; 3];
            c.recv_f32(0, &mut out).expect("recv_f32");
            assert_eq!(out, [1.0, -2.5, f32::MAX]);
            let mut short = [0f32; 4];
            let err = c.recv_f32(0, &mut short).expect_err("length mismatch");
            let after = c.recv(0).expect_err("poisoned");
            Some((err, after))
        }
    });
    let Some((err, after)) = &results[1] else {
        panic!("rank 1 returned nothing")
    };
    assert!(matches!(err, CommError::Protocol(_)), "{err}");
    assert!(err.to_string().contains("rank 0"), "{err}");
    assert!(matches!(after, CommError::Poisoned), "{after}");
}

#[test]
fn frames_over_the_limit_are_refused() {
    // Rank 0 may send 1 MiB frames, rank 1 accepts only 1 KiB.
    let mut comms = world_with(2, |r| {
        common::config().with_max_frame_bytes(if r == 0 { 1 << 20 } else { 1024 })
    });
    let err = comms[1]
        .send(0, &[0u8; 2000])
        .expect_err("send over the limit");
    assert!(matches!(err, CommError::Protocol(_)), "{err}");
    comms[0]
        .send(1, &[0u8; 2000])
        .expect("within rank 0's limit");
    let mut comms = world_with(2, |r| {
        common::config().with_max_frame_bytes(if r == 0 { 1 << 20 } else { 1024 })
    });
    comms[0]
        .send(1, &[0u8; 2000])
        .expect("within rank 0's limit");
    let err = comms[1].recv(0).expect_err("recv over the limit");
    assert!(matches!(err, CommError::Protocol(_)), "{err}");
}

#[test]
fn invalid_groups_and_peers_are_refused() {
    let mut comms = world(2);
    let err = comms[0]
        .all_reduce_sum(&[1, 0], &mut [1.0])
        .expect_err("unsorted");
    assert!(matches!(err, CommError::Protocol(_)), "{err}");
    let mut comms = world(2);
    let err = comms[0]
        .all_reduce_sum(&[1], &mut [1.0])
        .expect_err("not a member");
    assert!(matches!(err, CommError::Protocol(_)), "{err}");
    let mut comms = world(2);
    let err = comms[0].send(0, b"x").expect_err("self");
    assert!(matches!(err, CommError::Protocol(_)), "{err}");
    let mut comms = world(2);
    let err = comms[0].send(5, b"x").expect_err("out of range");
    assert!(matches!(err, CommError::Protocol(_)), "{err}");
}

#[test]
fn a_world_of_one() {
    let rendezvous = tandem_comm::Rendezvous::bind(common::localhost()).expect("bind");
    let mut c = rendezvous
        .accept(1, common::config())
        .expect("world of one");
    assert_eq!((c.rank(), c.world_size()), (0, 1));
    let mut buf = vec![3.0f32];
    c.all_reduce_sum(&[0], &mut buf).expect("all_reduce");
    assert_eq!(buf, vec![3.0]);
}
