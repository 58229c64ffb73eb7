//! [`Communicator`] over a full mesh of TCP connections; their setup is
//! `crate::setup`.

use std::net::{SocketAddr, TcpStream};
use std::ops::Range;
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use crate::frame::{f32_bytes, f32_bytes_mut, io_error};
use crate::link::Link;
use crate::setup::{check_config, connect_until, follower_setup};
use crate::shm;
use crate::{CommConfig, CommError, Communicator};

/// Collectives move in lock-step chunks of this many bytes (a multiple of 4,
/// so chunks hold whole floats); two of them per direction must fit in the
/// kernel's socket buffers (see `TcpComm::exchange`).
const CHUNK: usize = 16 * 1024;

/// A [`Communicator`] over a full mesh of TCP connections.
#[derive(Debug)]
pub struct TcpComm {
    rank: usize,
    world: usize,
    /// `links[peer]`: the connection to `peer` (`None` at our own rank).
    links: Vec<Option<Link>>,
    config: CommConfig,
    poisoned: bool,
}

impl TcpComm {
    /// Joins the communicator as follower `rank` (1..world_size) through rank
    /// 0's rendezvous at `leader`. Retries connecting until the setup timeout,
    /// since the leader may not be listening yet.
    pub fn connect(
        leader: SocketAddr,
        rank: usize,
        world_size: usize,
        config: CommConfig,
    ) -> Result<TcpComm, CommError> {
        check_config(&config)?;
        if rank == 0 {
            return Err(CommError::Setup(
                "rank 0 is the leader: use Rendezvous::bind and accept".into(),
            ));
        }
        if rank >= world_size {
            return Err(CommError::Setup(format!(
                "rank {rank} is out of range for world size {world_size}"
            )));
        }
        let deadline = Instant::now() + config.setup_timeout;
        let to_leader = connect_until(leader, deadline, &format!("rank {rank} joining"))?;
        // On failure the links close as they drop: rank 0 sees EOF.
        let (streams, shm) = follower_setup(to_leader, rank, world_size, deadline, &config)?;
        TcpComm::new(rank, world_size, streams, shm, config)
    }

    pub(crate) fn new(
        rank: usize,
        world: usize,
        streams: Vec<Option<TcpStream>>,
        shm: Vec<Option<MmapMut>>,
        config: CommConfig,
    ) -> Result<TcpComm, CommError> {
        let mut links = Vec::with_capacity(world);
        for (peer, (stream, map)) in streams.into_iter().zip(shm).enumerate() {
            let Some(stream) = stream else {
                links.push(None);
                continue;
            };
            let link = match map {
                Some(map) => Link::Shm(shm::link(map, rank < peer, stream, config.op_timeout)),
                None => Link::Tcp(stream),
            };
            link.configure(config.op_timeout).map_err(|e| {
                CommError::Setup(format!("configuring the link to rank {peer}: {e}"))
            })?;
            links.push(Some(link));
        }
        tracing::debug!(
            rank,
            world,
            shm_links = links.iter().flatten().filter(|l| l.is_shm()).count(),
            "communicator ready"
        );
        Ok(TcpComm {
            rank,
            world,
            links,
            config,
            poisoned: false,
        })
    }

    /// How many of this rank's links run over shared memory (the rest: TCP).
    pub fn shared_memory_links(&self) -> usize {
        self.links.iter().flatten().filter(|l| l.is_shm()).count()
    }

