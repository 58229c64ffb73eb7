//! The same-host fast path: two single-producer single-consumer byte rings
//! (one per direction) in a file under `/dev/shm`, mapped by both ranks.
//!
//! Each ring is a 256-byte header (the writer's position at offset 0, the
//! reader's at 64, on separate cache lines; a setup nonce at 128) followed by
//! [`RING_CAPACITY`] data bytes. Positions count bytes ever written/read; the
//! writer publishes data with a release store of its position and the reader
//! frees space with a release store of its own. Waiting spins briefly, then
//! yields, then sleeps, and every millisecond checks the TCP connection kept
//! as a liveness channel: EOF or a reset there means the peer's process (or
//! its communicator) is gone, exactly as on the TCP path.
//!
//! The lower rank creates the file (written out in full first, so a full
//! tmpfs fails with an error rather than a SIGBUS later), the higher rank maps
//! it and proves it did by echoing the nonce over TCP, and the lower rank then
//! unlinks it: nothing is left in `/dev/shm` even if a rank is killed.

use std::fs::{File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, Write};
use std::net::TcpStream;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use memmap2::MmapMut;

/// Data bytes per ring (per direction); at least two collective chunks.
pub(crate) const RING_CAPACITY: usize = 1 << 20;
const HEADER: usize = 256;
const RING_BYTES: usize = HEADER + RING_CAPACITY;
const FILE_BYTES: usize = 2 * RING_BYTES;
const NONCE_AT: usize = 128;
const LIVENESS_EVERY: Duration = Duration::from_millis(1);

/// A host identity: ranks that report the same one try shared memory.
pub(crate) fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// One direction of a link inside the mapping.
#[derive(Debug)]
struct Ring {
    base: *mut u8,
}

impl Ring {
    fn position(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `base` points at a ring header inside a live, page-aligned
        // mapping (owned by the `ShmLink` that owns this ring, so it outlives
        // the returned reference); offsets 0 and 64 are 8-aligned and inside
        // the header; both processes only access these words atomically.
        unsafe { &*(self.base.add(at).cast::<AtomicU64>()) }
    }

    fn written(&self) -> &AtomicU64 {
        self.position(0)
    }

    fn read(&self) -> &AtomicU64 {
        self.position(64)
    }

    fn nonce(&self) -> &AtomicU64 {
        self.position(NONCE_AT)
    }

    /// Copies `src` into the ring at stream position `pos`, wrapping.
    fn copy_in(&self, pos: u64, src: &[u8]) {
        let off = (pos % RING_CAPACITY as u64) as usize;
        let first = src.len().min(RING_CAPACITY - off);
        // SAFETY: `src.len() <= RING_CAPACITY` free bytes starting at `off`
        // (wrapping to the start) lie inside the data area; the protocol gives
        // the writer exclusive use of free bytes until it publishes them, so
        // the reader does not touch them; `src` is our own memory, so the
        // ranges do not overlap.
        unsafe {
            let data = self.base.add(HEADER);
            std::ptr::copy_nonoverlapping(src.as_ptr(), data.add(off), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), data, src.len() - first);
        }
    }

    /// Copies bytes at stream position `pos` out of the ring into `dst`.
    fn copy_out(&self, pos: u64, dst: &mut [u8]) {
        let off = (pos % RING_CAPACITY as u64) as usize;
        let first = dst.len().min(RING_CAPACITY - off);
        // SAFETY: as in `copy_in`: the bytes were published by the writer
        // (acquire load of its position) and it will not reuse them until we
        // release them; `dst` is our own memory.
        unsafe {
            let data = self.base.add(HEADER);
            std::ptr::copy_nonoverlapping(data.add(off), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(data, dst.as_mut_ptr().add(first), dst.len() - first);
        }
    }
}

/// A same-host link.
#[derive(Debug)]
pub(crate) struct ShmLink {
    /// Keeps the rings' memory mapped.
    _map: MmapMut,
    tx: Ring,
    rx: Ring,
    /// The TCP connection, now only a liveness channel (non-blocking).
    control: TcpStream,
    timeout: Duration,
}

