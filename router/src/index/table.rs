//! The index's main table: block hash → the bits of holders 0..64, open
//! addressing with linear probing in 16-byte slots.
//!
//! A decision is a walk of up to thousands of lookups into a table far
//! larger than the caches, so what a lookup costs is its cache misses.
//! `std`'s map (hashbrown) reads a control byte group and then the entry, two
//! places, and keeps its probe position private; here a key's home slot is a
//! multiply and a shift, the probe is the slots after it, usually in the
//! same line, and [`BitsTable::prefetch`] lets the walk request the lines of
//! a whole batch of lookups before it reads any of them. Deletion shifts the
//! following run back (no tombstones), so a probe ends at the first empty
//! slot and the table never degrades under the index's steady churn of
//! inserts and removes. The load is kept at most 3/4: an unsuccessful probe
//! (a walk's last lookup) then reads about 8 slots, two lines.
//!
//! A table of 2 MiB or more lives in 2 MiB-aligned memory that the kernel is
//! asked to back with huge pages (`MADV_HUGEPAGE`, which transparent huge
//! pages in their common `madvise` mode wait for): with 4 KiB pages nearly
//! every lookup of a walk is also a TLB miss, and those page walks are much
//! of the decision latency's tail
//! (64 workers, 32k-token prompts: p99 43–75 µs over 5 runs with 4 KiB
//! pages, 34–68 µs over 7 (median 38) with these tables in huge pages,
//! 44–47 µs over 3 with every allocation in them; p50 about 20 µs
//! throughout; bench/RESULTS.md).

use std::alloc::Layout;
use std::ptr::NonNull;

/// Key 0 marks an empty slot; the hash 0 itself lives beside the slots.
#[derive(Debug, Default, Clone, Copy)]
struct Slot {
    key: u64,
    bits: u64,
}

/// Fibonacci hashing: block hashes are uniform already, the multiply
/// spreads any structure in small test hashes over the top bits it keeps.
const MIX: u64 = 0x9e37_79b9_7f4a_7c15;

/// Tables from this size are aligned to it and advised into huge pages.
const HUGE_PAGE: usize = 2 << 20;

/// A zeroed run of slots that owns its memory (a `Vec` cannot carry the
/// huge-page alignment).
struct SlotBuf {
    ptr: NonNull<Slot>,
    len: usize,
    layout: Layout,
}

// SAFETY: `SlotBuf` owns its slots exclusively (plain data), like a `Box`.
unsafe impl Send for SlotBuf {}
// SAFETY: shared access only reads, through `&[Slot]`.
unsafe impl Sync for SlotBuf {}

impl SlotBuf {
    fn zeroed(len: usize) -> Self {
        let bytes = len * std::mem::size_of::<Slot>();
        let align = if bytes >= HUGE_PAGE {
            HUGE_PAGE
        } else {
            std::mem::align_of::<Slot>()
        };
        let Ok(layout) = Layout::from_size_align(bytes, align) else {
            std::alloc::handle_alloc_error(Layout::new::<Slot>());
        };
        if bytes == 0 {
            return Self::default();
        }
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<Slot>()) else {
            std::alloc::handle_alloc_error(layout);
        };
        #[cfg(target_os = "linux")]
        if align == HUGE_PAGE {
            // SAFETY: the range is this allocation, 2 MiB-aligned; advice
            // changes no contents. A refusal (THP off) only costs speed.
            unsafe {
                libc::madvise(raw.cast(), bytes, libc::MADV_HUGEPAGE);
            }
        }
        // SAFETY: `raw` is valid for `bytes` writes; all-zero is an empty
        // slot.
        unsafe { std::ptr::write_bytes(raw, 0, bytes) };
        Self { ptr, len, layout }
    }
}

impl Default for SlotBuf {
    fn default() -> Self {
        Self {
            ptr: NonNull::dangling(),
            len: 0,
            layout: Layout::new::<()>(),
        }
    }
}

impl Drop for SlotBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `zeroed` with this layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), self.layout) };
        }
    }
}

