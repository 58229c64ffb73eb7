//! The TCP wire format (little-endian throughout).
//!
//! **Handshake.** The connecting side (sender) sends a hello:
//!
//! ```text
//! magic "TDMKVXF1" (8) | version u16 | token_len u16 | layout (20) | token (token_len ≤ 1024)
//! ```
//!
//! The listening side checks, in order, magic, version, token (constant
//! time), layout validity and compatibility, and replies:
//!
//! ```text
//! magic (8) | version u16 | status u8 | 0 u8 | its layout (20) | its sink's num_blocks u32
//! ```
//!
//! with status 0 accepted, 1 version, 2 token, 3 layout mismatch, 4 invalid
//! layout; on refusal it closes the connection. The sender checks the reply's
//! layout itself too, so each side reports a mismatch in its own terms
//! ("block_size 16 here, 32 at the peer").
//!
//! **Frames.** Then every message is `type u8 | body_len u32 | body`.
//! Sender → receiver:
//!
//! - `WRITE` (1): `transfer u64 | count u32 | count × (layer u32, dst_block u32)
//!   | count × (K, V)`, each K and V exactly `block_layer_bytes`. The body
//!   length must equal what `count` and the layout imply, and at most
//!   [`MAX_FRAME_BYTES`], so a hostile length cannot make the receiver
//!   allocate more than a frame's table; payloads are read in bounded chunks.
//!   Block headers come first so the sender writes one header buffer followed
//!   by the caller's K/V buffers in one vectored write, with no copy.
//! - `FINISH` (2): `transfer u64`.
//! - `ABORT` (3): `transfer u64`.
//!
//! Receiver → sender:
//!
//! - `DONE` (0x81): `transfer u64 | status u8 (0 ok, 1 failed) | len u16 |
//!   message`. Exactly one per transfer.
//! - `CLOSE` (0x82): `len u16 | message` — why the receiver is closing the
//!   connection (a protocol error), sent best-effort before it does.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use std::collections::VecDeque;
use std::io::IoSlice;

use crate::{BlockWrite, KvLayoutDescriptor, TransferError, TransferId};

/// The TCP transport's magic.
pub(crate) const MAGIC: [u8; 8] = *b"TDMKVXF1";
/// The UCX transport's magic: its control connection uses the same
/// handshake, and a TCP peer meeting a UCX one is refused at the magic.
pub(crate) const MAGIC_UCX: [u8; 8] = *b"TDMKVXU1";
pub(crate) const VERSION: u16 = 1;
pub(crate) const MAX_TOKEN_BYTES: usize = 1024;
pub(crate) const HELLO_FIXED: usize = 8 + 2 + 2 + KvLayoutDescriptor::ENCODED_LEN;
pub(crate) const REPLY_LEN: usize = 8 + 2 + 1 + 1 + KvLayoutDescriptor::ENCODED_LEN + 4;

pub(crate) const STATUS_OK: u8 = 0;
pub(crate) const STATUS_VERSION: u8 = 1;
pub(crate) const STATUS_TOKEN: u8 = 2;
pub(crate) const STATUS_LAYOUT_MISMATCH: u8 = 3;
pub(crate) const STATUS_LAYOUT_INVALID: u8 = 4;

pub(crate) const FRAME_WRITE: u8 = 1;
pub(crate) const FRAME_FINISH: u8 = 2;
pub(crate) const FRAME_ABORT: u8 = 3;
pub(crate) const FRAME_DONE: u8 = 0x81;
pub(crate) const FRAME_CLOSE: u8 = 0x82;

pub(crate) const FRAME_HEADER: usize = 5;
/// The largest frame body either side accepts.
pub(crate) const MAX_FRAME_BYTES: usize = 64 << 20;
/// The sender packs blocks into frames of about this much payload.
pub(crate) const TARGET_FRAME_BYTES: usize = 4 << 20;
/// The longest message in `DONE`/`CLOSE`.
pub(crate) const MAX_MESSAGE_BYTES: usize = 4096;
/// The fixed part of a `WRITE` body (transfer, count).
pub(crate) const WRITE_FIXED: usize = 12;
/// Bytes of one block's entry in a `WRITE` table.
pub(crate) const WRITE_ENTRY: usize = 8;

