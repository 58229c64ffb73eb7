//! The collective-communication seam for tensor and pipeline parallelism on CPUs.
//!
//! Each rank of a TP/PP group is its own OS process. Between layers of a
//! sharded forward pass the engine calls the collectives of [`Communicator`]:
//! [`all_reduce_sum`](Communicator::all_reduce_sum) after row-parallel matmuls,
//! [`all_gather`](Communicator::all_gather) after column-parallel ones,
//! [`broadcast`](Communicator::broadcast) for the leader's commands, and
//! [`send`](Communicator::send)/[`recv`](Communicator::recv) between pipeline
//! stages. [`TcpComm`] implements it over TCP.
//!
//! # Design
//!
//! **A full mesh.** Every pair of ranks has its own TCP connection, built once
//! at start-up (rendezvous at rank 0, see [`Rendezvous`] and
//! [`TcpComm::connect`]). TP groups are small (2 to 8 ranks on one box or a few
//! boxes), so `n(n-1)/2` connections are cheap, and a mesh makes every
//! collective a single round: each member sends its buffer straight to every
//! other member and receives theirs. That is the lowest latency for the small
//! activations of decode steps, needs no relaying rank (so a dead rank cannot
//! silently stall traffic between two live ones), and lets any subset of ranks
//! form a group without extra connections. The bandwidth cost (each member
//! receives `(n-1)` whole buffers instead of the `2(n-1)/n` of a ring) does not
//! matter at these group sizes.
//!
//! **Sums in group order.** A member's result must be bit-identical on every
//! member: replicas of the same activation feed the same next layer, and if they
//! drifted by one ulp the ranks' sampled tokens could diverge. Floating-point
//! addition is not associative (`(1e8 + 1) - 1e8 == 0` but `1e8 + (1 - 1e8)
//! == 1` in f32), so every member receives all contributions and adds them in
//! the same order, the group's (sorted rank) order, rather than in arrival
//! order or with its own buffer first.
//!
//! **Deadlock freedom without threads.** A buffer larger than the kernel's
//! socket buffers cannot be written before the peer reads, and in a collective
//! every peer is writing too. So the collectives move in lock step, 16 KiB at a
//! time: write chunk `i` to every peer, then read chunk `i` from every peer (in
//! group order, summing or placing it at once). A peer never has more than two
//! of our chunks unread, which always fits in its socket buffers, so no write
//! can wait on a peer that is itself stuck writing. All on the calling thread:
//! no thread start-up or hand-off per call, which matters for the small
//! activations of decode steps (a per-peer sender thread cost about 1 ms per
//! call on a busy 2-core box; lock step costs tens of microseconds).
//!
//! **Same-host fast path.** Ranks whose hosts report the same boot id (and
//! that both enable [`CommConfig::shared_memory`], the default) carry their
//! frames through a pair of single-producer single-consumer byte rings in a
//! file under `/dev/shm` instead of through TCP: the same ordered byte stream,
//! so framing, lock step and the tests are the same on both paths. The lower
//! rank creates the file, the higher maps it and echoes a nonce over TCP to
//! prove it is the same file, and the file is unlinked before setup ends; any
//! failure there (no `/dev/shm`, separate IPC namespaces, full tmpfs) quietly
//! leaves that link on TCP. The TCP connection stays open as a liveness
//! channel: a rank waiting on a ring checks it every millisecond, so a peer
//! that dies is noticed as EOF exactly as on the TCP path. Waiting spins, then
//! yields, then sleeps (growing to 1 ms), so idle followers do not burn a core.
//!
//! # Failure model
//!
//! Ranks fail by crashing (the process and so its sockets go away) or by
//! hanging. A crashed peer shows up as EOF or a reset on its connection, and
//! every pending operation touching it returns [`CommError::PeerLost`] at once.
//! A hanging peer shows up as [`CommError::Timeout`] once no bytes have moved
//! on a connection for the communicator's operation timeout
//! ([`CommConfig::op_timeout`]); [`Communicator::recv_idle`] is the one wait
//! without a timeout, and it still returns `PeerLost` as soon as the peer's
//! connection closes. Setup is bounded by [`CommConfig::setup_timeout`].
//!
//! Any error *poisons* the communicator: a failed collective can leave a
//! connection in the middle of a frame, so every later call fails fast with
//! [`CommError::Poisoned`] instead of hanging or returning garbage. Poisoning
//! also shuts down all of this rank's connections, so the failure spreads to
//! every other rank within one operation (they see `PeerLost`) instead of each
//! waiting out its own timeout. The recovery is the caller's: tear the worker's
//! ranks down and build a new communicator.
//!
//! Wire format: every message is a frame, a little-endian `u64` payload length
//! followed by the payload; frames over [`CommConfig::max_frame_bytes`] are
//! refused as a [`CommError::Protocol`] error. `f32` data travels as
//! little-endian bytes.

