//! Setting up a [`TcpComm`] mesh.
//!
//! Setup: rank 0 listens ([`Rendezvous`]). Each follower connects to it, binds
//! its own listener on the local IP of that connection, and sends a hello
//! (magic, version, rank, world size, listen address). Rank 0 checks the hellos
//! (distinct ranks in range, same world size) and answers everyone with the
//! address table, or with the reason it gives up. Rank `i` then connects to
//! ranks `1..i` (sending its rank first) and accepts ranks `i+1..world`; rank
//! 0's links are the rendezvous connections. Then each pair on the same host
//! negotiates a shared-memory ring (see `crate::shm`; TCP otherwise). Finally
//! every follower reports
//! ready and rank 0 answers "go", so setup either succeeds on every rank or
//! fails on every rank. Every step is bounded by the setup timeout.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use crate::frame::{read_header, read_payload, write_frame};
use crate::shm;
use crate::tcp::TcpComm;
use crate::{CommConfig, CommError};

const MAGIC: &[u8; 8] = b"TNDMCOMM";
const VERSION: u32 = 1;
/// Setup messages are small; a peer announcing more is not one of ours.
const SETUP_FRAME_MAX: u64 = 1 << 20;
const STATUS_OK: u8 = 0;
const STATUS_ERR: u8 = 1;

/// Rank 0's side of the rendezvous: the listener followers connect to.
#[derive(Debug)]
pub struct Rendezvous {
    listener: TcpListener,
}

impl Rendezvous {
    /// Listens on `addr` (port 0 picks a free port, see [`Self::local_addr`]).
    pub fn bind(addr: SocketAddr) -> Result<Self, CommError> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| CommError::Setup(format!("rank 0 cannot listen on {addr}: {e}")))?;
        Ok(Self { listener })
    }

    /// The address followers pass to [`TcpComm::connect`].
    pub fn local_addr(&self) -> Result<SocketAddr, CommError> {
        self.listener
            .local_addr()
            .map_err(|e| CommError::Setup(format!("rendezvous listener address: {e}")))
    }

    /// Waits (at most `config.setup_timeout`) for ranks `1..world_size` and
    /// builds rank 0's communicator.
    pub fn accept(self, world_size: usize, config: CommConfig) -> Result<TcpComm, CommError> {
        check_config(&config)?;
        if world_size == 0 {
            return Err(CommError::Setup("world size must be at least 1".into()));
        }
        let deadline = Instant::now() + config.setup_timeout;
        let mut followers: Vec<Option<Follower>> = (0..world_size).map(|_| None).collect();
        let shm = match leader_setup(
            &self.listener,
            world_size,
            deadline,
            &config,
            &mut followers,
        ) {
            Ok(shm) => shm,
            Err(e) => {
                // Tell everyone who got this far, so they fail now rather than
                // at their own timeout (best effort: they may be gone already).
                let notice = setup_error_frame(&e);
                for f in followers.iter().flatten() {
                    let _ = write_frame(&f.stream, &notice);
                }
                return Err(e);
            }
        };
        let streams = followers.into_iter().map(|f| f.map(|f| f.stream)).collect();
        TcpComm::new(0, world_size, streams, shm, config)
    }
}

/// A follower as rank 0 knows it during setup.
struct Follower {
    stream: TcpStream,
    addr: String,
    host: String,
}

