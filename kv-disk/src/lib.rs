//! A local-disk tier under the KV pool.
//!
//! The engine's prefix cache forgets a block when the pool needs the
//! memory. With this tier, every block the cache names is also written
//! here (write-through, as SGLang HiCache's `write_through` policy), so a
//! block the pool evicted, or that a restarted worker never computed, can
//! be read back instead of recomputed.
//!
//! - **One file per block**, `DIR/<fingerprint>/<hash>.kvb`, in the
//!   versioned, checksummed [`format`]. The fingerprint names the model
//!   and KV layout; another model's store lives in another directory, and
//!   a file whose header names another fingerprint is skipped.
//! - **Off the engine thread.** [`DiskTier::offer`] queues a block for the
//!   writer thread and returns; a full queue drops the block (counted), it
//!   never stalls a step. [`DiskTier::load`] hands a run of hashes to the
//!   loader thread, which reads, verifies and returns them through
//!   [`DiskTier::poll`], so a restore overlaps the steps that run meanwhile.
//! - **Crash-safe.** A block is written to `<hash>.kvb.tmp` and renamed, so
//!   a killed process leaves whole files or a `.tmp` the next start
//!   deletes; every load checks both checksums, so a truncated or flipped
//!   file is a miss (deleted, logged, counted), never K/V in the pool.
//! - **A byte budget** ([`DiskTierConfig::budget_bytes`]), enforced after
//!   every write by deleting the least recently used blocks.
//! - **Warm restarts.** [`DiskTier::open`] scans the directory's headers
//!   (not payloads), so a restarted worker starts with its old blocks.

pub mod format;
mod index;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use format::{fingerprint, FormatError};
use index::{Index, State};

/// How a disk tier is set up.
#[derive(Debug, Clone)]
pub struct DiskTierConfig {
    /// The store lives in `dir/<fingerprint as 16 hex digits>`.
    pub dir: PathBuf,
    /// Most bytes of block files kept; the least recently used go first.
    pub budget_bytes: u64,
    /// Names the model and KV layout the blocks belong to.
    pub fingerprint: u64,
    /// f32 values in one block (every layer's K and V).
    pub block_values: usize,
    /// Blocks waiting for the writer at most; more are dropped.
    pub write_queue_blocks: usize,
}

impl DiskTierConfig {
    /// A store under `dir` of at most `budget_bytes`, for blocks of
    /// `block_values` values of the model `fingerprint` names.
    pub fn new(
        dir: impl Into<PathBuf>,
        budget_bytes: u64,
        fingerprint: u64,
        block_values: usize,
    ) -> Self {
        Self {
            dir: dir.into(),
            budget_bytes,
            fingerprint,
            block_values,
            write_queue_blocks: 256,
        }
    }

    /// Bounds the writer's queue (blocks).
    pub fn write_queue_blocks(mut self, blocks: usize) -> Self {
        self.write_queue_blocks = blocks.max(1);
        self
    }

    fn file_bytes(&self) -> u64 {
        (format::HEADER_BYTES + self.block_values * 4) as u64
    }
}

/// Why a disk tier could not start.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("the KV disk tier's directory {dir}: {source}")]
    Dir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "a KV block file takes {block} bytes; the disk tier's budget of {budget} bytes holds none"
    )]
    BudgetTooSmall { block: u64, budget: u64 },
    #[error("the KV disk tier in {dir} is in use by another process (each worker needs its own --kv-disk directory)")]
    Busy { dir: PathBuf },
    #[error("could not start the disk tier's {name} thread: {source}")]
    Thread {
        name: &'static str,
        source: std::io::Error,
    },
}

/// Counters and gauges of a disk tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskStats {
    /// Blocks on disk now, and their bytes (headers included).
    pub blocks: usize,
    pub bytes: u64,
    pub budget_bytes: u64,
    /// Blocks written, and their bytes.
    pub written_blocks: u64,
    pub written_bytes: u64,
    /// Blocks offered while the writer's queue was full (not written).
    pub write_dropped: u64,
    /// Writes that failed (a full disk, an I/O error).
    pub write_errors: u64,
    /// Blocks read back and verified, and their bytes.
    pub loaded_blocks: u64,
    pub loaded_bytes: u64,
    /// Loads refused: a corrupt, truncated, foreign or vanished file.
    pub load_failures: u64,
    /// Files skipped (and deleted) when the store was opened.
    pub skipped_files: u64,
    /// Blocks deleted to stay within the budget.
    pub evicted_blocks: u64,
    /// Load requests served, and their summed wall time.
    pub loads: u64,
    pub load_nanos: u64,
}

/// A run of blocks read back for [`DiskTier::load`]'s `ticket`: the
/// leading `blocks.len()` of the hashes asked for (fewer when one failed).
#[derive(Debug)]
pub struct Loaded {
    pub ticket: u64,
    pub hashes: Vec<u64>,
    pub blocks: Vec<Vec<f32>>,
    pub elapsed: Duration,
}

