//! The crate's error type.

/// What can go wrong compiling or following a grammar.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StructuredError {
    /// The client's format is invalid: bad JSON, an unsupported or
    /// unsatisfiable schema, a regex or Lark grammar that does not compile.
    /// `kind` is the format's field name (`json_schema`, `regex`, ...), the
    /// message is the grammar engine's.
    #[error("{kind}: {message}")]
    InvalidFormat { kind: &'static str, message: String },
    /// The tokenizer's vocabulary cannot be mapped to bytes.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The grammar engine failed while following a sequence (a token the
    /// mask did not allow, a lexer or parser limit).
    #[error("grammar: {0}")]
    Matcher(String),
    /// No token of the vocabulary can continue the output (the grammar needs
    /// bytes no token spells).
    #[error("grammar: no token of the vocabulary can continue the output")]
    DeadEnd,
}

/// The crate's result type.
pub type Result<T, E = StructuredError> = std::result::Result<T, E>;
