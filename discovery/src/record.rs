//! Worker records, their etcd keys and their value encoding.
//!
//! # Keys
//!
//! `/tandem/<cluster>/workers/<role>/<id>`, with `<role>` one of `prefill`
//! and `decode`. Cluster names and worker ids are non-empty, at most
//! [`MAX_NAME_LEN`] bytes, and contain no `/` and no control characters, so
//! a key always splits back into exactly the parts it was made of.
//!
//! # Values
//!
//! One JSON object, UTF-8, self-describing so `etcdctl get --prefix
//! /tandem/` is readable by a person:
//!
//! ```json
//! {"v":1,"role":"decode","id":"d0","addr":"127.0.0.1:50061","payload":"0a03..."}
//! ```
//!
//! * `v` — the format version, [`RECORD_VERSION`]. Any other version is
//!   refused, so a future incompatible change cannot be misread.
//! * `role`, `id` — repeated from the key; decoding checks they agree with
//!   the key the value was found under.
//! * `addr` — the worker's gRPC `host:port`.
//! * `payload` — the caller's opaque bytes (the workers store a protobuf
//!   `WorkerInfo` here), lowercase hex. Hex rather than base64 because it
//!   needs no dependency and the payloads are a few hundred bytes.
//!
//! Unknown fields are ignored, so a later version-1 writer may add optional
//! fields without breaking older readers. Decoding refuses anything else —
//! not JSON, a missing field, an unknown role, odd-length or non-hex payload,
//! an empty id or address, a value over [`MAX_VALUE_LEN`] — with a
//! [`DiscoveryError::Encoding`] that says what was wrong.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::DiscoveryError;

/// The version written into, and required of, every record value.
pub const RECORD_VERSION: u32 = 1;

/// Longest cluster name or worker id, in bytes.
pub const MAX_NAME_LEN: usize = 128;

/// Largest record value accepted when decoding (etcd's own default request
/// limit is 1.5 MiB; worker infos are far smaller).
pub const MAX_VALUE_LEN: usize = 1024 * 1024;

/// A worker pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Computes prompts' KV caches and pushes them to decode workers.
    Prefill,
    /// Runs the continuous batch and streams tokens.
    Decode,
}

impl Role {
    /// Both roles, in key order.
    pub const ALL: [Role; 2] = [Role::Prefill, Role::Decode];

    /// The other pool (where a switching worker goes).
    pub fn other(self) -> Role {
        match self {
            Role::Prefill => Role::Decode,
            Role::Decode => Role::Prefill,
        }
    }

    /// `"prefill"` or `"decode"`: the key segment and the JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = DiscoveryError;

    fn from_str(s: &str) -> Result<Role, DiscoveryError> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => Err(DiscoveryError::UnknownRole(other.to_string())),
        }
    }
}

/// What one worker publishes about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerRecord {
    /// The pool it serves in.
    pub role: Role,
    /// Unique within its role and cluster; the last key segment.
    pub id: String,
    /// Its gRPC `host:port`.
    pub addr: String,
    /// Opaque to discovery: the caller's own description of the worker (the
    /// workers store their protobuf `WorkerInfo` here).
    pub payload: Vec<u8>,
}

/// The JSON shape of a record value (see the module doc).
#[derive(Serialize, Deserialize)]
struct Wire {
    v: u32,
    role: Role,
    id: String,
    addr: String,
    payload: String,
}

impl WorkerRecord {
    /// Encodes the record as its etcd value.
    pub fn encode(&self) -> Vec<u8> {
        let wire = Wire {
            v: RECORD_VERSION,
            role: self.role,
            id: self.id.clone(),
            addr: self.addr.clone(),
            payload: hex_encode(&self.payload),
        };
        // Serialising a struct of strings and integers into a Vec cannot
        // fail; fall back to an empty value (which decoding refuses) rather
        // than panic should serde_json ever disagree.
        serde_json::to_vec(&wire).unwrap_or_default()
    }