pub(crate) fn encode_hello(magic: [u8; 8], layout: &KvLayoutDescriptor, token: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HELLO_FIXED + token.len());
    out.extend_from_slice(&magic);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(token.len() as u16).to_le_bytes());
    out.extend_from_slice(&layout.encode());
    out.extend_from_slice(token);
    out
}

/// Parses the fixed part of a hello; returns it and the token length still to
/// read.
pub(crate) fn decode_hello_fixed(
    magic: [u8; 8],
    bytes: &[u8; HELLO_FIXED],
) -> Result<(u16, Result<KvLayoutDescriptor, TransferError>, usize), TransferError> {
    if bytes[0..8] != magic {
        return Err(TransferError::Protocol(format!(
            "the peer is not a tandem KV transfer sender of this transport (bad magic; \
             both sides need the same --kv-transport, this side is {})",
            transport_name(magic)
        )));
    }
    let version = u16::from_le_bytes([bytes[8], bytes[9]]);
    let token_len = usize::from(u16::from_le_bytes([bytes[10], bytes[11]]));
    if token_len > MAX_TOKEN_BYTES {
        return Err(TransferError::Protocol(format!(
            "cluster token of {token_len} bytes; at most {MAX_TOKEN_BYTES}"
        )));
    }
    let mut layout = [0u8; KvLayoutDescriptor::ENCODED_LEN];
    layout.copy_from_slice(&bytes[12..HELLO_FIXED]);
    Ok((version, KvLayoutDescriptor::decode(&layout), token_len))
}

/// The listener's reply.
#[derive(Debug)]
pub(crate) struct Reply {
    pub version: u16,
    pub status: u8,
    pub layout: Result<KvLayoutDescriptor, TransferError>,
    pub num_blocks: u32,
}

/// The transport a magic belongs to, for error messages.
pub(crate) fn transport_name(magic: [u8; 8]) -> &'static str {
    if magic == MAGIC_UCX {
        "ucx"
    } else {
        "tcp"
    }
}

pub(crate) fn encode_reply(
    magic: [u8; 8],
    status: u8,
    layout: &KvLayoutDescriptor,
    num_blocks: u32,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(REPLY_LEN);
    out.extend_from_slice(&magic);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.push(status);
    out.push(0);
    out.extend_from_slice(&layout.encode());
    out.extend_from_slice(&num_blocks.to_le_bytes());
    out
}

pub(crate) fn decode_reply(
    magic: [u8; 8],
    bytes: &[u8; REPLY_LEN],
) -> Result<Reply, TransferError> {
    if bytes[0..8] != magic {
        return Err(TransferError::Protocol(format!(
            "the endpoint is not a tandem KV transfer listener of this transport (bad magic; \
             both sides need the same --kv-transport, this side is {})",
            transport_name(magic)
        )));
    }
    let mut layout = [0u8; KvLayoutDescriptor::ENCODED_LEN];
    layout.copy_from_slice(&bytes[12..32]);
    Ok(Reply {
        version: u16::from_le_bytes([bytes[8], bytes[9]]),
        status: bytes[10],
        layout: KvLayoutDescriptor::decode(&layout),
        num_blocks: u32::from_le_bytes([bytes[32], bytes[33], bytes[34], bytes[35]]),
    })
}

/// An outgoing byte stream made of shared buffers, written with vectored
/// writes so block payloads go from the caller's buffers to the socket
/// without a copy.
#[derive(Debug, Default)]
pub(crate) struct Segments {
    parts: VecDeque<Bytes>,
    remaining: usize,
}

impl Segments {
    pub(crate) fn push(&mut self, bytes: Bytes) {
        if !bytes.is_empty() {
            self.remaining += bytes.len();
            self.parts.push_back(bytes);
        }
    }
}

impl Buf for Segments {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        self.parts.front().map(|b| b.as_ref()).unwrap_or(&[])
    }

    fn advance(&mut self, mut cnt: usize) {
        cnt = cnt.min(self.remaining);
        self.remaining -= cnt;
        while cnt > 0 {
            let Some(front) = self.parts.front_mut() else {
                break;
            };
            let n = cnt.min(front.len());
            front.advance(n);
            cnt -= n;
            if front.is_empty() {
                self.parts.pop_front();
            }
        }
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        let mut n = 0;
        for (slot, part) in dst.iter_mut().zip(self.parts.iter()) {
            *slot = IoSlice::new(part);
            n += 1;
        }
        n
    }
}

