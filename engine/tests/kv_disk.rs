//! The disk tier under the KV pool: a prefix the pool evicted, or a
//! restarted engine never computed, comes back from disk with the tokens a
//! cold run gives; corrupt block files are recomputed, never loaded. Every
//! step checks the block books.

use std::path::Path;

use tandem_engine::serving::{
    DiskTier, DiskTierConfig, EngineConfig, EngineCore, KvPoolSize, Prompt, Request, RequestEvent,
};
use tandem_engine::{synth, Checkpoint, DType};
use tokio::sync::mpsc::unbounded_channel;

const BLOCK: usize = 16;

fn checkpoint() -> (tempfile::TempDir, Checkpoint) {
    checkpoint_of("tiny")
}

fn checkpoint_of(preset: &str) -> (tempfile::TempDir, Checkpoint) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cfg = synth::SynthConfig {
        max_position_embeddings: 1024,
        ..synth::preset(preset).expect("preset")
    };
    cfg.write(tmp.path(), 5, DType::F32).expect("write");
    let ck = Checkpoint::open(tmp.path()).expect("open");
    (tmp, ck)
}

/// An engine with a 40-block pool (two 17-block prompts fit, three do
/// not), with a disk tier in `disk` if given.
fn engine(ck: &Checkpoint, disk: Option<&Path>) -> EngineCore {
    let model = tandem_engine::Model::load(&ck.dir).expect("load");
    let config = EngineConfig {
        kv_pool: KvPoolSize::Blocks(40),
        ..EngineConfig::default()
    };
    let mut core = EngineCore::new(model, None, ck.eos_token_ids.clone(), &config).expect("core");
    if let Some(dir) = disk {
        let cfg = DiskTierConfig::new(dir, 1 << 30, 77, core.disk_block_values());
        let tier = DiskTier::open(cfg).expect("disk tier");
        core.enable_disk_tier(tier).expect("enable");
    }
    core
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..16 * BLOCK as u32 + 5)
        .map(|i| (i * 7 + seed * 131 + 1) % 250)
        .collect()
}

/// What a request produced: its tokens, with their logprobs.
#[derive(Debug)]
struct Tokens(Vec<(u32, f32)>);

/// Equal tokens, logprobs within 1e-4 (the cold run computed the prompt's
/// end in a bigger batch). Restored K/V that were wrong would move them far
/// more: zeroing them moves the first by whole units.
impl PartialEq for Tokens {
    fn eq(&self, other: &Self) -> bool {
        self.0.len() == other.0.len()
            && self
                .0
                .iter()
                .zip(&other.0)
                .all(|(a, b)| a.0 == b.0 && (a.1 - b.1).abs() < 1e-4)
    }
}

/// Runs one greedy 6-token request to the end: its tokens and how many
/// prompt tokens it found cached.
fn run(core: &mut EngineCore, prompt: Vec<u32>) -> (Tokens, usize) {
    let (tx, mut rx) = unbounded_channel();
    let mut req = Request::new(Prompt::Tokens(prompt), 6);
    req.ignore_eos = true;
    req.sampling.logprobs = Some(0);
    core.add_request(0, req, tx).expect("valid");
    let (mut tokens, mut cached) = (Vec::new(), None);
    for step in 0..10_000 {
        if !core.has_work() {
            break;
        }
        core.step();
        if let Err(e) = core.check_accounting() {
            panic!("block books broken after step {step}: {e}");
        }
    }
    while let Ok(ev) = rx.try_recv() {
        match ev {
            RequestEvent::Delta(d) => tokens.extend(
                d.token_ids
                    .iter()
                    .zip(&d.logprobs)
                    .map(|(&t, l)| (t, l.logprob)),
            ),
            RequestEvent::Finished(s) => cached = Some(s.usage.cached_tokens),
            other => panic!("unexpected {other:?}"),
        }
    }
    let s = core.stats();
    assert_eq!(s.free_blocks, s.num_blocks, "blocks leaked");
    (Tokens(tokens), cached.expect("finished"))
}

/// Runs `prompt` cold on a fresh engine with the disk tier in `disk`,
/// waits for its blocks to be written, and drops the engine (its lock):
/// the tokens.
fn run_and_write(ck: &Checkpoint, disk: &Path, prompt: Vec<u32>) -> Tokens {
    let mut core = engine(ck, Some(disk));
    let (cold, _) = run(&mut core, prompt);
    core.flush_disk_tier();
    cold
}

