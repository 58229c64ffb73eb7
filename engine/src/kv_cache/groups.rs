//! Layer groups: how a model whose layers mix sliding-window and global
//! attention shares one block pool (vLLM's hybrid allocator, simplified).
//!
//! The layers are cut into groups of `k` layers each, global layers first,
//! then windowed ones, where `k` is the greatest common divisor of the two
//! counts (all layers when the model has only one kind). A physical block
//! holds `k` layers' K/V — one *slot* per layer of a group — and a sequence
//! keeps one logical block per group per `block_size` tokens. A global
//! group's blocks live as long as the sequence; a windowed group's leading
//! blocks go back to the pool once every future query's window has moved
//! past them. Gemma 3 (5 windowed layers to 1 global, window 512) thus holds
//! about a sixth of a global-only model's KV on a long sequence.
//!
//! A model with one kind of layer has one group of all layers: one table
//! entry per logical block, one slot per layer — the plain paged cache.
//!
//! **Architecture Invariant:** attention never reads a freed entry: a
//! windowed group's block is released only when its last position is before
//! the window of the next position to compute.

use tandem_block_hash::BlockHash;

use super::{BlockId, KvLayout};

/// A table entry of a windowed group whose block has left the window.
pub const FREED: BlockId = BlockId::MAX;

/// Which layers slide, and by how much. Part of [`KvLayout`], so two
/// workers whose windows differ cannot exchange blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct SlidingLayers {
    /// Positions a windowed layer's query sees (its own included); 0 when
    /// no layer slides.
    pub window: usize,
    /// Bit `l` set: layer `l` slides. Models of more than 128 layers do not
    /// free windowed blocks (their layouts carry no window).
    pub layers: u128,
}

impl SlidingLayers {
    /// No layer slides.
    pub const NONE: Self = Self {
        window: 0,
        layers: 0,
    };

    /// The layout field for per-layer windows (`None`: global). Freeing
    /// needs one window size shared by every windowed layer and at most 128
    /// layers; otherwise no layer is marked (attention still applies each
    /// layer's window; only the memory saving is lost).
    pub fn from_windows(windows: impl IntoIterator<Item = Option<usize>>) -> Self {
        let mut out = Self::NONE;
        for (l, w) in windows.into_iter().enumerate() {
            let Some(w) = w else { continue };
            if l >= 128 || (out.window != 0 && out.window != w) || w == 0 {
                return Self::NONE;
            }
            out.window = w;
            out.layers |= 1 << l;
        }
        out
    }

    /// Whether layer `layer` slides.
    pub fn is_windowed(&self, layer: usize) -> bool {
        self.window > 0 && layer < 128 && (self.layers >> layer) & 1 == 1
    }

    /// Windowed layers among the first `num_layers`.
    pub fn count(&self, num_layers: usize) -> usize {
        (0..num_layers).filter(|&l| self.is_windowed(l)).count()
    }
}

/// The layer-to-(group, slot) map of one layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroups {
    group_of: Vec<usize>,
    slot_of: Vec<usize>,
    /// Per group: whether it slides.
    windowed: Vec<bool>,
    slots: usize,
    window: usize,
}

impl KvGroups {
    /// The groups of `layout` (see the module docs).
    pub fn of(layout: &KvLayout) -> Self {
        let n = layout.num_layers;
        let slots = layout.layers_per_block();
        let mut group_of = vec![0; n];
        let mut slot_of = vec![0; n];
        let mut windowed = Vec::new();
        for sliding in [false, true] {
            let layers: Vec<usize> = (0..n)
                .filter(|&l| layout.sliding.is_windowed(l) == sliding)
                .collect();
            let base = windowed.len();
            for (i, &l) in layers.iter().enumerate() {
                group_of[l] = base + i / slots;
                slot_of[l] = i % slots;
            }
            windowed.extend(std::iter::repeat_n(sliding, layers.len() / slots));
        }
        if windowed.is_empty() {
            windowed.push(false);
        }
        Self {
            group_of,
            slot_of,
            windowed,
            slots,
            window: layout.sliding.window,
        }
    }

    /// One group of `num_layers` global layers (the plain paged cache).
    pub fn single(num_layers: usize) -> Self {
        Self {
            group_of: vec![0; num_layers],
            slot_of: (0..num_layers).collect(),
            windowed: vec![false],
            slots: num_layers.max(1),
            window: 0,
        }
    }

    /// Table entries per logical block.
    pub fn num_groups(&self) -> usize {
        self.windowed.len()
    }

    /// Layers (slots) one physical block holds.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The group of `layer`.
    pub fn group(&self, layer: usize) -> usize {
        self.group_of.get(layer).copied().unwrap_or(0)
    }

    /// The slot `layer` occupies in its group's blocks.
    pub fn slot(&self, layer: usize) -> usize {
        self.slot_of.get(layer).copied().unwrap_or(0)
    }

