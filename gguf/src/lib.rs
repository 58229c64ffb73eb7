//! GGUF files: the single-file checkpoints of llama.cpp, Ollama and LM
//! Studio (header, metadata, tokenizer and quantized tensors together).
//!
//! [`Gguf::open`] memory-maps the file (and the other shards of a
//! `name-00001-of-0000N.gguf` split), parses the header with every count
//! and offset checked against the file ([`parse`]), and hands out each
//! tensor's bytes in place. Decoding is [`blocks`]' job; what a tensor or a
//! key *means* for a model family is the engine's (`tandem-engine`'s `gguf`
//! module), so this crate knows nothing of architectures.

pub mod blocks;
mod error;
pub mod parse;
mod value;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

pub use blocks::{dequantize, four_bit_groups, k_scale_min, FourBitGroup, GgmlType};
pub use error::{GgufError, Result};
pub use parse::{parse, Header, TensorInfo};
pub use value::Value;

/// An opened GGUF checkpoint: one file or all shards of a split.
#[derive(Debug)]
pub struct Gguf {
    paths: Vec<PathBuf>,
    maps: Vec<Arc<Mmap>>,
    version: u32,
    metadata: HashMap<String, Value>,
    /// Name → (shard, info).
    tensors: HashMap<String, (usize, TensorInfo)>,
    /// Names in file order (shard by shard).
    order: Vec<String>,
}

/// Whether `path` names a GGUF file (by its extension).
pub fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

impl Gguf {
    /// Opens a GGUF file; given any shard of a `-0000K-of-0000N.gguf`
    /// split, opens all `N`.
    pub fn open(path: &Path) -> Result<Self> {
        let paths = match split_paths(path)? {
            Some(p) => p,
            None => vec![path.to_path_buf()],
        };
        let mut maps = Vec::with_capacity(paths.len());
        let mut headers = Vec::with_capacity(paths.len());
        for p in &paths {
            let io = |source| GgufError::Io {
                path: p.clone(),
                source,
            };
            let file = File::open(p).map_err(io)?;
            // SAFETY: the mapping is read-only and private to this process;
            // a checkpoint modified while being served is outside what any
            // loader can defend against, as with safetensors.
            let map = unsafe { Mmap::map(&file) }.map_err(io)?;
            headers.push(parse(&map)?);
            maps.push(Arc::new(map));
        }
        Self::assemble(paths, maps, headers)
    }

    fn assemble(paths: Vec<PathBuf>, maps: Vec<Arc<Mmap>>, headers: Vec<Header>) -> Result<Self> {
        let n = headers.len();
        let mut tensors = HashMap::new();
        let mut order = Vec::new();
        let mut metadata = HashMap::new();
        let version = headers.first().map_or(3, |h| h.version);
        for (i, h) in headers.into_iter().enumerate() {
            if n > 1 {
                check_split(&h, i, n)?;
            }
            for t in h.tensors {
                if tensors.contains_key(&t.name) {
                    return Err(GgufError::DuplicateTensor(t.name));
                }
                order.push(t.name.clone());
                tensors.insert(t.name.clone(), (i, t));
            }
            if i == 0 {
                metadata = h.metadata;
            }
        }
        Ok(Self {
            paths,
            maps,
            version,
            metadata,
            tensors,
            order,
        })
    }

    /// The file (or first shard) path.
    pub fn path(&self) -> &Path {
        &self.paths[0]
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required non-negative integer.
    pub fn u64(&self, key: &str) -> Result<u64> {
        self.typed(key, Value::as_u64, "a non-negative integer")
    }

    /// A required number.
    pub fn f64(&self, key: &str) -> Result<f64> {
        self.typed(key, Value::as_f64, "a number")
    }

    /// A required string.
    pub fn str(&self, key: &str) -> Result<&str> {
        self.typed(key, Value::as_str, "a string")
    }

    /// An optional value, `Err` when present with the wrong type.
    pub fn optional<'a, T>(
        &'a self,
        key: &str,
        read: impl Fn(&'a Value) -> Option<T>,
        expected: &str,
    ) -> Result<Option<T>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => read(v).map(Some).ok_or_else(|| GgufError::Metadata {
                key: key.to_owned(),
                msg: format!("expected {expected}, found {}", v.type_name()),
            }),
        }
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        read: impl Fn(&'a Value) -> Option<T>,
        expected: &str,
    ) -> Result<T> {
        self.optional(key, read, expected)?
            .ok_or_else(|| GgufError::Metadata {
                key: key.to_owned(),
                msg: "missing".into(),
            })
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorInfo> {
        self.order.iter().filter_map(|n| self.tensor(n))
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name).map(|(_, t)| t)
    }