#[derive(Debug, Default)]
struct Counters {
    written_blocks: AtomicU64,
    written_bytes: AtomicU64,
    write_dropped: AtomicU64,
    write_errors: AtomicU64,
    loaded_blocks: AtomicU64,
    loaded_bytes: AtomicU64,
    load_failures: AtomicU64,
    skipped_files: AtomicU64,
    evicted_blocks: AtomicU64,
    loads: AtomicU64,
    load_nanos: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

#[derive(Debug)]
struct Shared {
    /// `config.dir/<fingerprint>`.
    dir: PathBuf,
    config: DiskTierConfig,
    index: Mutex<Index>,
    counters: Counters,
    /// Blocks that left the store after they were offered or found at
    /// start-up, for [`DiskTier::drain_forgotten`].
    forgotten: Mutex<Vec<u64>>,
}

impl Shared {
    /// Drops `hash` from the index and notes it for whoever announced it.
    fn forget(&self, hash: u64) {
        self.index().forget(hash);
        self.forgotten
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(hash);
    }

    fn index(&self) -> MutexGuard<'_, Index> {
        // Index updates cannot panic half-way; a poisoned lock still
        // guards consistent books.
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn path(&self, hash: u64) -> PathBuf {
        self.dir.join(format!("{hash:016x}.kvb"))
    }
}

enum Write {
    Block {
        hash: u64,
        parent: u64,
        values: Vec<f32>,
    },
    Flush(Sender<()>),
}

struct Load {
    ticket: u64,
    hashes: Vec<u64>,
}

/// The disk tier: the index, and the writer and loader threads.
#[derive(Debug)]
pub struct DiskTier {
    shared: Arc<Shared>,
    writes: Option<SyncSender<Write>>,
    loads: Option<Sender<Load>>,
    loaded: Receiver<Loaded>,
    threads: Vec<JoinHandle<()>>,
    /// Held open, locked, for the store's life: one process per store (the
    /// lock goes with the process, however it ends).
    _lock: std::fs::File,
}

impl std::fmt::Debug for Write {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Write::Block { hash, .. } => write!(f, "Write::Block({hash:016x})"),
            Write::Flush(_) => f.write_str("Write::Flush"),
        }
    }
}

