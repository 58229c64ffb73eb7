//! [`NcclComm`]: the [`Communicator`] seam on NVIDIA's NCCL, one rank per GPU.
//!
//! # Design
//!
//! **Bootstrap through the CPU communicator.** NCCL needs every rank to hold
//! the same 128-byte unique id before `ncclCommInitRank`. Rank 0 creates it
//! and [`broadcast`](Communicator::broadcast)s it over the bootstrap
//! communicator (a [`tandem_comm::TcpComm`] in practice: the same rendezvous
//! the CPU path uses); ranks and the world size are the bootstrap's, so an
//! NCCL rank is the TCP rank of the same process.
//!
//! **Host buffers in, host buffers out.** The trait's buffers are host
//! memory, so every call stages through device buffers kept in the struct
//! (grown to the next power of two when a call needs more, never shrunk, so
//! steady-state calls allocate nothing), runs NCCL on this rank's one stream,
//! synchronizes it and copies the result back. Everything runs on that one
//! stream, so cudarc's event tracking is off for this context.
//!
//! **Groups.** NCCL collectives always span the whole communicator. A `group`
//! equal to the world uses `ncclAllReduce`/`ncclAllGather`/`ncclBroadcast`.
//! NCCL's algorithms compute each reduced element once and then copy it to
//! every rank, so the result is bit-identical on all ranks (though not
//! necessarily equal bit for bit to [`tandem_comm::TcpComm`]'s group-order
//! sum). A strict subset of the world uses grouped point-to-point transfers
//! (`ncclGroupStart`, a send to and a receive from every other member,
//! `ncclGroupEnd`): every member gathers every contribution and sums them on
//! the host in group order, exactly like the TCP implementation, so the
//! result is bit-identical on every member.
//!
//! **Framing.** NCCL receives need the element count up front, so variable
//! length messages carry their length first: a one-element `u64` transfer,
//! then the payload (skipped when empty). `broadcast` of bytes and `send` /
//! `recv` all do this; `recv_f32` compares the announced length with `out`,
//! and on a mismatch still drains the payload (so the sender is not left
//! blocked) before failing with [`CommError::Protocol`].
//!
//! # Failure model (weaker than TCP's)
//!
//! NCCL has no per-operation timeout: a peer that hangs, or dies in the middle
//! of an operation, can leave this rank blocked in a stream synchronize
//! (NCCL may also report it as an error, typically `ncclRemoteError` or
//! `ncclSystemError`, when its transport notices). `recv` therefore never
//! returns [`CommError::Timeout`], and [`recv_idle`](Communicator::recv_idle)
//! is the same as `recv`. Sends are rendezvous, not buffered: `send` returns
//! once the peer has received, so two ranks that both send to each other
//! before receiving deadlock (unlike on TCP, where small messages fit in the
//! socket buffers). NCCL errors on point-to-point calls map to
//! [`CommError::PeerLost`] with that peer; on collectives NCCL does not say
//! which rank failed, so `PeerLost` names the lowest other member of the group
//! and says so; CUDA driver errors (copies, allocation, synchronize) and bad
//! arguments are [`CommError::Protocol`]. As on TCP, any error poisons the
//! communicator: later calls fail with [`CommError::Poisoned`].
//!
//! This is not yet used by the engine's parallel backend, which is CPU-only;
//! it is compiled in CI and exercised only on machines with 2+ GPUs.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::safe::{group_end, group_start, Comm, Id, ReduceOp};
use tandem_comm::{CommError, Communicator};

/// The largest message `recv` accepts (the TCP default's frame limit).
pub const MAX_MESSAGE_BYTES: u64 = 1 << 30;

