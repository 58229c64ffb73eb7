//! The safe layer over `tandem-ucx-sys`: a UCX context, one worker owned by
//! a dedicated progress thread, registered memory regions, and the few
//! operations the transport needs (connect, put + flush + notice, a notice
//! carrying its blocks, close).
//!
//! Ownership and threads:
//!
//! - [`Context`] (`ucp_context_h`) is shared (`Arc`) by the worker and by
//!   every [`Region`]; it is created with `mt_workers_shared` so memory can
//!   be mapped and unmapped from any thread, and cleaned up last.
//! - The worker (`ucp_worker_h`) and every endpoint and rkey live on the
//!   progress thread only (`UCS_THREAD_MODE_SINGLE`); tokio tasks talk to it
//!   through [`Runtime`]'s command queue plus an eventfd that wakes it. When
//!   idle the thread arms the worker and sleeps in `poll(2)` on the worker's
//!   event fd and the eventfd, so an idle transport costs no CPU.
//! - A [`Region`] owns its `ucp_mem_map`ped memory and unmaps it on drop,
//!   which happens only once the last `Arc` (the connection using it) is
//!   gone.
//! - Buffers a put or an active message reads from (`Bytes`, `Vec`) are
//!   owned by the in-flight operation on the progress thread and dropped
//!   only after UCX has reported the operation complete (or failed), or
//!   after the worker is destroyed.
//! - A message's payload lands in its connection's region: copied there by
//!   the active-message handler when UCX delivered it eagerly, or received
//!   there by `ucp_am_recv_data_nbx` (rendezvous). Such a receive holds an
//!   `Arc` of the region, so the region stays mapped until the receive has
//!   completed or failed, even if its connection is gone by then.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr;
use std::rc::Rc;
use std::sync::atomic::{AtomicI8, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tandem_ucx_sys as sys;
use tokio::sync::{mpsc, oneshot};

use crate::TransferError;

/// The active-message id of every sender → receiver message.
pub(crate) const AM_ID: u32 = 0x7d;
/// Bytes of the fixed part of an active message's header: connection id,
/// sequence number, and where its payload lands (first slot, slot count).
/// The rest of the header is the message body (the notice).
pub(crate) const AM_HEADER: usize = 24;
/// UCX settings for KV transfer, names without the `UCX_` prefix:
/// segments of 1 MiB for the `tcp` transport (8 KiB / 64 KiB by default).
/// Rendezvous over `tcp` moves its data in segments, one system call each.
/// See [`tuning_env`] for how they are applied.
pub const TUNING: &[(&str, &str)] = &[("TCP_TX_SEG_SIZE", "1M"), ("TCP_RX_SEG_SIZE", "1M")];

/// The [`TUNING`] settings the environment does not set, as `UCX_<name>`
/// variables, for a binary to export at start, before it starts threads.
/// UCX takes transport settings only from the environment: in UCX 1.13
/// `ucp_config_modify` accepts `TCP_RX_SEG_SIZE` but the `tcp` transport
/// never sees it. Whatever the operator sets wins.
pub fn tuning_env() -> Vec<(String, String)> {
    TUNING
        .iter()
        .map(|(name, value)| (format!("UCX_{name}"), value.to_string()))
        .filter(|(name, _)| std::env::var_os(name).is_none())
        .collect()
}
/// How long dropping the runtime waits for endpoints to close.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// Progress rounds without any event before the thread sleeps in `poll`.
const IDLE_SPINS: u32 = 64;

fn status_str(status: sys::ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a pointer to a static, NUL-terminated
    // string for every status value (unknown ones included).
    let s = unsafe { std::ffi::CStr::from_ptr(sys::ucs_status_string(status)) };
    s.to_string_lossy().into_owned()
}

fn check(status: sys::ucs_status_t, what: &str) -> Result<(), TransferError> {
    if status == sys::ucs_status_t::UCS_OK {
        Ok(())
    } else {
        Err(TransferError::Config(format!(
            "UCX: {what} failed: {}",
            status_str(status)
        )))
    }
}

/// A `ucp_context_h`, configured from the `UCX_*` environment variables.
#[derive(Debug)]
pub(crate) struct Context {
    raw: sys::ucp_context_h,
}

// SAFETY: the context is created with `mt_workers_shared = 1`, which makes
// UCX serialise context-level calls (mem_map/unmap, rkey_pack) internally;
// the handle itself is an opaque pointer valid until `ucp_cleanup`.
unsafe impl Send for Context {}
// SAFETY: as above; every method takes `&self` and calls thread-safe UCX
// context functions.
unsafe impl Sync for Context {}

impl Context {
    /// Reads the UCX configuration (`UCX_TLS`, `UCX_NET_DEVICES`, ... from
    /// the environment), applies `overrides` (`("TLS", "tcp")`: names
    /// without the `UCX_` prefix) on top, and initialises UCP for RMA,
    /// active messages and wakeup.
    pub(crate) fn new(overrides: &[(String, String)]) -> Result<Arc<Self>, TransferError> {
        let mut config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: null prefix and file mean "UCX_ from the environment";
        // `config` is a valid out-pointer.
        check(
            unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut config) },
            "reading the configuration (ucp_config_read; check the UCX_* variables)",
        )?;
        for (name, value) in overrides {
            let c = |s: &str| {
                std::ffi::CString::new(s).map_err(|_| {
                    TransferError::Config(format!("UCX setting {name:?} contains a NUL byte"))
                })
            };
            let modified = c(name).and_then(|n| {
                let v = c(value)?;
                // SAFETY: valid config and NUL-terminated strings for the call.
                Ok(unsafe { sys::ucp_config_modify(config, n.as_ptr(), v.as_ptr()) })
            });
            let failed = match modified {
                Ok(status) => check(status, &format!("setting UCX_{name}={value}")).err(),
                Err(e) => Some(e),
            };
            if let Some(e) = failed {
                // SAFETY: read above, released once.
                unsafe { sys::ucp_config_release(config) };
                return Err(e);
            }
        }
        let params = sys::ucp_params_t {
            field_mask: (sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED)
                as u64,
            features: (sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP) as u64,
            mt_workers_shared: 1,
            ..Default::default()
        };
        let mut raw: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: `params` and `config` are valid for the call; `raw` is a
        // valid out-pointer. The config is released right after, as the API
        // allows once the context exists.
        let status = unsafe {
            let status = sys::ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                config,
                &mut raw,
            );
            sys::ucp_config_release(config);
            status
        };
        check(status, "initialising UCP (ucp_init)")?;
        Ok(Arc::new(Self { raw }))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every worker and region holds an `Arc<Context>`, so this
        // runs after all of them were destroyed/unmapped.
        unsafe { sys::ucp_cleanup(self.raw) }
    }
}

