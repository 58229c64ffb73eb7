//! Where a checkpoint file's bytes live while the engine reads its weights:
//! the file's memory map, or a copy in anonymous memory on huge pages.
//!
//! A mapped file is read through the page cache in 4 KiB pages. A decode
//! step streams every weight once, so on a CPU its loads walk a new page
//! every 64 cache lines; on the 2-core Zen 4 VM the same weights in 2 MiB
//! pages decoded batch 1 10–18% faster (bench/RESULTS.md, "Weights on huge
//! pages"). [`Residency::HugePages`], what [`crate::Model::load`] uses, reads
//! each safetensors file once into a 2 MiB-aligned anonymous region advised
//! `MADV_HUGEPAGE` (transparent huge pages in their common `madvise` mode
//! honour it) and keeps no map: the process holds the same bytes it would
//! have touched through the map; what it gives up is sharing the page cache
//! with another process serving the same file. GGUF files, split ranks and
//! the CUDA loader stay [`Residency::Mapped`], and so does whatever a
//! caller loads with [`crate::Model::load_with`] `Mapped` (the CLI does for
//! weights quantized at load, a GPU, a `--tp`/`--pp` leader, and
//! `--mmap-weights`): read once, a private copy would only cost memory.

use std::alloc::Layout;
use std::fs::File;
use std::io::Read;
use std::ops::Deref;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{EngineError, Result};

/// How a [`super::WeightStore`] holds its files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Residency {
    /// Memory-mapped, read in place from the page cache (shared with every
    /// process mapping the same file).
    #[default]
    Mapped,
    /// Read once into anonymous memory on 2 MiB pages (safetensors files).
    HugePages,
}

/// One file's bytes.
pub(super) enum Backing {
    Mapped(Arc<Mmap>),
    Resident(HugePageBytes),
}

impl Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Mapped(m) => m,
            Self::Resident(r) => r,
        }
    }
}

impl Backing {
    /// Drops the whole pages of `bytes` bytes from `start` (inside this
    /// backing) from the process's resident set, if it is a mapped file:
    /// `MADV_DONTNEED` on a read-only private file mapping unmaps the pages
    /// and leaves the file's page cache alone; a later read faults them back
    /// in from the file, so nothing is lost. A resident copy is left as it
    /// is (on anonymous memory the advice would zero it).
    pub(super) fn release_pages(&self, start: *const u8, bytes: usize) {
        let Self::Mapped(map) = self else {
            return;
        };
        let base = map.as_ptr() as usize;
        let (from, to) = (start as usize, start as usize + bytes);
        assert!(
            from >= base && to <= base + map.len(),
            "a range of this mapping"
        );
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let (lo, hi) = (from.next_multiple_of(page), to / page * page);
        if lo < hi {
            // SAFETY: [lo, hi) is whole pages inside this read-only private
            // file mapping (asserted above), which nothing writes; dropping
            // them only makes the next read fault the file's bytes in again.
            unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_DONTNEED) };
        }
    }

    /// `path` held as `residency` asks.
    pub(super) fn open(path: &Path, residency: Residency) -> Result<Self> {
        let io = |source| EngineError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = File::open(path).map_err(io)?;
        Ok(match residency {
            // SAFETY: the checkpoint is opened read-only and we never write
            // through the map; a concurrent truncation of the file by another
            // process is outside what a model server can defend against.
            Residency::Mapped => Self::Mapped(Arc::new(unsafe { Mmap::map(&file) }.map_err(io)?)),
            Residency::HugePages => {
                let len = file.metadata().map_err(io)?.len();
                let len = usize::try_from(len).map_err(|_| {
                    EngineError::InvalidCheckpoint(format!("{} is too large", path.display()))
                })?;
                let mut bytes = HugePageBytes::zeroed(len);
                file.read_exact(&mut bytes).map_err(io)?;
                Self::Resident(bytes)
            }
        })
    }
}

/// Bytes in an anonymous region aligned to 2 MiB and advised for huge
/// pages.
pub(crate) struct HugePageBytes {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

/// The huge page size the region is aligned and rounded to.
const HUGE_PAGE: usize = 2 << 20;

// SAFETY: the region is owned, plain bytes; shared references only read it.
unsafe impl Send for HugePageBytes {}
// SAFETY: as above.
unsafe impl Sync for HugePageBytes {}

impl HugePageBytes {
    /// `len` zero bytes: allocated, advised, then zeroed (the advice must
    /// come before the first touch of a page for it to be a huge one).
    pub(crate) fn zeroed(len: usize) -> Self {
        let size = len.max(1).next_multiple_of(HUGE_PAGE);
        let Ok(layout) = Layout::from_size_align(size, HUGE_PAGE) else {
            // Only a size near usize::MAX fails, which no file has.
            std::alloc::handle_alloc_error(Layout::new::<u8>())
        };
        // SAFETY: the layout's size is non-zero.
        let raw = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        #[cfg(target_os = "linux")]
        // SAFETY: the range is the allocation just made; the advice changes
        // how it is backed, not its contents. Failure (no THP) is harmless.
        unsafe {
            libc::madvise(raw.cast(), size, libc::MADV_HUGEPAGE);
        }
        // SAFETY: the allocation holds `size` bytes.
        unsafe { std::ptr::write_bytes(raw, 0, size) };
        Self { ptr, len, layout }
    }
}

impl Deref for HugePageBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` owns `layout.size() >= len` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for HugePageBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HugePageBytes {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_residencies_hold_the_files_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f.bin");
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&path, &data).expect("write");
        for residency in [Residency::Mapped, Residency::HugePages] {
            let b = Backing::open(&path, residency).expect("open");
            assert_eq!(&b[..], &data[..], "{residency:?}");
        }
        let empty = dir.path().join("empty.bin");
        std::fs::write(&empty, []).expect("write");
        assert!(Backing::open(&empty, Residency::HugePages)
            .expect("open")
            .is_empty());
    }

    #[test]
    fn the_copy_is_aligned_to_a_huge_page() {
        let b = HugePageBytes::zeroed(3 << 20);
        assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0);
        assert!(b.iter().all(|&x| x == 0));
    }
}