/// Whether libnccl can be loaded (cudarc would panic on first use otherwise).
pub fn nccl_available() -> bool {
    // SAFETY: probing loads the NCCL shared library by name (running its
    // initialisers), which is how it is made to be loaded.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// The NCCL communicator, movable between threads.
struct SendComm(Comm);

// SAFETY: an NCCL communicator may be used from any thread as long as only
// one thread uses it at a time. `SendComm` is owned by one `NcclComm`, whose
// every operation takes `&mut self`, and it is not `Sync`; the CUDA context
// is bound to the calling thread before each use.
unsafe impl Send for SendComm {}

/// A device staging buffer that only grows.
struct Staging<T> {
    buf: Option<CudaSlice<T>>,
}

impl<T: DeviceRepr + ValidAsZeroBits> Staging<T> {
    fn new() -> Self {
        Self { buf: None }
    }

    /// A buffer of at least `len` elements (at least one: empty allocations
    /// are avoided).
    fn get(
        &mut self,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<&mut CudaSlice<T>, CommError> {
        let have = self.buf.as_ref().map_or(0, |b| b.len());
        let want = grown_capacity(have, len);
        if want != have || self.buf.is_none() {
            self.buf = None; // free the old allocation first
            let fresh = stream
                .alloc_zeros::<T>(want)
                .map_err(|e| driver("allocate a staging buffer", e))?;
            self.buf = Some(fresh);
        }
        self.buf
            .as_mut()
            .ok_or_else(|| CommError::Protocol("staging buffer missing".into()))
    }
}

/// One rank of an NCCL communicator on one GPU; see the [module docs](self).
pub struct NcclComm {
    // Field order matters for drop: the communicator is aborted before the
    // buffers and the stream go away.
    comm: SendComm,
    f32_a: Staging<f32>,
    f32_b: Staging<f32>,
    bytes: Staging<u8>,
    len: Staging<u64>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    poisoned: bool,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.ctx.ordinal())
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

impl NcclComm {
    /// Joins the NCCL communicator of the bootstrap's ranks on GPU
    /// `device_ordinal`. Every rank of `bootstrap` must call this at the same
    /// point (it makes one world-wide broadcast on it).
    pub fn new(device_ordinal: usize, bootstrap: &mut dyn Communicator) -> Result<Self, CommError> {
        let rank = bootstrap.rank();
        let world = bootstrap.world_size();
        let everyone: Vec<usize> = (0..world).collect();
        if !nccl_available() {
            return Err(CommError::Setup(
                "libnccl not found (install NCCL or put it on LD_LIBRARY_PATH)".into(),
            ));
        }
        let ctx = CudaContext::new(device_ordinal)
            .map_err(|e| CommError::Setup(format!("open GPU {device_ordinal}: {e:?}")))?;
        // SAFETY: this communicator queues all of its work on its one stream
        // (see the module docs), so cross-stream events are not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| {
            CommError::Setup(format!("create a stream on GPU {device_ordinal}: {e:?}"))
        })?;
        let mut id_bytes = if rank == 0 {
            let id = Id::new().map_err(|e| CommError::Setup(nccl_detail("ncclGetUniqueId", &e)))?;
            id_to_bytes(id.internal())
        } else {
            Vec::new()
        };
        bootstrap.broadcast(&everyone, 0, &mut id_bytes)?;
        let id = Id::uninit(id_from_bytes(&id_bytes)?);
        ctx.bind_to_thread()
            .map_err(|e| CommError::Setup(format!("bind GPU {device_ordinal}: {e:?}")))?;
        let comm = Comm::from_rank(stream.clone(), rank, world, id)
            .map_err(|e| CommError::Setup(nccl_detail("ncclCommInitRank", &e)))?;
        tracing::info!(rank, world, device_ordinal, "NCCL communicator ready");
        Ok(Self {
            comm: SendComm(comm),
            f32_a: Staging::new(),
            f32_b: Staging::new(),
            bytes: Staging::new(),
            len: Staging::new(),
            ctx,
            stream,
            rank,
            world,
            poisoned: false,
        })
    }

    /// The GPU this rank runs on.
    pub fn device_ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Whether an earlier error broke this communicator.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    /// Runs `op` unless poisoned; poisons on error.
    fn guarded<T>(
        &mut self,
        op: impl FnOnce(&mut Self) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        if self.poisoned {
            return Err(CommError::Poisoned);
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("bind the context", e))?;
        let result = op(self);
        if result.is_err() {
            self.poisoned = true;
        }
        result
    }

    fn sync(&self) -> Result<(), CommError> {
        self.stream
            .synchronize()
            .map_err(|e| driver("synchronize the stream", e))
    }

    fn check_peer(&self, peer: usize) -> Result<i32, CommError> {
        if peer >= self.world || peer == self.rank {
            return Err(CommError::Protocol(format!(
                "rank {} cannot exchange messages with rank {peer} (world size {})",
                self.rank, self.world
            )));
        }
        i32::try_from(peer).map_err(|_| CommError::Protocol(format!("rank {peer} too large")))
    }

    /// `mine` gathered over `group` (a strict subset of the world) into
    /// `out`, by grouped point-to-point transfers.
    fn gather_p2p(
        &mut self,
        group: &[usize],
        mine: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        let n = mine.len();
        let stream = self.stream.clone();
        if n == 0 {
            return Ok(());
        }
        let me = group.iter().position(|&r| r == self.rank).unwrap_or(0);
        let send = self.f32_a.get(&stream, n)?;
        stream
            .memcpy_htod(mine, &mut send.slice_mut(0..n))
            .map_err(|e| driver("copy to the device", e))?;
        let recv = self.f32_b.get(&stream, group.len() * n)?;
        stream
            .memcpy_htod(mine, &mut recv.slice_mut(me * n..(me + 1) * n))
            .map_err(|e| driver("copy to the device", e))?;
        let comm = &self.comm.0;
        let send_view = send.slice(0..n);
        let mut first_err = None;
        group_start().map_err(|e| nccl_lost(group, self.rank, "ncclGroupStart", &e))?;
        for (i, &peer) in group.iter().enumerate() {
            if peer == self.rank {
                continue;
            }
            let p = peer as i32;
            let mut slot = recv.slice_mut(i * n..(i + 1) * n);
            let sent = comm.send(&send_view, p);
            let got = comm.recv(&mut slot, p).map(|_| ());
            if let Some(e) = sent.err().or(got.err()) {
                first_err.get_or_insert(peer_lost(peer, "ncclSend/ncclRecv", &e));
            }
        }
        let ended = group_end();
        if let Some(e) = first_err {
            return Err(e);
        }
        ended.map_err(|e| nccl_lost(group, self.rank, "ncclGroupEnd", &e))?;
        stream
            .memcpy_dtoh(&recv.slice(0..group.len() * n), out)
            .map_err(|e| driver("copy from the device", e))?;
        self.sync()
    }

    /// Sends one framed message: the length, then the payload.
    fn send_framed<T: cudarc::nccl::safe::NcclType + DeviceRepr + ValidAsZeroBits>(
        stream: &Arc<CudaStream>,
        comm: &Comm,
        len_buf: &mut Staging<u64>,
        payload_buf: &mut Staging<T>,
        peer: usize,
        data: &[T],
    ) -> Result<(), CommError> {
        let p = peer as i32;
        let header = len_buf.get(stream, 1)?;
        stream
            .memcpy_htod(&[encode_len(data.len())], header)
            .map_err(|e| driver("copy to the device", e))?;
        comm.send(&header.slice(0..1), p)
            .map_err(|e| peer_lost(peer, "ncclSend (length)", &e))?;
        if !data.is_empty() {
            let payload = payload_buf.get(stream, data.len())?;
            stream
                .memcpy_htod(data, &mut payload.slice_mut(0..data.len()))
                .map_err(|e| driver("copy to the device", e))?;
            comm.send(&payload.slice(0..data.len()), p)
                .map_err(|e| peer_lost(peer, "ncclSend", &e))?;
        }
        stream
            .synchronize()
            .map_err(|e| driver("synchronize the stream", e))
    }

    /// Receives the length of the next framed message from `peer`.
    fn recv_len(&mut self, peer: usize) -> Result<u64, CommError> {
        let stream = self.stream.clone();
        let header = self.len.get(&stream, 1)?;
        self.comm
            .0
            .recv(&mut header.slice_mut(0..1), peer as i32)
            .map_err(|e| peer_lost(peer, "ncclRecv (length)", &e))?;
        let mut len = [0u64];
        stream
            .memcpy_dtoh(&header.slice(0..1), &mut len)
            .map_err(|e| driver("copy from the device", e))?;
        self.sync()?;
        Ok(len[0])
    }

    /// Receives `out.len()` elements from `peer` (the payload of a frame).
    fn recv_payload<T: cudarc::nccl::safe::NcclType + DeviceRepr + ValidAsZeroBits>(
        stream: &Arc<CudaStream>,
        comm: &Comm,
        buf: &mut Staging<T>,
        peer: usize,
        out: &mut [T],
    ) -> Result<(), CommError> {
        if out.is_empty() {
            return Ok(());
        }
        let n = out.len();
        let dev = buf.get(stream, n)?;
        comm.recv(&mut dev.slice_mut(0..n), peer as i32)
            .map_err(|e| peer_lost(peer, "ncclRecv", &e))?;
        stream
            .memcpy_dtoh(&dev.slice(0..n), out)
            .map_err(|e| driver("copy from the device", e))?;
        stream
            .synchronize()
            .map_err(|e| driver("synchronize the stream", e))
    }

    fn recv_bytes(&mut self, peer: usize) -> Result<Vec<u8>, CommError> {
        self.check_peer(peer)?;
        let len = decode_len(peer, self.recv_len(peer)?, MAX_MESSAGE_BYTES)?;
        let mut out = vec![0u8; len];
        Self::recv_payload(&self.stream, &self.comm.0, &mut self.bytes, peer, &mut out)?;
        Ok(out)
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, group: &[usize], buf: &mut [f32]) -> Result<(), CommError> {
        self.guarded(|s| {
            let whole = check_group(group, s.rank, s.world)?;
            let n = buf.len();
            if group.len() == 1 || n == 0 {
                return Ok(());
            }
            if !whole {
                let mut gathered = vec![0f32; group.len() * n];
                s.gather_p2p(group, buf, &mut gathered)?;
                sum_in_group_order(&gathered, buf);
                return Ok(());
            }
            let stream = s.stream.clone();
            let dev = s.f32_a.get(&stream, n)?;
            stream
                .memcpy_htod(&*buf, &mut dev.slice_mut(0..n))
                .map_err(|e| driver("copy to the device", e))?;
            s.comm
                .0
                .all_reduce_in_place(&mut dev.slice_mut(0..n), &ReduceOp::Sum)
                .map_err(|e| nccl_lost(group, s.rank, "ncclAllReduce", &e))?;
            stream
                .memcpy_dtoh(&dev.slice(0..n), buf)
                .map_err(|e| driver("copy from the device", e))?;
            s.sync()
        })
    }

    fn all_gather(
        &mut self,
        group: &[usize],
        mine: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        self.guarded(|s| {
            let whole = check_group(group, s.rank, s.world)?;
            let n = mine.len();
            if out.len() != group.len() * n {
                return Err(CommError::Protocol(format!(
                    "all_gather output holds {} floats, expected {} members x {n}",
                    out.len(),
                    group.len()
                )));
            }
            if group.len() == 1 || n == 0 {
                out.copy_from_slice(mine);
                return Ok(());
            }
            if !whole {
                return s.gather_p2p(group, mine, out);
            }
            let stream = s.stream.clone();
            let send = s.f32_a.get(&stream, n)?;
            stream
                .memcpy_htod(mine, &mut send.slice_mut(0..n))
                .map_err(|e| driver("copy to the device", e))?;
            let recv = s.f32_b.get(&stream, out.len())?;
            s.comm
                .0
                .all_gather(&send.slice(0..n), &mut recv.slice_mut(0..out.len()))
                .map_err(|e| nccl_lost(group, s.rank, "ncclAllGather", &e))?;
            stream
                .memcpy_dtoh(&recv.slice(0..out.len()), out)
                .map_err(|e| driver("copy from the device", e))?;
            s.sync()
        })
    }

    fn broadcast(
        &mut self,
        group: &[usize],
        root: usize,
        buf: &mut Vec<u8>,
    ) -> Result<(), CommError> {
        self.guarded(|s| {
            let whole = check_group(group, s.rank, s.world)?;
            if group.binary_search(&root).is_err() {
                return Err(CommError::Protocol(format!(
                    "broadcast root {root} is not in the group {group:?}"
                )));
            }
            if group.len() == 1 {
                return Ok(());
            }
            let stream = s.stream.clone();
            if !whole {
                // Point to point from the root to every other member.
                if s.rank == root {
                    for &peer in group.iter().filter(|&&r| r != root) {
                        Self::send_framed(
                            &stream,
                            &s.comm.0,
                            &mut s.len,
                            &mut s.bytes,
                            peer,
                            buf.as_slice(),
                        )?;
                    }
                } else {
                    *buf = s.recv_bytes(root)?;
                }
                return Ok(());
            }
            let root_i32 = root as i32;
            // The length first.
            let header = s.len.get(&stream, 1)?;
            if s.rank == root {
                stream
                    .memcpy_htod(&[encode_len(buf.len())], header)
                    .map_err(|e| driver("copy to the device", e))?;
            }
            s.comm
                .0
                .broadcast_in_place(&mut header.slice_mut(0..1), root_i32)
                .map_err(|e| nccl_lost(group, s.rank, "ncclBroadcast (length)", &e))?;
            let mut len = [0u64];
            stream
                .memcpy_dtoh(&header.slice(0..1), &mut len)
                .map_err(|e| driver("copy from the device", e))?;
            s.sync()?;
            let len = decode_len(root, len[0], MAX_MESSAGE_BYTES)?;
            if s.rank != root {
                buf.clear();
                buf.resize(len, 0);
            }
            if len == 0 {
                return Ok(());
            }
            // Then the payload.
            let dev = s.bytes.get(&stream, len)?;
            if s.rank == root {
                stream
                    .memcpy_htod(buf.as_slice(), &mut dev.slice_mut(0..len))
                    .map_err(|e| driver("copy to the device", e))?;
            }
            s.comm
                .0
                .broadcast_in_place(&mut dev.slice_mut(0..len), root_i32)
                .map_err(|e| nccl_lost(group, s.rank, "ncclBroadcast", &e))?;
            if s.rank != root {
                stream
                    .memcpy_dtoh(&dev.slice(0..len), buf.as_mut_slice())
                    .map_err(|e| driver("copy from the device", e))?;
            }
            s.sync()
        })
    }

    fn send(&mut self, peer: usize, bytes: &[u8]) -> Result<(), CommError> {
        self.guarded(|s| {
            s.check_peer(peer)?;
            if bytes.len() as u64 > MAX_MESSAGE_BYTES {
                return Err(CommError::Protocol(format!(
                    "message of {} bytes is over the limit of {MAX_MESSAGE_BYTES}",
                    bytes.len()
                )));
            }
            let stream = s.stream.clone();
            Self::send_framed(&stream, &s.comm.0, &mut s.len, &mut s.bytes, peer, bytes)
        })
    }

    fn recv(&mut self, peer: usize) -> Result<Vec<u8>, CommError> {
        self.guarded(|s| s.recv_bytes(peer))
    }

    /// The same as [`recv`](Communicator::recv): NCCL has no timeout, so
    /// neither does `recv` (see the module docs).
    fn recv_idle(&mut self, peer: usize) -> Result<Vec<u8>, CommError> {
        self.recv(peer)
    }

    fn send_f32(&mut self, peer: usize, data: &[f32]) -> Result<(), CommError> {
        self.guarded(|s| {
            s.check_peer(peer)?;
            let stream = s.stream.clone();
            Self::send_framed(&stream, &s.comm.0, &mut s.len, &mut s.f32_a, peer, data)
        })
    }

    fn recv_f32(&mut self, peer: usize, out: &mut [f32]) -> Result<(), CommError> {
        self.guarded(|s| {
            s.check_peer(peer)?;
            let announced = s.recv_len(peer)?;
            let stream = s.stream.clone();
            match check_f32_len(peer, announced, out.len()) {
                Ok(()) => Self::recv_payload(&stream, &s.comm.0, &mut s.f32_b, peer, out),
                Err(mismatch) => {
                    // Drain the payload so the sender is not left blocked.
                    let len = decode_len(peer, announced, MAX_MESSAGE_BYTES / 4)?;
                    let mut scratch = vec![0f32; len];
                    Self::recv_payload(&stream, &s.comm.0, &mut s.f32_b, peer, &mut scratch)?;
                    Err(mismatch)
                }
            }
        })
    }
}