/// The one store directory (named by the fingerprint) under `disk`.
fn store_dir(disk: &Path) -> std::path::PathBuf {
    std::fs::read_dir(disk)
        .expect("dir")
        .next()
        .expect("the fingerprint's directory")
        .expect("entry")
        .path()
}

fn restored(core: &EngineCore) -> u64 {
    core.stats().disk.expect("a disk tier").restored_blocks
}

#[test]
fn an_evicted_prefix_comes_back_from_disk_with_a_cold_runs_tokens() {
    let (_m, ck) = checkpoint();
    let disk = tempfile::tempdir().expect("tempdir");
    let mut core = engine(&ck, Some(disk.path()));
    let (cold, cached) = run(&mut core, prompt(0));
    assert_eq!(cached, 0);
    // Three other prompts push prompt 0's blocks out of the pool.
    for p in 1..=3 {
        run(&mut core, prompt(p));
    }
    assert!(
        core.stats().prefix.evicted_blocks >= 16,
        "{:?}",
        core.stats().prefix
    );
    let (warm, cached) = run(&mut core, prompt(0));
    assert_eq!(warm, cold, "restored K/V gives other tokens");
    assert_eq!(cached, 16 * BLOCK, "every full prompt block came from disk");
    assert_eq!(restored(&core), 16);
    // The writer runs beside the engine: wait for the last prompt's blocks
    // (a loaded CI machine once read 48 of the 64 offered).
    core.flush_disk_tier();
    let s = core.stats().disk.expect("disk");
    assert_eq!(s.tier.load_failures, 0);
    assert!(s.tier.written_blocks >= 4 * 16, "{s:?}");

    // Without the tier the same prompt is recomputed, to the same tokens.
    let mut plain = engine(&ck, None);
    for p in 0..=3 {
        run(&mut plain, prompt(p));
    }
    assert_eq!(run(&mut plain, prompt(0)), (cold, 0));
}

#[test]
fn a_restarted_engine_serves_its_old_blocks_from_disk() {
    let (_m, ck) = checkpoint();
    let disk = tempfile::tempdir().expect("tempdir");
    let cold = run_and_write(&ck, disk.path(), prompt(4));
    let mut core = engine(&ck, Some(disk.path()));
    assert_eq!(core.stats().disk.expect("disk").tier.blocks, 16);
    assert_eq!(run(&mut core, prompt(4)), (cold, 16 * BLOCK));
    assert_eq!(restored(&core), 16);
}

/// A latent cache (DeepSeek-V3's multi-head latent attention) is stored
/// and restored as its rows alone: a block file holds layers × 16 × 40
/// floats, and a restart gives a cold run's tokens.
#[test]
fn a_latent_cache_restarts_warm_from_disk() {
    let (_m, ck) = checkpoint_of("tiny-mla");
    let disk = tempfile::tempdir().expect("tempdir");
    let cold = run_and_write(&ck, disk.path(), prompt(4));
    let file = std::fs::read_dir(store_dir(disk.path()))
        .expect("store")
        .next()
        .expect("a block file")
        .expect("entry");
    let payload = 2 * BLOCK * 40 * 4;
    assert_eq!(file.metadata().expect("meta").len() as usize, 64 + payload);
    let mut core = engine(&ck, Some(disk.path()));
    assert_eq!(run(&mut core, prompt(4)), (cold, 16 * BLOCK));
    assert_eq!(restored(&core), 16);
}

#[test]
fn corrupt_block_files_are_recomputed_never_loaded() {
    let (_m, ck) = checkpoint();
    let disk = tempfile::tempdir().expect("tempdir");
    let cold = run_and_write(&ck, disk.path(), prompt(5));
    // Flip one payload bit in the prompt's 9th block (the chain's files
    // are named by hash: find it by its parent, the 8th).
    let hashes = tandem_block_hash::block_hashes(&prompt(5), BLOCK);
    let store = store_dir(disk.path());
    let file = store.join(format!("{:016x}.kvb", hashes[8]));
    let mut bytes = std::fs::read(&file).expect("read");
    bytes[100] ^= 0x01;
    std::fs::write(&file, bytes).expect("write");

    let mut core = engine(&ck, Some(disk.path()));
    let (warm, cached) = run(&mut core, prompt(5));
    assert_eq!(warm, cold);
    assert_eq!(cached, 8 * BLOCK, "the run stops at the corrupt block");
    assert_eq!(restored(&core), 8);
    let s = core.stats().disk.expect("disk");
    assert_eq!(s.tier.load_failures, 1);
    // The recomputed block is written again, whole: a restart restores
    // all 16.
    core.flush_disk_tier();
    drop(core);
    let mut core = engine(&ck, Some(disk.path()));
    assert_eq!(run(&mut core, prompt(5)), (cold, 16 * BLOCK));
    assert_eq!(restored(&core), 16);
}

