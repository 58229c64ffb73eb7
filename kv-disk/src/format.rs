//! The block file: a 64-byte header, then the payload.
//!
//! ```text
//! 0   magic "TKVB"        4   version (u32)
//! 8   fingerprint (u64)   16  block hash (u64)   24  parent hash (u64)
//! 32  payload bytes (u64) 40  payload xxh3 (u64) 48  header xxh3 of 0..48
//! 56  reserved (zero)     64  payload: f32 little-endian
//! ```
//!
//! All integers are little-endian. The fingerprint names the model and KV
//! layout the values belong to, so a file another model wrote is never
//! loaded; the header has its own checksum so a flipped length or hash is
//! caught before the payload is read; the payload checksum is checked on
//! every load, so a bit flip on disk is a miss, never wrong K/V.

use xxhash_rust::xxh3::xxh3_64;

/// The first bytes of every block file.
pub const MAGIC: [u8; 4] = *b"TKVB";
/// The format this crate writes and reads; any other is skipped.
pub const VERSION: u32 = 1;
/// Bytes before the payload.
pub const HEADER_BYTES: usize = 64;

/// Why a block file's bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("{len} bytes is shorter than the {HEADER_BYTES}-byte header")]
    Truncated { len: usize },
    #[error("not a tandem KV block file (bad magic)")]
    BadMagic,
    #[error("format version {found}, this build reads {VERSION}")]
    Version { found: u32 },
    #[error("the header checksum does not match (a corrupt header)")]
    HeaderChecksum,
    #[error("written for fingerprint {found:016x}, this store is {expected:016x}")]
    Foreign { found: u64, expected: u64 },
    #[error("the file is named for block {named:016x} but holds {holds:016x}")]
    WrongHash { named: u64, holds: u64 },
    #[error("payload of {found} bytes, the layout's blocks take {expected}")]
    PayloadSize { found: u64, expected: u64 },
    #[error("the payload checksum does not match (a corrupt block)")]
    Checksum,
}

/// What a block file says about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub fingerprint: u64,
    pub hash: u64,
    pub parent: u64,
    pub payload_bytes: u64,
    pub checksum: u64,
}

impl Header {
    /// The header's 64 bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..8].copy_from_slice(&VERSION.to_le_bytes());
        let words = [
            self.fingerprint,
            self.hash,
            self.parent,
            self.payload_bytes,
            self.checksum,
        ];
        for (i, w) in words.iter().enumerate() {
            out[8 + 8 * i..16 + 8 * i].copy_from_slice(&w.to_le_bytes());
        }
        let sum = xxh3_64(&out[..48]);
        out[48..56].copy_from_slice(&sum.to_le_bytes());
        out
    }

    /// Reads and checks a header (magic, version, its own checksum).
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        let h = bytes
            .get(..HEADER_BYTES)
            .ok_or(FormatError::Truncated { len: bytes.len() })?;
        if h[0..4] != MAGIC {
            return Err(FormatError::BadMagic);
        }
        let version = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        if version != VERSION {
            return Err(FormatError::Version { found: version });
        }
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&h[at..at + 8]);
            u64::from_le_bytes(w)
        };
        // The reserved word must be zero: nothing covers it otherwise.
        if word(48) != xxh3_64(&h[..48]) || word(56) != 0 {
            return Err(FormatError::HeaderChecksum);
        }
        Ok(Self {
            fingerprint: word(8),
            hash: word(16),
            parent: word(24),
            payload_bytes: word(32),
            checksum: word(40),
        })
    }

    /// Checks that the header belongs to this store, names `hash` and
    /// carries `payload_bytes`.
    pub fn check(
        &self,
        fingerprint: u64,
        hash: u64,
        payload_bytes: u64,
    ) -> Result<(), FormatError> {
        if self.fingerprint != fingerprint {
            return Err(FormatError::Foreign {
                found: self.fingerprint,
                expected: fingerprint,
            });
        }
        if self.hash != hash {
            return Err(FormatError::WrongHash {
                named: hash,
                holds: self.hash,
            });
        }
        if self.payload_bytes != payload_bytes {
            return Err(FormatError::PayloadSize {
                found: self.payload_bytes,
                expected: payload_bytes,
            });
        }
        Ok(())
    }
}