/// Memory allocated and registered by UCX (`ucp_mem_map` with
/// `UCP_MEM_MAP_ALLOCATE`, so shared-memory transports can map it), unmapped
/// when dropped.
#[derive(Debug)]
pub(crate) struct Region {
    ctx: Arc<Context>,
    memh: sys::ucp_mem_h,
    addr: *mut u8,
    len: usize,
}

// SAFETY: the handle and address stay valid until `Drop`; unmapping through
// the context is thread-safe (see `Context`). Readers only take shared views.
unsafe impl Send for Region {}
// SAFETY: `read` hands out shared slices only; writes come from peers via
// UCX, ordered by the protocol (see `read`).
unsafe impl Sync for Region {}

impl Region {
    /// Allocates and registers `len` bytes.
    pub(crate) fn new(ctx: Arc<Context>, len: usize) -> Result<Self, TransferError> {
        if len == 0 {
            return Err(TransferError::Config(
                "UCX: cannot register an empty region".into(),
            ));
        }
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS) as u64,
            address: ptr::null_mut(),
            length: len,
            flags: sys::UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: valid context, params and out-pointer.
        check(
            unsafe { sys::ucp_mem_map(ctx.raw, &params, &mut memh) },
            "registering the receive region (ucp_mem_map)",
        )?;
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: (sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH) as u64,
            ..Default::default()
        };
        // SAFETY: `memh` was just mapped; `attr` is a valid out-struct.
        let status = unsafe { sys::ucp_mem_query(memh, &mut attr) };
        if status != sys::ucs_status_t::UCS_OK || attr.address.is_null() || attr.length < len {
            // SAFETY: unmapping the handle mapped above, once.
            unsafe { sys::ucp_mem_unmap(ctx.raw, memh) };
            return Err(TransferError::Config(format!(
                "UCX: querying the registered region failed: {}",
                status_str(status)
            )));
        }
        Ok(Self {
            ctx,
            memh,
            addr: attr.address.cast(),
            len,
        })
    }

    /// The region's address as peers use it in `ucp_put_nbx`.
    pub(crate) fn remote_addr(&self) -> u64 {
        self.addr as u64
    }

    /// The remote key peers need to write into the region.
    pub(crate) fn pack_rkey(&self) -> Result<Vec<u8>, TransferError> {
        let mut buf: *mut c_void = ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: valid context and memh; out-pointers valid.
        check(
            unsafe { sys::ucp_rkey_pack(self.ctx.raw, self.memh, &mut buf, &mut size) },
            "packing the remote key (ucp_rkey_pack)",
        )?;
        // SAFETY: UCX returned `size` readable bytes at `buf`; they are
        // copied before the buffer is released, once.
        let packed = unsafe {
            let packed = std::slice::from_raw_parts(buf.cast::<u8>(), size).to_vec();
            sys::ucp_rkey_buffer_release(buf);
            packed
        };
        Ok(packed)
    }

    /// `len` bytes at `offset`, or `None` when out of bounds.
    ///
    /// Peers write into the region with RMA. The protocol makes a range
    /// readable only after its writer flushed and announced it, and reusable
    /// by the writer only after the reader returned it (credits), so no
    /// write races this view; a peer that broke that rule could only garble
    /// the KV bytes it itself sent.
    pub(crate) fn read(&self, offset: usize, len: usize) -> Option<&[u8]> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        std::sync::atomic::fence(Ordering::Acquire);
        // SAFETY: `offset..end` lies inside the mapped allocation, which
        // lives as long as `self`; see above for concurrent writers.
        Some(unsafe { std::slice::from_raw_parts(self.addr.add(offset), len) })
    }

    /// The address of `len` bytes at `offset`, for UCX to receive into, or
    /// `None` when out of bounds. The same protocol rule as for `read`
    /// applies: only ranges the sender holds credits for are written.
    fn range_ptr(&self, offset: usize, len: usize) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        // SAFETY: `offset <= end <= self.len`, inside the allocation.
        (end <= self.len).then(|| unsafe { self.addr.add(offset) })
    }

    /// Copies `bytes` to `offset`; false when out of bounds.
    fn write(&self, offset: usize, bytes: &[u8]) -> bool {
        let Some(dst) = self.range_ptr(offset, bytes.len()) else {
            return false;
        };
        // SAFETY: the destination range is inside the mapped allocation and
        // does not overlap `bytes` (which UCX owns); see `range_ptr` for
        // concurrent readers.
        unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) };
        std::sync::atomic::fence(Ordering::Release);
        true
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: mapped in `new`, unmapped exactly once here; no `read`
        // view can outlive `&self`.
        unsafe { sys::ucp_mem_unmap(self.ctx.raw, self.memh) };
    }
}

/// One message a receiver got for one of its connections.
#[derive(Debug)]
pub(crate) struct AmMsg {
    pub(crate) seq: u64,
    pub(crate) body: Vec<u8>,
}

/// Where the progress thread delivers one connection's messages and lands
/// their payloads.
#[derive(Debug)]
pub(crate) struct Route {
    pub(crate) queue: mpsc::Sender<AmMsg>,
    pub(crate) region: Arc<Region>,
    pub(crate) slot_bytes: usize,
    pub(crate) slots: u32,
}

impl Route {
    /// The region ranges (offset, length) a payload of `length` bytes for
    /// `count` slots from `first` lands in: one, or two where it wraps
    /// around the ring. `None` when it does not fit the ring exactly.
    fn landing(&self, first: u32, count: u32, length: usize) -> Option<Vec<(usize, usize)>> {
        if count == 0 || first >= self.slots || count > self.slots {
            return None;
        }
        if length != (count as usize).checked_mul(self.slot_bytes)? {
            return None;
        }
        let head = count.min(self.slots - first);
        let mut ranges = vec![(
            first as usize * self.slot_bytes,
            head as usize * self.slot_bytes,
        )];
        if count > head {
            ranges.push((0, (count - head) as usize * self.slot_bytes));
        }
        Some(ranges)
    }
}

