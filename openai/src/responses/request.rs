//! The Responses API's request body and its translation into chat messages,
//! tools and a sampling plan.
//!
//! `input` is text or a list of items: messages (`input_text` /
//! `output_text` parts), `function_call` items (an assistant turn's calls)
//! and `function_call_output` items (a `tool` message answering one);
//! `reasoning` items are accepted and left out of the prompt. The API is
//! stateless here: `previous_response_id` is a 400, the client sends the
//! whole conversation.

use serde::Deserialize;
use serde_json::Value;

use crate::chat::Message;
use crate::error::ApiError;
use crate::params::{join_text_parts, CommonParams, Plan, ResponseFormatIn};
use crate::tools::{self, ToolChoice, ToolSet};

/// `input`: text, or a list of items.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<Value>),
}

/// `POST /v1/responses`.
#[derive(Debug, Clone, Deserialize)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    pub input: Input,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<i64>,
    pub stream: Option<bool>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub previous_response_id: Option<String>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", …}}`.
    pub text: Option<Value>,
}

impl ResponsesRequest {
    pub fn plan(&self) -> Result<Plan, ApiError> {
        if self.previous_response_id.is_some() {
            return Err(ApiError::bad_param(
                "previous_response_id",
                "responses are not stored here; send the whole conversation as input",
            ));
        }
        let response_format = match self.text.as_ref().map(|t| &t["format"]) {
            None | Some(Value::Null) => None,
            Some(f) => {
                // The chat API's shape nests the schema one level deeper.
                let mut chat = serde_json::json!({"type": f["type"]});
                if f["type"] == "json_schema" {
                    chat["json_schema"] =
                        serde_json::json!({"name": f["name"], "schema": f["schema"]});
                }
                Some(
                    serde_json::from_value::<ResponseFormatIn>(chat)
                        .map_err(|e| ApiError::bad_param("text.format", e.to_string()))?,
                )
            }
        };
        let common = CommonParams {
            max_tokens: self.max_output_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            stream: self.stream,
            response_format,
            ..CommonParams::default()
        };
        common.plan().map_err(|mut e| {
            match e.param.as_deref() {
                Some("max_tokens") => e.param = Some("max_output_tokens".into()),
                Some("response_format") => e.param = Some("text.format".into()),
                _ => {}
            }
            e
        })
    }

