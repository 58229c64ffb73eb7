//! The TCP wire format (little-endian throughout).
//!
//! **Handshake** (version 2): mutual challenge–response over the cluster
//! secret (the cluster token), so the secret itself never crosses the wire
//! and a recorded handshake cannot be replayed (each side's fresh nonce is
//! in what the other signs). The connecting side (sender) sends a hello:
//!
//! ```text
//! magic "TDMKVXF1" (8) | version u16 | 0 u16 | layout (20) | sender nonce (32)
//! ```
//!
//! The listener answers a hello of another version at once with a reply
//! (status 1, below); otherwise it sends a challenge:
//!
//! ```text
//! magic (8) | version u16 | receiver nonce (32)
//! ```
//!
//! The sender proves it holds the secret:
//!
//! ```text
//! HMAC-SHA256(secret, "tandem-kv sender" | magic | sender nonce | receiver nonce | its layout) (32)
//! ```
//!
//! The listener checks, in order, the proof (constant time, `ring::hmac`),
//! layout validity and compatibility, and replies:
//!
//! ```text
//! magic (8) | version u16 | status u8 | 0 u8 | its layout (20) | its sink's num_blocks u32 | proof (32)
//! ```
//!
//! with status 0 accepted, 1 version, 2 bad proof (the secrets differ), 3
//! layout mismatch, 4 invalid layout; on refusal it closes the connection.
//! On acceptance the proof is the receiver's own, `HMAC-SHA256(secret,
//! "tandem-kv receiver" | magic | sender nonce | receiver nonce | the reply
//! before the proof)`, and the sender checks it before it sends any block:
//! a listener that does not hold the secret never sees KV data (zeros on
//! refusal). The sender checks the reply's layout itself too, so each side
//! reports a mismatch in its own terms ("block_size 16 here, 32 at the
//! peer").
//!
//! **Frames.** Then every message is `type u8 | body_len u32 | body`.
//! Sender → receiver:
//!
//! - `WRITE` (1): `transfer u64 | count u32 | count × (layer u32, dst_block u32)
//!   | count × (K, V)`, each K `block_layer_bytes` and V `value_bytes`. The body
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
/// 3: the layout descriptor carries the sliding-window layers (40 bytes).
pub(crate) const VERSION: u16 = 3;
pub(crate) const MAX_TOKEN_BYTES: usize = 1024;
/// Bytes of each side's handshake nonce.
pub(crate) const NONCE_LEN: usize = 32;
/// Bytes of an HMAC-SHA256 proof.
pub(crate) const PROOF_LEN: usize = 32;
pub(crate) const HELLO_LEN: usize = 8 + 2 + 2 + KvLayoutDescriptor::ENCODED_LEN + NONCE_LEN;
/// Magic and version: how both the challenge and the reply begin.
pub(crate) const GREETING_LEN: usize = 8 + 2;
pub(crate) const CHALLENGE_LEN: usize = GREETING_LEN + NONCE_LEN;
pub(crate) const REPLY_LEN: usize = 8 + 2 + 1 + 1 + KvLayoutDescriptor::ENCODED_LEN + 4 + PROOF_LEN;
const REPLY_SIGNED: usize = REPLY_LEN - PROOF_LEN;
const SENDER_LABEL: &[u8] = b"tandem-kv sender";
const RECEIVER_LABEL: &[u8] = b"tandem-kv receiver";

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

/// A fresh random nonce.
pub(crate) fn nonce() -> Result<[u8; NONCE_LEN], TransferError> {
    let mut n = [0u8; NONCE_LEN];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut n)
        .map_err(|_| TransferError::Config("the system has no secure randomness".into()))?;
    Ok(n)
}

/// The HMAC key of a cluster secret.
pub(crate) fn secret_key(secret: &[u8]) -> ring::hmac::Key {
    ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret)
}

fn proof_input(
    label: &[u8],
    magic: [u8; 8],
    sender_nonce: &[u8; NONCE_LEN],
    receiver_nonce: &[u8; NONCE_LEN],
    signed: &[u8],
) -> Vec<u8> {
    let mut m = Vec::with_capacity(label.len() + 8 + 2 * NONCE_LEN + signed.len());
    m.extend_from_slice(label);
    m.extend_from_slice(&magic);
    m.extend_from_slice(sender_nonce);
    m.extend_from_slice(receiver_nonce);
    m.extend_from_slice(signed);
    m
}

/// The sender's proof: it holds the secret, for these nonces and its
/// encoded layout.
pub(crate) fn sender_proof(
    key: &ring::hmac::Key,
    magic: [u8; 8],
    sender_nonce: &[u8; NONCE_LEN],
    receiver_nonce: &[u8; NONCE_LEN],
    layout: &[u8],
) -> [u8; PROOF_LEN] {
    let m = proof_input(SENDER_LABEL, magic, sender_nonce, receiver_nonce, layout);
    let mut out = [0u8; PROOF_LEN];
    out.copy_from_slice(ring::hmac::sign(key, &m).as_ref());
    out
}