/// Connection id → its route.
pub(crate) type Routes = Mutex<HashMap<u64, Route>>;

/// A message header: the fixed part (see [`AM_HEADER`]) then `body`.
pub(crate) fn am_header(conn: u64, seq: u64, first_slot: u32, slots: u32, body: &[u8]) -> Vec<u8> {
    let mut h = Vec::with_capacity(AM_HEADER + body.len());
    h.extend_from_slice(&conn.to_le_bytes());
    h.extend_from_slice(&seq.to_le_bytes());
    h.extend_from_slice(&first_slot.to_le_bytes());
    h.extend_from_slice(&slots.to_le_bytes());
    h.extend_from_slice(body);
    h
}

/// The fixed part of a header: (connection, sequence, first slot, slots).
pub(crate) fn parse_am_header(h: &[u8]) -> Option<(u64, u64, u32, u32)> {
    let u64_at = |i: usize| Some(u64::from_le_bytes(h.get(i..i + 8)?.try_into().ok()?));
    let u32_at = |i: usize| Some(u32::from_le_bytes(h.get(i..i + 4)?.try_into().ok()?));
    Some((u64_at(0)?, u64_at(8)?, u32_at(16)?, u32_at(20)?))
}

/// Identifies an endpoint on the progress thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct EpId(u64);

/// One put of a batch: local bytes to a remote address.
#[derive(Debug)]
pub(crate) struct Put {
    pub(crate) bytes: Bytes,
    pub(crate) remote_addr: u64,
}

/// How a message's blocks travel.
#[derive(Debug)]
pub(crate) enum Payload {
    /// RMA puts into the peer's region, flushed before the message is sent
    /// (the message then carries no data). Empty for control messages.
    Put(Vec<Put>),
    /// The buffers, in order, as the message's data (UCX sends it eagerly
    /// or by rendezvous, by size), landing in the slots the header names.
    /// Buffers adjacent in memory go as one contiguous range: UCX 1.13's
    /// rendezvous over tcp moves a scatter-gather list at a seventh of the
    /// speed of one contiguous buffer (see [`contiguous_ranges`]).
    Send(Vec<Bytes>),
}

/// Pieces (address, length, destination) merged into runs: a piece joins
/// the previous run where both its source and its destination continue it.
fn merge_runs(
    pieces: impl IntoIterator<Item = (*const u8, usize, u64)>,
) -> Vec<(*const u8, usize, u64)> {
    let mut runs: Vec<(*const u8, usize, u64)> = Vec::new();
    for (start, len, dst) in pieces.into_iter().filter(|p| p.1 > 0) {
        match runs.last_mut() {
            Some((run, run_len, run_dst))
                if run.wrapping_add(*run_len) == start
                    && run_dst.wrapping_add(*run_len as u64) == dst =>
            {
                *run_len += len;
            }
            _ => runs.push((start, len, dst)),
        }
    }
    runs
}

/// `buffers` as (address, length) ranges, adjacent ones merged.
pub(crate) fn contiguous_ranges(buffers: &[Bytes]) -> Vec<(*const u8, usize)> {
    // Sent in order, each buffer's destination continues the previous one.
    let mut at = 0u64;
    let pieces = buffers.iter().map(|b| {
        let piece = (b.as_ptr(), b.len(), at);
        at += b.len() as u64;
        piece
    });
    merge_runs(pieces)
        .into_iter()
        .map(|(start, len, _)| (start, len))
        .collect()
}

/// `puts` as (address, length, remote address), a put merged into the
/// previous one where both its source and its destination continue it: a
/// contiguous batch into consecutive slots is one put (two where the ring
/// wraps), not one per K and V.
pub(crate) fn merged_puts(puts: &[Put]) -> Vec<(*const u8, usize, u64)> {
    merge_runs(
        puts.iter()
            .map(|p| (p.bytes.as_ptr(), p.bytes.len(), p.remote_addr)),
    )
}

/// A connected endpoint.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Connected {
    pub(crate) ep: EpId,
    /// Whether the transports UCX chose for it do RMA natively (see
    /// `native_rma`).
    pub(crate) native_rma: bool,
}

enum Op {
    Connect {
        address: Vec<u8>,
        rkey: Vec<u8>,
        reply: oneshot::Sender<Result<Connected, TransferError>>,
    },
    /// Puts (then a flush) or data, and the active message.
    Batch {
        ep: EpId,
        payload: Payload,
        header: Vec<u8>,
        reply: oneshot::Sender<Result<(), TransferError>>,
    },
    Close(EpId),
}

