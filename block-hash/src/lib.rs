//! The chained hash of full KV blocks.
//!
//! Block `i` of a token sequence (tokens `i*B .. (i+1)*B` for block size `B`)
//! is named by `h[i] = xxh3_64(h[i-1] ‖ tokens of block i)` with a fixed seed,
//! where `h[-1]` is [`ROOT`]. Chaining makes a hash name the whole prefix up
//! to and including its block, so two sequences share block `i` exactly when
//! they share every token before its end, and a hash-map lookup per block
//! finds the longest cached prefix.
//!
//! Only full blocks are hashed: a partial block can still change. The engine
//! (prefix cache), the router (prefix-affinity index) and KV transfer all
//! call these functions, so a block hashed on one worker is found by the
//! router under the same name. [`SetDigest`] summarizes a set of these
//! hashes, so a router can check that its copy of a worker's set is whole;
//! [`PrefixClosure`] says whether a set holds every parent of its blocks.
//!
//! **Architecture Invariant:** this crate knows nothing but tokens and block
//! sizes. Two parties agree on hashes only if they agree on the block size;
//! the KV layout exchange checks that before anything is matched.

use xxhash_rust::xxh3::xxh3_64_with_seed;

mod closure;
mod digest;
pub use closure::PrefixClosure;
pub use digest::{SetDigest, DISK_TIER_SALT};

/// A chained block hash.
pub type BlockHash = u64;

/// The parent of the first block.
pub const ROOT: BlockHash = 0;

/// Fixed seed: hashes must agree across processes and restarts.
const SEED: u64 = 0x7461_6e64_656d_0001; // "tandem" + version 1

/// Hash of one block given its parent's hash.
pub fn hash_block(parent: BlockHash, tokens: &[u32]) -> BlockHash {
    let mut bytes = Vec::with_capacity(8 + 4 * tokens.len());
    bytes.extend_from_slice(&parent.to_le_bytes());
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, SEED)
}

/// Hashes of every full block of `tokens`, in order.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    extend_block_hashes(&mut out, tokens, block_size);
    out
}

/// Appends the hashes of the full blocks of `tokens` not yet in `hashes`
/// (which must hold the hashes of its first `hashes.len()` blocks). Lets a
/// growing sequence hash each block once.
pub fn extend_block_hashes(hashes: &mut Vec<BlockHash>, tokens: &[u32], block_size: usize) {
    extend_block_hashes_from(hashes, ROOT, tokens, block_size);
}

/// Hashes of every full block of `tokens` in a chain that starts at `root`
/// instead of [`ROOT`] (see [`adapter_root`]).
pub fn block_hashes_from(root: BlockHash, tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    extend_block_hashes_from(&mut out, root, tokens, block_size);
    out
}

/// As [`extend_block_hashes`] for a chain that starts at `root`.
pub fn extend_block_hashes_from(
    hashes: &mut Vec<BlockHash>,
    root: BlockHash,
    tokens: &[u32],
    block_size: usize,
) {
    if block_size == 0 {
        return;
    }
    let full = tokens.len() / block_size;
    let mut parent = hashes.last().copied().unwrap_or(root);
    for i in hashes.len()..full {
        parent = hash_block(parent, &tokens[i * block_size..(i + 1) * block_size]);
        hashes.push(parent);
    }
}

/// The root of the chains computed under a LoRA adapter whose weights
/// digest to `digest`: the same tokens under two adapters (or under one and
/// the base model) never share a hash, so a prefix cache never serves one's
/// KV to the other. The digest is of the weights, not the name, so an
/// adapter reloaded with other weights under the same name starts afresh.
pub fn adapter_root(digest: u64) -> BlockHash {
    let mut bytes = *b"lora\0\0\0\0\0\0\0\0";
    bytes[4..].copy_from_slice(&digest.to_le_bytes());
    match xxh3_64_with_seed(&bytes, SEED) {
        ROOT => 1,
        h => h,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_full_blocks_are_hashed() {
        let toks: Vec<u32> = (0..37).collect();
        assert_eq!(block_hashes(&toks, 16).len(), 2);
        assert!(block_hashes(&toks[..15], 16).is_empty());
    }

    #[test]
    fn a_hash_names_the_whole_prefix() {
        let a: Vec<u32> = (0..32).collect();
        let mut b = a.clone();
        b[3] = 999; // differs in block 0 only
        let (ha, hb) = (block_hashes(&a, 16), block_hashes(&b, 16));
        assert_ne!(ha[0], hb[0]);
        assert_ne!(
            ha[1], hb[1],
            "block 1 has equal tokens but a different prefix"
        );
        // The same tokens in another position hash differently too.
        let shifted: Vec<u32> = (16..32).collect();
        assert_ne!(block_hashes(&shifted, 16)[0], ha[1]);
    }

    #[test]
    fn extending_matches_hashing_at_once() {
        let toks: Vec<u32> = (0..100).map(|i| i * 7 % 13).collect();
        let mut h = Vec::new();
        for end in [5, 16, 17, 40, 100] {
            extend_block_hashes(&mut h, &toks[..end], 8);
            assert_eq!(h, block_hashes(&toks[..end], 8));
        }
    }

    #[test]
    fn an_adapter_root_separates_the_chains() {
        let toks: Vec<u32> = (0..32).collect();
        let (a, b) = (adapter_root(1), adapter_root(2));
        assert_ne!(a, ROOT);
        let base = block_hashes(&toks, 16);
        let under_a = block_hashes_from(a, &toks, 16);
        assert_ne!(base[0], under_a[0]);
        assert_ne!(under_a[0], block_hashes_from(b, &toks, 16)[0]);
        assert_eq!(block_hashes_from(ROOT, &toks, 16), base);
        let mut grown = Vec::new();
        extend_block_hashes_from(&mut grown, a, &toks[..20], 16);
        extend_block_hashes_from(&mut grown, a, &toks, 16);
        assert_eq!(grown, under_a);
    }

    #[test]
    fn hashes_are_stable_across_builds() {
        // Routers and workers of different builds must agree: pin one value.
        assert_eq!(hash_block(ROOT, &[1, 2, 3]), hash_block(ROOT, &[1, 2, 3]));
        assert_eq!(
            block_hashes(&[1, 2, 3, 4], 4)[0],
            xxh3_64_with_seed(
                &[0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0],
                SEED
            )
        );
    }
}