    /// Whether an earlier error broke this communicator.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &CommConfig {
        &self.config
    }

    /// Records an error: poisons the communicator and closes every link, so
    /// the other ranks fail fast instead of waiting out their timeouts.
    fn fail(&mut self, err: CommError) -> CommError {
        if !self.poisoned {
            tracing::warn!(rank = self.rank, error = %err, "communicator failed; poisoning it");
            self.poisoned = true;
            shutdown_all(&self.links);
        }
        err
    }

    fn check_live(&self) -> Result<(), CommError> {
        if self.poisoned {
            Err(CommError::Poisoned)
        } else {
            Ok(())
        }
    }

    fn link(&self, peer: usize) -> Result<&Link, CommError> {
        if peer == self.rank {
            return Err(CommError::Protocol(format!(
                "rank {peer} cannot send to or receive from itself"
            )));
        }
        self.links
            .get(peer)
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                CommError::Protocol(format!(
                    "peer rank {peer} is out of range for world size {}",
                    self.world
                ))
            })
    }

    fn check_group(&self, group: &[usize]) -> Result<(), CommError> {
        let sorted = group.windows(2).all(|w| w[0] < w[1]);
        let in_range = group.iter().all(|&r| r < self.world);
        if !sorted || !in_range || !group.contains(&self.rank) {
            return Err(CommError::Protocol(format!(
                "group {group:?} must be sorted, distinct ranks below {} containing rank {}",
                self.world, self.rank
            )));
        }
        Ok(())
    }

    /// Reads the next frame from `peer` whose payload must be `dst.len()` bytes.
    fn read_exact_frame(
        link: &Link,
        peer: usize,
        dst: &mut [u8],
        timeout: Duration,
    ) -> Result<(), CommError> {
        let len = link
            .read_header(false)
            .map_err(|e| io_error(peer, &e, timeout))?;
        if len != dst.len() as u64 {
            return Err(CommError::Protocol(format!(
                "rank {peer} sent {len} bytes where {} were expected (mismatched call?)",
                dst.len()
            )));
        }
        link.read_exact(dst, false)
            .map_err(|e| io_error(peer, &e, timeout))
    }

    fn read_any_frame(&self, peer: usize, idle: bool) -> Result<Vec<u8>, CommError> {
        let link = self.link(peer)?;
        let timeout = self.config.op_timeout;
        let len = link
            .read_header(idle)
            .map_err(|e| io_error(peer, &e, timeout))?;
        if len > self.config.max_frame_bytes {
            return Err(CommError::Protocol(format!(
                "rank {peer} sent a frame of {len} bytes, over the limit of {}",
                self.config.max_frame_bytes
            )));
        }
        let len = usize::try_from(len)
            .map_err(|_| CommError::Protocol(format!("rank {peer} sent a frame of {len} bytes")))?;
        let mut buf = vec![0u8; len];
        link.read_exact(&mut buf, false)
            .map_err(|e| io_error(peer, &e, timeout))?;
        Ok(buf)
    }

    fn check_send_size(&self, len: usize) -> Result<(), CommError> {
        if len as u64 > self.config.max_frame_bytes {
            return Err(CommError::Protocol(format!(
                "a frame of {len} bytes is over the limit of {}",
                self.config.max_frame_bytes
            )));
        }
        Ok(())
    }

    /// The core of the collectives: every member of `group` sends its `mine`
    /// (all the same length) to every other member, as one frame.
    ///
    /// The frames move in lock step, [`CHUNK`] bytes at a time: write chunk
    /// `i` to every peer, then read chunk `i` from every peer in group order,
    /// handing each (and our own) to `on_chunk(position, byte range, bytes)`.
    /// Before we write chunk `i`, every peer has written chunk `i - 1`, so has
    /// read our chunk `i - 2`: at most two chunks per direction are unread,
    /// which the kernel's socket buffers hold, so no write waits on a peer
    /// that is itself waiting to write, whatever the buffer size. One thread,
    /// no hand-offs: the lowest latency for the small buffers of decode steps.
    fn exchange(
        &self,
        group: &[usize],
        mine: &[u8],
        mut on_chunk: impl FnMut(usize, Range<usize>, &[u8]),
    ) -> Result<(), CommError> {
        self.check_send_size(mine.len())?;
        let timeout = self.config.op_timeout;
        let mut peers = Vec::with_capacity(group.len());
        for &member in group {
            if member != self.rank {
                peers.push((member, self.link(member)?));
            }
        }
        let total = mine.len();
        let chunks = total.div_ceil(CHUNK).max(1);
        let mut first = Vec::with_capacity(8 + total.min(CHUNK));
        let mut incoming = vec![0u8; total.min(CHUNK)];
        for i in 0..chunks {
            let range = i * CHUNK..((i + 1) * CHUNK).min(total);
            let out = &mine[range.clone()];
            let out: &[u8] = if i == 0 {
                // The frame header travels with the first chunk.
                first.extend_from_slice(&(total as u64).to_le_bytes());
                first.extend_from_slice(out);
                &first
            } else {
                out
            };
            for &(peer, link) in &peers {
                link.write_all(out)
                    .map_err(|e| io_error(peer, &e, timeout))?;
            }
            let mut next_peer = peers.iter();
            for (pos, &member) in group.iter().enumerate() {
                if member == self.rank {
                    on_chunk(pos, range.clone(), &mine[range.clone()]);
                    continue;
                }
                let Some(&(peer, link)) = next_peer.next() else {
                    return Err(CommError::Protocol("group members out of step".into()));
                };
                if i == 0 {
                    let len = link
                        .read_header(false)
                        .map_err(|e| io_error(peer, &e, timeout))?;
                    if len != total as u64 {
                        return Err(CommError::Protocol(format!(
                            "rank {peer} contributed {len} bytes where {total} were expected \
                             (mismatched call?)"
                        )));
                    }
                }
                let dst = &mut incoming[..range.len()];
                link.read_exact(dst, false)
                    .map_err(|e| io_error(peer, &e, timeout))?;
                on_chunk(pos, range.clone(), dst);
            }
        }
        Ok(())
    }

    fn all_reduce_inner(&self, group: &[usize], buf: &mut [f32]) -> Result<(), CommError> {
        if group.len() == 1 {
            return Ok(());
        }
        let mut acc = vec![0f32; buf.len()];
        self.exchange(group, f32_bytes(buf), |pos, range, bytes| {
            // CHUNK is a multiple of 4, so chunks hold whole floats.
            let acc = &mut acc[range.start / 4..range.end / 4];
            let values = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            if pos == 0 {
                for (a, v) in acc.iter_mut().zip(values) {
                    *a = v;
                }
            } else {
                for (a, v) in acc.iter_mut().zip(values) {
                    *a += v;
                }
            }
        })?;
        buf.copy_from_slice(&acc);
        Ok(())
    }
}