/// The handle tokio code holds: commands to the progress thread.
#[derive(Debug)]
pub(crate) struct Runtime {
    ctx: Arc<Context>,
    ops: std_mpsc::Sender<Op>,
    wake: Arc<OwnedFd>,
    address: Vec<u8>,
    max_am_header: usize,
    routes: Arc<Routes>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Runtime {
    /// Creates the context, the worker and its progress thread.
    pub(crate) fn start(overrides: &[(String, String)]) -> Result<Self, TransferError> {
        let ctx = Context::new(overrides)?;
        // SAFETY: plain eventfd(2) call; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(TransferError::io(
                "creating the UCX progress eventfd",
                &std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let routes: Arc<Routes> = Arc::default();
        let (ops, queue) = std_mpsc::channel();
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let thread = {
            let (ctx, wake, routes) = (ctx.clone(), wake.clone(), routes.clone());
            std::thread::Builder::new()
                .name("ucx-progress".into())
                .spawn(move || {
                    let worker = match Worker::new(ctx, routes) {
                        Ok(w) => w,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok((worker.address.clone(), worker.max_am_header)));
                    worker.run(queue, &wake);
                })
                .map_err(|e| TransferError::io("starting the UCX progress thread", &e))?
        };
        let (address, max_am_header) = ready_rx.recv().map_err(|_| {
            TransferError::Config("UCX: the progress thread died while starting".into())
        })??;
        Ok(Self {
            ctx,
            ops,
            wake,
            address,
            max_am_header,
            routes,
            thread: Some(thread),
        })
    }

    pub(crate) fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// This worker's packed address, for peers' `ucp_ep_create`.
    pub(crate) fn address(&self) -> &[u8] {
        &self.address
    }

    /// The largest active-message header (fixed part and body) the worker
    /// can send.
    pub(crate) fn max_am_header(&self) -> usize {
        self.max_am_header
    }

    pub(crate) fn routes(&self) -> &Arc<Routes> {
        &self.routes
    }

    fn send(&self, op: Op) -> Result<(), TransferError> {
        self.ops.send(op).map_err(|_| {
            TransferError::ConnectionLost("the UCX progress thread has stopped".into())
        })?;
        let one = 1u64.to_ne_bytes();
        // SAFETY: writing 8 bytes from a live buffer to our eventfd; a full
        // counter (EAGAIN) still leaves the thread woken.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        Ok(())
    }

    /// Opens an endpoint to the worker at `address` and unpacks `rkey` on it.
    pub(crate) async fn connect(
        &self,
        address: Vec<u8>,
        rkey: Vec<u8>,
    ) -> Result<Connected, TransferError> {
        let (reply, rx) = oneshot::channel();
        self.send(Op::Connect {
            address,
            rkey,
            reply,
        })?;
        rx.await.map_err(|_| {
            TransferError::ConnectionLost("the UCX progress thread has stopped".into())
        })?
    }

    /// Sends one active message with `header` (see [`am_header`]) and its
    /// payload: puts, flushed first (the data is then in the peer's memory),
    /// or the message's own data. The receiver resolves when the message is
    /// sent (for a rendezvous, received) or anything failed.
    pub(crate) fn batch(
        &self,
        ep: EpId,
        payload: Payload,
        header: Vec<u8>,
    ) -> Result<oneshot::Receiver<Result<(), TransferError>>, TransferError> {
        let (reply, rx) = oneshot::channel();
        self.send(Op::Batch {
            ep,
            payload,
            header,
            reply,
        })?;
        Ok(rx)
    }

    /// Force-closes an endpoint; its pending operations fail.
    pub(crate) fn close(&self, ep: EpId) {
        let _ = self.send(Op::Close(ep));
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // Disconnect the queue, wake the thread, wait for it to close its
        // endpoints and destroy the worker.
        let (dead, _) = std_mpsc::channel();
        drop(std::mem::replace(&mut self.ops, dead));
        let one = 1u64.to_ne_bytes();
        // SAFETY: as in `send`.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Status cell an endpoint's error callback writes (`UCS_OK` while healthy).
#[derive(Debug, Default)]
struct EpStatus(AtomicI8);

struct EpEntry {
    ep: sys::ucp_ep_h,
    rkey: sys::ucp_rkey_h,
    /// Opened with `UCP_ERR_HANDLING_MODE_PEER`: only such an endpoint may
    /// be force-closed (UCX leaves a force close without peer error
    /// handling undefined; 1.13 aborts on the peer's late wireup reply).
    peer_errors: bool,
    /// Boxed so its address, given to UCX as the error handler's argument,
    /// is stable.
    status: Box<EpStatus>,
}

enum Stage {
    Flushing(*mut c_void),
    Sending(*mut c_void),
}

/// A batch between its puts and its active message's completion. Owns the
/// buffers UCX reads from until then. UCX holds pointers into the heap
/// buffers of `header`, `iov` and the payload, which do not move when the
/// flight does (into and within `Worker::flights`).
struct Flight {
    ep: EpId,
    stage: Stage,
    payload: Payload,
    /// The scatter-gather list of a `Payload::Send`, built when it is sent.
    iov: Vec<sys::ucp_dt_iov_t>,
    header: Vec<u8>,
    reply: oneshot::Sender<Result<(), TransferError>>,
}

/// A rendezvous payload being received into a connection's region.
struct Receive {
    req: *mut c_void,
    conn: u64,
    /// Delivered to the connection once the payload has landed.
    msg: AmMsg,
    /// UCX writes through these until the receive completes.
    _iov: Vec<sys::ucp_dt_iov_t>,
    /// Keeps the region mapped until then.
    _region: Arc<Region>,
}

/// What the active-message handler works with: the routes, the worker (to
/// start rendezvous receives) and the receives in progress. Lives on the
/// progress thread only (`Rc`, `RefCell`), as the handler runs inside
/// `ucp_worker_progress` there.
struct AmState {
    routes: Arc<Routes>,
    worker: Cell<sys::ucp_worker_h>,
    receives: RefCell<Vec<Receive>>,
}

struct Worker {
    raw: sys::ucp_worker_h,
    efd: i32,
    address: Vec<u8>,
    max_am_header: usize,
    /// Kept alive for the AM handler's `arg` pointer.
    am: Rc<AmState>,
    eps: HashMap<EpId, EpEntry>,
    next_ep: u64,
    flights: Vec<Flight>,
    closing: Vec<*mut c_void>,
    /// Whether to ask for `UCP_ERR_HANDLING_MODE_PEER` (see `connect`).
    peer_failure_handling: bool,
    /// Error cells of closed endpoints (see `close`); boxed because UCX
    /// holds their addresses, which must not move when the Vec grows.
    #[allow(clippy::vec_box)]
    retired: Vec<Box<EpStatus>>,
    /// Owns the worker's context reference: the context is cleaned up
    /// after the worker is destroyed.
    _ctx: Arc<Context>,
}

/// Hands `msg` to connection `conn`'s queue; a full queue (the peer outran
/// its credits) or a closed one fails the connection (drops its route).
fn deliver(routes: &mut HashMap<u64, Route>, conn: u64, msg: AmMsg) {
    if let Some(route) = routes.get(&conn) {
        if route.queue.try_send(msg).is_err() {
            routes.remove(&conn);
        }
    }
}

/// Where a payload went.
enum Landing {
    /// In the region already.
    Done,
    /// Being received (rendezvous).
    Pending(*mut c_void, Vec<sys::ucp_dt_iov_t>),
}

/// Lands a message's payload (`length` bytes at `data`, or the rendezvous
/// descriptor `data`) in `count` slots of `route`'s region from `first`.
/// An error fails the connection.
///
/// # Safety
/// `data` and `length` as UCX passed them to the handler, which is running;
/// `worker` is the worker the handler runs on.
unsafe fn land(
    worker: sys::ucp_worker_h,
    route: &Route,
    data: *mut c_void,
    length: usize,
    rndv: bool,
    first: u32,
    count: u32,
) -> Result<Landing, ()> {
    let ranges = route.landing(first, count, length).ok_or(())?;
    if !rndv {
        if data.is_null() {
            return Err(());
        }
        // SAFETY: eager data: `length` readable bytes at `data` for the
        // handler's duration (the caller's contract).
        let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) };
        let mut at = 0;
        for (offset, len) in ranges {
            if !route.region.write(offset, &bytes[at..at + len]) {
                return Err(());
            }
            at += len;
        }
        return Ok(Landing::Done);
    }
    let mut iov = Vec::with_capacity(ranges.len());
    for (offset, len) in ranges {
        let buffer = route.region.range_ptr(offset, len).ok_or(())?;
        iov.push(sys::ucp_dt_iov_t {
            buffer: buffer.cast(),
            length: len,
        });
    }
    // One range (the ring did not wrap) is received as a contiguous buffer.
    let (buffer, count, param) = match iov.as_slice() {
        [one] => (one.buffer, one.length, request_param(0)),
        many => (many.as_ptr().cast_mut().cast(), many.len(), iov_param()),
    };
    // SAFETY: `data` is a rendezvous descriptor UCX handed to the running
    // handler (received once, here); the buffer or list points into the
    // mapped region, and both the list (moved into the `Receive`, its heap
    // buffer does not move) and the region (an `Arc` in the `Receive`) live
    // until the request completes.
    let ptr = unsafe { sys::ucp_am_recv_data_nbx(worker, data, buffer, count, &param) };
    match started(ptr, "receive") {
        Ok(Started::Done) => Ok(Landing::Done),
        Ok(Started::Pending(req)) => Ok(Landing::Pending(req, iov)),
        Err(_) => Err(()),
    }
}

/// The active-message handler: lands the payload, if any, in the
/// connection's region, then (for a rendezvous, once received) queues the
/// message for the connection; drops messages for unknown (closed)
/// connections.
unsafe extern "C" fn on_am(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is `Rc::as_ptr` of the worker's `AmState`, alive as long
    // as the worker, whose progress (on this thread) is the only caller.
    let state = unsafe { &*arg.cast::<AmState>() };
    if header_length < AM_HEADER || header.is_null() {
        return sys::ucs_status_t::UCS_OK;
    }
    // SAFETY: UCX passes `header_length` readable bytes at `header`.
    let header = unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) };
    let Some((conn, seq, first, count)) = parse_am_header(header) else {
        return sys::ucs_status_t::UCS_OK;
    };
    // SAFETY: `param` is valid for the callback's duration.
    let rndv = unsafe { param.as_ref() }
        .is_some_and(|p| p.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0);
    let msg = AmMsg {
        seq,
        body: header[AM_HEADER..].to_vec(),
    };
    let mut routes = state.routes.lock().unwrap_or_else(PoisonError::into_inner);
    let Some(route) = routes.get(&conn) else {
        return sys::ucs_status_t::UCS_OK;
    };
    if length == 0 && !rndv {
        deliver(&mut routes, conn, msg);
        return sys::ucs_status_t::UCS_OK;
    }
    // SAFETY: `data`/`length` as UCX passed them; the worker runs this.
    match unsafe { land(state.worker.get(), route, data, length, rndv, first, count) } {
        Ok(Landing::Done) => deliver(&mut routes, conn, msg),
        Ok(Landing::Pending(req, iov)) => state.receives.borrow_mut().push(Receive {
            req,
            conn,
            msg,
            _iov: iov,
            _region: route.region.clone(),
        }),
        // A payload that does not fit the slots it names breaks the
        // protocol: dropping the route fails the connection at its task.
        Err(()) => {
            routes.remove(&conn);
        }
    }
    sys::ucs_status_t::UCS_OK
}