// SAFETY: the raw ring pointers point into `_map`, which the link owns and
// which moves with it (the mapping's address does not change); nothing else in
// this process refers to that memory.
unsafe impl Send for ShmLink {}

/// Waiting for a ring: spin, yield, sleep; check the peer and the timeout.
struct Waiter<'a> {
    control: &'a TcpStream,
    timeout: Option<Duration>,
    rounds: u32,
    last_progress: Instant,
    last_check: Instant,
}

impl<'a> Waiter<'a> {
    fn new(control: &'a TcpStream, timeout: Option<Duration>) -> Self {
        let now = Instant::now();
        Self {
            control,
            timeout,
            rounds: 0,
            last_progress: now,
            last_check: now,
        }
    }

    fn progress(&mut self) {
        if self.rounds > 0 {
            self.rounds = 0;
            self.last_progress = Instant::now();
        }
    }

    fn wait(&mut self) -> io::Result<()> {
        self.rounds = self.rounds.saturating_add(1);
        if self.rounds < 100 {
            std::hint::spin_loop();
            return Ok(());
        }
        let now = Instant::now();
        if let Some(timeout) = self.timeout {
            if now.duration_since(self.last_progress) >= timeout {
                return Err(io::Error::new(io::ErrorKind::WouldBlock, "timed out"));
            }
        }
        if now.duration_since(self.last_check) >= LIVENESS_EVERY {
            self.last_check = now;
            check_alive(self.control)?;
        }
        if self.rounds < 5_000 {
            thread::yield_now();
        } else {
            // Long waits (an idle follower): sleep, growing to 1 ms.
            let micros = u64::from((self.rounds - 5_000) / 100 + 20).min(1_000);
            thread::sleep(Duration::from_micros(micros));
        }
        Ok(())
    }
}

fn corrupt() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        "shared-memory ring positions are inconsistent",
    )
}

/// The liveness channel carries no data: EOF or an error means the peer is gone.
fn check_alive(control: &TcpStream) -> io::Result<()> {
    let mut byte = [0u8; 1];
    match control.peek(&mut byte) {
        Ok(0) => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed (EOF)",
        )),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "unexpected data on the shared-memory liveness channel",
        )),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
        Err(e) => Err(e),
    }
}

impl ShmLink {
    pub(crate) fn control(&self) -> &TcpStream {
        &self.control
    }

    pub(crate) fn configure(&self, timeout: Duration) -> io::Result<()> {
        // `timeout` was fixed at construction; the control socket only peeks.
        debug_assert_eq!(timeout, self.timeout);
        self.control.set_nonblocking(true)
    }

    pub(crate) fn write_all(&self, mut bytes: &[u8]) -> io::Result<()> {
        let mut waiter = Waiter::new(&self.control, Some(self.timeout));
        while !bytes.is_empty() {
            let written = self.tx.written().load(Ordering::Relaxed);
            let read = self.tx.read().load(Ordering::Acquire);
            let used = written.wrapping_sub(read);
            if used > RING_CAPACITY as u64 {
                return Err(corrupt());
            }
            let free = RING_CAPACITY - used as usize;
            if free == 0 {
                waiter.wait()?;
                continue;
            }
            let n = free.min(bytes.len());
            self.tx.copy_in(written, &bytes[..n]);
            self.tx
                .written()
                .store(written + n as u64, Ordering::Release);
            bytes = &bytes[n..];
            waiter.progress();
        }
        Ok(())
    }

    pub(crate) fn read_exact(&self, mut buf: &mut [u8], idle: bool) -> io::Result<()> {
        let timeout = if idle { None } else { Some(self.timeout) };
        let mut waiter = Waiter::new(&self.control, timeout);
        while !buf.is_empty() {
            let read = self.rx.read().load(Ordering::Relaxed);
            let written = self.rx.written().load(Ordering::Acquire);
            let available = written.wrapping_sub(read);
            if available > RING_CAPACITY as u64 {
                return Err(corrupt());
            }
            let available = available as usize;
            if available == 0 {
                waiter.wait()?;
                continue;
            }
            let n = available.min(buf.len());
            let (now, rest) = buf.split_at_mut(n);
            self.rx.copy_out(read, now);
            self.rx.read().store(read + n as u64, Ordering::Release);
            buf = rest;
            waiter.progress();
        }
        Ok(())
    }
}