fn leader_setup(
    listener: &TcpListener,
    world: usize,
    deadline: Instant,
    config: &CommConfig,
    followers: &mut [Option<Follower>],
) -> Result<Vec<Option<MmapMut>>, CommError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| CommError::Setup(format!("rendezvous listener: {e}")))?;
    let mut joined = 1;
    while joined < world {
        let (stream, from) = accept_until(listener, deadline, || {
            let missing: Vec<usize> = (1..world).filter(|&r| followers[r].is_none()).collect();
            format!("rank 0 timed out waiting for ranks {missing:?} to join")
        })?;
        let hello = read_setup_frame(&stream, deadline, &format!("hello from {from}"))?;
        let (rank, their_world, addr, host) = parse_hello(&hello, from)?;
        if their_world != world {
            let e = CommError::Setup(format!(
                "world size mismatch: rank {rank} (from {from}) says {their_world}, rank 0 says {world}"
            ));
            let _ = write_frame(&stream, &setup_error_frame(&e));
            return Err(e);
        }
        if rank == 0 || rank >= world {
            let e = CommError::Setup(format!(
                "rank {rank} (from {from}) is out of range 1..{world}"
            ));
            let _ = write_frame(&stream, &setup_error_frame(&e));
            return Err(e);
        }
        if followers[rank].is_some() {
            let e = CommError::Setup(format!(
                "duplicate rank {rank}: a second process (from {from}) claims it"
            ));
            let _ = write_frame(&stream, &setup_error_frame(&e));
            return Err(e);
        }
        followers[rank] = Some(Follower { stream, addr, host });
        joined += 1;
    }
    // The table: each rank's listen address (rank 0's is empty) and host id.
    let mut hosts = vec![shm::host_id()];
    hosts.extend(followers.iter().skip(1).flatten().map(|f| f.host.clone()));
    let mut table = vec![STATUS_OK];
    table.extend_from_slice(&(world as u64).to_le_bytes());
    for (rank, entry) in followers.iter().enumerate() {
        let addr = entry.as_ref().map(|f| f.addr.as_str()).unwrap_or("");
        put_string(&mut table, addr);
        put_string(&mut table, &hosts[rank]);
    }
    for (rank, entry) in followers.iter().enumerate() {
        if let Some(f) = entry {
            write_frame(&f.stream, &table).map_err(|e| {
                CommError::Setup(format!("sending the address table to rank {rank}: {e}"))
            })?;
        }
    }
    let streams: Vec<Option<&TcpStream>> = followers
        .iter()
        .map(|f| f.as_ref().map(|f| &f.stream))
        .collect();
    let shm = negotiate_shm(0, &streams, &hosts, config, deadline)?;
    for (rank, stream) in streams.iter().enumerate() {
        if let Some(stream) = stream {
            let ready = read_setup_frame(stream, deadline, &format!("rank {rank}'s ready"))?;
            expect_ok(&ready, &format!("rank {rank}"))?;
        }
    }
    for (rank, stream) in streams.iter().enumerate() {
        if let Some(stream) = stream {
            write_frame(stream, &[STATUS_OK])
                .map_err(|e| CommError::Setup(format!("sending go to rank {rank}: {e}")))?;
        }
    }
    Ok(shm)
}