/// An endpoint's error callback: records the failure.
unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: `arg` points to the entry's boxed `EpStatus`, which lives until
    // the endpoint is closed.
    let cell = unsafe { &*arg.cast::<EpStatus>() };
    cell.0.store(status.0, Ordering::Release);
}

/// Whether the transports UCX chose for `ep` do RMA natively. UCX 1.13 has
/// no query for it; the endpoint's configuration, as `ucp_ep_print_info`
/// writes it, lists one `put[i]` protocol line per RMA lane, and none where
/// UCX emulates RMA over active messages (`tcp`). Unknown (the text cannot
/// be captured) counts as no: the active-message data path works on every
/// transport.
fn native_rma(ep: sys::ucp_ep_h) -> bool {
    let mut buf: *mut libc::c_char = ptr::null_mut();
    let mut size: libc::size_t = 0;
    // SAFETY: valid out-pointers; the stream and its buffer are released
    // below, once.
    let stream = unsafe { libc::open_memstream(&mut buf, &mut size) };
    if stream.is_null() {
        return false;
    }
    // SAFETY: valid endpoint and an open stream, closed right after, which
    // makes `buf`/`size` valid; `buf` is freed once, after copying.
    let text = unsafe {
        sys::ucp_ep_print_info(ep, stream.cast());
        libc::fclose(stream);
        let text = if buf.is_null() {
            String::new()
        } else {
            String::from_utf8_lossy(std::slice::from_raw_parts(buf.cast::<u8>(), size)).into_owned()
        };
        libc::free(buf.cast());
        text
    };
    text.lines()
        .any(|l| l.trim_start_matches('#').trim_start().starts_with("put["))
}

/// Parameters for a scatter-gather (`UCP_DATATYPE_IOV`) buffer.
fn iov_param() -> sys::ucp_request_param_t {
    sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_DATATYPE,
        datatype: sys::ucp_datatype_t::from(sys::UCP_DATATYPE_IOV),
        ..Default::default()
    }
}

fn request_param(flags: u32) -> sys::ucp_request_param_t {
    sys::ucp_request_param_t {
        op_attr_mask: if flags != 0 {
            sys::UCP_OP_ATTR_FIELD_FLAGS
        } else {
            0
        },
        flags,
        ..Default::default()
    }
}

/// What a `*_nbx` call returned: done, failed, or a request to poll.
enum Started {
    Done,
    Pending(*mut c_void),
}