    /// Decodes an etcd value; refuses garbage (see the module doc).
    pub fn decode(value: &[u8]) -> Result<WorkerRecord, DiscoveryError> {
        if value.len() > MAX_VALUE_LEN {
            return Err(DiscoveryError::Encoding(format!(
                "the value is {} bytes, more than the {MAX_VALUE_LEN} allowed",
                value.len()
            )));
        }
        let wire: Wire = serde_json::from_slice(value).map_err(|e| {
            DiscoveryError::Encoding(format!(
                "not a version-{RECORD_VERSION} worker record ({e})"
            ))
        })?;
        if wire.v != RECORD_VERSION {
            return Err(DiscoveryError::Encoding(format!(
                "record version {} is not supported (this build reads version \
                 {RECORD_VERSION}); upgrade the router or the worker so they agree",
                wire.v
            )));
        }
        check_name("worker id", &wire.id)?;
        if wire.addr.is_empty() {
            return Err(DiscoveryError::Encoding(
                "the worker address is empty".to_string(),
            ));
        }
        let payload = hex_decode(&wire.payload).map_err(DiscoveryError::Encoding)?;
        Ok(WorkerRecord {
            role: wire.role,
            id: wire.id,
            addr: wire.addr,
            payload,
        })
    }

    /// Checks the fields a key is made of (used before registering).
    pub(crate) fn check(&self) -> Result<(), DiscoveryError> {
        check_name("worker id", &self.id)?;
        if self.addr.is_empty() {
            return Err(DiscoveryError::InvalidName {
                what: "worker address",
                value: String::new(),
                reason: "it is empty; give the worker's gRPC host:port",
            });
        }
        Ok(())
    }
}

/// `/tandem/<cluster>/workers/`: the prefix the router watches.
pub fn workers_prefix(cluster: &str) -> String {
    format!("/tandem/{cluster}/workers/")
}

/// `/tandem/<cluster>/workers/<role>/<id>`.
pub fn worker_key(cluster: &str, role: Role, id: &str) -> String {
    format!("{}{}/{id}", workers_prefix(cluster), role.as_str())
}

/// Splits a key found under [`workers_prefix`] into role and id.
pub fn parse_worker_key(cluster: &str, key: &[u8]) -> Result<(Role, String), DiscoveryError> {
    let bad = |reason: &str| {
        DiscoveryError::Encoding(format!(
            "key {:?} is not /tandem/{cluster}/workers/<role>/<id>: {reason}",
            String::from_utf8_lossy(key)
        ))
    };
    let key = std::str::from_utf8(key).map_err(|_| bad("not UTF-8"))?;
    let rest = key
        .strip_prefix(&workers_prefix(cluster))
        .ok_or_else(|| bad("wrong prefix"))?;
    let (role, id) = rest.split_once('/').ok_or_else(|| bad("no id"))?;
    let role = role.parse::<Role>().map_err(|_| bad("unknown role"))?;
    check_name("worker id", id).map_err(|_| bad("invalid id"))?;
    Ok((role, id.to_string()))
}

/// Decodes a value found under `key`, and checks the two agree.
pub(crate) fn decode_entry(
    cluster: &str,
    key: &[u8],
    value: &[u8],
) -> Result<WorkerRecord, DiscoveryError> {
    let (role, id) = parse_worker_key(cluster, key)?;
    let record = WorkerRecord::decode(value)?;
    if record.role != role || record.id != id {
        return Err(DiscoveryError::Encoding(format!(
            "the record under /{role}/{id} says it is /{}/{}",
            record.role, record.id
        )));
    }
    Ok(record)
}

/// Cluster names and worker ids: non-empty, short, no `/`, no controls.
pub(crate) fn check_name(what: &'static str, value: &str) -> Result<(), DiscoveryError> {
    let reason = if value.is_empty() {
        "it is empty"
    } else if value.len() > MAX_NAME_LEN {
        "it is longer than 128 bytes"
    } else if value.contains('/') {
        "it contains '/', which would change the etcd key's shape"
    } else if value.chars().any(char::is_control) {
        "it contains control characters"
    } else {
        return Ok(());
    };
    Err(DiscoveryError::InvalidName {
        what,
        value: value.to_string(),
        reason,
    })
}