fn put_string(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

const SHM_NO: u8 = 0;
const SHM_YES: u8 = 1;

/// Decides, for every link of rank `me`, whether it runs over shared memory;
/// returns the ring mappings of those that do. The lower rank of a pair on the
/// same host offers a ring file, the higher maps it and echoes its nonce, the
/// lower confirms. Four phases, each waiting only on messages of the phase
/// before, so no two ranks wait on each other.
// The loops run over peer ranks, which index several tables at once.
#[allow(clippy::needless_range_loop)]
fn negotiate_shm(
    me: usize,
    streams: &[Option<&TcpStream>],
    hosts: &[String],
    config: &CommConfig,
    deadline: Instant,
) -> Result<Vec<Option<MmapMut>>, CommError> {
    let world = streams.len();
    let stream = |peer: usize| -> Result<&TcpStream, CommError> {
        streams[peer]
            .ok_or_else(|| CommError::Setup(format!("rank {me} has no link to rank {peer}")))
    };
    let send = |peer: usize, frame: &[u8]| -> Result<(), CommError> {
        write_frame(stream(peer)?, frame)
            .map_err(|e| CommError::Setup(format!("rank {me} negotiating with rank {peer}: {e}")))
    };
    let recv = |peer: usize| -> Result<Vec<u8>, CommError> {
        read_setup_frame(
            stream(peer)?,
            deadline,
            &format!("rank {peer}'s shared-memory answer"),
        )
    };
    let same_host =
        |peer: usize| config.shared_memory && !hosts[me].is_empty() && hosts[peer] == hosts[me];
    let mut offers: Vec<Option<shm::Offer>> = (0..world).map(|_| None).collect();
    let mut mapped: Vec<Option<(MmapMut, u64)>> = (0..world).map(|_| None).collect();
    let mut result: Vec<Option<MmapMut>> = (0..world).map(|_| None).collect();
    // 1: offers to higher ranks.
    for peer in me + 1..world {
        let offer = if same_host(peer) {
            shm::Offer::create(me, peer)
                .map_err(|e| tracing::debug!(rank = me, peer, error = %e, "no shared-memory ring; using TCP"))
                .ok()
        } else {
            None
        };
        match &offer {
            Some(o) => {
                let mut frame = vec![SHM_YES];
                frame.extend_from_slice(o.path.to_string_lossy().as_bytes());
                send(peer, &frame)?;
            }
            None => send(peer, &[SHM_NO])?,
        }
        offers[peer] = offer;
    }
    // 2: answers to lower ranks' offers.
    for peer in 0..me {
        let offer = recv(peer)?;
        let accepted = match offer.split_first() {
            Some((&SHM_YES, path)) if config.shared_memory => {
                let path = String::from_utf8_lossy(path).into_owned();
                shm::accept_offer(Path::new(&path))
                    .map_err(|e| tracing::debug!(rank = me, peer, error = %e, "cannot map the ring; using TCP"))
                    .ok()
            }
            _ => None,
        };
        match &accepted {
            Some((_, nonce)) => {
                let mut frame = vec![SHM_YES];
                frame.extend_from_slice(&nonce.to_le_bytes());
                send(peer, &frame)?;
            }
            None => send(peer, &[SHM_NO])?,
        }
        mapped[peer] = accepted;
    }
    // 3: confirmations to higher ranks (the offers' files are unlinked here).
    for peer in me + 1..world {
        let answer = recv(peer)?;
        let confirmed = match (offers[peer].take(), answer.split_first()) {
            (Some(offer), Some((&SHM_YES, nonce))) if nonce == offer.nonce.to_le_bytes() => {
                offer.take_map()
            }
            _ => None,
        };
        send(peer, &[if confirmed.is_some() { SHM_YES } else { SHM_NO }])?;
        result[peer] = confirmed;
    }
    // 4: confirmations from lower ranks.
    for peer in 0..me {
        let confirmed = recv(peer)?;
        if confirmed.first() == Some(&SHM_YES) {
            result[peer] = mapped[peer].take().map(|(map, _)| map);
        }
    }
    Ok(result)
}

pub(crate) fn check_config(config: &CommConfig) -> Result<(), CommError> {
    if config.op_timeout.is_zero() || config.setup_timeout.is_zero() {
        return Err(CommError::Setup(
            "op_timeout and setup_timeout must be positive".into(),
        ));
    }
    Ok(())
}

fn remaining(deadline: Instant, what: &str) -> Result<Duration, CommError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(CommError::Setup(format!("timed out during {what}")));
    }
    Ok(left)
}

/// Accepts one connection before `deadline` (the listener is non-blocking).
fn accept_until(
    listener: &TcpListener,
    deadline: Instant,
    on_timeout: impl Fn() -> String,
) -> Result<(TcpStream, SocketAddr), CommError> {
    loop {
        match listener.accept() {
            Ok((stream, from)) => {
                stream.set_nonblocking(false).map_err(|e| {
                    CommError::Setup(format!("accepted connection from {from}: {e}"))
                })?;
                return Ok((stream, from));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(CommError::Setup(on_timeout()));
                }
                thread::sleep(Duration::from_millis(2));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(CommError::Setup(format!("accept: {e}"))),
        }
    }
}