// ---------------------------------------------------------------------------
// Host-side helpers (tested without a GPU).

/// The capacity a staging buffer of `have` elements grows to for `need`:
/// unchanged when it fits, else the next power of two (at least 1).
fn grown_capacity(have: usize, need: usize) -> usize {
    if need <= have && have > 0 {
        have
    } else {
        need.max(1).next_power_of_two()
    }
}

/// A length as it travels (one `u64`).
fn encode_len(len: usize) -> u64 {
    len as u64
}

/// A received length, refused over `max` (a corrupt or mismatched frame).
fn decode_len(peer: usize, len: u64, max: u64) -> Result<usize, CommError> {
    if len > max {
        return Err(CommError::Protocol(format!(
            "rank {peer} announced a message of {len} elements, over the limit of {max} \
             (mismatched call?)"
        )));
    }
    usize::try_from(len).map_err(|_| CommError::Protocol(format!("length {len} does not fit")))
}

/// `recv_f32`'s length check (the same message as the TCP implementation's).
fn check_f32_len(peer: usize, announced: u64, expected: usize) -> Result<(), CommError> {
    if announced != expected as u64 {
        return Err(CommError::Protocol(format!(
            "rank {peer} sent {} bytes where {} were expected (mismatched call?)",
            announced.saturating_mul(4),
            expected * 4
        )));
    }
    Ok(())
}