fn shutdown_all(links: &[Option<Link>]) {
    for link in links.iter().flatten() {
        link.shutdown();
    }
}

impl Drop for TcpComm {
    fn drop(&mut self) {
        shutdown_all(&self.links);
    }
}

impl Communicator for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, group: &[usize], buf: &mut [f32]) -> Result<(), CommError> {
        self.check_live()?;
        let result = self
            .check_group(group)
            .and_then(|()| self.all_reduce_inner(group, buf));
        result.map_err(|e| self.fail(e))
    }

    fn all_gather(
        &mut self,
        group: &[usize],
        mine: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        self.check_live()?;
        let result = self.check_group(group).and_then(|()| {
            let n = mine.len();
            if out.len() != group.len() * n {
                return Err(CommError::Protocol(format!(
                    "all_gather: out has {} floats, expected {} members x {n}",
                    out.len(),
                    group.len()
                )));
            }
            let slot_bytes = n * 4;
            let out_bytes = f32_bytes_mut(out);
            self.exchange(group, f32_bytes(mine), |pos, range, bytes| {
                let at = pos * slot_bytes;
                out_bytes[at + range.start..at + range.end].copy_from_slice(bytes);
            })
        });
        result.map_err(|e| self.fail(e))
    }

    fn broadcast(
        &mut self,
        group: &[usize],
        root: usize,
        buf: &mut Vec<u8>,
    ) -> Result<(), CommError> {
        self.check_live()?;
        let result = self.check_group(group).and_then(|()| {
            if !group.contains(&root) {
                return Err(CommError::Protocol(format!(
                    "broadcast root {root} is not in group {group:?}"
                )));
            }
            if root == self.rank {
                self.check_send_size(buf.len())?;
                for &member in group.iter().filter(|&&m| m != root) {
                    self.link(member)?
                        .write_frame(buf)
                        .map_err(|e| io_error(member, &e, self.config.op_timeout))?;
                }
            } else {
                *buf = self.read_any_frame(root, false)?;
            }
            Ok(())
        });
        result.map_err(|e| self.fail(e))
    }

    fn send(&mut self, peer: usize, bytes: &[u8]) -> Result<(), CommError> {
        self.check_live()?;
        let result = self.check_send_size(bytes.len()).and_then(|()| {
            self.link(peer)?
                .write_frame(bytes)
                .map_err(|e| io_error(peer, &e, self.config.op_timeout))
        });
        result.map_err(|e| self.fail(e))
    }

    fn recv(&mut self, peer: usize) -> Result<Vec<u8>, CommError> {
        self.check_live()?;
        self.read_any_frame(peer, false).map_err(|e| self.fail(e))
    }

    fn recv_idle(&mut self, peer: usize) -> Result<Vec<u8>, CommError> {
        self.check_live()?;
        self.read_any_frame(peer, true).map_err(|e| self.fail(e))
    }

    fn send_f32(&mut self, peer: usize, data: &[f32]) -> Result<(), CommError> {
        self.send(peer, f32_bytes(data))
    }

    fn recv_f32(&mut self, peer: usize, out: &mut [f32]) -> Result<(), CommError> {
        self.check_live()?;
        let result = self.link(peer).and_then(|link| {
            Self::read_exact_frame(link, peer, f32_bytes_mut(out), self.config.op_timeout)
        });
        result.map_err(|e| self.fail(e))
    }
}
