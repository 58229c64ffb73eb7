//! The disk tier against real files: warm reopen, the byte budget, and
//! every way a file can be bad (truncated, flipped, foreign, a full disk).

use std::path::Path;
use std::time::Duration;

use tandem_kv_disk::{DiskTier, DiskTierConfig};

const VALUES: usize = 64;
const FILE: u64 = 64 + VALUES as u64 * 4;

fn block(seed: u64) -> Vec<f32> {
    (0..VALUES)
        .map(|i| (seed * 100 + i as u64) as f32 * 0.25)
        .collect()
}

fn config(dir: &Path, fingerprint: u64, blocks: u64) -> DiskTierConfig {
    DiskTierConfig::new(dir, blocks * FILE, fingerprint, VALUES)
}

fn load(tier: &DiskTier, hashes: &[u64]) -> Vec<Vec<f32>> {
    tier.load(9, hashes.to_vec());
    let l = tier
        .wait(Duration::from_secs(10))
        .expect("the loader answers");
    assert_eq!((l.ticket, l.hashes.as_slice()), (9, hashes));
    l.blocks
}

#[test]
fn blocks_survive_a_reopen_and_load_back_verified() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let tier = DiskTier::open(config(dir.path(), 1, 100)).expect("open");
        for h in 1..=4 {
            assert!(tier.offer(h, h - 1, block(h)));
        }
        assert!(
            !tier.offer(2, 1, block(2)),
            "known blocks are not written twice"
        );
        assert!(!tier.offer(5, 4, vec![0.0; 3]), "wrong size");
        tier.flush();
        let s = tier.stats();
        assert_eq!((s.blocks, s.written_blocks, s.bytes), (4, 4, 4 * FILE));
        // Dropping it releases the lock, as a killed process's would.
    }
    let tier = DiskTier::open(config(dir.path(), 1, 100)).expect("reopen");
    assert_eq!(tier.stats().blocks, 4);
    assert_eq!(tier.stored_run(&[1, 2, 3, 7, 4]), 3);
    let mut links = tier.stored_blocks();
    links.sort_unstable();
    assert_eq!(links, vec![(1, 0), (2, 1), (3, 2), (4, 3)]);
    assert_eq!(load(&tier, &[2, 3]), vec![block(2), block(3)]);
    // A hash never written ends the run.
    assert_eq!(load(&tier, &[1, 8, 2]), vec![block(1)]);
    let s = tier.stats();
    assert_eq!((s.loaded_blocks, s.load_failures, s.loads), (3, 1, 2));
}

#[test]
fn the_budget_keeps_the_most_recently_used_blocks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tier = DiskTier::open(config(dir.path(), 1, 3)).expect("open");
    for h in 1..=3 {
        tier.offer(h, 0, block(h));
    }
    tier.flush();
    // Using block 1 keeps it: 2 and 3 go first.
    assert_eq!(load(&tier, &[1]).len(), 1);
    tier.offer(4, 0, block(4));
    tier.offer(5, 0, block(5));
    tier.flush();
    let s = tier.stats();
    assert_eq!((s.blocks, s.bytes, s.evicted_blocks), (3, 3 * FILE, 2));
    let mut held: Vec<u64> = tier.stored_blocks().into_iter().map(|l| l.0).collect();
    held.sort_unstable();
    assert_eq!(held, vec![1, 4, 5]);
    assert_eq!(tier.drain_forgotten(), vec![2, 3]);
    assert!(tier.drain_forgotten().is_empty());
    let files = std::fs::read_dir(tier.dir()).expect("dir").count();
    assert_eq!(
        files,
        3 + 1,
        "evicted blocks' files are deleted (LOCK stays)"
    );
    assert!(
        DiskTier::open(config(dir.path(), 1, 0)).is_err(),
        "a budget that holds no block"
    );
}

#[test]
fn bad_files_are_skipped_and_never_loaded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = {
        let tier = DiskTier::open(config(dir.path(), 1, 100)).expect("open");
        for h in 1..=4 {
            tier.offer(h, 0, block(h));
        }
        tier.flush();
        tier.dir().to_path_buf()
    };
    let file = |h: u64| path.join(format!("{h:016x}.kvb"));
    // Block 1 truncated, block 2 with a flipped payload bit, block 3
    // replaced by another model's block under its name, and a crash's
    // leftover temporary file.
    let bytes = std::fs::read(file(1)).expect("read");
    std::fs::write(file(1), &bytes[..bytes.len() - 9]).expect("truncate");
    let mut flipped = std::fs::read(file(2)).expect("read");
    flipped[200] ^= 0x04;
    std::fs::write(file(2), &flipped).expect("flip");
    {
        let other = tempfile::tempdir().expect("tempdir");
        let foreign = DiskTier::open(config(other.path(), 2, 100)).expect("open");
        foreign.offer(3, 0, block(3));
        foreign.flush();
        std::fs::copy(foreign.dir().join(format!("{:016x}.kvb", 3)), file(3)).expect("copy");
    }
    std::fs::write(path.join("0000000000000009.kvb.tmp"), b"half a block").expect("tmp");

    let tier = DiskTier::open(config(dir.path(), 1, 100)).expect("reopen");
    let s = tier.stats();
    // The truncated and the foreign file fail their header checks at once;
    // the flipped payload only shows when read.
    assert_eq!((s.skipped_files, s.blocks), (2, 2));
    assert!(!file(1).exists() && !file(3).exists());
    assert!(!path.join("0000000000000009.kvb.tmp").exists());
    assert_eq!(tier.stored_run(&[2, 4]), 2);
    assert!(
        load(&tier, &[2, 4]).is_empty(),
        "a corrupt block ends the run"
    );
    assert_eq!(tier.stats().load_failures, 1);
    assert!(!file(2).exists(), "the corrupt file is deleted");
    assert_eq!(tier.drain_forgotten(), vec![2]);
    assert_eq!(tier.stored_run(&[2]), 0);
    assert_eq!(load(&tier, &[4]), vec![block(4)]);
}

#[test]
fn a_full_disk_fails_the_write_not_the_tier() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tier = DiskTier::open(config(dir.path(), 1, 100)).expect("open");
    // The writer's temporary file for block 7 is /dev/full: every write to
    // it fails with ENOSPC, as on a full disk.
    std::os::unix::fs::symlink("/dev/full", tier.dir().join("0000000000000007.kvb.tmp"))
        .expect("symlink");
    assert!(tier.offer(7, 0, block(7)));
    tier.flush();
    let s = tier.stats();
    assert_eq!((s.write_errors, s.blocks, s.written_blocks), (1, 0, 0));
    assert!(
        !tier.knows(7),
        "a failed write is forgotten, so it can be offered again"
    );
    assert_eq!(tier.drain_forgotten(), vec![7], "and reported");
    assert!(tier.offer(8, 0, block(8)));
    tier.flush();
    assert_eq!(load(&tier, &[8]), vec![block(8)]);
}

#[test]
fn one_process_per_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let first = DiskTier::open(config(dir.path(), 1, 10)).expect("open");
    let err = DiskTier::open(config(dir.path(), 1, 10)).expect_err("locked");
    assert!(err.to_string().contains("in use"), "{err}");
    drop(first);
    DiskTier::open(config(dir.path(), 1, 10)).expect("free again");
}