    /// Whether group `g` slides.
    pub fn is_windowed(&self, g: usize) -> bool {
        self.windowed.get(g).copied().unwrap_or(false)
    }

    /// Whether any group slides.
    pub fn any_windowed(&self) -> bool {
        self.windowed.iter().any(|&w| w)
    }

    /// The window of the windowed groups (0 when none slides).
    pub fn window(&self) -> usize {
        self.window
    }

    /// First logical block the query at `pos` reads in a windowed group.
    pub fn window_start(&self, pos: usize, block_size: usize) -> usize {
        window_start(pos, self.window, block_size)
    }

    /// What sizing needs of the groups ([`KvFootprint`]).
    pub fn footprint(&self) -> KvFootprint {
        KvFootprint {
            groups: self.num_groups(),
            windowed_groups: self.windowed.iter().filter(|&&w| w).count(),
            window: self.window,
        }
    }

    /// Physical blocks a sequence of `tokens` holds once its windowed
    /// groups have freed what left the window.
    pub fn blocks_held(&self, tokens: usize, block_size: usize) -> usize {
        self.footprint().held(tokens, block_size)
    }

    /// The name group `g`'s copy of a block is cached under: group 0 keeps
    /// the sequence's own chained hash (what routers see), the others a
    /// hash salted by their group.
    pub fn hash(&self, g: usize, hash: BlockHash) -> BlockHash {
        match g {
            0 => hash,
            _ => tandem_block_hash::hash_block(hash, &[u32::MAX - g as u32]),
        }
    }
}

/// How many physical blocks a sequence takes, from its groups' counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvFootprint {
    /// Layer groups (table entries per logical block).
    pub groups: usize,
    /// Of those, groups that slide.
    pub windowed_groups: usize,
    /// Their window.
    pub window: usize,
}

impl KvFootprint {
    /// One group, nothing freed.
    pub const PLAIN: Self = Self {
        groups: 1,
        windowed_groups: 0,
        window: 0,
    };

    /// Blocks a sequence of `tokens` holds between steps: every global
    /// group's, and the windowed groups' blocks the next position reads.
    pub fn held(&self, tokens: usize, block_size: usize) -> usize {
        let all = tokens.div_ceil(block_size);
        let windowed = all - window_start(tokens, self.window, block_size).min(all);
        (self.groups - self.windowed_groups) * all + self.windowed_groups * windowed
    }

    /// The most blocks a sequence of `prompt` tokens growing to `total`
    /// holds at once when its prompt runs in chunks of at most `chunk`
    /// tokens: a windowed group holds a chunk and the window before it
    /// while the chunk runs.
    pub fn peak(&self, prompt: usize, total: usize, chunk: usize, block_size: usize) -> usize {
        let all = prompt.div_ceil(block_size);
        let windowed = match self.window {
            0 => all,
            w => all.min((chunk + w).div_ceil(block_size) + 1),
        };
        let prefill = (self.groups - self.windowed_groups) * all + self.windowed_groups * windowed;
        prefill.max(self.held(total, block_size))
    }
}

/// First logical block the query at `pos` reads in a layer of `window`.
fn window_start(pos: usize, window: usize, block_size: usize) -> usize {
    match window {
        0 => 0,
        w => (pos + 1).saturating_sub(w) / block_size,
    }
}