/// A whole block file: header and payload.
pub fn encode(fingerprint: u64, hash: u64, parent: u64, values: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; HEADER_BYTES + values.len() * 4];
    for (dst, v) in out[HEADER_BYTES..].chunks_exact_mut(4).zip(values) {
        dst.copy_from_slice(&v.to_le_bytes());
    }
    let header = Header {
        fingerprint,
        hash,
        parent,
        payload_bytes: (values.len() * 4) as u64,
        checksum: xxh3_64(&out[HEADER_BYTES..]),
    };
    out[..HEADER_BYTES].copy_from_slice(&header.encode());
    out
}

/// The values of a whole block file, every check passed: header, owner,
/// name, size and payload checksum.
pub fn decode(
    bytes: &[u8],
    fingerprint: u64,
    hash: u64,
    values: usize,
) -> Result<(Header, Vec<f32>), FormatError> {
    let header = Header::decode(bytes)?;
    header.check(fingerprint, hash, (values * 4) as u64)?;
    let payload = &bytes[HEADER_BYTES..];
    if payload.len() as u64 != header.payload_bytes {
        return Err(FormatError::PayloadSize {
            found: payload.len() as u64,
            expected: header.payload_bytes,
        });
    }
    if xxh3_64(payload) != header.checksum {
        return Err(FormatError::Checksum);
    }
    let out = payload
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok((header, out))
}

/// A stable 64-bit name for whatever identifies a store's contents (the
/// model's files, the KV layout): each part is hashed with its length, so
/// `["ab", "c"]` and `["a", "bc"]` differ.
pub fn fingerprint(parts: &[&[u8]]) -> u64 {
    let mut buf = Vec::new();
    for p in parts {
        buf.extend_from_slice(&(p.len() as u64).to_le_bytes());
        buf.extend_from_slice(p);
    }
    xxh3_64(&buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_round_trips_and_every_check_fires() {
        let values: Vec<f32> = (0..48).map(|i| i as f32 * 0.5 - 3.0).collect();
        let bytes = encode(7, 42, 41, &values);
        let (h, back) = decode(&bytes, 7, 42, 48).expect("round trip");
        assert_eq!((h.hash, h.parent, back), (42, 41, values.clone()));
        assert_eq!(
            decode(&bytes, 8, 42, 48).expect_err("foreign"),
            FormatError::Foreign {
                found: 7,
                expected: 8
            }
        );
        assert!(matches!(
            decode(&bytes, 7, 43, 48),
            Err(FormatError::WrongHash { .. })
        ));
        assert!(matches!(
            decode(&bytes, 7, 42, 47),
            Err(FormatError::PayloadSize { .. })
        ));
        assert!(matches!(
            decode(&bytes[..bytes.len() - 4], 7, 42, 48),
            Err(FormatError::PayloadSize { .. })
        ));
        assert!(matches!(
            decode(&bytes[..10], 7, 42, 48),
            Err(FormatError::Truncated { len: 10 })
        ));
        // Any flipped bit anywhere is caught.
        for byte in (0..bytes.len()).step_by(5) {
            let mut bad = bytes.clone();
            bad[byte] ^= 0x10;
            assert!(decode(&bad, 7, 42, 48).is_err(), "flip at byte {byte}");
        }
    }

    #[test]
    fn fingerprints_keep_part_boundaries() {
        assert_ne!(fingerprint(&[b"ab", b"c"]), fingerprint(&[b"a", b"bc"]));
        assert_eq!(fingerprint(&[b"ab", b"c"]), fingerprint(&[b"ab", b"c"]));
    }
}