/// Appends `WRITE` frames for `blocks` (already validated against `layout`),
/// at most `blocks_per_frame` per frame.
pub(crate) fn encode_writes(
    out: &mut Segments,
    transfer: TransferId,
    blocks: Vec<BlockWrite>,
    block_layer_bytes: usize,
    blocks_per_frame: usize,
) {
    let mut blocks = blocks.into_iter().peekable();
    while blocks.peek().is_some() {
        let frame: Vec<BlockWrite> = blocks.by_ref().take(blocks_per_frame.max(1)).collect();
        let count = frame.len();
        let body = WRITE_FIXED + count * (WRITE_ENTRY + 2 * block_layer_bytes);
        let mut header = BytesMut::with_capacity(FRAME_HEADER + WRITE_FIXED + count * WRITE_ENTRY);
        header.put_u8(FRAME_WRITE);
        header.put_u32_le(body as u32);
        header.put_u64_le(transfer.0);
        header.put_u32_le(count as u32);
        for block in &frame {
            header.put_u32_le(block.layer);
            header.put_u32_le(block.dst_block);
        }
        out.push(header.freeze());
        for block in frame {
            out.push(block.k);
            out.push(block.v);
        }
    }
}

pub(crate) fn encode_control(out: &mut Segments, kind: u8, transfer: TransferId) {
    let mut frame = BytesMut::with_capacity(FRAME_HEADER + 8);
    frame.put_u8(kind);
    frame.put_u32_le(8);
    frame.put_u64_le(transfer.0);
    out.push(frame.freeze());
}

/// Cuts `message` to [`MAX_MESSAGE_BYTES`] on a character boundary.
fn clip(message: &str) -> &str {
    if message.len() <= MAX_MESSAGE_BYTES {
        return message;
    }
    let mut end = MAX_MESSAGE_BYTES;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}

pub(crate) fn encode_done(transfer: TransferId, result: &Result<(), String>) -> Vec<u8> {
    let message = match result {
        Ok(()) => "",
        Err(reason) => clip(reason),
    };
    let mut out = Vec::with_capacity(FRAME_HEADER + 11 + message.len());
    out.push(FRAME_DONE);
    out.extend_from_slice(&((11 + message.len()) as u32).to_le_bytes());
    out.extend_from_slice(&transfer.0.to_le_bytes());
    out.push(u8::from(result.is_err()));
    out.extend_from_slice(&(message.len() as u16).to_le_bytes());
    out.extend_from_slice(message.as_bytes());
    out
}

pub(crate) fn encode_close(message: &str) -> Vec<u8> {
    let message = clip(message);
    let mut out = Vec::with_capacity(FRAME_HEADER + 2 + message.len());
    out.push(FRAME_CLOSE);
    out.extend_from_slice(&((2 + message.len()) as u32).to_le_bytes());
    out.extend_from_slice(&(message.len() as u16).to_le_bytes());
    out.extend_from_slice(message.as_bytes());
    out
}

/// Parses a `DONE` body.
pub(crate) fn decode_done(body: &[u8]) -> Result<(TransferId, Result<(), String>), TransferError> {
    let bad = || TransferError::Protocol(format!("malformed DONE frame of {} bytes", body.len()));
    if body.len() < 11 {
        return Err(bad());
    }
    let mut b = body;
    let transfer = TransferId(b.get_u64_le());
    let status = b.get_u8();
    let len = usize::from(b.get_u16_le());
    if b.len() != len || status > 1 {
        return Err(bad());
    }
    let message = String::from_utf8_lossy(b).into_owned();
    Ok((transfer, if status == 0 { Ok(()) } else { Err(message) }))
}

/// Parses a `CLOSE` body into its message.
pub(crate) fn decode_close(body: &[u8]) -> Result<String, TransferError> {
    if body.len() < 2 || body.len() - 2 != usize::from(u16::from_le_bytes([body[0], body[1]])) {
        return Err(TransferError::Protocol(format!(
            "malformed CLOSE frame of {} bytes",
            body.len()
        )));
    }
    Ok(String::from_utf8_lossy(&body[2..]).into_owned())
}