/// Greatest common divisor (`gcd(0, n) = n`).
pub(super) fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{BlockAllocator, BlockTable, CacheEvent, KvLayout};
    use super::*;

    fn layout(num_layers: usize, sliding: SlidingLayers) -> KvLayout {
        KvLayout {
            rows: crate::KvRows::PerHead,
            num_layers,
            num_kv_heads: 1,
            head_dim: 2,
            block_size: 4,
            sliding,
        }
    }

    /// Gemma 3's pattern: every sixth layer global.
    fn gemma(num_layers: usize, window: usize) -> SlidingLayers {
        SlidingLayers::from_windows((0..num_layers).map(|l| (l % 6 != 5).then_some(window)))
    }

    #[test]
    fn gemma_layers_group_by_the_gcd_of_the_two_counts() {
        // 12 layers: 10 windowed, 2 global -> 2 layers per block, 6 groups.
        let l = layout(12, gemma(12, 8));
        assert_eq!(l.layers_per_block(), 2);
        let g = KvGroups::of(&l);
        assert_eq!((g.num_groups(), g.slots()), (6, 2));
        // The global group comes first and holds layers 5 and 11.
        assert_eq!(
            (g.group(5), g.slot(5), g.group(11), g.slot(11)),
            (0, 0, 0, 1)
        );
        assert!(!g.is_windowed(0) && (1..6).all(|x| g.is_windowed(x)));
        assert_eq!((g.group(0), g.slot(0), g.group(1), g.slot(1)), (1, 0, 1, 1));
        assert_eq!(g.group(10), 5);
        // A block holds 2 of the 12 layers: a sixth of a plain block.
        assert_eq!(
            l.block_bytes() * 6,
            layout(12, SlidingLayers::NONE).block_bytes()
        );
    }

    #[test]
    fn one_kind_of_layer_is_one_group() {
        let plain = KvGroups::of(&layout(4, SlidingLayers::NONE));
        assert_eq!((plain.num_groups(), plain.slots()), (1, 4));
        assert!(!plain.any_windowed());
        let all = KvGroups::of(&layout(4, SlidingLayers::from_windows([Some(8); 4])));
        assert_eq!((all.num_groups(), all.slots()), (1, 4));
        assert!(all.is_windowed(0));
    }

    #[test]
    fn windows_that_cannot_share_a_pool_mark_no_layer() {
        assert_eq!(
            SlidingLayers::from_windows([Some(8), Some(16)]),
            SlidingLayers::NONE
        );
        assert_eq!(
            SlidingLayers::from_windows(vec![Some(8); 129]),
            SlidingLayers::NONE
        );
        let s = SlidingLayers::from_windows([None, Some(8), None]);
        assert_eq!((s.window, s.layers), (8, 0b010));
    }

    #[test]
    fn footprint_counts_global_groups_whole_and_windows_capped() {
        let g = KvGroups::of(&layout(12, gemma(12, 8)));
        // 40 tokens, block 4: 10 logical blocks; the next position (40)
        // reads from position 33 on: blocks 8 and 9.
        assert_eq!(g.blocks_held(40, 4), 10 + 5 * 2);
        assert_eq!(g.footprint().peak(40, 40, 40, 4), 6 * 10);
        assert_eq!(g.footprint().peak(40, 40, 8, 4), 10 + 5 * 5);
        assert_eq!(KvFootprint::PLAIN.held(40, 4), 10);
    }

    /// One global and one windowed layer, window 8, blocks of 4 tokens.
    fn pool(blocks: usize) -> BlockAllocator {
        let l = layout(2, SlidingLayers::from_windows([None, Some(8)]));
        BlockAllocator::with_groups(blocks, 4, KvGroups::of(&l)).expect("pool")
    }

    fn hashes(n: usize) -> Vec<BlockHash> {
        tandem_block_hash::block_hashes(&(0..n as u32 * 4).collect::<Vec<_>>(), 4)
    }

    #[test]
    fn blocks_behind_the_window_go_back_to_the_pool() {
        let p = pool(12);
        let mut t = BlockTable::new(&p);
        t.append(20).expect("5 logical blocks, 2 entries each");
        assert_eq!((t.num_logical(), t.num_held(), p.num_free()), (5, 10, 2));
        // Position 20 reads from 13 on: windowed blocks 0..3 are done.
        assert_eq!(t.release_outside_window(20), 3);
        assert_eq!(t.release_outside_window(20), 0, "idempotent");
        assert_eq!((t.num_held(), p.num_free()), (7, 5));
        assert!((0..3).all(|i| t.blocks()[i * 2 + 1] == FREED));
        assert!((0..5).all(|i| t.blocks()[i * 2] != FREED), "global kept");
        p.check_accounting(7).expect("books");
        let fork = t.fork();
        p.check_accounting(14)
            .expect("a fork shares held blocks only");
        drop(fork);
        t.truncate(6);
        assert_eq!((t.num_logical(), t.num_held()), (4, 5));
        drop(t);
        assert_eq!(p.num_free(), 12);
        p.check_accounting(0).expect("books");
    }

    #[test]
    fn a_prefix_hit_needs_the_window_before_its_end() {
        let p = pool(16);
        let h = hashes(5);
        let mut t = BlockTable::new(&p);
        t.append(20).expect("blocks");
        t.release_outside_window(20);
        // Windowed blocks 0..3 left before they were named.
        t.register_computed(&h, 20);
        drop(t);
        // Five blocks: position 20 reads windowed blocks 3 and 4, cached.
        assert_eq!(p.probe(&h).0, 5);
        let hit = BlockTable::from_cached_prefix(&p, &h);
        assert_eq!((hit.num_tokens(), hit.num_held()), (20, 7));
        assert_eq!(hit.blocks()[2 * 2 + 1], FREED);
        drop(hit);
        // Four: position 16 would read windowed block 2, never cached; no
        // shorter prefix has its window either.
        assert_eq!(p.probe(&h[..4]).0, 0);
        assert_eq!(BlockTable::from_cached_prefix(&p, &h[..4]).num_tokens(), 0);
    }

    #[test]
    fn routers_hear_of_group_zero_only() {
        let p = pool(16);
        let h = hashes(2);
        let mut t = BlockTable::new(&p);
        t.append(8).expect("blocks");
        t.register_computed(&h, 8);
        assert_eq!(p.num_cached(), 4, "both groups cached");
        let stored: Vec<BlockHash> = p
            .drain_events()
            .into_iter()
            .filter_map(|e| match e {
                CacheEvent::Stored { hash, .. } => Some(hash),
                _ => None,
            })
            .collect();
        assert_eq!(stored, h);
        assert_eq!(p.snapshot().len(), 2);
    }
}