/// Checks a group (sorted, no duplicates, in range, contains `rank`) and says
/// whether it is the whole world.
fn check_group(group: &[usize], rank: usize, world: usize) -> Result<bool, CommError> {
    let sorted = group.windows(2).all(|w| w[0] < w[1]);
    let in_range = group.iter().all(|&r| r < world);
    if !sorted || !in_range || group.binary_search(&rank).is_err() {
        return Err(CommError::Protocol(format!(
            "bad group {group:?} for rank {rank} of {world}: groups are sorted, distinct ranks \
             below the world size, including the caller"
        )));
    }
    Ok(group.len() == world)
}

/// `out[i]` = the sum over members of `gathered[m * n + i]`, added in group
/// order starting from the first member's value (so every member rounds alike).
fn sum_in_group_order(gathered: &[f32], out: &mut [f32]) {
    let n = out.len();
    if n == 0 {
        return;
    }
    let mut chunks = gathered.chunks_exact(n);
    if let Some(first) = chunks.next() {
        out.copy_from_slice(first);
    }
    for chunk in chunks {
        for (o, &x) in out.iter_mut().zip(chunk) {
            *o += x;
        }
    }
}

fn id_to_bytes(internal: &[std::ffi::c_char; 128]) -> Vec<u8> {
    internal.iter().map(|&c| c as u8).collect()
}