/// Checks a sender's proof in constant time.
pub(crate) fn verify_sender(
    key: &ring::hmac::Key,
    magic: [u8; 8],
    sender_nonce: &[u8; NONCE_LEN],
    receiver_nonce: &[u8; NONCE_LEN],
    layout: &[u8],
    proof: &[u8],
) -> bool {
    let m = proof_input(SENDER_LABEL, magic, sender_nonce, receiver_nonce, layout);
    ring::hmac::verify(key, &m, proof).is_ok()
}

pub(crate) fn encode_hello(
    magic: [u8; 8],
    layout: &KvLayoutDescriptor,
    sender_nonce: &[u8; NONCE_LEN],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(HELLO_LEN);
    out.extend_from_slice(&magic);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&layout.encode());
    out.extend_from_slice(sender_nonce);
    out
}

/// A sender's hello.
#[derive(Debug)]
pub(crate) struct Hello {
    /// The layout as sent (what the sender's proof covers).
    pub layout_bytes: [u8; KvLayoutDescriptor::ENCODED_LEN],
    pub layout: Result<KvLayoutDescriptor, TransferError>,
    pub nonce: [u8; NONCE_LEN],
}

/// Checks the magic a sender's hello begins with.
pub(crate) fn check_sender_magic(magic: [u8; 8], bytes: &[u8]) -> Result<(), TransferError> {
    if bytes.get(0..8) != Some(&magic[..]) {
        return Err(TransferError::Protocol(format!(
            "the peer is not a tandem KV transfer sender of this transport (bad magic; \
             both sides need the same --kv-transport, this side is {})",
            transport_name(magic)
        )));
    }
    Ok(())
}

/// Parses a hello whose version the caller checked already.
pub(crate) fn decode_hello(
    magic: [u8; 8],
    bytes: &[u8; HELLO_LEN],
) -> Result<Hello, TransferError> {
    check_sender_magic(magic, bytes)?;
    let mut layout_bytes = [0u8; KvLayoutDescriptor::ENCODED_LEN];
    layout_bytes.copy_from_slice(&bytes[12..12 + KvLayoutDescriptor::ENCODED_LEN]);
    let mut nonce = [0u8; NONCE_LEN];
    nonce.copy_from_slice(&bytes[HELLO_LEN - NONCE_LEN..]);
    Ok(Hello {
        layout: KvLayoutDescriptor::decode(&layout_bytes),
        layout_bytes,
        nonce,
    })
}

pub(crate) fn encode_challenge(magic: [u8; 8], receiver_nonce: &[u8; NONCE_LEN]) -> Vec<u8> {
    let mut out = Vec::with_capacity(CHALLENGE_LEN);
    out.extend_from_slice(&magic);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(receiver_nonce);
    out
}

/// The magic and version that begin a challenge or a reply.
pub(crate) fn decode_greeting(
    magic: [u8; 8],
    bytes: &[u8; GREETING_LEN],
) -> Result<u16, TransferError> {
    if bytes[0..8] != magic {
        return Err(TransferError::Protocol(format!(
            "the endpoint is not a tandem KV transfer listener of this transport (bad magic; \
             both sides need the same --kv-transport, this side is {})",
            transport_name(magic)
        )));
    }
    Ok(u16::from_le_bytes([bytes[8], bytes[9]]))
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

/// The listener's reply; with `proof` (accepted) it carries the receiver's
/// proof over everything before it.
pub(crate) fn encode_reply(
    magic: [u8; 8],
    status: u8,
    layout: &KvLayoutDescriptor,
    num_blocks: u32,
    proof: Option<ReceiverProof<'_>>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(REPLY_LEN);
    out.extend_from_slice(&magic);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.push(status);
    out.push(0);
    out.extend_from_slice(&layout.encode());
    out.extend_from_slice(&num_blocks.to_le_bytes());
    match proof {
        Some(p) => {
            let m = proof_input(
                RECEIVER_LABEL,
                magic,
                p.sender_nonce,
                p.receiver_nonce,
                &out,
            );
            out.extend_from_slice(ring::hmac::sign(p.key, &m).as_ref());
        }
        None => out.extend_from_slice(&[0u8; PROOF_LEN]),
    }
    out
}

/// What the receiver's proof binds.
#[derive(Clone, Copy)]
pub(crate) struct ReceiverProof<'a> {
    pub key: &'a ring::hmac::Key,
    pub sender_nonce: &'a [u8; NONCE_LEN],
    pub receiver_nonce: &'a [u8; NONCE_LEN],
}

