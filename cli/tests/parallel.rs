//! `--tp` / `--pp` workers as real processes (the leader starts its ranks
//! with `tandem rank`): the same greedy tokens as one process, disaggregated
//! pools with different splits, and a killed rank that takes its worker out
//! cleanly.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tandem_tests::cluster::{greedy, Outcome, Started};

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

/// `tandem serve` on the built-in model split `tp × pp`.
fn serve(tp: usize, pp: usize) -> Started {
    let (tp, pp) = (tp.to_string(), pp.to_string());
    tandem_tests::cluster::start(
        tandem(),
        &[
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--num-kv-blocks",
            "512",
            "--batch-invariant",
            "--tp",
            &tp,
            "--pp",
            &pp,
        ],
    )
}

/// Prompts of 9..~120 tokens (a long one goes to a prefill worker).
fn prompts() -> Vec<Vec<u32>> {
    [9usize, 40, 120]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..n as u32)
                .map(|t| (t * 13 + i as u32 * 101 + 7) % 900 + 3)
                .collect()
        })
        .collect()
}

fn run_all(addr: &str) -> Vec<Outcome> {
    let rt = tandem_tests::cluster::runtime();
    rt.block_on(async {
        let mut out = Vec::new();
        for p in prompts() {
            out.push(greedy(addr, p, 24).await.expect("greedy call"));
        }
        out
    })
}

fn tokens(o: &[Outcome]) -> Vec<Vec<u32>> {
    o.iter().map(|x| x.tokens.clone()).collect()
}

#[test]
fn tensor_and_pipeline_parallel_workers_give_the_same_greedy_tokens() {
    let want = {
        let one = serve(1, 1);
        tokens(&run_all(&one.addr))
    };
    assert!(want.iter().all(|t| t.len() == 24));
    for (tp, pp) in [(2, 1), (1, 2), (2, 2)] {
        let split = serve(tp, pp);
        assert_eq!(tokens(&run_all(&split.addr)), want, "tp={tp} pp={pp}");
    }
}

/// `tandem up` with one prefill and one decode worker, each pool with its
/// own split, every long prompt prefilled remotely.
fn up(prefill_arg: &str, decode_arg: &str) -> Started {
    tandem_tests::cluster::start(
        tandem(),
        &[
            "up",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--addr",
            "127.0.0.1:0",
            "--no-http",
            "--kv-cache-memory",
            "32MiB",
            "--remote-prefill-threshold",
            "16",
            "--worker-arg=--batch-invariant",
            prefill_arg,
            decode_arg,
        ],
    )
}

#[test]
fn prefill_and_decode_pools_with_different_tensor_parallelism_agree() {
    let want = {
        let one = serve(1, 1);
        tokens(&run_all(&one.addr))
    };
    for (p, d) in [
        ("--prefill-arg=--tp=2", "--decode-arg=--tp=1"),
        ("--prefill-arg=--tp=1", "--decode-arg=--tp=2"),
    ] {
        let cluster = up(p, d);
        let got = run_all(&cluster.addr);
        assert!(
            got[1..].iter().all(|o| o.prefill.is_some()),
            "{p} {d}: the long prompts were prefilled remotely: {got:?}"
        );
        assert_eq!(tokens(&got), want, "{p} {d}");
    }
}

/// The pids of `pid`'s children (from `/proc`).
fn children(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|stat| {
                // `pid (comm) state ppid ...`; comm may hold spaces.
                stat.rsplit_once(") ")
                    .and_then(|(_, rest)| rest.split(' ').nth(1))
                    .and_then(|ppid| ppid.parse::<u32>().ok())
                    == Some(pid)
            })
        })
        .collect()
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

#[test]
fn killing_one_rank_takes_its_worker_out_and_requests_go_on_elsewhere() {
    kill_one_rank(&[], "--decode-arg=--tp=2");
}

/// The same for an expert-parallel worker of a mixture of experts.
#[test]
fn killing_an_expert_parallel_rank_takes_its_worker_out() {
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_tests::cluster::gen_model(tandem(), tmp.path(), "tiny-moe");
    let model = tmp.path().to_str().expect("utf8");
    kill_one_rank(&["--model", model], "--decode-arg=--ep=2");
}