fn id_from_bytes(bytes: &[u8]) -> Result<[std::ffi::c_char; 128], CommError> {
    if bytes.len() != 128 {
        return Err(CommError::Setup(format!(
            "the NCCL unique id from rank 0 has {} bytes, expected 128",
            bytes.len()
        )));
    }
    let mut id = [0 as std::ffi::c_char; 128];
    for (d, &b) in id.iter_mut().zip(bytes) {
        *d = b as std::ffi::c_char;
    }
    Ok(id)
}

fn nccl_detail(what: &str, e: &NcclError) -> String {
    format!("{what} failed: {:?}", e.0)
}

fn driver(what: &str, e: impl std::fmt::Debug) -> CommError {
    CommError::Protocol(format!("CUDA: {what} failed: {e:?}"))
}

fn peer_lost(peer: usize, what: &str, e: &NcclError) -> CommError {
    CommError::PeerLost {
        peer,
        reason: nccl_detail(what, e),
    }
}

/// An NCCL collective failed; NCCL does not name the rank, so the lowest
/// other member stands in.
fn nccl_lost(group: &[usize], rank: usize, what: &str, e: &NcclError) -> CommError {
    let peer = group.iter().copied().find(|&r| r != rank).unwrap_or(rank);
    CommError::PeerLost {
        peer,
        reason: format!(
            "{} in group {group:?} (NCCL does not say which rank; rank {peer} stands in)",
            nccl_detail(what, e)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_grows_to_powers_of_two_and_never_shrinks() {
        assert_eq!(grown_capacity(0, 0), 1);
        assert_eq!(grown_capacity(0, 5), 8);
        assert_eq!(grown_capacity(8, 5), 8);
        assert_eq!(grown_capacity(8, 8), 8);
        assert_eq!(grown_capacity(8, 9), 16);
        assert_eq!(grown_capacity(1024, 1), 1024);
    }

    #[test]
    fn lengths_frame_and_are_bounded() {
        assert_eq!(decode_len(1, encode_len(0), 10).ok(), Some(0));
        assert_eq!(decode_len(1, encode_len(10), 10).ok(), Some(10));
        assert!(matches!(decode_len(1, 11, 10), Err(CommError::Protocol(_))));
        assert!(check_f32_len(1, 4, 4).is_ok());
        let err = check_f32_len(1, 3, 4).err().map(|e| e.to_string());
        assert!(err.is_some_and(|m| m.contains("rank 1 sent 12 bytes where 16 were expected")));
    }

    #[test]
    fn groups_are_checked() {
        assert_eq!(check_group(&[0, 1], 0, 2).ok(), Some(true));
        assert_eq!(check_group(&[1, 3], 3, 4).ok(), Some(false));
        assert!(check_group(&[1, 0], 0, 2).is_err()); // unsorted
        assert!(check_group(&[0, 0, 1], 0, 2).is_err()); // duplicate
        assert!(check_group(&[0, 2], 0, 2).is_err()); // out of range
        assert!(check_group(&[1, 2], 0, 3).is_err()); // caller missing
    }

    #[test]
    fn group_order_sum_matches_left_to_right_addition() {
        // (1e8 + 1) - 1e8 == 0 in f32, while 1e8 + (1 - 1e8) == 1: the order is fixed.
        let gathered = [1e8f32, 5.0, 1.0, -0.0, -1e8, -0.0];
        let mut out = [0f32; 2];
        sum_in_group_order(&gathered, &mut out);
        assert_eq!(out[0].to_bits(), ((1e8f32 + 1.0) + -1e8).to_bits());
        assert_eq!(out[1], 5.0);
        let mut neg = [0f32; 1];
        sum_in_group_order(&[-0.0, -0.0], &mut neg);
        assert!(neg[0].is_sign_negative(), "-0 + -0 stays -0 (no 0.0 seed)");
    }

    #[test]
    fn unique_id_round_trips_and_is_checked() {
        let mut id = [0 as std::ffi::c_char; 128];
        for (i, c) in id.iter_mut().enumerate() {
            *c = (i as u8).wrapping_mul(37) as std::ffi::c_char;
        }
        let bytes = id_to_bytes(&id);
        assert_eq!(bytes.len(), 128);
        assert_eq!(id_from_bytes(&bytes).ok(), Some(id));
        assert!(matches!(
            id_from_bytes(&bytes[..5]),
            Err(CommError::Setup(_))
        ));
    }
}