    /// A tensor's bytes, in place, with the mapping that holds them.
    pub fn mapped(&self, name: &str) -> Option<(&Arc<Mmap>, &[u8])> {
        let (shard, t) = self.tensors.get(name)?;
        let map = &self.maps[*shard];
        Some((map, &map[t.start..t.end]))
    }

    /// A tensor's bytes.
    pub fn bytes(&self, name: &str) -> Option<&[u8]> {
        self.mapped(name).map(|(_, b)| b)
    }

    /// Bytes of all tensor data (what the weights cost in memory).
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors
            .values()
            .map(|(_, t)| (t.end - t.start) as u64)
            .sum()
    }
}

/// A shard's place in its split, checked against its `split.*` keys.
fn check_split(h: &Header, index: usize, count: usize) -> Result<()> {
    let get = |k: &str| h.metadata.get(k).and_then(Value::as_u64);
    match (get("split.no"), get("split.count")) {
        (Some(no), Some(n)) if no as usize == index && n as usize == count => Ok(()),
        (no, n) => Err(GgufError::Split(format!(
            "shard {} of {count} says split.no {no:?} of split.count {n:?}",
            index + 1
        ))),
    }
}

/// A split shard's file stem (`prefix-00002-of-00005`) as its prefix and
/// shard count; `None` for any other stem (never a panic, whatever its
/// characters).
pub fn split_stem(stem: &str) -> Option<(&str, usize)> {
    // `-KKKKK-of-NNNNN`: the last 15 bytes, all ASCII when they match.
    let at = stem.len().checked_sub(15)?;
    let (prefix, tail) = (stem.get(..at)?, stem.get(at..)?);
    let number = |s: Option<&str>| {
        s.filter(|s| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit()))?
            .parse::<usize>()
            .ok()
    };
    let shape = (tail.get(0..1), tail.get(6..10));
    match (number(tail.get(1..6)), number(tail.get(10..15)), shape) {
        (Some(_), Some(n), (Some("-"), Some("-of-"))) => Some((prefix, n)),
        _ => None,
    }
}

/// All shards' paths when `path` is named like a shard of a split
/// (`prefix-00002-of-00005.gguf`), `None` otherwise.
fn split_paths(path: &Path) -> Result<Option<Vec<PathBuf>>> {
    let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
        return Ok(None);
    };
    let Some((prefix, n)) = split_stem(stem) else {
        return Ok(None);
    };
    if !(1..=9999).contains(&n) {
        return Err(GgufError::Split(format!(
            "{} names {n} shards",
            path.display()
        )));
    }
    let dir = path.parent().unwrap_or(Path::new(""));
    let paths: Vec<PathBuf> = (1..=n)
        .map(|k| dir.join(format!("{prefix}-{k:05}-of-{n:05}.gguf")))
        .collect();
    if let Some(missing) = paths.iter().find(|p| !p.is_file()) {
        return Err(GgufError::Split(format!(
            "shard {} is missing",
            missing.display()
        )));
    }
    Ok(Some(paths))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_stems_are_parsed_without_panicking_on_any_name() {
        assert_eq!(split_stem("m-00002-of-00003"), Some(("m", 3)));
        assert_eq!(split_stem("-00001-of-00001"), Some(("", 1)));
        for stem in [
            "model",
            "m-0000x-of-00003",
            "模型模型模型模型模型",
            "ab模型-0001-of-00003",
            "m-00001+of-00003",
        ] {
            assert_eq!(split_stem(stem), None, "{stem}");
        }
    }

    #[test]
    fn split_names_are_recognised() {
        let dir = tempdir();
        for k in 1..=2 {
            std::fs::write(dir.join(format!("m-{k:05}-of-00002.gguf")), b"").expect("write");
        }
        let got = split_paths(&dir.join("m-00002-of-00002.gguf")).expect("split");
        assert_eq!(got.map(|p| p.len()), Some(2));
        assert_eq!(split_paths(&dir.join("model.gguf")).expect("plain"), None);
        let err = split_paths(&dir.join("m-00001-of-00003.gguf")).expect_err("missing shard");
        assert!(
            err.to_string().contains("-of-00003.gguf is missing"),
            "{err}"
        );
        std::fs::remove_dir_all(dir).ok();
    }

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("tandem-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }
}