/// The error a sender reports when `endpoint` closed the connection with
/// CLOSE frame `body` (or a protocol error if the frame is malformed).
pub(crate) fn closed_by_peer(endpoint: &str, body: &[u8]) -> TransferError {
    match decode_close(body) {
        Ok(message) => {
            TransferError::ConnectionLost(format!("{endpoint} closed the connection: {message}"))
        }
        Err(e) => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvDtype;

    fn layout() -> KvLayoutDescriptor {
        KvLayoutDescriptor {
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 2,
            block_size: 2,
            dtype: KvDtype::F32,
        }
    }

    #[test]
    fn write_frames_split_and_carry_exact_lengths() {
        let bytes = layout().block_layer_bytes();
        let blocks: Vec<BlockWrite> = (0..5)
            .map(|i| BlockWrite {
                layer: i % 2,
                dst_block: i,
                k: Bytes::from(vec![i as u8; bytes]),
                v: Bytes::from(vec![100 + i as u8; bytes]),
            })
            .collect();
        let mut out = Segments::default();
        encode_writes(&mut out, TransferId(7), blocks, bytes, 2);
        let mut flat = out.copy_to_bytes(out.remaining());
        let mut frames = 0;
        let mut seen = 0;
        while flat.has_remaining() {
            assert_eq!(flat.get_u8(), FRAME_WRITE);
            let len = flat.get_u32_le() as usize;
            let mut body = flat.split_to(len);
            assert_eq!(body.get_u64_le(), 7);
            let count = body.get_u32_le() as usize;
            assert_eq!(len, WRITE_FIXED + count * (WRITE_ENTRY + 2 * bytes));
            for j in 0..count {
                let (layer, dst) = (body.get_u32_le(), body.get_u32_le());
                assert_eq!(dst as usize, seen + j);
                assert_eq!(layer, dst % 2);
            }
            seen += count;
            frames += 1;
        }
        assert_eq!((frames, seen), (3, 5));
    }

    #[test]
    fn segments_advance_across_parts() {
        let mut s = Segments::default();
        s.push(Bytes::from_static(b"abc"));
        s.push(Bytes::from_static(b""));
        s.push(Bytes::from_static(b"defg"));
        assert_eq!(s.remaining(), 7);
        s.advance(4);
        assert_eq!(s.chunk(), b"efg");
        let mut slices = [IoSlice::new(&[]); 4];
        assert_eq!(s.chunks_vectored(&mut slices), 1);
        s.advance(3);
        assert_eq!(s.remaining(), 0);
        assert_eq!(s.chunk(), b"");
    }

    #[test]
    fn done_and_close_round_trip() -> Result<(), TransferError> {
        for result in [Ok(()), Err("sink full".to_string())] {
            let frame = encode_done(TransferId(3), &result);
            assert_eq!(frame[0], FRAME_DONE);
            assert_eq!(
                decode_done(&frame[FRAME_HEADER..])?,
                (TransferId(3), result)
            );
        }
        let long = "é".repeat(MAX_MESSAGE_BYTES);
        let frame = encode_close(&long);
        let msg = decode_close(&frame[FRAME_HEADER..])?;
        assert!(msg.len() <= MAX_MESSAGE_BYTES && msg.chars().all(|c| c == 'é'));
        assert!(decode_done(&[0; 5]).is_err());
        assert!(decode_close(&[9, 0]).is_err());
        Ok(())
    }

    #[test]
    fn handshake_round_trips() -> Result<(), TransferError> {
        let hello = encode_hello(MAGIC, &layout(), b"tok");
        let mut fixed = [0u8; HELLO_FIXED];
        fixed.copy_from_slice(&hello[..HELLO_FIXED]);
        let (version, l, token_len) = decode_hello_fixed(MAGIC, &fixed)?;
        assert_eq!((version, l?, token_len), (VERSION, layout(), 3));
        let reply = encode_reply(MAGIC, STATUS_TOKEN, &layout(), 99);
        let mut fixed = [0u8; REPLY_LEN];
        fixed.copy_from_slice(&reply);
        let r = decode_reply(MAGIC, &fixed)?;
        assert_eq!(
            (r.status, r.layout?, r.num_blocks),
            (STATUS_TOKEN, layout(), 99)
        );
        Ok(())
    }
}
