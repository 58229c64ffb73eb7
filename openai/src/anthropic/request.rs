//! Anthropic's Messages request body and its translation into the chat
//! messages, tools and sampling plan the OpenAI side already uses.
//!
//! Content blocks map onto transformers' chat shape: `tool_use` blocks of
//! an assistant turn become its `tool_calls` (the input as the JSON text of
//! `arguments`), each `tool_result` of a user turn becomes a `tool` message
//! answering that call, `thinking` becomes `reasoning_content`. Blocks this
//! server cannot use (images, documents, server tools) and blocks in the
//! wrong role are 400s naming the block (`messages.1.content.0.type`).

use serde::Deserialize;
use serde_json::Value;

use crate::chat::Message;
use crate::error::ApiError;
use crate::params::{join_text_parts, CommonParams, Plan, Stop};
use crate::tools::{self, ToolChoice, ToolSet};

/// `system`: text, or a list of text blocks.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum System {
    Text(String),
    Blocks(Vec<Value>),
}

/// A message's `content`: text, or a list of blocks.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Blocks(Vec<Value>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct MessageIn {
    pub role: String,
    pub content: Content,
}

/// `POST /v1/messages` (and, without `max_tokens`, `count_tokens`).
#[derive(Debug, Clone, Deserialize)]
pub struct MessagesRequest {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub messages: Vec<MessageIn>,
    pub system: Option<System>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub stream: Option<bool>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
}

impl MessagesRequest {
    /// The sampling plan (Anthropic's temperature is in [0, 1]).
    pub fn plan(&self) -> Result<Plan, ApiError> {
        let max_tokens = self
            .max_tokens
            .ok_or_else(|| ApiError::bad_param("max_tokens", "max_tokens is required"))?;
        if let Some(t) = self.temperature.filter(|t| !(0.0..=1.0).contains(t)) {
            return Err(ApiError::bad_param(
                "temperature",
                format!("temperature must be between 0 and 1, got {t}"),
            ));
        }
        let common = CommonParams {
            max_tokens: Some(max_tokens),
            temperature: Some(self.temperature.unwrap_or(1.0)),
            top_p: self.top_p,
            top_k: self.top_k,
            stream: self.stream,
            stop: self.stop_sequences.clone().map(Stop::Many),
            ..CommonParams::default()
        };
        common.plan().map_err(|mut e| {
            if e.param.as_deref() == Some("stop") {
                e.param = Some("stop_sequences".into());
            }
            e
        })
    }

    /// The tools and `tool_choice`, checked.
    pub fn tool_set(&self) -> Result<Option<ToolSet>, ApiError> {
        let list = self.tools.as_deref().unwrap_or_default();
        if list.len() > tools::MAX_TOOLS {
            return Err(ApiError::bad_param(
                "tools",
                format!("at most {} tools per request", tools::MAX_TOOLS),
            ));
        }
        let mut parsed = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            if let Some(kind) = t
                .get("type")
                .and_then(Value::as_str)
                .filter(|k| *k != "custom")
            {
                return Err(ApiError::bad_param(
                    format!("tools.{i}.type"),
                    format!("tool type `{kind}` is not supported; give client tools (name, input_schema)"),
                ));
            }
            parsed.push(tools::tool(
                t["name"].as_str(),
                t["description"].as_str(),
                t.get("input_schema").or(Some(&Value::Null)),
                &format!("tools.{i}.name"),
                &format!("tools.{i}.input_schema"),
            )?);
        }
        let (choice, parallel) = match &self.tool_choice {
            None | Some(Value::Null) => (None, true),
            Some(c) => {
                let parallel = c["disable_parallel_tool_use"] != Value::Bool(true);
                let choice = match c["type"].as_str() {
                    Some("auto") => ToolChoice::Auto,
                    Some("any") => ToolChoice::Required,
                    Some("none") => ToolChoice::None,
                    Some("tool") => match c["name"].as_str() {
                        Some(name) => ToolChoice::Named(name.to_string()),
                        None => {
                            return Err(ApiError::bad_param(
                                "tool_choice.name",
                                "a tool_choice of type tool names the tool",
                            ))
                        }
                    },
                    _ => {
                        return Err(ApiError::bad_param(
                            "tool_choice.type",
                            "tool_choice.type must be auto, any, tool or none",
                        ))
                    }
                };
                (Some(choice), parallel)
            }
        };
        ToolSet::new(parsed, choice, parallel, "tool_choice")
    }

    /// The conversation as chat messages, the system prompt first.
    pub fn messages(&self) -> Result<Vec<Message>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::bad_param(
                "messages",
                "messages must hold at least one message",
            ));
        }
        let mut out = Vec::new();
        match &self.system {
            None => {}
            Some(System::Text(t)) => out.push(Message::text("system", t.clone())),
            Some(System::Blocks(blocks)) => {
                let text = text_of(blocks, "system")?;
                out.push(Message::text("system", text));
            }
        }
        let mut tool_use_ids: Vec<String> = Vec::new();
        for (i, m) in self.messages.iter().enumerate() {
            let blocks = match &m.content {
                Content::Text(t) => vec![serde_json::json!({"type": "text", "text": t})],
                Content::Blocks(b) => b.clone(),
            };
            match m.role.as_str() {
                "user" => user_turn(i, &blocks, &tool_use_ids, &mut out)?,
                "assistant" => out.push(assistant_turn(i, &blocks, &mut tool_use_ids)?),
                other => {
                    return Err(ApiError::bad_param(
                        format!("messages.{i}.role"),
                        format!("role must be user or assistant, got `{other}`"),
                    ))
                }
            }
        }
        Ok(out)
    }
}

