//! A thin wrapper over the `tokenizers` crate, plus incremental decoding.
//!
//! Its own crate so that the router and the HTTP APIs, which tokenize
//! prompts and count tokens, need not depend on the engine.

use std::path::Path;

/// A tokenizer that failed to load, encode or decode, with its message.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TokenizerError(String);

/// This crate's result.
pub type Result<T> = std::result::Result<T, TokenizerError>;

/// A Hugging Face `tokenizer.json`.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// Loads `tokenizer.json` from a file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| TokenizerError(format!("{}: {e}", path.display())))?;
        Ok(Self { inner })
    }

    /// Loads a tokenizer from the text of a `tokenizer.json` (one built in
    /// memory, e.g. from a GGUF file's vocabulary).
    pub fn from_json(json: &str) -> Result<Self> {
        let inner = json
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| TokenizerError(format!("tokenizer: {e}")))?;
        Ok(Self { inner })
    }

    /// Token ids of `text`, with the tokenizer's special tokens (e.g. BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.ids(text, true)
    }

    /// Token ids of `text` without added special tokens: for text that
    /// already spells them out, such as a rendered chat template.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        self.ids(text, false)
    }

    fn ids(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| TokenizerError(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of one token on its own, special tokens included (what
    /// logprob reports show for it).
    pub fn token_text(&self, id: u32) -> Result<String> {
        self.inner
            .decode(&[id], false)
            .map_err(|e| TokenizerError(e.to_string()))
    }

    /// The underlying Hugging Face tokenizer.
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Text of `ids`, skipping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| TokenizerError(e.to_string()))
    }
}

/// Turns a growing list of token ids into text deltas, in O(1) decoding
/// work per token.
///
/// Byte-level BPE tokens can split a UTF-8 character, and some tokenizers
/// decode a token differently after a word boundary, so each token is decoded
/// together with a few tokens of context (the window from `prefix` to the
/// end) and the delta is the text past the context's own decoding (the
/// offsets scheme of Hugging Face TGI and vLLM). A delta is released only
/// when it does not end in a replacement character; the next token completes
/// the character.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Start of the context window.
    prefix: usize,
    /// End of the text already released.
    read: usize,
}

/// Prompt tokens kept as context for the first output tokens.
const PROMPT_CONTEXT: usize = 5;

impl StreamDecoder {
    /// A decoder whose first tokens follow `prompt` (only its last few
    /// tokens are kept, as decoding context).
    pub fn after_prompt(prompt: &[u32]) -> Self {
        let tail = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..];
        Self {
            ids: tail.to_vec(),
            prefix: 0,
            read: tail.len(),
        }
    }

    /// Adds one token; returns the newly printable text, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let context = tok.decode(&self.ids[self.prefix..self.read])?;
        let text = tok.decode(&self.ids[self.prefix..])?;
        if text.len() <= context.len()
            || text.ends_with('\u{FFFD}')
            || !text.is_char_boundary(context.len())
        {
            return Ok(String::new());
        }
        let delta = text[context.len()..].to_string();
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(delta)
    }
}
