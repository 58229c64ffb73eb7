//! The body of `/v1/chat/completions` (also what `tandem.v1.Chat` and the
//! Anthropic and Responses translations produce): messages, tools and
//! chat's logprob flags, checked into chat messages and a plan.

use serde::Deserialize;

use super::{CommonParams, Plan, MAX_TOP_LOGPROBS};
use crate::error::ApiError;

/// Message content: text or a list of typed parts (only `text` parts).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant turn's calls: `{"id", "type": "function", "function":
    /// {"name", "arguments"}}`.
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
    pub reasoning_content: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessageIn>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<serde_json::Value>>,
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Default true: end the prompt with the assistant's turn opened.
    pub add_generation_prompt: Option<bool>,
    #[serde(flatten)]
    pub common: CommonParams,
}

impl ChatRequest {
    /// The plan, with chat's `logprobs` (a flag) and `top_logprobs` checked.
    pub fn plan(&self) -> Result<Plan, ApiError> {
        let mut plan = self.common.plan()?;
        let top = match self.top_logprobs {
            None => 0,
            Some(k) if (0..=i64::from(MAX_TOP_LOGPROBS)).contains(&k) => k as u32,
            Some(k) => {
                return Err(ApiError::bad_param(
                    "top_logprobs",
                    format!("top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
                ))
            }
        };
        plan.template.logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (true, _) => Some(top),
            (false, Some(_)) => {
                return Err(ApiError::bad_param(
                    "top_logprobs",
                    "top_logprobs requires logprobs to be true",
                ))
            }
            (false, None) => None,
        };
        Ok(plan)
    }

    /// The request's tools, checked (`None` without tools).
    pub fn tool_set(&self) -> Result<Option<crate::tools::ToolSet>, ApiError> {
        crate::tools::ToolSet::from_openai(
            self.tools.as_deref(),
            self.tool_choice.as_ref(),
            self.parallel_tool_calls,
        )
    }

    /// The messages with their content flattened to text. A `tool`
    /// message must answer a call an earlier assistant turn made.
    pub fn messages(&self) -> Result<Vec<crate::chat::Message>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::bad_param(
                "messages",
                "messages must hold at least one message",
            ));
        }
        let mut call_ids: Vec<&str> = Vec::new();
        let mut out = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            let field = |f: &str| format!("messages[{i}].{f}");
            if !matches!(
                m.role.as_str(),
                "system" | "developer" | "user" | "assistant" | "tool"
            ) {
                return Err(ApiError::bad_param(
                    field("role"),
                    format!("unknown message role `{}`", m.role),
                ));
            }
            let content = flatten_content(m.content.as_ref(), || field("content"))?;
            if let Some(calls) = &m.tool_calls {
                if m.role != "assistant" {
                    return Err(ApiError::bad_param(
                        field("tool_calls"),
                        "only assistant messages carry tool_calls",
                    ));
                }
                for (j, call) in calls.iter().enumerate() {
                    let f = &call["function"];
                    if !(call["id"].is_string()
                        && f["name"].is_string()
                        && f["arguments"].is_string())
                    {
                        return Err(ApiError::bad_param(
                            field(&format!("tool_calls[{j}]")),
                            "a tool call is {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}} with string values",
                        ));
                    }
                    call_ids.extend(call["id"].as_str());
                }
            }
            if m.role == "tool" {
                match m.tool_call_id.as_deref() {
                    Some(id) if call_ids.contains(&id) => {}
                    Some(id) => {
                        return Err(ApiError::bad_param(
                            field("tool_call_id"),
                            format!("`{id}` answers no tool call of an earlier assistant message"),
                        ))
                    }
                    None => {
                        return Err(ApiError::bad_param(
                            field("tool_call_id"),
                            "a tool message needs tool_call_id",
                        ))
                    }
                }
            }
            out.push(crate::chat::Message {
                role: m.role.clone(),
                content,
                tool_calls: m.tool_calls.clone(),
                tool_call_id: m.tool_call_id.clone(),
                name: m.name.clone(),
                reasoning_content: m.reasoning_content.clone(),
            });
        }
        Ok(out)
    }
}

/// Message content as text: a string, or the concatenation of `text` parts.
fn flatten_content(
    content: Option<&Content>,
    field: impl Fn() -> String,
) -> Result<String, ApiError> {
    match content {
        None => Ok(String::new()),
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::bad_param(
                            field(),
                            format!("content part type `{kind}` is not supported"),
                        ))
                    }
                }
            }
            Ok(text)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_logprobs_and_messages() {
        let r: ChatRequest = serde_json::from_str(
            r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                "logprobs": true, "top_logprobs": 3}"#,
        )
        .expect("parses");
        assert_eq!(r.plan().expect("valid").template.logprobs, Some(3));
        assert_eq!(r.messages().expect("valid")[0].content, "ab");
        let r: ChatRequest = serde_json::from_str(
            r#"{"messages": [{"role": "wizard", "content": "x"}], "top_logprobs": 3}"#,
        )
        .expect("parses");
        assert_eq!(
            r.plan().expect_err("needs logprobs").param.as_deref(),
            Some("top_logprobs")
        );
        assert!(r.messages().is_err());
    }
}
