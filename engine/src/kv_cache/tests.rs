use super::*;

#[test]
fn allocate_append_free() {
    let pool = BlockAllocator::new(4, 16).expect("pool");
    let mut t = BlockTable::new(&pool);
    t.append(1).expect("first token");
    assert_eq!(t.blocks().len(), 1);
    t.append(15).expect("fill the block");
    assert_eq!(t.blocks().len(), 1, "16 tokens fit one block");
    t.append(1).expect("spill");
    assert_eq!(t.blocks().len(), 2);
    assert_eq!(pool.num_free(), 2);
    assert_eq!(pool.referenced(), 2);
    drop(t);
    assert_eq!(pool.num_free(), 4);
    assert_eq!(pool.referenced(), 0);
}

#[test]
fn exhaustion_is_an_error_and_takes_nothing() {
    let pool = BlockAllocator::new(3, 4).expect("pool");
    let mut a = BlockTable::new(&pool);
    a.append(8).expect("two blocks");
    let mut b = BlockTable::new(&pool);
    let err = b.append(8).expect_err("only one block left");
    assert_eq!(
        err,
        KvError::OutOfBlocks {
            needed: 2,
            free: 1,
            total: 3
        }
    );
    assert_eq!(b.num_tokens(), 0);
    assert!(b.blocks().is_empty());
    assert_eq!(pool.num_free(), 1, "a failed append takes no block");
    b.append(4).expect("one block still fits");
    assert!(a.append(1).is_err());
}

#[test]
fn truncate_returns_emptied_blocks() {
    let pool = BlockAllocator::new(4, 4).expect("pool");
    let mut t = BlockTable::new(&pool);
    t.append(9).expect("three blocks");
    t.truncate(5);
    assert_eq!(t.num_tokens(), 4);
    assert_eq!(t.blocks().len(), 1);
    assert_eq!(pool.num_free(), 3);
}

fn hashes(n: usize) -> Vec<u64> {
    tandem_block_hash::block_hashes(&(0..n as u32 * 4).collect::<Vec<_>>(), 4)
}

#[test]
fn freed_blocks_stay_cached_until_reused() {
    let pool = BlockAllocator::new(4, 4).expect("pool");
    let h = hashes(2);
    let mut a = BlockTable::new(&pool);
    assert!(a.append(8).expect("two blocks").is_empty());
    a.register_computed(&h, 8);
    let a_blocks = a.blocks().to_vec();
    drop(a);
    assert_eq!(pool.num_free(), 4, "cached blocks are free");
    assert_eq!(pool.num_cached(), 2);
    assert_eq!(pool.probe(&h), (2, 2));
    let b = BlockTable::from_cached_prefix(&pool, &h);
    assert_eq!(b.blocks(), &a_blocks[..]);
    assert_eq!(b.num_tokens(), 8);
    assert_eq!(pool.num_free(), 2);
    pool.check_accounting(2).expect("books");
    drop(b);
    // Two fresh blocks come from the never-cached ones first (LRU head).
    let mut c = BlockTable::new(&pool);
    c.append(8).expect("two");
    assert_eq!(pool.num_cached(), 2, "cached blocks were not evicted");
    // The next allocation must evict; the tail block of `a` goes first.
    let mut d = BlockTable::new(&pool);
    d.append(4).expect("one");
    assert_eq!(d.blocks(), &[a_blocks[1]]);
    assert_eq!(pool.probe(&h), (1, 1), "block 0 is still cached");
    assert_eq!(pool.prefix_stats().evicted_blocks, 1);
    pool.check_accounting(3).expect("books");
}

#[test]
fn fork_shares_and_copy_on_write_splits_the_partial_block() {
    let pool = BlockAllocator::new(8, 4).expect("pool");
    let mut a = BlockTable::new(&pool);
    a.append(6).expect("prompt");
    let b = a.fork();
    let mut b = b;
    assert_eq!(pool.refcount(a.blocks()[1]), 2);
    pool.check_accounting(4).expect("books");
    let copy = *b
        .append(1)
        .expect("append")
        .first()
        .expect("a copy-on-write");
    assert_eq!(copy.src, a.blocks()[1]);
    assert_ne!(b.blocks()[1], a.blocks()[1]);
    assert_eq!(b.blocks()[0], a.blocks()[0], "the full block stays shared");
    // `a` now owns its tail alone and appends in place.
    assert!(a.append(1).expect("append").is_empty());
    pool.check_accounting(4).expect("books");
    drop(a);
    drop(b);
    assert_eq!(pool.num_free(), 8);
    pool.check_accounting(0).expect("books");
}

#[test]
fn a_failed_copy_on_write_changes_nothing() {
    let pool = BlockAllocator::new(2, 4).expect("pool");
    let mut a = BlockTable::new(&pool);
    a.append(6).expect("two blocks");
    let mut b = a.fork();
    assert!(b.append(1).is_err());
    assert_eq!(b.blocks(), a.blocks());
    assert_eq!(b.num_tokens(), 6);
    pool.check_accounting(4).expect("books");
}