#[test]
fn a_disk_tier_needs_the_prefix_cache() {
    let (_m, ck) = checkpoint();
    let disk = tempfile::tempdir().expect("tempdir");
    let model = tandem_engine::Model::load(&ck.dir).expect("load");
    let config = EngineConfig {
        enable_prefix_caching: false,
        kv_pool: KvPoolSize::Blocks(40),
        ..EngineConfig::default()
    };
    let mut core = EngineCore::new(model, None, Vec::new(), &config).expect("core");
    let tier = DiskTier::open(DiskTierConfig::new(
        disk.path(),
        1 << 20,
        1,
        core.disk_block_values(),
    ))
    .expect("tier");
    let err = core.enable_disk_tier(tier).expect_err("refused");
    assert!(err.to_string().contains("prefix cache is off"), "{err}");
}

#[test]
fn a_burst_of_arrivals_loads_at_most_a_pools_worth_from_disk() {
    let (_m, ck) = checkpoint();
    let disk = tempfile::tempdir().expect("tempdir");
    let cold: Vec<Tokens> = {
        let mut core = engine(&ck, Some(disk.path()));
        let cold = (6..9).map(|p| run(&mut core, prompt(p)).0).collect();
        core.flush_disk_tier();
        cold
    };
    // Three prompts of 16 disk blocks arrive at once at a 40-block pool:
    // the loads asked for stop at 40 blocks (16 + 16 + 8); the rest is
    // computed.
    let mut core = engine(&ck, Some(disk.path()));
    let mut streams = Vec::new();
    for (id, p) in (6..9).enumerate() {
        let (tx, rx) = unbounded_channel();
        let mut req = Request::new(Prompt::Tokens(prompt(p)), 6);
        req.ignore_eos = true;
        req.sampling.logprobs = Some(0);
        core.add_request(id as u64, req, tx).expect("valid");
        streams.push(rx);
    }
    for step in 0..10_000 {
        if !core.has_work() {
            break;
        }
        core.step();
        core.check_accounting()
            .unwrap_or_else(|e| panic!("block books broken after step {step}: {e}"));
    }
    for (rx, want) in streams.iter_mut().zip(&cold) {
        let mut got = Vec::new();
        while let Ok(ev) = rx.try_recv() {
            if let RequestEvent::Delta(d) = ev {
                got.extend(
                    d.token_ids
                        .iter()
                        .zip(&d.logprobs)
                        .map(|(&t, l)| (t, l.logprob)),
                );
            }
        }
        assert_eq!(&Tokens(got), want);
    }
    let s = core.stats().disk.expect("disk");
    assert_eq!(s.tier.loaded_blocks, 40, "{s:?}");
}

#[test]
fn a_full_disk_fails_the_writes_not_the_request() {
    let (_m, ck) = checkpoint();
    let disk = tempfile::tempdir().expect("tempdir");
    let mut core = engine(&ck, Some(disk.path()));
    // Every write of this prompt's first 4 blocks goes to /dev/full
    // (ENOSPC, as on a full disk): the writer's temporary files are
    // symlinks to it.
    let store = store_dir(disk.path());
    let hashes = tandem_block_hash::block_hashes(&prompt(9), BLOCK);
    for h in &hashes[..4] {
        std::os::unix::fs::symlink("/dev/full", store.join(format!("{h:016x}.kvb.tmp")))
            .expect("symlink");
    }
    let (tokens, _) = run(&mut core, prompt(9));
    core.flush_disk_tier();
    let s = core.stats().disk.expect("disk");
    assert_eq!(
        (s.tier.write_errors, s.tier.written_blocks),
        (4, 12),
        "{s:?}"
    );
    // The request was served; a plain engine gives the same tokens.
    assert_eq!(run(&mut engine(&ck, None), prompt(9)).0, tokens);
}
