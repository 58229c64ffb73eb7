//! Frames (little-endian `u64` length + payload) and `f32` byte views.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::CommError;

#[cfg(not(target_endian = "little"))]
compile_error!(
    "tandem-comm sends f32 data as its in-memory bytes and needs a little-endian target"
);

/// Payloads up to this size are copied behind their header and written with
/// one system call (one TCP segment with `TCP_NODELAY`).
const COALESCE_MAX: usize = 64 * 1024;

/// Writes one frame.
pub(crate) fn write_frame(mut stream: &TcpStream, payload: &[u8]) -> io::Result<()> {
    let header = (payload.len() as u64).to_le_bytes();
    if payload.len() <= COALESCE_MAX {
        let mut whole = Vec::with_capacity(header.len() + payload.len());
        whole.extend_from_slice(&header);
        whole.extend_from_slice(payload);
        stream.write_all(&whole)
    } else {
        stream.write_all(&header)?;
        stream.write_all(payload)
    }
}

/// Reads a frame header: the payload length.
pub(crate) fn read_header(mut stream: &TcpStream) -> io::Result<u64> {
    let mut header = [0u8; 8];
    stream.read_exact(&mut header)?;
    Ok(u64::from_le_bytes(header))
}

/// Reads `dst.len()` payload bytes.
pub(crate) fn read_payload(mut stream: &TcpStream, dst: &mut [u8]) -> io::Result<()> {
    stream.read_exact(dst)
}

/// Maps an I/O error on the connection to `peer` to a [`CommError`].
pub(crate) fn io_error(peer: usize, err: &io::Error, timeout: Duration) -> CommError {
    match err.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => CommError::Timeout {
            peer,
            after: timeout,
        },
        io::ErrorKind::UnexpectedEof => CommError::PeerLost {
            peer,
            reason: "connection closed (EOF)".to_string(),
        },
        _ => CommError::PeerLost {
            peer,
            reason: err.to_string(),
        },
    }
}

/// The bytes of an `f32` slice (its little-endian encoding on this target).
pub(crate) fn f32_bytes(data: &[f32]) -> &[u8] {
    // SAFETY: the pointer and length cover exactly the memory of `data`
    // (`size_of::<f32>() == 4`, no padding); `u8` has alignment 1 and every
    // byte of an initialised f32 is initialised; the result borrows `data`.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) }
}

/// The bytes of a mutable `f32` slice; writing little-endian f32 encodings into
/// them sets the floats.
pub(crate) fn f32_bytes_mut(data: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `f32_bytes`; additionally every bit pattern is a valid f32,
    // so any bytes written through the view leave valid floats, and the
    // exclusive borrow of `data` is carried by the result.
    unsafe {
        std::slice::from_raw_parts_mut(data.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_views_are_little_endian_bytes() {
        let v = [1.5f32, -2.0];
        let mut expect = Vec::new();
        for x in v {
            expect.extend_from_slice(&x.to_le_bytes());
        }
        assert_eq!(f32_bytes(&v), &expect[..]);
        let mut w = [0f32; 2];
        f32_bytes_mut(&mut w).copy_from_slice(&expect);
        assert_eq!(w, v);
    }
}
