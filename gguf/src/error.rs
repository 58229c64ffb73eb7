//! What can be wrong with a GGUF file.

use std::path::PathBuf;

/// An error reading a GGUF file: each names what is wrong and where.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("not a GGUF file (magic {0:02x?}, expected \"GGUF\")")]
    BadMagic([u8; 4]),
    #[error("GGUF version {0} is not supported (2 and 3 are)")]
    Version(u32),
    #[error("the file ends at byte {len} while reading {what} (needs byte {needed})")]
    Truncated { what: String, needed: u64, len: u64 },
    #[error("{what}: {count} entries cannot fit in the {left} bytes left")]
    Count { what: String, count: u64, left: u64 },
    #[error("{what}: not valid UTF-8")]
    Utf8 { what: String },
    #[error("metadata `{key}`: unknown value type {code}")]
    ValueType { key: String, code: u32 },
    #[error("metadata `{key}`: arrays nested deeper than {max}")]
    Nesting { key: String, max: usize },
    #[error("metadata key `{0}` appears twice")]
    DuplicateKey(String),
    #[error("tensor `{0}` appears twice")]
    DuplicateTensor(String),
    #[error("tensor `{name}`: unknown tensor type {code}")]
    UnknownType { name: String, code: u32 },
    #[error("tensor `{name}`: {msg}")]
    Tensor { name: String, msg: String },
    #[error("metadata `{key}`: {msg}")]
    Metadata { key: String, msg: String },
    #[error("split files: {0}")]
    Split(String),
}

pub type Result<T> = std::result::Result<T, GgufError>;