fn started(ptr: sys::ucs_status_ptr_t, what: &str) -> Result<Started, TransferError> {
    let ptr = ptr.cast::<c_void>();
    if ptr.is_null() {
        Ok(Started::Done)
    } else if sys::ucs_ptr_is_err(ptr) {
        Err(TransferError::ConnectionLost(format!(
            "UCX {what}: {}",
            status_str(sys::ucs_ptr_raw_status(ptr))
        )))
    } else {
        Ok(Started::Pending(ptr))
    }
}

impl Worker {
    fn new(ctx: Arc<Context>, routes: Arc<Routes>) -> Result<Self, TransferError> {
        let am = Rc::new(AmState {
            routes,
            worker: Cell::new(ptr::null_mut()),
            receives: RefCell::default(),
        });
        let params = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut raw: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: valid context, params and out-pointer.
        check(
            unsafe { sys::ucp_worker_create(ctx.raw, &params, &mut raw) },
            "creating the worker (ucp_worker_create)",
        )?;
        // From here on, `worker`'s Drop destroys `raw`.
        let mut worker = Self {
            raw,
            efd: -1,
            address: Vec::new(),
            max_am_header: 0,
            am,
            eps: HashMap::new(),
            next_ep: 0,
            flights: Vec::new(),
            closing: Vec::new(),
            peer_failure_handling: true,
            retired: Vec::new(),
            _ctx: ctx,
        };
        let mut efd = -1;
        // SAFETY: valid worker (created with WAKEUP) and out-pointer.
        check(
            unsafe { sys::ucp_worker_get_efd(worker.raw, &mut efd) },
            "getting the worker's event fd",
        )?;
        worker.efd = efd;
        worker.am.worker.set(worker.raw);
        let mut attr = sys::ucp_worker_attr_t {
            field_mask: u64::from(sys::UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER),
            ..Default::default()
        };
        // SAFETY: valid worker and out-struct.
        check(
            unsafe { sys::ucp_worker_query(worker.raw, &mut attr) },
            "querying the worker (ucp_worker_query)",
        )?;
        worker.max_am_header = attr.max_am_header;
        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: valid worker and out-pointers; the address is copied and
        // released once.
        unsafe {
            check(
                sys::ucp_worker_get_address(worker.raw, &mut addr, &mut len),
                "getting the worker's address",
            )?;
            worker.address = std::slice::from_raw_parts(addr.cast::<u8>(), len).to_vec();
            sys::ucp_worker_release_address(worker.raw, addr);
        }
        let handler = sys::ucp_am_handler_param_t {
            field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64,
            id: AM_ID,
            flags: sys::UCP_AM_FLAG_WHOLE_MSG,
            cb: Some(on_am),
            arg: Rc::as_ptr(&worker.am).cast_mut().cast(),
        };
        // SAFETY: valid worker; `arg` stays valid while the worker lives
        // (the worker holds the Rc).
        check(
            unsafe { sys::ucp_worker_set_am_recv_handler(worker.raw, &handler) },
            "setting the active-message handler",
        )?;
        Ok(worker)
    }

    /// Opens an endpoint asking UCX to report peer failures; where the
    /// transports cannot (UCX 1.13's shared memory when connecting by worker
    /// address), one without, and the worker remembers that so UCX logs its
    /// refusal once, not per connection. Either way the control connection
    /// is how a dead peer is noticed.
    fn connect(&mut self, address: &[u8], rkey: &[u8]) -> Result<Connected, TransferError> {
        let ep = self.connect_ep(address, rkey)?;
        let native_rma = self.eps.get(&ep).is_some_and(|e| native_rma(e.ep));
        Ok(Connected { ep, native_rma })
    }

    fn connect_ep(&mut self, address: &[u8], rkey: &[u8]) -> Result<EpId, TransferError> {
        if self.peer_failure_handling {
            match self.connect_with(address, rkey, sys::UCP_ERR_HANDLING_MODE_PEER) {
                Err(TransferError::Config(first)) => {
                    tracing::info!(
                        error = %first,
                        "UCX: these transports cannot report peer failures; connecting without"
                    );
                    self.peer_failure_handling = false;
                }
                other => return other,
            }
        }
        self.connect_with(address, rkey, sys::UCP_ERR_HANDLING_MODE_NONE)
    }

