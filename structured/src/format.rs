//! What a client asks the output to be.

use llguidance::api::TopLevelGrammar;

use crate::error::{Result, StructuredError};

/// The most text (a schema, a regex, a grammar, the choices together) one
/// response format may have. Compiling is bounded by llguidance's own fuel
/// limits too; this refuses the obviously oversized up front, before any
/// parsing: 128 KiB is several times the largest tool schemas seen in
/// practice.
pub const MAX_FORMAT_BYTES: usize = 128 << 10;

/// A constraint on a request's output, as the client states it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ResponseFormat {
    /// JSON valid against this JSON schema (the schema's text).
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// Text matching this regex as a whole (Rust `regex` syntax, implicitly
    /// anchored at both ends).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark syntax (EBNF rules such as
    /// `start: item ("," item)*`, `"literal"` and `/regex/` terminals, `{m,n}`
    /// repeats, `%json {...}` for embedded schemas).
    Grammar(String),
}

impl ResponseFormat {
    /// The API field name of this kind of format.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonSchema(_) => "json_schema",
            Self::JsonObject => "json_object",
            Self::Regex(_) => "regex",
            Self::Choice(_) => "choice",
            Self::Grammar(_) => "grammar",
        }
    }

    fn invalid(&self, message: impl Into<String>) -> StructuredError {
        StructuredError::InvalidFormat {
            kind: self.kind(),
            message: message.into(),
        }
    }

    /// Bytes of the format's text (schema, regex, grammar or choices).
    pub fn text_bytes(&self) -> usize {
        match self {
            Self::JsonSchema(t) | Self::Regex(t) | Self::Grammar(t) => t.len(),
            Self::JsonObject => 0,
            Self::Choice(c) => c.iter().map(String::len).sum(),
        }
    }

    /// llguidance's description of the grammar; checks what can be checked
    /// without a tokenizer, the size first ([`MAX_FORMAT_BYTES`]).
    pub(crate) fn to_grammar(&self) -> Result<TopLevelGrammar> {
        let bytes = self.text_bytes();
        if bytes > MAX_FORMAT_BYTES {
            return Err(self.invalid(format!(
                "the {} is {bytes} bytes; at most {MAX_FORMAT_BYTES} are compiled",
                self.kind()
            )));
        }
        match self {
            Self::JsonSchema(text) => {
                let schema: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| self.invalid(format!("the schema is not valid JSON: {e}")))?;
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(self.invalid("the schema must be a JSON object or a boolean"));
                }
                Ok(TopLevelGrammar::from_json_schema(schema))
            }
            Self::JsonObject => Ok(TopLevelGrammar::from_json_schema(
                serde_json::json!({"type": "object"}),
            )),
            Self::Regex(rx) => {
                if rx.is_empty() {
                    return Err(self.invalid("the regex is empty"));
                }
                Ok(TopLevelGrammar::from_regex(rx))
            }
            Self::Choice(choices) => {
                if choices.is_empty() {
                    return Err(self.invalid("the choice list is empty"));
                }
                if choices.iter().any(String::is_empty) {
                    return Err(self.invalid("choices must not be empty strings"));
                }
                // Lark string literals use JSON string syntax.
                let alts: Vec<String> = choices
                    .iter()
                    .map(|c| serde_json::Value::String(c.clone()).to_string())
                    .collect();
                Ok(TopLevelGrammar::from_lark(format!(
                    "start: {}",
                    alts.join(" | ")
                )))
            }
            Self::Grammar(text) => {
                if text.trim().is_empty() {
                    return Err(self.invalid("the grammar is empty"));
                }
                Ok(TopLevelGrammar::from_lark(text.clone()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_formats_are_refused_before_compiling() {
        for (f, want) in [
            (ResponseFormat::JsonSchema("{".into()), "not valid JSON"),
            (ResponseFormat::JsonSchema("3".into()), "JSON object"),
            (ResponseFormat::Regex(String::new()), "empty"),
            (ResponseFormat::Choice(vec![]), "empty"),
            (
                ResponseFormat::Choice(vec!["a".into(), String::new()]),
                "empty",
            ),
            (ResponseFormat::Grammar("  \n".into()), "empty"),
        ] {
            let err = f.to_grammar().expect_err("invalid").to_string();
            assert!(err.starts_with(f.kind()), "{err}");
            assert!(err.contains(want), "{err}");
        }
    }
}
