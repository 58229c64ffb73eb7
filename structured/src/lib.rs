//! Constrained decoding for tandem: a response that must parse.
//!
//! A request may carry a [`ResponseFormat`] — a JSON schema, "any JSON
//! object", a regex, a list of choices, or a Lark grammar. This crate turns
//! it into a per-step **token mask**: the set of vocabulary ids that keep the
//! output a prefix of something the grammar accepts. The engine sets every
//! other logit to −∞ before sampling, so both greedy and sampled decoding can
//! only produce valid output.
//!
//! The grammar work is done by [`llguidance`] (the engine behind vLLM's,
//! SGLang's and llama.cpp's structured outputs): a lazily built lexer DFA
//! plus an Earley parser, walking a token trie ([`toktrie`]) to compute a
//! mask in tens to hundreds of microseconds. We do not compile regexes or
//! grammars ourselves.
//!
//! # Pieces
//!
//! * [`ResponseFormat`] — what the client asked for, as text. Choices become
//!   a Lark alternation of JSON-quoted literals; `json_object` is the schema
//!   `{"type": "object"}`; regexes must match the whole output.
//! * [`Vocabulary`] — the bytes of every token id, read from a Hugging Face
//!   `tokenizers` tokenizer (byte-level BPE and SentencePiece byte-fallback
//!   vocabularies), sized to the model's logits. Special tokens can never be
//!   produced by a grammar, except end-of-sequence when the grammar is
//!   complete. (We read the bytes ourselves rather than through
//!   `toktrie_hf_tokenizers`, which pins an older `tokenizers`.)
//! * [`GrammarCompiler`] — one per engine: llguidance's parser factory over
//!   the vocabulary and a bounded LRU cache of compiled grammars keyed by
//!   (tokenizer fingerprint, format). Compiling validates: a bad schema,
//!   regex or grammar is a [`StructuredError::InvalidFormat`] carrying
//!   llguidance's message, raised at admission, never mid-generation.
//! * [`CompiledGrammar`] — a fresh parser plus its first mask, computed once.
//! * [`Constraint`] — one sequence's state: a private deep copy of the
//!   parser (no lock shared with batch-mates, so masks of a batch can be
//!   computed in parallel) and the mask for its next token. It is `Send`,
//!   so the engine can move it to a worker thread to compute the next mask
//!   while the model's forward pass runs. [`Constraint::fork`] copies the
//!   state for parallel samples; [`Constraint::accept_prefix`] and
//!   [`Constraint::rollback`] are the seam for speculative decoding (check
//!   drafted tokens against the grammar, undo the rejected ones).
//! * [`TokenMask`] — a bitset over the vocabulary, applied to a logits row.
//!
//! # Ending
//!
//! A grammar that can continue and can also end allows the end-of-sequence
//! token in its mask; sampling it ends the choice. A grammar that can only
//! end (the last character of a choice, a closed top-level JSON object)
//! stops the matcher as soon as its last token is committed:
//! [`Commit::stopped`] tells the engine to end the choice there, with
//! finish reason `stop`, without spending a step on the end token.
//!
//! **Architecture Invariant:** this crate knows token ids, token bytes and
//! grammars — nothing of models, KV caches, scheduling or the network. Every
//! failure is a [`StructuredError`]; nothing here panics on user input
//! (llguidance's own internal panics are caught by its matcher and become
//! errors).

mod compiler;
mod constraint;
mod error;
mod format;
mod vocab;

pub use compiler::{CacheStats, CompiledGrammar, GrammarCompiler, DEFAULT_CACHE_CAPACITY};
pub use constraint::{Commit, Constraint, TokenMask};
pub use error::{Result, StructuredError};
pub use format::{ResponseFormat, MAX_FORMAT_BYTES};
pub use vocab::Vocabulary;
