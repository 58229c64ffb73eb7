//! One rank-to-rank connection: a TCP stream, or (for ranks on the same host)
//! a pair of shared-memory rings with the TCP stream kept as a liveness channel.
//! Both are ordered byte streams with the same read/write semantics.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use crate::shm::ShmLink;

/// Payloads up to this size are copied behind their header and written with
/// one system call (one TCP segment with `TCP_NODELAY`).
const COALESCE_MAX: usize = 64 * 1024;

#[derive(Debug)]
pub(crate) enum Link {
    Tcp(TcpStream),
    Shm(ShmLink),
}

impl Link {
    /// Configures a link for operation (`timeout`: the operation timeout).
    pub(crate) fn configure(&self, timeout: Duration) -> io::Result<()> {
        match self {
            Link::Tcp(stream) => {
                stream.set_nodelay(true)?;
                stream.set_read_timeout(Some(timeout))?;
                stream.set_write_timeout(Some(timeout))
            }
            Link::Shm(shm) => shm.configure(timeout),
        }
    }

    pub(crate) fn is_shm(&self) -> bool {
        matches!(self, Link::Shm(_))
    }

    pub(crate) fn write_all(&self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Link::Tcp(stream) => (&*stream).write_all(bytes),
            Link::Shm(shm) => shm.write_all(bytes),
        }
    }

    /// Reads exactly `buf.len()` bytes; `idle`: wait without the operation timeout.
    pub(crate) fn read_exact(&self, buf: &mut [u8], idle: bool) -> io::Result<()> {
        match self {
            Link::Tcp(stream) => {
                let mut stream: &TcpStream = stream;
                if !idle {
                    return stream.read_exact(buf);
                }
                let timeout = stream.read_timeout()?;
                stream.set_read_timeout(None)?;
                let result = stream.read_exact(buf);
                stream.set_read_timeout(timeout)?;
                result
            }
            Link::Shm(shm) => shm.read_exact(buf, idle),
        }
    }

    /// Writes one frame: little-endian `u64` length, then the payload.
    pub(crate) fn write_frame(&self, payload: &[u8]) -> io::Result<()> {
        let header = (payload.len() as u64).to_le_bytes();
        if payload.len() <= COALESCE_MAX {
            let mut whole = Vec::with_capacity(header.len() + payload.len());
            whole.extend_from_slice(&header);
            whole.extend_from_slice(payload);
            self.write_all(&whole)
        } else {
            self.write_all(&header)?;
            self.write_all(payload)
        }
    }

    /// Reads a frame header: the payload length.
    pub(crate) fn read_header(&self, idle: bool) -> io::Result<u64> {
        let mut header = [0u8; 8];
        self.read_exact(&mut header, idle)?;
        Ok(u64::from_le_bytes(header))
    }

    /// Closes the connection both ways (the peer sees EOF).
    pub(crate) fn shutdown(&self) {
        let stream = match self {
            Link::Tcp(stream) => stream,
            Link::Shm(shm) => shm.control(),
        };
        let _ = stream.shutdown(Shutdown::Both);
    }
}
