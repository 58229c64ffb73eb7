//! A SentencePiece BPE vocabulary (`tokenizer.ggml.model` = `llama`: Llama
//! 2, Mistral, Phi-3, Gemma) rebuilt as transformers' GGUF loader builds it:
//! BPE with byte fallback over `▁`-marked text, the marking per family
//! ([`Style`]), a `▁` before the first word when the file's
//! `add_space_prefix` says so, and merges recovered from the tokens' scores
//! ([`merges_from_scores`]), since the file carries none.

use serde_json::{json, Value};
use tandem_gguf::Gguf;

use super::gguf_error;
use super::tokenizer::{bos_processor, string_array, token_types, vocab_and_added};
use crate::error::{EngineError, Result};
use crate::tokenizer::Tokenizer;

/// How a family's SentencePiece text is marked, as transformers' GGUF
/// loader builds each (`integrations/gguf/gguf_tokenizer_mapping.py`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Style {
    /// `LlamaTokenizer`: `Metaspace`, a `▁` before the first word.
    Llama,
    /// Phi-3: a normalizer prepends `▁` and replaces every space (so a text
    /// starting with a space keeps both).
    Phi3,
    /// Gemma: spaces become `▁` with no prefix; tokens of only spaces are
    /// respelled with `▁`, and merges follow the file's token order, not
    /// its scores.
    Gemma,
}

impl Style {
    fn of(g: &Gguf) -> Self {
        match g.str("general.architecture").unwrap_or_default() {
            "phi3" => Self::Phi3,
            a if a.starts_with("gemma") => Self::Gemma,
            _ => Self::Llama,
        }
    }
}

/// The file's SentencePiece vocabulary as a tokenizer.
pub(super) fn tokenizer(g: &Gguf) -> Result<Tokenizer> {
    let path = g.path();
    let style = Style::of(g);
    let stored = string_array(g, "tokenizer.ggml.tokens")?;
    let mut scores: Vec<f64> = match g
        .get("tokenizer.ggml.scores")
        .and_then(tandem_gguf::Value::as_array)
    {
        Some(a) => a.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect(),
        None => vec![0.0; stored.len()],
    };
    if scores.len() != stored.len() {
        return Err(EngineError::InvalidCheckpoint(format!(
            "{}: {} scores for {} tokens",
            path.display(),
            scores.len(),
            stored.len()
        )));
    }
    let respelled: Vec<String>;
    let tokens: Vec<&str> = match style {
        Style::Gemma => {
            // llama.cpp stores a token of spaces as spaces; Gemma's text
            // has them as `▁`. Its merges go by position.
            respelled = stored
                .iter()
                .map(|t| match t.contains(' ') && t.trim().is_empty() {
                    true => "\u{2581}".repeat(t.chars().count()),
                    false => (*t).to_owned(),
                })
                .collect();
            scores = (0..stored.len()).map(|i| -(i as f64)).collect();
            respelled.iter().map(String::as_str).collect()
        }
        _ => stored.clone(),
    };
    let (vocab, _) = vocab_and_added(&tokens, &[]);
    // Whole-matched tokens are the file's own spellings; a user-defined one
    // only when it is in the vocabulary as spelled.
    let (_, mut added) = vocab_and_added(&stored, &token_types(g));
    added.retain(|a| {
        a["special"] == true || a["content"].as_str().is_some_and(|c| vocab.contains_key(c))
    });
    let merges = match g.get("tokenizer.ggml.merges") {
        Some(_) => string_array(g, "tokenizer.ggml.merges")?
            .iter()
            .map(|m| json!(m))
            .collect(),
        None => merges_from_scores(&tokens, &scores),
    };
    let prefix = g
        .optional(
            "tokenizer.ggml.add_space_prefix",
            tandem_gguf::Value::as_bool,
            "a bool",
        )
        .map_err(|e| gguf_error(path, e))?
        .unwrap_or(style != Style::Gemma);
    let unk = g
        .get("tokenizer.ggml.unknown_token_id")
        .and_then(tandem_gguf::Value::as_u64)
        .and_then(|id| tokens.get(id as usize).copied());
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let replace_spaces =
        json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
    let (normalizer, pre_tokenizer) = match style {
        Style::Llama => {
            let scheme = if prefix { "first" } else { "never" };
            (
                Value::Null,
                json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": scheme, "split": false}),
            )
        }
        Style::Phi3 => {
            let mut steps = vec![replace_spaces];
            if prefix {
                steps.insert(0, json!({"type": "Prepend", "prepend": "\u{2581}"}));
            }
            (
                json!({"type": "Sequence", "normalizers": steps}),
                Value::Null,
            )
        }
        Style::Gemma => (
            replace_spaces,
            json!({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false}),
        ),
    };
    let json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        // SentencePiece vocabularies get BOS unless the file says not.
        "post_processor": bos_processor(g, &stored, true)?,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab, "merges": merges},
    });
    Tokenizer::from_json(&json.to_string())
        .map_err(|e| EngineError::Tokenizer(format!("{}: {e}", path.display())))
}

/// The merges a SentencePiece vocabulary implies (transformers'
/// `generate_merges`): every split of a token into two tokens, ranked by
/// the whole token's score, then the pieces' lengths, best first. Ties keep
/// the vocabulary's order, and one token's splits are ordered by their
/// pieces' ids.
fn merges_from_scores(tokens: &[&str], scores: &[f64]) -> Vec<Value> {
    let ids: std::collections::HashMap<&str, usize> =
        tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut merges: Vec<(&str, &str, f64)> = Vec::new();
    for (token, &score) in tokens.iter().zip(scores) {
        let mut local: Vec<(&str, &str, f64)> = token
            .char_indices()
            .skip(1)
            .map(|(at, _)| token.split_at(at))
            .filter(|(l, r)| ids.contains_key(l) && ids.contains_key(r))
            .map(|(l, r)| (l, r, score))
            .collect();
        local.sort_by_key(|(l, r, _)| (ids[l], ids[r]));
        merges.extend(local);
    }
    let lens = |m: &(&str, &str, f64)| (m.0.chars().count(), m.1.chars().count());
    // A stable sort, best first: as Python's `sorted(..., reverse=True)`.
    merges.sort_by(|a, b| b.2.total_cmp(&a.2).then(lens(b).cmp(&lens(a))));
    merges.into_iter().map(|(l, r, _)| json!([l, r])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_follow_the_whole_tokens_scores() {
        let tokens = ["a", "b", "c", "ab", "abc", "bc"];
        let scores = [0.0, 0.0, 0.0, -1.0, -3.0, -2.0];
        let merges = merges_from_scores(&tokens, &scores);
        assert_eq!(
            merges,
            // abc's splits tie on its score; the longer left piece first.
            [
                json!(["a", "b"]),
                json!(["b", "c"]),
                json!(["ab", "c"]),
                json!(["a", "bc"])
            ]
        );
    }
}