/// The text of a list of `text` blocks.
fn text_of(blocks: &[Value], at: &str) -> Result<String, ApiError> {
    join_text_parts(blocks, &["text"], |j| format!("{at}.{j}.type"))
}

fn user_turn(
    i: usize,
    blocks: &[Value],
    tool_use_ids: &[String],
    out: &mut Vec<Message>,
) -> Result<(), ApiError> {
    let mut text = String::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = |f: &str| format!("messages.{i}.content.{j}.{f}");
        match b["type"].as_str() {
            Some("text") => text.push_str(
                b["text"]
                    .as_str()
                    .ok_or_else(|| ApiError::bad_param(at("text"), "a text block needs text"))?,
            ),
            Some("tool_result") => {
                let id = b["tool_use_id"].as_str().unwrap_or_default();
                if !tool_use_ids.iter().any(|u| u == id) {
                    return Err(ApiError::bad_param(
                        at("tool_use_id"),
                        format!("`{id}` answers no tool_use block of an earlier assistant turn"),
                    ));
                }
                let content = match &b["content"] {
                    Value::Null => String::new(),
                    Value::String(s) => s.clone(),
                    Value::Array(parts) => {
                        text_of(parts, &format!("messages.{i}.content.{j}.content"))?
                    }
                    _ => {
                        return Err(ApiError::bad_param(
                            at("content"),
                            "tool_result content is text or a list of text blocks",
                        ))
                    }
                };
                out.push(Message {
                    role: "tool".into(),
                    content,
                    tool_call_id: Some(id.to_string()),
                    ..Message::default()
                });
            }
            Some(kind @ ("tool_use" | "thinking" | "redacted_thinking")) => {
                return Err(ApiError::bad_param(
                    at("type"),
                    format!("a `{kind}` block belongs in an assistant turn"),
                ))
            }
            kind => {
                return Err(ApiError::bad_param(
                    at("type"),
                    format!(
                        "content block type {} is not supported",
                        kind.unwrap_or("(none)")
                    ),
                ))
            }
        }
    }
    if !text.is_empty() || blocks.is_empty() {
        out.push(Message::text("user", text));
    }
    Ok(())
}