impl std::ops::Deref for SlotBuf {
    type Target = [Slot];
    fn deref(&self) -> &[Slot] {
        // SAFETY: `len` initialized slots (dangling and 0 when empty).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for SlotBuf {
    fn deref_mut(&mut self) -> &mut [Slot] {
        // SAFETY: as above, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for SlotBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SlotBuf({} slots)", self.len)
    }
}

#[derive(Debug, Default)]
pub(super) struct BitsTable {
    /// A power of two long (or empty).
    slots: SlotBuf,
    /// `64 − log2(slots.len())`.
    shift: u32,
    /// Occupied slots.
    len: usize,
    /// The entry of hash 0.
    zero: Option<u64>,
}

impl BitsTable {
    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(MIX) >> self.shift) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// The slot holding `key`, if any.
    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        self.probe(key).ok()
    }

    /// `Ok(slot)` of `key`, or `Err(slot)`: the empty slot that ends its
    /// run, where it would go (without tombstones a probe can stop there).
    /// The table must not be empty.
    #[inline]
    fn probe(&self, key: u64) -> Result<usize, usize> {
        let mut i = self.home(key);
        loop {
            let s = self.slots[i];
            if s.key == key {
                return Ok(i);
            }
            if s.key == 0 {
                return Err(i);
            }
            i = (i + 1) & self.mask();
        }
    }

    /// Asks the core to bring `key`'s home slot into cache (the walk does
    /// this for a batch of lookups, so their misses overlap).
    #[inline]
    pub fn prefetch(&self, key: u64) {
        if self.slots.is_empty() {
            return;
        }
        let at: *const Slot = &self.slots[self.home(key)];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch reads nothing architecturally and never
        // faults; `at` points into `slots` anyway.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(at.cast());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = at;
    }

    /// The bits of `key`.
    #[inline]
    pub fn get(&self, key: u64) -> Option<u64> {
        if key == 0 {
            return self.zero;
        }
        self.find(key).map(|i| self.slots[i].bits)
    }

    /// The bits of `key`, inserted as 0 when absent.
    pub fn get_or_insert(&mut self, key: u64) -> &mut u64 {
        if key == 0 {
            return self.zero.get_or_insert(0);
        }
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        let i = match self.probe(key) {
            Ok(i) => return &mut self.slots[i].bits,
            Err(i) => i,
        };
        self.slots[i] = Slot { key, bits: 0 };
        self.len += 1;
        &mut self.slots[i].bits
    }

    /// Clears `bits` of `key`'s entry, dropping the entry when none are
    /// left and `drop_empty`; whether any of `bits` was set (`None`: no
    /// entry).
    pub fn clear_bits(&mut self, key: u64, bits: u64, drop_empty: bool) -> Option<bool> {
        if key == 0 {
            let b = self.zero.as_mut()?;
            let was = *b & bits != 0;
            *b &= !bits;
            if *b == 0 && drop_empty {
                self.zero = None;
            }
            return Some(was);
        }
        let i = self.find(key)?;
        let b = &mut self.slots[i].bits;
        let was = *b & bits != 0;
        *b &= !bits;
        if *b == 0 && drop_empty {
            self.remove_at(i);
        }
        Some(was)
    }

    /// Removes `key`; its bits if it was present. (The index drops
    /// entries through [`clear_bits`](Self::clear_bits); the tests check
    /// the table against a map through this.)
    #[cfg(test)]
    fn remove(&mut self, key: u64) -> Option<u64> {
        if key == 0 {
            return self.zero.take();
        }
        let i = self.find(key)?;
        let bits = self.slots[i].bits;
        self.remove_at(i);
        Some(bits)
    }

    /// Empties occupied slot `hole`.
    fn remove_at(&mut self, mut hole: usize) {
        self.len -= 1;
        // Backward shift: move each later slot of the run into the hole
        // when its home does not lie cyclically in (hole, slot].
        let mut i = hole;
        loop {
            i = (i + 1) & self.mask();
            let s = self.slots[i];
            if s.key == 0 {
                break;
            }
            let home = self.home(s.key);
            let stays = if hole <= i {
                hole < home && home <= i
            } else {
                hole < home || home <= i
            };
            if !stays {
                self.slots[hole] = s;
                hole = i;
            }
        }
        self.slots[hole] = Slot::default();
    }

    fn grow(&mut self) {
        let cap = (self.slots.len() * 2).max(16);
        let old = std::mem::replace(&mut self.slots, SlotBuf::zeroed(cap));
        self.shift = 64 - cap.trailing_zeros();
        for &s in old.iter().filter(|s| s.key != 0) {
            // Keys are distinct, so the probe ends at an empty slot.
            let (Ok(i) | Err(i)) = self.probe(s.key);
            self.slots[i] = s;
        }
    }

    /// Every (key, bits), in no order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.zero.map(|b| (0, b)).into_iter().chain(
            self.slots
                .iter()
                .filter(|s| s.key != 0)
                .map(|s| (s.key, s.bits)),
        )
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    /// Bytes of the slots.
    pub fn bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Slot>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Random inserts, updates and removes (keys from a small range, so
    /// runs collide and wrap, 0 included) agree with `HashMap`.
    #[test]
    fn agrees_with_a_hash_map_under_churn() {
        let mut table = BitsTable::default();
        let mut model: HashMap<u64, u64> = HashMap::new();
        let mut x = 0x9e37_79b9_u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for step in 0..200_000 {
            let key = next(3000);
            match next(3) {
                0 | 1 => {
                    let bits = next(1 << 20);
                    *table.get_or_insert(key) |= bits;
                    *model.entry(key).or_insert(0) |= bits;
                }
                _ => assert_eq!(table.remove(key), model.remove(&key), "step {step}"),
            }
            if step % 10_000 == 0 {
                assert_eq!(table.len(), model.len());
                for k in 0..3000 {
                    assert_eq!(table.get(k), model.get(&k).copied(), "step {step} key {k}");
                }
                let mut all: Vec<_> = table.iter().collect();
                all.sort_unstable();
                let mut want: Vec<_> = model.iter().map(|(&k, &v)| (k, v)).collect();
                want.sort_unstable();
                assert_eq!(all, want);
            }
        }
    }

    /// Keys whose homes are the last slots wrap to the front, and removing
    /// one shifts the wrapped ones back across the end.
    #[test]
    fn runs_wrap_around_the_end() {
        let mut table = BitsTable::default();
        *table.get_or_insert(1) = 1; // makes 16 slots
        let last = (2u64..)
            .filter(|&k| table.home(k) == 15)
            .take(4)
            .collect::<Vec<_>>();
        for (b, &k) in last.iter().enumerate() {
            *table.get_or_insert(k) = b as u64 + 10;
        }
        assert_eq!(table.remove(last[0]), Some(10));
        for (b, &k) in last.iter().enumerate().skip(1) {
            assert_eq!(table.get(k), Some(b as u64 + 10));
        }
        assert_eq!(table.get(last[0]), None);
        assert_eq!(table.get(1), Some(1));
    }
}