/// Checks the receiver's proof of a whole reply, in constant time.
pub(crate) fn verify_receiver(
    magic: [u8; 8],
    reply: &[u8; REPLY_LEN],
    p: ReceiverProof<'_>,
) -> bool {
    let m = proof_input(
        RECEIVER_LABEL,
        magic,
        p.sender_nonce,
        p.receiver_nonce,
        &reply[..REPLY_SIGNED],
    );
    ring::hmac::verify(p.key, &m, &reply[REPLY_SIGNED..]).is_ok()
}

/// Parses a reply whose greeting was read already.
pub(crate) fn decode_reply(
    magic: [u8; 8],
    bytes: &[u8; REPLY_LEN],
) -> Result<Reply, TransferError> {
    let mut greeting = [0u8; GREETING_LEN];
    greeting.copy_from_slice(&bytes[..GREETING_LEN]);
    let version = decode_greeting(magic, &greeting)?;
    const AT: usize = 12;
    const END: usize = AT + KvLayoutDescriptor::ENCODED_LEN;
    let mut layout = [0u8; KvLayoutDescriptor::ENCODED_LEN];
    layout.copy_from_slice(&bytes[AT..END]);
    Ok(Reply {
        version,
        status: bytes[10],
        layout: KvLayoutDescriptor::decode(&layout),
        num_blocks: u32::from_le_bytes([
            bytes[END],
            bytes[END + 1],
            bytes[END + 2],
            bytes[END + 3],
        ]),
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
    payload_bytes: usize,
    blocks_per_frame: usize,
) {
    let mut blocks = blocks.into_iter().peekable();
    while blocks.peek().is_some() {
        let frame: Vec<BlockWrite> = blocks.by_ref().take(blocks_per_frame.max(1)).collect();
        let count = frame.len();
        let body = WRITE_FIXED + count * (WRITE_ENTRY + payload_bytes);
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
            rows: crate::KvRows::PerHead,
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 2,
            block_size: 2,
            dtype: KvDtype::F32,
            sliding_window: 0,
            windowed_layers: 0,
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
        encode_writes(&mut out, TransferId(7), blocks, 2 * bytes, 2);
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
        let (ns, nr) = (nonce()?, nonce()?);
        assert_ne!(ns, nr, "nonces are fresh");
        let hello = encode_hello(MAGIC, &layout(), &ns);
        let mut fixed = [0u8; HELLO_LEN];
        fixed.copy_from_slice(&hello);
        let h = decode_hello(MAGIC, &fixed)?;
        assert_eq!(u16::from_le_bytes([hello[8], hello[9]]), VERSION);
        assert_eq!((h.layout?, h.nonce), (layout(), ns));
        let challenge = encode_challenge(MAGIC, &nr);
        assert_eq!(challenge.len(), CHALLENGE_LEN);

        let key = secret_key(b"cluster secret");
        let proof = sender_proof(&key, MAGIC, &ns, &nr, &h.layout_bytes);
        assert!(verify_sender(
            &key,
            MAGIC,
            &ns,
            &nr,
            &h.layout_bytes,
            &proof
        ));
        // Another secret, another nonce (a replay) or another transport fails.
        let other = secret_key(b"cluster secreT");
        assert!(!verify_sender(
            &other,
            MAGIC,
            &ns,
            &nr,
            &h.layout_bytes,
            &proof
        ));
        assert!(!verify_sender(
            &key,
            MAGIC,
            &ns,
            &nonce()?,
            &h.layout_bytes,
            &proof
        ));
        assert!(!verify_sender(
            &key,
            MAGIC_UCX,
            &ns,
            &nr,
            &h.layout_bytes,
            &proof
        ));

        let p = ReceiverProof {
            key: &key,
            sender_nonce: &ns,
            receiver_nonce: &nr,
        };
        let reply = encode_reply(MAGIC, STATUS_OK, &layout(), 99, Some(p));
        let mut fixed = [0u8; REPLY_LEN];
        fixed.copy_from_slice(&reply);
        let r = decode_reply(MAGIC, &fixed)?;
        assert_eq!(
            (r.status, r.layout?, r.num_blocks),
            (STATUS_OK, layout(), 99)
        );
        assert!(verify_receiver(MAGIC, &fixed, p));
        // A reply tampered with (more blocks) or signed with another key fails.
        let mut tampered = fixed;
        tampered[12 + KvLayoutDescriptor::ENCODED_LEN] ^= 1;
        assert!(!verify_receiver(MAGIC, &tampered, p));
        let forged = ReceiverProof { key: &other, ..p };
        assert!(!verify_receiver(MAGIC, &fixed, forged));
        let refusal = encode_reply(MAGIC, STATUS_TOKEN, &layout(), 0, None);
        assert!(refusal[REPLY_LEN - PROOF_LEN..].iter().all(|b| *b == 0));
        Ok(())
    }
}