fn hex_encode(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

fn hex_decode(text: &str) -> Result<Vec<u8>, String> {
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    let bytes = text.as_bytes();
    if !bytes.len().is_multiple_of(2) {
        return Err(format!(
            "the payload has an odd number ({}) of hex digits",
            bytes.len()
        ));
    }
    bytes
        .chunks_exact(2)
        .enumerate()
        .map(|(i, pair)| match (digit(pair[0]), digit(pair[1])) {
            (Some(hi), Some(lo)) => Ok(hi << 4 | lo),
            _ => Err(format!(
                "the payload is not hex (byte {} is {:?})",
                i * 2,
                String::from_utf8_lossy(pair)
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(payload: Vec<u8>) -> WorkerRecord {
        WorkerRecord {
            role: Role::Decode,
            id: "d-0".to_string(),
            addr: "127.0.0.1:50061".to_string(),
            payload,
        }
    }

    #[test]
    fn roles_parse_and_print() {
        for role in Role::ALL {
            assert_eq!(role.as_str().parse::<Role>().expect("parses"), role);
            assert_eq!(role.to_string(), role.as_str());
        }
        let err = "Decode".parse::<Role>().expect_err("case matters");
        assert!(err.to_string().contains("prefill"), "{err}");
    }

    #[test]
    fn records_round_trip() {
        for payload in [vec![], vec![0], (0..=255).collect::<Vec<u8>>()] {
            let r = record(payload);
            let value = r.encode();
            assert_eq!(WorkerRecord::decode(&value).expect("decodes"), r);
        }
        let value = String::from_utf8(record(vec![0xab, 0x01]).encode()).expect("utf-8");
        assert_eq!(
            value,
            r#"{"v":1,"role":"decode","id":"d-0","addr":"127.0.0.1:50061","payload":"ab01"}"#
        );
    }

    #[test]
    fn unknown_fields_are_ignored_and_uppercase_hex_accepted() {
        let value = br#"{"v":1,"role":"prefill","id":"p","addr":"h:1","payload":"AB","new":3}"#;
        let r = WorkerRecord::decode(value).expect("decodes");
        assert_eq!((r.role, r.payload), (Role::Prefill, vec![0xab]));
    }

    #[test]
    fn garbage_is_refused() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "not a version-1"),
            (b"\xff\xfe", "not a version-1"),
            (b"not json", "not a version-1"),
            (b"[]", "not a version-1"),
            (
                br#"{"v":1,"role":"decode","id":"d","addr":"h:1"}"#,
                "payload",
            ),
            (
                br#"{"v":2,"role":"decode","id":"d","addr":"h:1","payload":""}"#,
                "version 2",
            ),
            (
                br#"{"v":1,"role":"router","id":"d","addr":"h:1","payload":""}"#,
                "router",
            ),
            (
                br#"{"v":1,"role":"decode","id":"d","addr":"h:1","payload":"abc"}"#,
                "odd",
            ),
            (
                br#"{"v":1,"role":"decode","id":"d","addr":"h:1","payload":"zz"}"#,
                "not hex",
            ),
            (
                br#"{"v":1,"role":"decode","id":"","addr":"h:1","payload":""}"#,
                "empty",
            ),
            (
                br#"{"v":1,"role":"decode","id":"a/b","addr":"h:1","payload":""}"#,
                "'/'",
            ),
            (
                br#"{"v":1,"role":"decode","id":"d","addr":"","payload":""}"#,
                "address is empty",
            ),
        ];
        for (value, expected) in cases {
            let err = WorkerRecord::decode(value).expect_err("garbage");
            assert!(
                matches!(
                    err,
                    DiscoveryError::Encoding(_) | DiscoveryError::InvalidName { .. }
                ),
                "{err:?}"
            );
            assert!(
                err.to_string().contains(expected),
                "{:?}: {err}",
                String::from_utf8_lossy(value)
            );
        }
        let huge = vec![b' '; MAX_VALUE_LEN + 1];
        assert!(WorkerRecord::decode(&huge).is_err());
    }

    #[test]
    fn keys_round_trip_and_mismatches_are_refused() {
        let key = worker_key("c1", Role::Prefill, "p-7");
        assert_eq!(key, "/tandem/c1/workers/prefill/p-7");
        assert_eq!(
            parse_worker_key("c1", key.as_bytes()).expect("parses"),
            (Role::Prefill, "p-7".to_string())
        );
        for bad in [
            "/tandem/c2/workers/prefill/p",
            "/tandem/c1/workers/prefill",
            "/tandem/c1/workers/router/p",
            "/tandem/c1/workers/prefill/",
            "/tandem/c1/workers/prefill/a/b",
        ] {
            assert!(parse_worker_key("c1", bad.as_bytes()).is_err(), "{bad}");
        }
        let r = record(vec![1]);
        let err = decode_entry("c1", b"/tandem/c1/workers/decode/other", &r.encode())
            .expect_err("id mismatch");
        assert!(err.to_string().contains("says it is"), "{err}");
        let ok = decode_entry("c1", b"/tandem/c1/workers/decode/d-0", &r.encode());
        assert_eq!(ok.expect("agrees"), r);
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("cluster", "prod-1").is_ok());
        for bad in ["", "a/b", "a\nb", &"x".repeat(MAX_NAME_LEN + 1)] {
            assert!(check_name("cluster", bad).is_err(), "{bad:?}");
        }
    }
}
