//! The bytes every token id stands for, as the grammar engine needs them.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use serde_json::Value;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

use crate::error::{Result, StructuredError};

/// A vocabulary as bytes: one entry per logit, special tokens marked.
#[derive(Debug, Clone)]
pub struct Vocabulary {
    /// Bytes of each id; special tokens start with
    /// [`TokTrie::SPECIAL_TOKEN_MARKER`]; ids that stand for nothing are empty.
    tokens: Vec<Vec<u8>>,
    /// End-of-sequence ids (the grammar's "done").
    eos: Vec<u32>,
    /// Logits per row (the model's vocabulary size).
    logits: usize,
}

/// How a tokenizer spells bytes in its vocabulary strings.
#[derive(Debug, Clone, Copy)]
enum Spelling {
    /// GPT-2 byte-level: every byte is one printable character.
    ByteLevel,
    /// SentencePiece: text with `space` for ' ', bytes as `<0xAB>`.
    ByteFallback { space: char },
}

/// GPT-2's printable character for each byte, inverted.
fn byte_level_chars() -> HashMap<char, u8> {
    let mut map = HashMap::new();
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        let c = char::from(b);
        if matches!(c, '!'..='~' | '\u{a1}'..='\u{ac}' | '\u{ae}'..='\u{ff}') {
            map.insert(c, b);
        } else if let Some(c) = char::from_u32(next) {
            map.insert(c, b);
            next += 1;
        }
    }
    map
}

/// Finds the spelling from the decoder's JSON form (`ByteLevel`, or
/// `ByteFallback` with an optional `Replace("▁" → " ")`, or `Metaspace`).
fn spelling(decoder: &Value) -> Option<Spelling> {
    let mut byte_level = false;
    let mut fallback = false;
    let mut space = None;
    let mut stack = vec![decoder];
    while let Some(d) = stack.pop() {
        match d["type"].as_str() {
            Some("ByteLevel") => byte_level = true,
            Some("ByteFallback") => fallback = true,
            Some("Metaspace") => {
                fallback = true;
                space = d["replacement"]
                    .as_str()
                    .and_then(|s| s.chars().next())
                    .or(space);
            }
            Some("Replace") if d["content"].as_str() == Some(" ") => {
                let pat = d["pattern"]["String"].as_str().unwrap_or_default();
                let mut chars = pat.chars();
                if let (Some(c), None) = (chars.next(), chars.next()) {
                    space = Some(c);
                }
            }
            Some("Sequence") => {
                if let Some(list) = d["decoders"].as_array() {
                    stack.extend(list.iter());
                }
            }
            _ => {}
        }
    }
    if byte_level {
        Some(Spelling::ByteLevel)
    } else if fallback {
        Some(Spelling::ByteFallback {
            space: space.unwrap_or('\u{2581}'),
        })
    } else {
        None
    }
}

fn hex_byte(name: &str) -> Option<u8> {
    let hex = name.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

fn special(text: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(text.len() + 1);
    b.push(TokTrie::SPECIAL_TOKEN_MARKER);
    b.extend_from_slice(text.as_bytes());
    b
}

impl Vocabulary {
    /// Reads every token's bytes from a Hugging Face tokenizer. `logits` is
    /// the model's vocabulary size (ids past the tokenizer's stand for
    /// nothing); `eos` are the ids that end a sequence.
    pub fn from_tokenizer(
        tokenizer: &tokenizers::Tokenizer,
        logits: usize,
        eos: &[u32],
    ) -> Result<Self> {
        if logits == 0 {
            return Err(StructuredError::Tokenizer("the vocabulary is empty".into()));
        }
        let decoder = tokenizer
            .get_decoder()
            .map(|d| serde_json::to_value(d).unwrap_or(Value::Null))
            .unwrap_or(Value::Null);
        let spelling = spelling(&decoder).ok_or_else(|| {
            StructuredError::Tokenizer(format!(
                "cannot tell how the vocabulary spells bytes (decoder {}); \
                 byte-level BPE and byte-fallback tokenizers are supported",
                decoder["type"]
            ))
        })?;
        let added = tokenizer.get_added_tokens_decoder();
        let chars = byte_level_chars();
        let mut tokens = Vec::with_capacity(logits);
        for id in 0..logits as u32 {
            let bytes = match (added.get(&id), tokenizer.id_to_token(id)) {
                // Added tokens of the form <...> are control tokens even
                // when not flagged special.
                (Some(a), _)
                    if a.special || (a.content.starts_with('<') && a.content.ends_with('>')) =>
                {
                    special(&a.content)
                }
                (Some(a), _) => a.content.as_bytes().to_vec(),
                (None, Some(name)) => match spelling {
                    Spelling::ByteLevel => name
                        .chars()
                        .map(|c| chars.get(&c).copied())
                        .collect::<Option<Vec<u8>>>()
                        // A string that is not byte-level: never allowed.
                        .unwrap_or_else(|| special(&name)),
                    Spelling::ByteFallback { space } => match hex_byte(&name) {
                        Some(b) => vec![b],
                        None => name.replace(space, " ").into_bytes(),
                    },
                },
                // Padding rows of the model's vocabulary.
                (None, None) => Vec::new(),
            };
            tokens.push(bytes);
        }
        let eos: Vec<u32> = eos
            .iter()
            .copied()
            .filter(|&t| (t as usize) < logits)
            .collect();
        Ok(Self {
            tokens,
            eos,
            logits,
        })
    }

    /// Logits per row.
    pub fn logits(&self) -> usize {
        self.logits
    }

    /// The end-of-sequence ids the grammar may end with.
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    /// The bytes of token `id` (empty for padding and unknown ids).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.tokens.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// A hash of every token's bytes and the end ids: equal for equal
    /// vocabularies, so compiled grammars can be keyed by it.
    pub fn fingerprint(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.tokens.hash(&mut h);
        self.eos.hash(&mut h);
        h.finish()
    }

    /// The token trie the grammar engine walks. Without an end-of-sequence
    /// id, a virtual one is appended past the logits (grammars then end only
    /// when nothing can follow).
    pub(crate) fn tok_env(&self) -> TokEnv {
        let mut words = self.tokens.clone();
        let eos = match self.eos.first() {
            Some(&e) => e,
            None => {
                words.push(special("</virtual-eos>"));
                self.logits as u32
            }
        };
        let info = TokRxInfo::new(words.len() as u32, eos);
        let mut trie = TokTrie::from(&info, &words);
        if self.eos.len() > 1 {
            trie = trie.with_eos_tokens(&self.eos);
        }
        Arc::new(Env { trie })
    }
}

/// The grammar engine's view of the tokenizer: the trie, and greedy
/// tokenization (we never ask it to force tokens, so canonical tokenization
/// is not needed).
struct Env {
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn decoders_are_recognised() {
        assert!(matches!(
            spelling(&json!({"type": "ByteLevel"})),
            Some(Spelling::ByteLevel)
        ));
        let sp = json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]});
        assert!(matches!(
            spelling(&sp),
            Some(Spelling::ByteFallback { space: '▁' })
        ));
        assert!(spelling(&json!({"type": "WordPiece"})).is_none());
        assert!(spelling(&Value::Null).is_none());
    }

    #[test]
    fn byte_level_map_covers_every_byte() {
        let m = byte_level_chars();
        assert_eq!(m.len(), 256);
        assert_eq!(m.get(&'Ġ'), Some(&b' '));
        assert_eq!(m.get(&'a'), Some(&b'a'));
        assert_eq!(hex_byte("<0x0A>"), Some(b'\n'));
        assert_eq!(hex_byte("<0x0A"), None);
    }
}
