//! A leader and its followers over the real TCP communicator (ranks as
//! threads of this test; `cli/tests/parallel.rs` runs them as processes):
//! the same logits as the whole model, KV blocks that cross the seam whole,
//! and a lost rank that fails the backend for good instead of hanging.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use tandem_engine::serving::KvPoolSize;
use tandem_engine::{
    BlockAllocator, BlockTable, ComputeBackend, CpuBackend, DType, KvBlocks, Logits, Model,
    SeqInput,
};
use tandem_parallel::{
    run_follower, CommConfig, LeaderOptions, ParallelBackend, Parallelism, Rendezvous, TcpComm,
};

const BLOCKS: usize = 32;

/// One layer of one block: K and V.
type BlockPair = (Vec<f32>, Vec<f32>);
const BS: usize = 4;

fn checkpoint(preset: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_engine::synth::preset(preset)
        .expect("preset")
        .write(tmp.path(), 3, DType::F32)
        .expect("write");
    tmp
}

fn config() -> CommConfig {
    CommConfig::default()
        .with_op_timeout(Duration::from_secs(20))
        .with_setup_timeout(Duration::from_secs(20))
}

/// Starts `par.world() - 1` follower threads and the leader backend.
fn start(
    dir: &Path,
    par: Parallelism,
) -> (
    ParallelBackend,
    Vec<std::thread::JoinHandle<Result<(), String>>>,
) {
    let rv = Rendezvous::bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
    let addr: SocketAddr = rv.local_addr().expect("addr");
    let followers = (1..par.world())
        .map(|rank| {
            let dir = dir.to_path_buf();
            std::thread::spawn(move || {
                let comm = TcpComm::connect(addr, rank, par.world(), config())
                    .map_err(|e| e.to_string())?;
                run_follower(&dir, par, Box::new(comm)).map_err(|e| e.to_string())
            })
        })
        .collect();
    let comm = rv.accept(par.world(), config()).expect("accept");
    let mut opts = LeaderOptions::new(par, KvPoolSize::Blocks(BLOCKS));
    opts.block_size = BS;
    let leader = ParallelBackend::start(dir, opts, Box::new(comm)).expect("leader");
    (leader, followers)
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (seed * 31 + i * 7) % 500).collect()
}

fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i as u32)
}

/// Three prompts, then `steps` greedy decode steps, all batched; returns
/// every step's logits and the blocks of layer `l` of the first prompt as
/// the export hook read them after the prefill.
fn greedy(backend: &mut dyn ComputeBackend, steps: usize) -> (Vec<Vec<f32>>, Vec<BlockPair>) {
    let pool = BlockAllocator::new(BLOCKS, BS).expect("pool");
    let mut seqs: Vec<Vec<u32>> = vec![prompt(1, 11), prompt(2, 5), prompt(3, 8)];
    let mut tables: Vec<BlockTable> = seqs.iter().map(|_| BlockTable::new(&pool)).collect();
    let mut computed = vec![0usize; seqs.len()];
    let mut all = Vec::new();
    let mut exported = Vec::new();
    for step in 0..=steps {
        for ((t, s), c) in tables.iter_mut().zip(&seqs).zip(&computed) {
            t.append(s.len() - c).expect("blocks");
        }
        let inputs: Vec<SeqInput<'_>> = seqs
            .iter()
            .zip(&tables)
            .zip(&computed)
            .map(|((s, t), &c)| SeqInput {
                tokens: &s[c..],
                start_pos: c,
                blocks: t.blocks(),
                all_logits: false,
                lora: None,
            })
            .collect();
        let first_blocks: Vec<u32> = tables[0].blocks().to_vec();
        let mut hook = |layer: usize, kv: &dyn KvBlocks| {
            if step == 0 {
                for &b in &first_blocks {
                    let (k, v) = kv.read_block(layer, b).expect("read");
                    exported.push((k.into_owned(), v.into_owned()));
                }
            }
        };
        let logits: Logits = backend.forward(&inputs, &mut hook).expect("forward");
        drop(inputs);
        for (i, s) in seqs.iter_mut().enumerate() {
            computed[i] = s.len();
            s.push(argmax(logits.last(i)));
            all.push(logits.last(i).to_vec());
        }
    }
    (all, exported)
}