/// Two decode workers, the first split over two ranks by `split_arg`: one
/// of its ranks is killed mid-call; the worker fails its calls cleanly or
/// they migrate, it leaves etcd, and the survivor serves what follows.
fn kill_one_rank(model_args: &[&str], split_arg: &str) {
    let mut args = vec![
        "up",
        "--prefill",
        "0",
        "--decode",
        "2",
        "--addr",
        "127.0.0.1:0",
        "--no-http",
        "--kv-cache-memory",
        "32MiB",
        split_arg,
    ];
    args.extend(model_args);
    let cluster = tandem_tests::cluster::start(tandem(), &args);
    let victim = cluster.decode[0].clone();
    let survivor = cluster.decode[1].clone();
    let leader = cluster.pids[&victim];
    let ranks = children(leader);
    assert_eq!(
        ranks.len(),
        1,
        "one follower rank under {leader}: {ranks:?}"
    );
    let rt = tandem_tests::cluster::runtime();
    rt.block_on(async {
        // Long calls in flight when a rank of the first worker dies, one
        // more every 100 ms until the victim runs one: the router's ties
        // are a hash of the prompt and the workers' addresses, so the
        // first calls may all land on the survivor.
        let addr = cluster.addr.clone();
        let mut calls = Vec::new();
        // Kill while the victim is decoding a call: a leader with no work
        // only finds a dead rank at its next step (the next request it is
        // sent), and a fixed sleep raced the call's end on a fast machine.
        let busy_by = Instant::now() + Duration::from_secs(10);
        let mut sent_at = Instant::now() - Duration::from_secs(1);
        while tandem_tests::cluster::load(&victim).await.running == 0 {
            assert!(Instant::now() < busy_by, "the victim never got a call");
            if sent_at.elapsed() >= Duration::from_millis(100) && calls.len() < 16 {
                let (addr, i) = (addr.clone(), calls.len() as u32);
                calls.push(tokio::spawn(async move {
                    greedy(&addr, vec![5 + i, 17, 29, 41], 300).await
                }));
                sent_at = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let killed_at = Instant::now();
        Command::new("kill")
            .args(["-KILL", &ranks[0].to_string()])
            .status()
            .expect("kill");
        // The leader notices at its next step, fails its requests, leaves
        // etcd and exits. A small model can finish its call between the
        // check above and the kill, leaving the leader idle: a short call
        // every 200 ms gives it that next step (least-loaded routing sends
        // some of them to the victim).
        let mut probes = Vec::new();
        let mut probed_at = Instant::now();
        while alive(leader) {
            assert!(
                killed_at.elapsed() < Duration::from_secs(10),
                "the worker with a dead rank is still running after 10 s"
            );
            if probed_at.elapsed() > Duration::from_millis(200) {
                let addr = addr.clone();
                probes.push(tokio::spawn(async move {
                    greedy(&addr, vec![7, 8, 9], 2).await
                }));
                probed_at = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for p in probes {
            // A probe is served (by either worker) or ends with a status.
            let _ = tokio::time::timeout(Duration::from_secs(30), p)
                .await
                .expect("probe ended");
        }
        let gone_after = killed_at.elapsed();
        eprintln!("worker {victim} exited {gone_after:?} after its rank was killed");
        for c in calls {
            // Each call either migrated to the surviving worker and got all
            // its tokens, or ended with a status; none hangs.
            match tokio::time::timeout(Duration::from_secs(60), c)
                .await
                .expect("the call ended")
                .expect("task")
            {
                Ok(o) => assert_eq!(o.tokens.len(), 300, "{o:?}"),
                Err(s) => assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}"),
            }
        }
        // New calls all go to the survivor.
        for i in 0..6u32 {
            let o = greedy(&addr, vec![3, 4, i], 4).await.expect("served");
            assert_eq!(o.decode.as_deref(), Some(survivor.as_str()));
        }
    });
}