impl DiskTier {
    /// Opens (or creates) the store, indexes the blocks already there and
    /// starts its threads.
    pub fn open(config: DiskTierConfig) -> Result<Self, DiskError> {
        if config.budget_bytes < config.file_bytes() {
            return Err(DiskError::BudgetTooSmall {
                block: config.file_bytes(),
                budget: config.budget_bytes,
            });
        }
        let dir = config.dir.join(format!("{:016x}", config.fingerprint));
        std::fs::create_dir_all(&dir).map_err(|source| DiskError::Dir {
            dir: dir.clone(),
            source,
        })?;
        let lock = lock_dir(&dir)?;
        let shared = Arc::new(Shared {
            index: Mutex::new(Index::new(config.budget_bytes)),
            dir,
            config: config.clone(),
            counters: Counters::default(),
            forgotten: Mutex::new(Vec::new()),
        });
        scan(&shared).map_err(|source| DiskError::Dir {
            dir: shared.dir.clone(),
            source,
        })?;
        let (writes, write_rx) = mpsc::sync_channel(config.write_queue_blocks);
        let (loads, load_rx) = mpsc::channel();
        let (loaded_tx, loaded) = mpsc::channel();
        let spawn = |name: &'static str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(format!("kv-disk-{name}"))
                .spawn(f)
                .map_err(|source| DiskError::Thread { name, source })
        };
        let s = shared.clone();
        let writer = spawn("writer", Box::new(move || write_loop(&s, &write_rx)))?;
        let s = shared.clone();
        let loader = spawn(
            "loader",
            Box::new(move || load_loop(&s, &load_rx, &loaded_tx)),
        )?;
        let (blocks, bytes) = shared.index().stored();
        tracing::info!(dir = %shared.dir.display(), blocks, bytes, budget = config.budget_bytes, "KV disk tier");
        Ok(Self {
            shared,
            writes: Some(writes),
            loads: Some(loads),
            loaded,
            threads: vec![writer, loader],
            _lock: lock,
        })
    }

    /// The directory holding this store's block files.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// Whether `hash` is on disk or queued for it (no need to offer it).
    pub fn knows(&self, hash: u64) -> bool {
        self.shared.index().state(hash).is_some()
    }

    /// How many leading `hashes` are on disk (loadable).
    pub fn stored_run(&self, hashes: &[u64]) -> usize {
        let ix = self.shared.index();
        hashes
            .iter()
            .take_while(|&&h| ix.state(h) == Some(State::Stored))
            .count()
    }

    /// Every block on disk and its parent, oldest use first.
    pub fn stored_blocks(&self) -> Vec<(u64, u64)> {
        self.shared.index().stored_chain_links()
    }

    /// Queues a block (`block_values` values) for writing; false when it is
    /// known already, the wrong size, or the writer's queue is full.
    pub fn offer(&self, hash: u64, parent: u64, values: Vec<f32>) -> bool {
        let Some(writes) = &self.writes else {
            return false;
        };
        if values.len() != self.shared.config.block_values || !self.shared.index().queue(hash) {
            return false;
        }
        match writes.try_send(Write::Block {
            hash,
            parent,
            values,
        }) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.shared.index().forget(hash);
                add(&self.shared.counters.write_dropped, 1);
                false
            }
        }
    }

    /// Blocks offered earlier, or found at start-up, that have left the
    /// store since the last call (a failed write, the budget, a corrupt
    /// file), oldest first.
    pub fn drain_forgotten(&self) -> Vec<u64> {
        std::mem::take(
            &mut *self
                .shared
                .forgotten
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }

    /// Waits until every block offered so far is written (or failed).
    pub fn flush(&self) {
        let Some(writes) = &self.writes else {
            return;
        };
        let (tx, rx) = mpsc::channel();
        if writes.send(Write::Flush(tx)).is_ok() {
            let _ = rx.recv();
        }
    }

    /// Asks the loader for `hashes` (a run of one prompt's blocks); the
    /// answer comes back through [`poll`](Self::poll) under `ticket`.
    pub fn load(&self, ticket: u64, hashes: Vec<u64>) {
        if let Some(loads) = &self.loads {
            let _ = loads.send(Load { ticket, hashes });
        }
    }

    /// Loads finished since the last call.
    pub fn poll(&self) -> Vec<Loaded> {
        let mut out = Vec::new();
        loop {
            match self.loaded.try_recv() {
                Ok(l) => out.push(l),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => return out,
            }
        }
    }

    /// Waits at most `timeout` for one finished load.
    pub fn wait(&self, timeout: Duration) -> Option<Loaded> {
        self.loaded.recv_timeout(timeout).ok()
    }

    /// Counters and gauges.
    pub fn stats(&self) -> DiskStats {
        self.shared.stats()
    }

    /// A handle that reads [`stats`](Self::stats) from another thread (the
    /// tier's counters move as its threads work, between engine steps).
    pub fn stats_reader(&self) -> DiskStatsReader {
        DiskStatsReader(self.shared.clone())
    }
}

/// Reads a [`DiskTier`]'s counters from anywhere; cheap to clone.
#[derive(Debug, Clone)]
pub struct DiskStatsReader(Arc<Shared>);

impl DiskStatsReader {
    pub fn stats(&self) -> DiskStats {
        self.0.stats()
    }
}

impl Shared {
    fn stats(&self) -> DiskStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (blocks, bytes) = self.index().stored();
        DiskStats {
            blocks,
            bytes,
            budget_bytes: self.config.budget_bytes,
            written_blocks: get(&c.written_blocks),
            written_bytes: get(&c.written_bytes),
            write_dropped: get(&c.write_dropped),
            write_errors: get(&c.write_errors),
            loaded_blocks: get(&c.loaded_blocks),
            loaded_bytes: get(&c.loaded_bytes),
            load_failures: get(&c.load_failures),
            skipped_files: get(&c.skipped_files),
            evicted_blocks: get(&c.evicted_blocks),
            loads: get(&c.loads),
            load_nanos: get(&c.load_nanos),
        }
    }
}