    fn connect_with(
        &mut self,
        address: &[u8],
        rkey: &[u8],
        err_mode: sys::ucp_err_handling_mode_t,
    ) -> Result<EpId, TransferError> {
        let status = Box::<EpStatus>::default();
        let params = sys::ucp_ep_params_t {
            field_mask: (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
            address: address.as_ptr().cast(),
            err_mode,
            err_handler: sys::ucp_err_handler_t {
                cb: Some(on_ep_error),
                arg: ptr::from_ref::<EpStatus>(&status).cast_mut().cast(),
            },
            ..Default::default()
        };
        let mut ep: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: valid worker; `address` is the peer's packed worker address
        // (UCX validates it); the error handler's arg outlives the endpoint
        // (it is dropped only after the endpoint is closed).
        check(
            unsafe { sys::ucp_ep_create(self.raw, &params, &mut ep) },
            "connecting to the peer (ucp_ep_create)",
        )?;
        let mut key: sys::ucp_rkey_h = ptr::null_mut();
        // SAFETY: valid endpoint, buffer and out-pointer.
        let unpacked = unsafe { sys::ucp_ep_rkey_unpack(ep, rkey.as_ptr().cast(), &mut key) };
        let id = EpId(self.next_ep);
        self.next_ep += 1;
        self.eps.insert(
            id,
            EpEntry {
                ep,
                rkey: if unpacked == sys::ucs_status_t::UCS_OK {
                    key
                } else {
                    ptr::null_mut()
                },
                peer_errors: err_mode == sys::UCP_ERR_HANDLING_MODE_PEER,
                status,
            },
        );
        if let Err(e) = check(unpacked, "unpacking the peer's remote key") {
            self.close(id);
            return Err(e);
        }
        Ok(id)
    }

    fn ep_error(&self, id: EpId) -> Option<TransferError> {
        let Some(entry) = self.eps.get(&id) else {
            return Some(TransferError::ConnectionLost(
                "the UCX endpoint is closed".into(),
            ));
        };
        let status = sys::ucs_status_t(entry.status.0.load(Ordering::Acquire));
        (status != sys::ucs_status_t::UCS_OK).then(|| {
            TransferError::ConnectionLost(format!("UCX endpoint failed: {}", status_str(status)))
        })
    }

    /// Starts a batch: its puts and the flush, or its message with data.
    fn start_batch(
        &mut self,
        id: EpId,
        payload: Payload,
        header: Vec<u8>,
        reply: oneshot::Sender<Result<(), TransferError>>,
    ) {
        if let Some(e) = self.ep_error(id) {
            let _ = reply.send(Err(e));
            return;
        }
        let Some(entry) = self.eps.get(&id) else {
            return;
        };
        let (ep, rkey) = (entry.ep, entry.rkey);
        let param = request_param(0);
        let mut flushing = None;
        if let Payload::Put(puts) = &payload {
            for (start, len, remote_addr) in merged_puts(puts) {
                // SAFETY: valid endpoint and rkey; the range lies inside the
                // puts' buffers (adjacent ones only are merged), which stay
                // alive in the flight until the flush below completes, which
                // covers this put.
                let ptr =
                    unsafe { sys::ucp_put_nbx(ep, start.cast(), len, remote_addr, rkey, &param) };
                match started(ptr, "put") {
                    Ok(Started::Done) => {}
                    // SAFETY: freeing a pending send request is allowed; UCX
                    // releases it on completion and the flush reports errors.
                    Ok(Started::Pending(req)) => unsafe { sys::ucp_request_free(req) },
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return;
                    }
                }
            }
            if !puts.is_empty() {
                // SAFETY: valid endpoint and param.
                match started(unsafe { sys::ucp_ep_flush_nbx(ep, &param) }, "flush") {
                    Ok(Started::Done) => {}
                    Ok(Started::Pending(req)) => flushing = Some(req),
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return;
                    }
                }
            }
        }
        let flight = Flight {
            ep: id,
            stage: Stage::Flushing(flushing.unwrap_or(ptr::null_mut())),
            payload,
            iov: Vec::new(),
            header,
            reply,
        };
        if flushing.is_some() {
            self.flights.push(flight);
        } else {
            self.send_notice(flight);
        }
    }

    /// Sends a flight's active message: after its puts were flushed, or
    /// with its data.
    fn send_notice(&mut self, mut flight: Flight) {
        let Some(entry) = self.eps.get(&flight.ep) else {
            let _ = flight.reply.send(Err(TransferError::ConnectionLost(
                "the UCX endpoint is closed".into(),
            )));
            return;
        };
        let ep = entry.ep;
        if let Payload::Send(buffers) = &flight.payload {
            flight.iov = contiguous_ranges(buffers)
                .into_iter()
                .map(|(start, length)| sys::ucp_dt_iov_t {
                    buffer: start.cast_mut().cast(),
                    length,
                })
                .collect();
        }
        // UCX picks eager or rendezvous by size for data; a message with
        // only the header is small and always eager.
        let (data, count, param) = match flight.iov.as_slice() {
            [] => (ptr::null(), 0, request_param(sys::UCP_AM_SEND_FLAG_EAGER)),
            [one] => (one.buffer.cast_const(), one.length, request_param(0)),
            many => (many.as_ptr().cast(), many.len(), iov_param()),
        };
        // SAFETY: valid endpoint; the header, the scatter-gather list and
        // the buffers it points to (merged ranges lie inside buffers the
        // payload owns: adjacent ones only) live on the heap, owned by the
        // flight until the send completes (UCX only reads them).
        let ptr = unsafe {
            sys::ucp_am_send_nbx(
                ep,
                AM_ID,
                flight.header.as_ptr().cast(),
                flight.header.len(),
                data,
                count,
                &param,
            )
        };
        match started(ptr, "active message") {
            Ok(Started::Done) => {
                let _ = flight.reply.send(Ok(()));
            }
            Ok(Started::Pending(req)) => {
                flight.stage = Stage::Sending(req);
                self.flights.push(flight);
            }
            Err(e) => {
                let _ = flight.reply.send(Err(e));
            }
        }
    }

    /// Delivers the messages whose payload's rendezvous receive completed
    /// (or fails their connections); returns whether any did.
    fn poll_receives(&mut self) -> bool {
        let receives = std::mem::take(&mut *self.am.receives.borrow_mut());
        let mut pending = Vec::with_capacity(receives.len());
        let mut progressed = false;
        for r in receives {
            // SAFETY: `r.req` is a live request we have not freed yet.
            let status = unsafe { sys::ucp_request_check_status(r.req) };
            if status == sys::ucs_status_t::UCS_INPROGRESS {
                pending.push(r);
                continue;
            }
            progressed = true;
            // SAFETY: completed request, freed once; UCX no longer writes
            // through the list or into the region for it.
            unsafe { sys::ucp_request_free(r.req) };
            let mut routes = self
                .am
                .routes
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if status == sys::ucs_status_t::UCS_OK {
                deliver(&mut routes, r.conn, r.msg);
            } else {
                routes.remove(&r.conn);
            }
        }
        // No handler ran meanwhile (nothing here progresses the worker),
        // but keep anything one might have added, after the older ones.
        let mut cell = self.am.receives.borrow_mut();
        pending.append(&mut cell);
        *cell = pending;
        progressed
    }

    /// Advances every flight whose request completed; returns whether any did.
    fn poll_flights(&mut self) -> bool {
        let mut progressed = false;
        let mut i = 0;
        while i < self.flights.len() {
            let req = match self.flights[i].stage {
                Stage::Flushing(r) | Stage::Sending(r) => r,
            };
            // SAFETY: `req` is a live request we have not freed yet.
            let status = unsafe { sys::ucp_request_check_status(req) };
            if status == sys::ucs_status_t::UCS_INPROGRESS {
                i += 1;
                continue;
            }
            progressed = true;
            // SAFETY: completed request, freed once.
            unsafe { sys::ucp_request_free(req) };
            let flight = self.flights.swap_remove(i);
            if status != sys::ucs_status_t::UCS_OK {
                let _ = flight.reply.send(Err(TransferError::ConnectionLost(format!(
                    "UCX transfer failed: {}",
                    status_str(status)
                ))));
                continue;
            }
            match flight.stage {
                Stage::Flushing(_) => self.send_notice(flight),
                Stage::Sending(_) => {
                    let _ = flight.reply.send(Ok(()));
                }
            }
        }
        self.closing.retain(|&req| {
            // SAFETY: live close request, freed once when done.
            unsafe {
                if sys::ucp_request_check_status(req) == sys::ucs_status_t::UCS_INPROGRESS {
                    true
                } else {
                    sys::ucp_request_free(req);
                    false
                }
            }
        });
        progressed
    }

    fn close(&mut self, id: EpId) {
        let Some(entry) = self.eps.remove(&id) else {
            return;
        };
        let mut param = request_param(0);
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS;
        // Without peer error handling a close must flush (it completes once
        // wireup and outstanding operations have).
        param.flags = if entry.peer_errors {
            sys::UCP_EP_CLOSE_FLAG_FORCE
        } else {
            0
        };
        // SAFETY: the rkey belongs to this endpoint and is destroyed before
        // it; the endpoint is closed once. Flights on it complete with an
        // error during the close and are reaped by `poll_flights`.
        let ptr = unsafe {
            if !entry.rkey.is_null() {
                sys::ucp_rkey_destroy(entry.rkey);
            }
            sys::ucp_ep_close_nbx(entry.ep, &param)
        };
        if let Ok(Started::Pending(req)) = started(ptr, "close") {
            self.closing.push(req);
        }
        // The error cell may still be written by UCX until the close
        // request completes; keep it until the worker is gone.
        self.retired.push(entry.status);
    }

    fn handle(&mut self, op: Op) {
        match op {
            Op::Connect {
                address,
                rkey,
                reply,
            } => {
                let _ = reply.send(self.connect(&address, &rkey));
            }
            Op::Batch {
                ep,
                payload,
                header,
                reply,
            } => self.start_batch(ep, payload, header, reply),
            Op::Close(ep) => self.close(ep),
        }
    }

    /// The progress loop, until the runtime is dropped.
    fn run(mut self, queue: std_mpsc::Receiver<Op>, wake: &OwnedFd) {
        let mut idle = 0u32;
        let mut open = true;
        while open {
            let mut busy = false;
            loop {
                match queue.try_recv() {
                    Ok(op) => {
                        busy = true;
                        self.handle(op);
                    }
                    Err(std_mpsc::TryRecvError::Empty) => break,
                    Err(std_mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            // SAFETY: the worker is used on this thread only.
            while unsafe { sys::ucp_worker_progress(self.raw) } != 0 {
                busy = true;
            }
            busy |= self.poll_flights();
            busy |= self.poll_receives();
            if busy {
                idle = 0;
                continue;
            }
            idle += 1;
            if idle < IDLE_SPINS {
                continue;
            }
            idle = 0;
            // Sleep until UCX or a command wakes us: briefly while
            // operations are pending (in case a transport signals no
            // event for them), long when idle.
            let timeout_ms = if self.flights.is_empty()
                && self.closing.is_empty()
                && self.am.receives.borrow().is_empty()
            {
                100
            } else {
                1
            };
            // SAFETY: valid worker on its own thread.
            if unsafe { sys::ucp_worker_arm(self.raw) } == sys::ucs_status_t::UCS_OK {
                let mut fds = [
                    libc::pollfd {
                        fd: self.efd,
                        events: libc::POLLIN,
                        revents: 0,
                    },
                    libc::pollfd {
                        fd: wake.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    },
                ];
                // SAFETY: two valid pollfds; the timeout bounds the sleep even
                // if a transport signals no event.
                unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
                let mut counter = [0u8; 8];
                // SAFETY: draining our non-blocking eventfd into a local.
                unsafe { libc::read(wake.as_raw_fd(), counter.as_mut_ptr().cast(), 8) };
            }
        }
        self.shutdown();
    }

    /// Closes every endpoint and gives their requests a bounded time.
    fn shutdown(&mut self) {
        let ids: Vec<EpId> = self.eps.keys().copied().collect();
        for id in ids {
            self.close(id);
        }
        let deadline = Instant::now() + CLOSE_GRACE;
        while (!self.closing.is_empty()
            || !self.flights.is_empty()
            || !self.am.receives.borrow().is_empty())
            && Instant::now() < deadline
        {
            // SAFETY: the worker is used on this thread only.
            unsafe { sys::ucp_worker_progress(self.raw) };
            self.poll_flights();
            self.poll_receives();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let flights = std::mem::take(&mut self.flights);
        // SAFETY: destroys the worker once, on its thread, after its
        // endpoints were closed (`shutdown`); requests still pending die
        // with it. Only then are the buffers they referenced (owned by
        // `flights`) dropped. The context outlives it (`self._ctx`).
        unsafe { sys::ucp_worker_destroy(self.raw) };
        // Receives still pending died with the worker: only now may their
        // regions be unmapped.
        self.am.receives.borrow_mut().clear();
        for flight in flights {
            let _ = flight.reply.send(Err(TransferError::ConnectionLost(
                "the UCX transport was shut down".into(),
            )));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(slots: u32, slot_bytes: usize) -> Result<Route, TransferError> {
        let ctx = Context::new(&[("TLS".into(), "self".into())])?;
        let region = Arc::new(Region::new(ctx, slots as usize * slot_bytes)?);
        Ok(Route {
            queue: mpsc::channel(1).0,
            region,
            slot_bytes,
            slots,
        })
    }

    #[test]
    fn a_payload_lands_in_its_slots_and_wraps_around_the_ring() -> Result<(), TransferError> {
        let r = route(8, 16)?;
        assert_eq!(r.landing(2, 3, 48), Some(vec![(32, 48)]));
        // Slots 6, 7, then 0, 1.
        assert_eq!(r.landing(6, 4, 64), Some(vec![(96, 32), (0, 32)]));
        assert_eq!(r.landing(0, 8, 128), Some(vec![(0, 128)]));
        // Wrong length, no slots, a start or a count past the ring.
        assert_eq!(r.landing(2, 3, 47), None);
        assert_eq!(r.landing(2, 0, 0), None);
        assert_eq!(r.landing(8, 1, 16), None);
        assert_eq!(r.landing(0, 9, 144), None);
        // Writes stay inside the region.
        assert!(r.region.write(112, &[1; 16]));
        assert!(!r.region.write(113, &[1; 16]));
        assert_eq!(r.region.read(112, 16), Some(&[1u8; 16][..]));
        Ok(())
    }
}