/// Reads one small setup frame, waiting at most until `deadline`.
fn read_setup_frame(
    stream: &TcpStream,
    deadline: Instant,
    what: &str,
) -> Result<Vec<u8>, CommError> {
    let fail = |e: io::Error| {
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            CommError::Setup(format!("timed out waiting for {what}"))
        } else {
            CommError::Setup(format!("reading {what}: {e}"))
        }
    };
    stream
        .set_read_timeout(Some(remaining(deadline, what)?))
        .map_err(fail)?;
    let len = read_header(stream).map_err(fail)?;
    if len > SETUP_FRAME_MAX {
        return Err(CommError::Setup(format!(
            "{what}: frame of {len} bytes is not a setup message"
        )));
    }
    let mut buf = vec![0u8; len as usize];
    stream
        .set_read_timeout(Some(remaining(deadline, what)?))
        .map_err(fail)?;
    read_payload(stream, &mut buf).map_err(fail)?;
    Ok(buf)
}

fn setup_error_frame(e: &CommError) -> Vec<u8> {
    let mut frame = vec![STATUS_ERR];
    frame.extend_from_slice(e.to_string().as_bytes());
    frame
}

/// Checks a status frame: OK, or the error the other side reported.
fn expect_ok(frame: &[u8], from: &str) -> Result<(), CommError> {
    match frame.first() {
        Some(&STATUS_OK) => Ok(()),
        Some(&STATUS_ERR) => Err(CommError::Setup(format!(
            "{from} reported: {}",
            String::from_utf8_lossy(&frame[1..])
        ))),
        _ => Err(CommError::Setup(format!("{from} sent a bad status frame"))),
    }
}

/// A little-endian cursor over a setup message.
struct Cursor<'a> {
    bytes: &'a [u8],
    what: &'a str,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CommError> {
        if self.bytes.len() < n {
            return Err(CommError::Setup(format!("{} is truncated", self.what)));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn u64(&mut self) -> Result<u64, CommError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }

    fn usize(&mut self) -> Result<usize, CommError> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| CommError::Setup(format!("{}: {v} is too large", self.what)))
    }

    fn string(&mut self) -> Result<String, CommError> {
        let len = self.usize()?;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| CommError::Setup(format!("{} holds a non-UTF-8 string", self.what)))
    }

    fn magic(&mut self) -> Result<(), CommError> {
        if self.take(MAGIC.len())? != MAGIC {
            return Err(CommError::Setup(format!(
                "{} is not from a tandem communicator (bad magic)",
                self.what
            )));
        }
        let mut v = [0u8; 4];
        v.copy_from_slice(self.take(4)?);
        let version = u32::from_le_bytes(v);
        if version != VERSION {
            return Err(CommError::Setup(format!(
                "{} speaks protocol version {version}, this build speaks {VERSION}",
                self.what
            )));
        }
        Ok(())
    }
}

fn magic_prefix() -> Vec<u8> {
    let mut m = MAGIC.to_vec();
    m.extend_from_slice(&VERSION.to_le_bytes());
    m
}

/// Hello to rank 0: magic, version, rank, world size, listen address.
fn hello_frame(rank: usize, world: usize, listen: SocketAddr) -> Vec<u8> {
    let mut f = magic_prefix();
    f.extend_from_slice(&(rank as u64).to_le_bytes());
    f.extend_from_slice(&(world as u64).to_le_bytes());
    put_string(&mut f, &listen.to_string());
    put_string(&mut f, &shm::host_id());
    f
}

fn parse_hello(
    frame: &[u8],
    from: SocketAddr,
) -> Result<(usize, usize, String, String), CommError> {
    let what = format!("the hello from {from}");
    let mut c = Cursor {
        bytes: frame,
        what: &what,
    };
    c.magic()?;
    let rank = c.usize()?;
    let world = c.usize()?;
    let addr = c.string()?;
    let host = c.string()?;
    Ok((rank, world, addr, host))
}

/// Connects to `addr`, retrying with a short backoff until `deadline`.
pub(crate) fn connect_until(
    addr: SocketAddr,
    deadline: Instant,
    what: &str,
) -> Result<TcpStream, CommError> {
    let mut backoff = Duration::from_millis(10);
    loop {
        let left = remaining(deadline, what)?;
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(2))) {
            Ok(s) => return Ok(s),
            Err(e) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(CommError::Setup(format!(
                        "{what}: cannot connect to {addr}: {e}"
                    )));
                }
                thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
    }
}