impl Drop for DiskTier {
    /// Writes what is queued, then stops the threads.
    fn drop(&mut self) {
        self.writes.take();
        self.loads.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The store's lock file, locked for this process.
const LOCK_FILE: &str = "LOCK";

fn lock_dir(dir: &Path) -> Result<std::fs::File, DiskError> {
    let path = dir.join(LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|source| DiskError::Dir {
            dir: dir.to_path_buf(),
            source,
        })?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(DiskError::Busy {
            dir: dir.to_path_buf(),
        }),
        Err(std::fs::TryLockError::Error(source)) => Err(DiskError::Dir {
            dir: dir.to_path_buf(),
            source,
        }),
    }
}

/// The hash a block file's name gives, if it is one of ours.
fn named_hash(name: &str) -> Option<u64> {
    let hex = name.strip_suffix(".kvb")?;
    (hex.len() == 16)
        .then(|| u64::from_str_radix(hex, 16).ok())
        .flatten()
}

/// Indexes the store's block files by their headers, oldest first;
/// deletes leftover `.tmp` files and block files that fail a header check.
fn scan(shared: &Shared) -> std::io::Result<()> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&shared.dir)? {
        let entry = entry?;
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == LOCK_FILE {
            continue;
        }
        if name.ends_with(".kvb.tmp") {
            // A write a crash interrupted.
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let Some(hash) = named_hash(&name) else {
            tracing::warn!(file = %path.display(), "not a KV block file; left alone");
            continue;
        };
        match check_header(shared, &path, hash) {
            Ok((parent, bytes, modified)) => found.push((modified, hash, parent, bytes)),
            Err(why) => {
                tracing::warn!(file = %path.display(), error = %why, "skipped a KV block file");
                add(&shared.counters.skipped_files, 1);
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    found.sort_unstable();
    let mut ix = shared.index();
    for (_, hash, parent, bytes) in found {
        for gone in ix.stored_block(hash, parent, bytes) {
            add(&shared.counters.evicted_blocks, 1);
            let _ = std::fs::remove_file(shared.path(gone));
        }
    }
    Ok(())
}

/// Why a block file was skipped at start-up.
#[derive(Debug, thiserror::Error)]
enum ScanError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("{found} bytes on disk, the header says {expected}")]
    Length { found: u64, expected: u64 },
}

fn check_header(
    shared: &Shared,
    path: &Path,
    hash: u64,
) -> Result<(u64, u64, std::time::SystemTime), ScanError> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let meta = file.metadata()?;
    let mut head = [0u8; format::HEADER_BYTES];
    let got = file.read(&mut head)?;
    let header = format::Header::decode(&head[..got])?;
    let cfg = &shared.config;
    header.check(cfg.fingerprint, hash, (cfg.block_values * 4) as u64)?;
    if meta.len() != cfg.file_bytes() {
        return Err(ScanError::Length {
            found: meta.len(),
            expected: cfg.file_bytes(),
        });
    }
    let modified = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
    Ok((header.parent, meta.len(), modified))
}

fn write_loop(shared: &Shared, jobs: &Receiver<Write>) {
    for job in jobs {
        match job {
            Write::Flush(done) => {
                let _ = done.send(());
            }
            Write::Block {
                hash,
                parent,
                values,
            } => write_block(shared, hash, parent, &values),
        }
    }
}

fn write_block(shared: &Shared, hash: u64, parent: u64, values: &[f32]) {
    let bytes = format::encode(shared.config.fingerprint, hash, parent, values);
    let path = shared.path(hash);
    let tmp = path.with_extension("kvb.tmp");
    let written = std::fs::write(&tmp, &bytes).and_then(|()| std::fs::rename(&tmp, &path));
    let c = &shared.counters;
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        shared.forget(hash);
        let errors = c.write_errors.fetch_add(1, Ordering::Relaxed);
        // A full disk fails every write: log the first and every 1000th.
        if errors.is_multiple_of(1000) {
            tracing::warn!(file = %path.display(), error = %e, errors = errors + 1, "KV block write failed");
        }
        return;
    }
    add(&c.written_blocks, 1);
    add(&c.written_bytes, bytes.len() as u64);
    let evicted = shared
        .index()
        .stored_block(hash, parent, bytes.len() as u64);
    for gone in evicted {
        add(&c.evicted_blocks, 1);
        let _ = std::fs::remove_file(shared.path(gone));
        shared
            .forgotten
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(gone);
    }
}

fn load_loop(shared: &Shared, jobs: &Receiver<Load>, out: &Sender<Loaded>) {
    for Load { ticket, hashes } in jobs {
        let start = Instant::now();
        let mut blocks = Vec::with_capacity(hashes.len());
        for &hash in &hashes {
            match read_block(shared, hash) {
                Ok(values) => blocks.push(values),
                Err(why) => {
                    add(&shared.counters.load_failures, 1);
                    if shared.index().state(hash).is_some() {
                        shared.forget(hash);
                    }
                    let path = shared.path(hash);
                    tracing::warn!(file = %path.display(), error = %why, "KV block not loaded; it will be recomputed");
                    let _ = std::fs::remove_file(path);
                    break;
                }
            }
        }
        let elapsed = start.elapsed();
        let c = &shared.counters;
        add(&c.loads, 1);
        add(&c.load_nanos, elapsed.as_nanos() as u64);
        add(&c.loaded_blocks, blocks.len() as u64);
        add(
            &c.loaded_bytes,
            (blocks.len() as u64) * shared.config.file_bytes(),
        );
        let loaded = Loaded {
            ticket,
            hashes,
            blocks,
            elapsed,
        };
        if out.send(loaded).is_err() {
            return;
        }
    }
}

fn read_block(shared: &Shared, hash: u64) -> Result<Vec<f32>, ScanError> {
    let bytes = std::fs::read(shared.path(hash))?;
    let cfg = &shared.config;
    let (_, values) = format::decode(&bytes, cfg.fingerprint, hash, cfg.block_values)?;
    shared.index().touch(hash);
    Ok(values)
}