#[test]
fn truncating_into_a_cached_block_uncaches_it() {
    let pool = BlockAllocator::new(4, 4).expect("pool");
    let h = hashes(2);
    let mut a = BlockTable::new(&pool);
    a.append(8).expect("two");
    a.register_computed(&h, 8);
    a.truncate(2);
    assert_eq!(pool.probe(&h), (1, 0), "block 1 will be overwritten");
}

#[test]
fn empty_pool_is_rejected() {
    assert_eq!(BlockAllocator::new(0, 16).err(), Some(KvError::EmptyPool));
    assert_eq!(BlockAllocator::new(4, 0).err(), Some(KvError::EmptyPool));
}

#[test]
fn write_lands_in_the_right_block_and_head() {
    let layout = KvLayout {
        rows: KvRows::PerHead,
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 3,
        block_size: 4,
        sliding: SlidingLayers::NONE,
    };
    let mut kv = KvCache::new(layout, 5);
    kv.write(
        1,
        3,
        2,
        &[1., 2., 3., 4., 5., 6.],
        &[7., 8., 9., 10., 11., 12.],
    );
    let (k, v) = kv.block(1, 3);
    let o = kv.offset(0, 1, 2);
    assert_eq!(&k[o..o + 3], &[4., 5., 6.]);
    assert_eq!(&v[o..o + 3], &[10., 11., 12.]);
    assert!((0..5).all(|b| kv.block(0, b).0.iter().all(|&x| x == 0.0)));
}

#[test]
fn an_fp8_blocks_recent_rows_cross_a_transfer_at_sixteen_bits() {
    let (d, bs) = (64, 16);
    let layout = KvLayout {
        rows: KvRows::PerHead,
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: d,
        block_size: bs,
        sliding: SlidingLayers::NONE,
    };
    let truth = |p: usize, side: f32| -> Vec<f32> {
        (0..d)
            .map(|c| side * ((p * 31 + c * 7) % 23) as f32 / 7.0 - 1.5)
            .collect()
    };
    let table: Vec<BlockId> = vec![0, 1];
    let mut sender = KvCache::with_dtype(layout, 16, KvCacheDtype::Fp8E4m3);
    sender.hold_recent([(0, 20, &table[..])]);
    for p in 0..20 {
        sender.write(0, table[p / bs], p % bs, &truth(p, 1.0), &truth(p, -0.5));
    }
    // The receiver holds the prompt's tail (block 1) before it arrives.
    let mut receiver = KvCache::with_dtype(layout, 16, KvCacheDtype::Fp8E4m3);
    receiver.hold_blocks(&[1]);
    for &b in &table {
        // The tail is sent from its copies (`KvBlocks::read_recent_block`).
        let (k, v) = sender.recent_block(0, b);
        receiver.write_block(0, b, &k, &v).expect("in range");
    }
    // Rows as a transfer reads them: from the copy where there is one.
    let worst = |kv: &KvCache, b: BlockId, positions: std::ops::Range<usize>| {
        let (k, v) = kv.recent_block(0, b);
        positions
            .flat_map(|p| {
                let r = (p % bs) * d..(p % bs + 1) * d;
                let (kt, vt) = (truth(p, 1.0), truth(p, -0.5));
                let k = k[r.clone()]
                    .iter()
                    .zip(kt)
                    .map(|(a, b)| (a - b).abs())
                    .collect::<Vec<_>>();
                let v = v[r]
                    .iter()
                    .zip(vt)
                    .map(|(a, b)| (a - b).abs())
                    .collect::<Vec<_>>();
                k.into_iter().chain(v)
            })
            .fold(0f32, f32::max)
    };
    let (sent, received, coded) = (
        worst(&sender, 1, 16..20),
        worst(&receiver, 1, 16..20),
        worst(&receiver, 0, 0..16),
    );
    eprintln!("worst error: sent {sent}, received {received}, coded {coded}");
    // bf16 copies of rotated rows (up to ~6 here): a few 2^-9 steps.
    assert!(sent < 2e-2 && received < 2e-2, "{sent} {received}");
    let mut buf = vec![0.0; d];
    assert!(receiver
        .layer(0)
        .recent_rows(true, bs, d, &mut buf)
        .is_some());
    // Block 0 arrived with no copy: codes, E4M3's steps.
    assert!(receiver
        .layer(0)
        .recent_rows(true, 0, d, &mut buf)
        .is_none());
    assert!(coded > 3.0 * received, "{coded} vs {received}");
    // Read as codes (what `block` gives), the tail has E4M3's steps too.
    let (k, _) = sender.block(0, 1);
    let codes_error = (0..4 * d)
        .map(|i| (k[i] - truth(16 + i / d, 1.0)[i % d]).abs())
        .fold(0f32, f32::max);
    assert!(codes_error > 3.0 * sent, "{codes_error} vs {sent}");
}