/// A follower's part of setup; returns its links (index 0 left for the caller).
#[allow(clippy::type_complexity)]
pub(crate) fn follower_setup(
    to_leader: TcpStream,
    rank: usize,
    world: usize,
    deadline: Instant,
    config: &CommConfig,
) -> Result<(Vec<Option<TcpStream>>, Vec<Option<MmapMut>>), CommError> {
    let local_ip = to_leader
        .local_addr()
        .map_err(|e| CommError::Setup(format!("rank {rank}: local address: {e}")))?
        .ip();
    let listener = TcpListener::bind(SocketAddr::new(local_ip, 0))
        .map_err(|e| CommError::Setup(format!("rank {rank} cannot listen on {local_ip}: {e}")))?;
    let listen_addr = listener
        .local_addr()
        .map_err(|e| CommError::Setup(format!("rank {rank}: listener address: {e}")))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| CommError::Setup(format!("rank {rank}: listener: {e}")))?;
    write_frame(&to_leader, &hello_frame(rank, world, listen_addr))
        .map_err(|e| CommError::Setup(format!("rank {rank}: sending hello to rank 0: {e}")))?;

    let table = read_setup_frame(&to_leader, deadline, "the address table from rank 0")?;
    expect_ok(&table, "rank 0")?;
    let mut c = Cursor {
        bytes: &table[1..],
        what: "the address table",
    };
    let n = c.usize()?;
    if n != world {
        return Err(CommError::Setup(format!(
            "rank 0's table has {n} ranks, expected {world}"
        )));
    }
    let mut addrs = Vec::with_capacity(world);
    let mut hosts = Vec::with_capacity(world);
    for r in 0..world {
        let s = c.string()?;
        hosts.push(c.string()?);
        if r == 0 {
            addrs.push(None);
            continue;
        }
        let addr: SocketAddr = s
            .parse()
            .map_err(|_| CommError::Setup(format!("rank {r}'s address {s:?} is not an address")))?;
        addrs.push(Some(addr));
    }

    let mut links: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    // Connect down to ranks 1..rank.
    for (peer, addr) in addrs.iter().enumerate().take(rank).skip(1) {
        let Some(addr) = *addr else { continue };
        let stream = connect_until(
            addr,
            deadline,
            &format!("rank {rank} connecting to rank {peer}"),
        )?;
        let mut intro = magic_prefix();
        intro.extend_from_slice(&(rank as u64).to_le_bytes());
        write_frame(&stream, &intro).map_err(|e| {
            CommError::Setup(format!(
                "rank {rank} introducing itself to rank {peer}: {e}"
            ))
        })?;
        links[peer] = Some(stream);
    }
    // Accept ranks rank+1..world.
    for _ in rank + 1..world {
        let (stream, from) = accept_until(&listener, deadline, || {
            let missing: Vec<usize> = (rank + 1..world).filter(|&r| links[r].is_none()).collect();
            format!("rank {rank} timed out waiting for ranks {missing:?} to connect")
        })?;
        let intro = read_setup_frame(&stream, deadline, &format!("the introduction from {from}"))?;
        let what = format!("the introduction from {from}");
        let mut c = Cursor {
            bytes: &intro,
            what: &what,
        };
        c.magic()?;
        let peer = c.usize()?;
        if peer <= rank || peer >= world || links[peer].is_some() {
            return Err(CommError::Setup(format!(
                "rank {rank} got an unexpected introduction from rank {peer} ({from})"
            )));
        }
        links[peer] = Some(stream);
    }
    links[0] = Some(to_leader);
    let streams: Vec<Option<&TcpStream>> = links.iter().map(Option::as_ref).collect();
    let shm = negotiate_shm(rank, &streams, &hosts, config, deadline)?;
    let Some(to_leader) = &links[0] else {
        return Err(CommError::Setup("lost the link to rank 0".into()));
    };
    write_frame(to_leader, &[STATUS_OK])
        .map_err(|e| CommError::Setup(format!("rank {rank}: reporting ready to rank 0: {e}")))?;
    let go = read_setup_frame(to_leader, deadline, "rank 0's go")?;
    expect_ok(&go, "rank 0")?;
    Ok((links, shm))
}