fn log_softmax(rows: &[Vec<f32>]) -> Vec<Vec<f32>> {
    rows.iter()
        .map(|r| {
            let mut r = r.clone();
            tandem_engine::kernels::log_softmax(&mut r);
            r
        })
        .collect()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

#[test]
fn tp_pp_and_both_give_the_whole_models_logits_and_blocks() {
    for preset in ["tiny", "tiny-mqa"] {
        let tmp = checkpoint(preset);
        let model = Model::load(tmp.path()).expect("load");
        let mut whole = CpuBackend::new(model, BS, BLOCKS);
        let (want, want_blocks) = greedy(&mut whole, 6);
        for (tp, pp) in [(2, 1), (1, 2), (2, 2)] {
            let (mut leader, followers) = start(tmp.path(), Parallelism::tp_pp(tp, pp));
            let (got, got_blocks) = greedy(&mut leader, 6);
            let d = max_diff(&want, &got);
            assert!(d < 1e-4, "{preset} tp={tp} pp={pp}: logits differ by {d}");
            let lp = max_diff(&log_softmax(&want), &log_softmax(&got));
            assert!(
                lp < 1e-4,
                "{preset} tp={tp} pp={pp}: logprobs differ by {lp}"
            );
            let greedy_tokens =
                |rows: &[Vec<f32>]| rows.iter().map(|r| argmax(r)).collect::<Vec<_>>();
            assert_eq!(
                greedy_tokens(&want),
                greedy_tokens(&got),
                "{preset} tp={tp} pp={pp}"
            );
            let blocks_d = want_blocks
                .iter()
                .zip(&got_blocks)
                .flat_map(|((wk, wv), (gk, gv))| {
                    wk.iter()
                        .chain(wv)
                        .zip(gk.iter().chain(gv))
                        .map(|(a, b)| (a - b).abs())
                })
                .fold(0.0f32, f32::max);
            assert_eq!(want_blocks.len(), got_blocks.len());
            assert!(
                blocks_d < 1e-4,
                "{preset} tp={tp} pp={pp}: exported K/V differ by {blocks_d}"
            );
            let stats = leader.comm_stats();
            if tp > 1 {
                assert!(stats.all_reduces > 0, "{stats:?}");
            }
            drop(leader);
            for f in followers {
                f.join()
                    .expect("follower thread")
                    .expect("follower ends on Shutdown");
            }
        }
    }
}

/// A block written whole (as a KV transfer delivers it) lands re-sliced on
/// the ranks: decoding on from written blocks gives the same logits.
#[test]
fn whole_blocks_written_into_a_split_pool_decode_the_same() {
    let tmp = checkpoint("tiny");
    let model = Model::load(tmp.path()).expect("load");
    let mut whole = CpuBackend::new(model, BS, BLOCKS);
    let pool = BlockAllocator::new(BLOCKS, BS).expect("pool");
    let p = prompt(4, 10);
    let mut table = BlockTable::new(&pool);
    table.append(p.len() + 1).expect("blocks");
    let mut blocks = Vec::new();
    let prefill = SeqInput {
        tokens: &p,
        start_pos: 0,
        blocks: table.blocks(),
        all_logits: false,
        lora: None,
    };
    let logits = whole
        .forward(&[prefill], &mut |layer, kv: &dyn KvBlocks| {
            for &b in table.blocks() {
                let (k, v) = kv.read_block(layer, b).expect("read");
                blocks.push((layer, b, k.into_owned(), v.into_owned()));
            }
        })
        .expect("prefill");
    let next = [argmax(logits.last(0))];
    let step = SeqInput {
        tokens: &next,
        start_pos: p.len(),
        blocks: table.blocks(),
        all_logits: false,
        lora: None,
    };
    let want = whole.forward(&[step], &mut |_, _| {}).expect("decode");
    for (tp, pp) in [(2, 1), (2, 2)] {
        let (mut leader, followers) = start(tmp.path(), Parallelism::tp_pp(tp, pp));
        for (layer, b, k, v) in &blocks {
            leader.write_block(*layer, *b, k, v).expect("write");
        }
        let got = leader.forward(&[step], &mut |_, _| {}).expect("decode");
        let d = max_diff(&[want.last(0).to_vec()], &[got.last(0).to_vec()]);
        assert!(d < 1e-4, "tp={tp} pp={pp}: {d}");
        assert!(
            leader.write_block(0, 0, &[1.0], &[1.0]).is_err(),
            "wrong size"
        );
        assert!(
            leader
                .write_block(9, 0, &blocks[0].2, &blocks[0].3)
                .is_err(),
            "no layer 9"
        );
        assert!(leader.failure().is_none(), "bad input is not a lost rank");
        drop(leader);
        for f in followers {
            f.join().expect("thread").expect("clean end");
        }
    }
}

/// A follower that disappears fails the next step within seconds, and the
/// backend stays failed (it never hangs, never half-works).
#[test]
fn a_lost_rank_fails_the_backend_for_good() {
    let tmp = checkpoint("tiny");
    let par = Parallelism::tp_pp(2, 1);
    let rv = Rendezvous::bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
    let addr = rv.local_addr().expect("addr");
    // A "rank" that joins, answers Setup, then dies.
    let dying = std::thread::spawn(move || {
        let mut comm = TcpComm::connect(addr, 1, 2, config()).expect("connect");
        use tandem_parallel::Communicator;
        let _setup = comm.recv_idle(0).expect("setup");
        comm.send(0, &[0]).expect("ready");
        drop(comm);
    });
    let comm = rv.accept(2, config()).expect("accept");
    let mut opts = LeaderOptions::new(par, KvPoolSize::Blocks(BLOCKS));
    opts.block_size = BS;
    let mut leader = ParallelBackend::start(tmp.path(), opts, Box::new(comm)).expect("leader");
    dying.join().expect("thread");
    let pool = BlockAllocator::new(BLOCKS, BS).expect("pool");
    let mut table = BlockTable::new(&pool);
    table.append(5).expect("blocks");
    let toks = prompt(1, 5);
    let input = SeqInput {
        tokens: &toks,
        start_pos: 0,
        blocks: table.blocks(),
        all_logits: false,
        lora: None,
    };
    let t = Instant::now();
    let err = leader
        .forward(&[input], &mut |_, _| {})
        .expect_err("rank 1 is gone");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert!(err.to_string().contains("rank"), "{err}");
    assert!(leader.failure().is_some());
    assert!(
        leader.forward(&[input], &mut |_, _| {}).is_err(),
        "stays failed"
    );
}
