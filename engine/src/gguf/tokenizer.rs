//! The tokenizer a GGUF file carries, rebuilt as a Hugging Face one.
//!
//! A `gpt2`-model vocabulary (byte-level BPE: Llama 3, Qwen, SmolLM, …)
//! becomes a `tokenizer.json` with its tokens, merges and special tokens,
//! and the pre-tokenizer llama.cpp uses for the file's
//! `tokenizer.ggml.pre` (the same regular expressions as its
//! `llama-vocab.cpp`). A SentencePiece (`llama`) vocabulary is
//! [`super::sentencepiece`]'s.

use serde_json::{json, Value};
use tandem_gguf::Gguf;

use super::gguf_error;
use crate::error::{EngineError, Result};
use crate::tokenizer::Tokenizer;

/// GPT-2's own split, which the ByteLevel pre-tokenizer applies itself.
const GPT2: &str = "gpt2";
/// A SentencePiece BPE vocabulary (Llama 2, Mistral, Phi-3, Gemma).
const SENTENCEPIECE: &str = "llama";
/// Llama 3's split (llama.cpp's adapted spelling, no inline flags).
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2/3's: Llama 3's with single digits.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.pre` values and the split each means. SmolLM's is
/// GPT-2's after splitting off every digit.
fn pre_tokenizer(pre: &str) -> Option<Value> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |regex: &str| json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false});
    Some(match pre {
        "gpt-2" | "default" | GPT2 => byte_level(true),
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "llama-bpe" | "llama3" => {
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3), byte_level(false)]})
        }
        "qwen2" => json!({"type": "Sequence", "pretokenizers": [split(QWEN2), byte_level(false)]}),
        _ => return None,
    })
}

/// Token types (`tokenizer.ggml.token_type`) llama.cpp writes.
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The file's tokenizer; `Ok(None)` when it has no vocabulary.
pub fn tokenizer(g: &Gguf) -> Result<Option<Tokenizer>> {
    let path = g.path();
    let err = |e| gguf_error(path, e);
    let Some(model) = g
        .optional(
            "tokenizer.ggml.model",
            tandem_gguf::Value::as_str,
            "a string",
        )
        .map_err(err)?
    else {
        return Ok(None);
    };
    match model {
        GPT2 => byte_level(g).map(Some),
        SENTENCEPIECE => super::sentencepiece::tokenizer(g).map(Some),
        _ => Err(EngineError::Unsupported(format!(
            "{}: tokenizer model `{model}` (read: `gpt2` byte-level BPE, `llama` SentencePiece BPE)",
            path.display()
        ))),
    }
}

/// A byte-level BPE vocabulary with its merges.
fn byte_level(g: &Gguf) -> Result<Tokenizer> {
    let path = g.path();
    let pre = g
        .optional("tokenizer.ggml.pre", tandem_gguf::Value::as_str, "a string")
        .map_err(|e| gguf_error(path, e))?
        .unwrap_or("default");
    let pre_tokenizer = pre_tokenizer(pre).ok_or_else(|| {
        EngineError::Unsupported(format!(
            "{}: pre-tokenizer `{pre}` (read: gpt-2, smollm, llama-bpe, qwen2)",
            path.display()
        ))
    })?;
    let tokens = string_array(g, "tokenizer.ggml.tokens")?;
    let merges = match g.get("tokenizer.ggml.merges") {
        Some(_) => string_array(g, "tokenizer.ggml.merges")?,
        None => Vec::new(),
    };
    let (vocab, added) = vocab_and_added(&tokens, &token_types(g));
    let json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": bos_processor(g, &tokens, false)?,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges},
    });
    Tokenizer::from_json(&json.to_string())
        .map_err(|e| EngineError::Tokenizer(format!("{}: {e}", path.display())))
}

/// The vocabulary as a map, and the tokens to add whole: control tokens
/// as special, user-defined ones as plain.
pub(super) fn vocab_and_added(
    tokens: &[&str],
    types: &[i64],
) -> (serde_json::Map<String, Value>, Vec<Value>) {
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert((*tok).to_owned(), json!(id));
        let ty = types.get(id).copied().unwrap_or(1);
        if ty == CONTROL || ty == USER_DEFINED {
            added.push(
                json!({"id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == CONTROL}),
            );
        }
    }
    (vocab, added)
}

pub(super) fn token_types(g: &Gguf) -> Vec<i64> {
    match g
        .get("tokenizer.ggml.token_type")
        .and_then(tandem_gguf::Value::as_array)
    {
        Some(a) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
        None => Vec::new(),
    }
}

/// A post-processor prepending BOS when the file asks (`add_bos_token`;
/// `default` when the key is absent, llama.cpp's default for the
/// vocabulary type), as llama.cpp does; `null` otherwise.
pub(super) fn bos_processor(g: &Gguf, tokens: &[&str], default: bool) -> Result<Value> {
    let add = g
        .optional(
            "tokenizer.ggml.add_bos_token",
            tandem_gguf::Value::as_bool,
            "a bool",
        )
        .map_err(|e| gguf_error(g.path(), e))?
        .unwrap_or(default);
    let bos = add
        .then(|| {
            g.get("tokenizer.ggml.bos_token_id")
                .and_then(tandem_gguf::Value::as_u64)
        })
        .flatten()
        .and_then(|id| tokens.get(id as usize).map(|t| (id, *t)));
    Ok(match bos {
        Some((id, text)) => json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {text: {"id": text, "ids": [id], "tokens": [text]}}}),
        None => Value::Null,
    })
}

pub(super) fn string_array<'a>(g: &'a Gguf, key: &str) -> Result<Vec<&'a str>> {
    let bad = || {
        EngineError::InvalidCheckpoint(format!(
            "{}: `{key}` is not an array of strings",
            g.path().display()
        ))
    };
    g.get(key)
        .and_then(tandem_gguf::Value::as_array)
        .ok_or_else(bad)?
        .iter()
        .map(|v| v.as_str().ok_or_else(bad))
        .collect()
}

/// Ids of the tokens that end a turn: the file's end-of-sequence and
/// end-of-turn ids, and its control tokens spelled as the usual end
/// markers (what llama.cpp counts as end-of-generation).
pub fn end_ids(g: &Gguf) -> Vec<u64> {
    const ENDS: [&str; 6] = [
        "<|im_end|>",
        "<|eot_id|>",
        "<|end|>",
        "<|endoftext|>",
        "<end_of_turn>",
        "<|eom_id|>",
    ];
    let mut ids: Vec<u64> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
        .iter()
        .filter_map(|k| g.get(k).and_then(tandem_gguf::Value::as_u64))
        .collect();
    let tokens = g
        .get("tokenizer.ggml.tokens")
        .and_then(tandem_gguf::Value::as_array);
    let types = g
        .get("tokenizer.ggml.token_type")
        .and_then(tandem_gguf::Value::as_array);
    if let (Some(tokens), Some(types)) = (tokens, types) {
        for (id, (t, ty)) in tokens.iter().zip(types).enumerate() {
            if ty.as_i64() == Some(CONTROL) && t.as_str().is_some_and(|s| ENDS.contains(&s)) {
                ids.push(id as u64);
            }
        }
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}
