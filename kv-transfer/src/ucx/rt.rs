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

mod worker;

use worker::Worker;

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