    /// The function tools and `tool_choice`, checked.
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
            if t["type"] != "function" {
                return Err(ApiError::bad_param(
                    format!("tools[{i}].type"),
                    format!("only function tools are served here, got {}", t["type"]),
                ));
            }
            parsed.push(tools::tool(
                t["name"].as_str(),
                t["description"].as_str(),
                t.get("parameters"),
                &format!("tools[{i}].name"),
                &format!("tools[{i}].parameters"),
            )?);
        }
        let choice = ToolChoice::from_openai(self.tool_choice.as_ref())?;
        ToolSet::new(
            parsed,
            choice,
            self.parallel_tool_calls.unwrap_or(true),
            "tool_choice",
        )
    }

    /// The conversation as chat messages, `instructions` first.
    pub fn messages(&self) -> Result<Vec<Message>, ApiError> {
        let mut out = Vec::new();
        if let Some(i) = &self.instructions {
            out.push(Message::text("system", i.clone()));
        }
        let items = match &self.input {
            Input::Text(t) => {
                out.push(Message::text("user", t.clone()));
                return Ok(out);
            }
            Input::Items(items) => items,
        };
        if items.is_empty() {
            return Err(ApiError::bad_param("input", "input must not be empty"));
        }
        let mut call_ids: Vec<String> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let at = |f: &str| format!("input[{i}].{f}");
            let kind = item["type"]
                .as_str()
                .unwrap_or(if item.get("role").is_some() {
                    "message"
                } else {
                    ""
                });
            match kind {
                "message" => {
                    let role = item["role"].as_str().unwrap_or_default();
                    if !matches!(role, "user" | "system" | "developer" | "assistant") {
                        return Err(ApiError::bad_param(
                            at("role"),
                            format!(
                                "role must be user, system, developer or assistant, got `{role}`"
                            ),
                        ));
                    }
                    let content = text_content(&item["content"], &at("content"))?;
                    out.push(Message::text(role, content));
                }
                "function_call" => {
                    let (Some(id), Some(name), Some(args)) = (
                        item["call_id"].as_str(),
                        item["name"].as_str(),
                        item["arguments"].as_str(),
                    ) else {
                        return Err(ApiError::bad_param(
                            at("call_id"),
                            "a function_call item has call_id, name and arguments (strings)",
                        ));
                    };
                    call_ids.push(id.to_string());
                    let call = serde_json::json!({"id": id, "type": "function",
                                                  "function": {"name": name, "arguments": args}});
                    match out.last_mut().filter(|m| m.role == "assistant") {
                        Some(m) => m.tool_calls.get_or_insert_with(Vec::new).push(call),
                        None => out.push(Message {
                            tool_calls: Some(vec![call]),
                            ..Message::text("assistant", "")
                        }),
                    }
                }
                "function_call_output" => {
                    let id = item["call_id"].as_str().unwrap_or_default();
                    if !call_ids.iter().any(|c| c == id) {
                        return Err(ApiError::bad_param(
                            at("call_id"),
                            format!("`{id}` answers no function_call item before it"),
                        ));
                    }
                    let output = text_content(&item["output"], &at("output"))?;
                    out.push(Message {
                        role: "tool".into(),
                        content: output,
                        tool_call_id: Some(id.to_string()),
                        ..Message::default()
                    });
                }
                "reasoning" => {}
                other => {
                    return Err(ApiError::bad_param(
                        at("type"),
                        format!("input item type `{other}` is not supported"),
                    ))
                }
            }
        }
        Ok(out)
    }
}

/// Text content: a string, or `input_text` / `output_text` parts.
fn text_content(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            join_text_parts(parts, &["input_text", "output_text", "text"], |j| {
                format!("{at}[{j}].type")
            })
        }
        _ => Err(ApiError::bad_param(
            at.to_string(),
            "expected text or a list of text parts",
        )),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn request(body: Value) -> ResponsesRequest {
        serde_json::from_value(body).expect("parses")
    }

    #[test]
    fn items_become_chat_messages() {
        let r = request(json!({"instructions": "terse", "input": [
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "t", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"role": "user", "content": [{"type": "input_text", "text": "and?"}]}]}));
        let m = r.messages().expect("valid");
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(m[2].tool_calls.as_ref().map(Vec::len), Some(2));
        assert_eq!(m[3].tool_call_id.as_deref(), Some("c1"));
    }

    #[test]
    fn bad_items_name_their_field() {
        let field = |body: Value| {
            let r = request(body);
            let error = r
                .messages()
                .err()
                .or_else(|| r.plan().err())
                .or_else(|| r.tool_set().err())
                .expect("refused");
            error.param.map(|p| p.into_owned())
        };
        let orphan =
            json!({"input": [{"type": "function_call_output", "call_id": "x", "output": "1"}]});
        assert_eq!(field(orphan).as_deref(), Some("input[0].call_id"));
        let image = json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]});
        assert_eq!(field(image).as_deref(), Some("input[0].content[0].type"));
        let stored = json!({"input": "hi", "previous_response_id": "resp_1"});
        assert_eq!(field(stored).as_deref(), Some("previous_response_id"));
        let search = json!({"input": "hi", "tools": [{"type": "web_search"}]});
        assert_eq!(field(search).as_deref(), Some("tools[0].type"));
        let named = json!({"input": "hi", "tools": [{"type": "function", "name": "f"}],
                           "tool_choice": {"type": "function", "name": "g"}});
        assert_eq!(field(named).as_deref(), Some("tool_choice"));
    }
}