fn assistant_turn(
    i: usize,
    blocks: &[Value],
    tool_use_ids: &mut Vec<String>,
) -> Result<Message, ApiError> {
    let mut message = Message::text("assistant", "");
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = |f: &str| format!("messages.{i}.content.{j}.{f}");
        match b["type"].as_str() {
            Some("text") => message.content.push_str(
                b["text"]
                    .as_str()
                    .ok_or_else(|| ApiError::bad_param(at("text"), "a text block needs text"))?,
            ),
            Some("thinking") => {
                let thought = b["thinking"].as_str().unwrap_or_default();
                message
                    .reasoning_content
                    .get_or_insert_with(String::new)
                    .push_str(thought);
            }
            Some("tool_use") => {
                let (Some(id), Some(name)) = (b["id"].as_str(), b["name"].as_str()) else {
                    return Err(ApiError::bad_param(
                        at("id"),
                        "a tool_use block needs an id and a name",
                    ));
                };
                if !b["input"].is_object() {
                    return Err(ApiError::bad_param(
                        at("input"),
                        "tool_use input is an object",
                    ));
                }
                tool_use_ids.push(id.to_string());
                calls.push(serde_json::json!({
                    "id": id, "type": "function",
                    "function": {"name": name, "arguments": b["input"].to_string()},
                }));
            }
            Some("tool_result") => {
                return Err(ApiError::bad_param(
                    at("type"),
                    "a `tool_result` block belongs in a user turn",
                ))
            }
            kind => {
                return Err(ApiError::bad_param(
                    at("type"),
                    format!(
                        "content block type {} is not supported",
                        kind.unwrap_or("(none)")
                    ),
                ))
            }
        }
    }
    if !calls.is_empty() {
        message.tool_calls = Some(calls);
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn request(body: Value) -> MessagesRequest {
        serde_json::from_value(body).expect("parses")
    }

    #[test]
    fn tool_turns_become_tool_calls_and_tool_messages() {
        let r = request(json!({
            "max_tokens": 9, "system": [{"type": "text", "text": "be brief"}],
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "-3C"}]},
                    {"type": "text", "text": "and tomorrow?"}]}]
        }));
        let m = r.messages().expect("valid");
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(m[2].content, "Checking.");
        let call = &m[2].tool_calls.as_ref().expect("calls")[0];
        assert_eq!(call["function"]["arguments"], "{\"city\":\"Oslo\"}");
        assert_eq!(m[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(m[3].content, "-3C");
        assert_eq!(r.plan().expect("valid").template.max_tokens, Some(9));
    }

    #[test]
    fn mixed_up_blocks_name_the_block() {
        let field = |body: Value| {
            let r = request(body);
            r.messages()
                .and_then(|_| r.plan().map(|_| ()))
                .expect_err("refused")
                .param
                .map(|p| p.into_owned())
        };
        let unknown_result = json!({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]});
        assert_eq!(
            field(unknown_result).as_deref(),
            Some("messages.0.content.0.tool_use_id")
        );
        let use_in_user = json!({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]});
        assert_eq!(
            field(use_in_user).as_deref(),
            Some("messages.0.content.0.type")
        );
        let image = json!({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "see"}, {"type": "image", "source": {}}]}]});
        assert_eq!(field(image).as_deref(), Some("messages.0.content.1.type"));
        let no_max = json!({"messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(field(no_max).as_deref(), Some("max_tokens"));
        let hot = json!({"max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(field(hot).as_deref(), Some("temperature"));
    }

    #[test]
    fn tool_choices_map_to_openais() {
        let tools = json!([{"name": "f", "input_schema": {"type": "object"}}]);
        let choice = |c: Value| {
            request(json!({"max_tokens": 5, "messages": [], "tools": tools, "tool_choice": c}))
                .tool_set()
        };
        let set = choice(json!({"type": "any", "disable_parallel_tool_use": true}))
            .expect("valid")
            .expect("tools");
        assert_eq!((set.choice, set.parallel), (ToolChoice::Required, false));
        let set = choice(json!({"type": "tool", "name": "f"}))
            .expect("valid")
            .expect("tools");
        assert_eq!(set.choice, ToolChoice::Named("f".into()));
        let e = choice(json!({"type": "tool", "name": "g"})).expect_err("unknown");
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let bad_schema = json!({"max_tokens": 5, "messages": [],
                                "tools": [{"name": "f", "input_schema": {"type": "object",
                                           "properties": {"x": {"type": "texts"}}}}]});
        let e = request(bad_schema).tool_set().expect_err("bad schema");
        assert_eq!(e.param.as_deref(), Some("tools.0.input_schema"));
    }
}