use std::time::Duration;

mod frame;
mod link;
mod setup;
mod shm;
mod tcp;

pub use setup::Rendezvous;
pub use tcp::TcpComm;

/// Collective and point-to-point operations among the ranks of one worker.
/// Ranks are 0..world_size; `group` arguments are sorted rank lists that contain
/// `self.rank()`; every member of a group must make the same call in the same order.
pub trait Communicator: Send + std::fmt::Debug {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Every member ends with the elementwise sum, bit-identical on all members
    /// (the sum is taken in group order, so floating-point rounding is the same everywhere).
    fn all_reduce_sum(&mut self, group: &[usize], buf: &mut [f32]) -> Result<(), CommError>;
    /// `out` (len = group.len() * mine.len()) = every member's `mine`, concatenated in group order.
    fn all_gather(
        &mut self,
        group: &[usize],
        mine: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError>;
    /// `root`'s bytes reach every member of `group` (on non-roots `buf` is replaced).
    fn broadcast(
        &mut self,
        group: &[usize],
        root: usize,
        buf: &mut Vec<u8>,
    ) -> Result<(), CommError>;
    /// One message to `peer` (messages between a pair arrive in order).
    fn send(&mut self, peer: usize, bytes: &[u8]) -> Result<(), CommError>;
    /// The next message from `peer`, waiting at most the communicator's operation timeout.
    fn recv(&mut self, peer: usize) -> Result<Vec<u8>, CommError>;
    /// As `recv`, but waits without a timeout (a follower idling for its next command);
    /// still returns an error at once when the peer's process is gone (EOF / reset).
    fn recv_idle(&mut self, peer: usize) -> Result<Vec<u8>, CommError>;
    /// f32 convenience forms (little-endian bytes on the wire; recv_f32 checks the length).
    fn send_f32(&mut self, peer: usize, data: &[f32]) -> Result<(), CommError>;
    fn recv_f32(&mut self, peer: usize, out: &mut [f32]) -> Result<(), CommError>;
}

/// What went wrong in a [`Communicator`] call.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// The connection to `peer` is gone: EOF, reset, or a failed write.
    #[error("lost peer rank {peer}: {reason}")]
    PeerLost { peer: usize, reason: String },
    /// Nothing arrived from (or could be written to) `peer` for `after`.
    #[error("timed out after {after:?} waiting on peer rank {peer}")]
    Timeout { peer: usize, after: Duration },
    /// A bad frame, a wrong length, a rank mismatch or an invalid argument.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// Rendezvous failed.
    #[error("communicator setup failed: {0}")]
    Setup(String),
    /// An earlier error broke this communicator; it must be rebuilt.
    #[error("communicator is poisoned by an earlier error")]
    Poisoned,
}

/// Timeouts and limits of a communicator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommConfig {
    /// How long a receive (in `recv` and the collectives) or a send may make no
    /// progress before it fails with [`CommError::Timeout`]. Default 60 s.
    pub op_timeout: Duration,
    /// The bound on the whole rendezvous. Default 30 s.
    pub setup_timeout: Duration,
    /// Frames with a longer payload are refused (sending and receiving). Default 1 GiB.
    pub max_frame_bytes: u64,
    /// Ranks on the same host (same boot id) exchange frames through
    /// shared-memory rings in `/dev/shm` instead of TCP, when both enable it
    /// and the ring file can be created and mapped; otherwise TCP. Default true.
    pub shared_memory: bool,
}

impl Default for CommConfig {
    fn default() -> Self {
        Self {
            op_timeout: Duration::from_secs(60),
            setup_timeout: Duration::from_secs(30),
            max_frame_bytes: 1 << 30,
            shared_memory: true,
        }
    }
}

impl CommConfig {
    pub fn with_op_timeout(mut self, op_timeout: Duration) -> Self {
        self.op_timeout = op_timeout;
        self
    }

    pub fn with_setup_timeout(mut self, setup_timeout: Duration) -> Self {
        self.setup_timeout = setup_timeout;
        self
    }

    pub fn with_shared_memory(mut self, shared_memory: bool) -> Self {
        self.shared_memory = shared_memory;
        self
    }

    pub fn with_max_frame_bytes(mut self, max_frame_bytes: u64) -> Self {
        self.max_frame_bytes = max_frame_bytes;
        self
    }
}