/// The lower rank's half: a fresh ring file, mapped, and its nonce. The file
/// is unlinked when the offer is dropped (both sides have mapped it by then, or
/// setup has failed).
#[derive(Debug)]
pub(crate) struct Offer {
    pub(crate) path: PathBuf,
    pub(crate) nonce: u64,
    map: Option<MmapMut>,
}

impl Drop for Offer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Offer {
    /// Creates and maps a ring file for the link between `lower` and `higher`.
    pub(crate) fn create(lower: usize, higher: usize) -> io::Result<Offer> {
        let nonce = {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.write_usize(lower);
            h.write_usize(higher);
            h.finish()
        };
        let path = PathBuf::from(format!(
            "/dev/shm/tandem-comm-{}-{lower}-{higher}-{nonce:016x}",
            std::process::id()
        ));
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        let mut offer = Offer {
            path,
            nonce,
            map: None,
        };
        // Allocate every page now: ENOSPC here instead of SIGBUS later.
        file.write_all(&vec![0u8; FILE_BYTES])?;
        let mut map = map_file(&file)?;
        ring_at(&mut map, 0).nonce().store(nonce, Ordering::Release);
        offer.map = Some(map);
        Ok(offer)
    }

    /// The mapping, once the higher rank has proven it mapped the same file.
    pub(crate) fn take_map(mut self) -> Option<MmapMut> {
        self.map.take()
    }
}

/// The higher rank's half: maps the offered file; returns the nonce found in it.
pub(crate) fn accept_offer(path: &Path) -> io::Result<(MmapMut, u64)> {
    if !path.starts_with("/dev/shm") {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "ring file outside /dev/shm",
        ));
    }
    let file = OpenOptions::new().read(true).write(true).open(path)?;
    if file.metadata()?.len() != FILE_BYTES as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "ring file has the wrong size",
        ));
    }
    let mut map = map_file(&file)?;
    let nonce = ring_at(&mut map, 0).nonce().load(Ordering::Acquire);
    Ok((map, nonce))
}

/// A link over a ring mapping (`lower`: whether we are the lower rank).
pub(crate) fn link(
    mut map: MmapMut,
    lower: bool,
    control: TcpStream,
    timeout: Duration,
) -> ShmLink {
    let (tx, rx) = rings(&mut map, lower);
    ShmLink {
        _map: map,
        tx,
        rx,
        control,
        timeout,
    }
}

fn map_file(file: &File) -> io::Result<MmapMut> {
    // SAFETY: the file is a private, freshly created (or just verified-size)
    // file under /dev/shm that only the two ranks of this link open; neither
    // truncates it, so the mapping stays backed for its whole life. All
    // concurrent access to the shared bytes goes through `Ring`, which uses
    // atomics for the positions and copies only ranges the protocol reserves.
    unsafe { MmapMut::map_mut(file) }
}

/// Ring `index` (0 carries lower → higher, 1 higher → lower).
fn ring_at(map: &mut MmapMut, index: usize) -> Ring {
    let base = map.as_mut_ptr();
    Ring {
        // SAFETY: `index < 2`, so the offset stays inside the mapping.
        base: unsafe { base.add(index * RING_BYTES) },
    }
}

fn rings(map: &mut MmapMut, lower: bool) -> (Ring, Ring) {
    let base = map.as_mut_ptr();
    // SAFETY: both offsets lie inside the FILE_BYTES-long mapping.
    let (a, b) = unsafe { (base, base.add(RING_BYTES)) };
    if lower {
        (Ring { base: a }, Ring { base: b })
    } else {
        (Ring { base: b }, Ring { base: a })
    }
}
