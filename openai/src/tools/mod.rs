//! Tool calling: the functions a request offers, how the model may call
//! them, and the syntax its calls are written in.
//!
//! * [`ToolSet`] — the request's tools (OpenAI's `tools` or Anthropic's,
//!   checked up front: a bad name, schema or `tool_choice` is a 400 naming
//!   the field) and its [`ToolChoice`].
//! * [`ToolSyntax`] — how a model family writes a call: Hermes/Qwen
//!   `<tool_call>{json}</tool_call>`, Llama 3 bare JSON, Mistral
//!   `[TOOL_CALLS] [...]`. Recognised from the chat template's source, or
//!   named with `--tool-call-parser`.
//! * [`grammar`] — with `tool_choice` `required` or a named function the
//!   whole output is constrained to calls whose arguments follow each
//!   function's JSON schema (llguidance, through the request's Lark
//!   grammar), so they always parse and validate. With `auto` and a syntax
//!   that opens calls with a marker, the text before the marker is free and
//!   everything after it is constrained.
//! * [`parse`] — turns the output text, as it streams, into content and
//!   call pieces; streamed and unstreamed responses are both built from its
//!   pieces, so a stream's argument fragments reassemble byte-exactly into
//!   the unstreamed call.

pub mod grammar;
pub mod parse;

use serde_json::Value;

use crate::error::ApiError;

/// Most tools one request may offer.
pub const MAX_TOOLS: usize = 128;

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// JSON schema of the arguments (an object schema).
    pub parameters: Value,
}

/// What the request lets the model do with its tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Never call (the tools are still shown to the model).
    None,
    /// Call or answer, the model decides.
    Auto,
    /// Call at least one function.
    Required,
    /// Call this function.
    Named(String),
}

impl ToolChoice {
    /// OpenAI's `tool_choice`: `none`, `auto`, `required`, or a named
    /// function — `{"type": "function", "function": {"name"}}` (chat) or
    /// `{"type": "function", "name"}` (Responses). `None` when absent.
    pub fn from_openai(choice: Option<&Value>) -> Result<Option<Self>, ApiError> {
        match choice {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => match s.as_str() {
                "none" => Ok(Some(Self::None)),
                "auto" => Ok(Some(Self::Auto)),
                "required" => Ok(Some(Self::Required)),
                other => Err(ApiError::bad_param(
                    "tool_choice",
                    format!(
                        "tool_choice must be none, auto, required or a function, got `{other}`"
                    ),
                )),
            },
            Some(obj @ Value::Object(_)) => {
                let name = obj["function"]["name"].as_str().or(obj["name"].as_str());
                match (obj["type"].as_str(), name) {
                    (Some("function"), Some(name)) => Ok(Some(Self::Named(name.to_string()))),
                    _ => Err(ApiError::bad_param(
                        "tool_choice",
                        "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": …}}",
                    )),
                }
            }
            Some(_) => Err(ApiError::bad_param(
                "tool_choice",
                "tool_choice must be a string or an object",
            )),
        }
    }
}

/// How a model family writes its calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    /// Hermes / Qwen: `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`.
    Hermes,
    /// Llama 3.x: the output is `{"name": …, "parameters": {…}}` (calls
    /// separated by `; `), optionally after `<|python_tag|>`.
    Llama3Json,
    /// Mistral: `[TOOL_CALLS] [{"name": …, "arguments": {…}}, …]`.
    Mistral,
}

impl ToolSyntax {
    /// The syntax a chat template teaches, from its source.
    pub fn detect(template_source: &str) -> Option<Self> {
        if template_source.contains("<tool_call>") {
            Some(Self::Hermes)
        } else if template_source.contains("[TOOL_CALLS]") {
            Some(Self::Mistral)
        } else if template_source.contains("<|python_tag|>")
            || (template_source.contains("tools") && template_source.contains("\"parameters\""))
        {
            Some(Self::Llama3Json)
        } else {
            None
        }
    }

    /// The key of a call object that holds the arguments.
    pub fn arguments_key(self) -> &'static str {
        match self {
            Self::Llama3Json => "parameters",
            Self::Hermes | Self::Mistral => "arguments",
        }
    }
}

/// A request's tools and what it lets the model do with them.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSet {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// More than one call in a turn.
    pub parallel: bool,
}

impl ToolSet {
    /// From OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.
    /// `None` when the request offers no tools (then `tool_choice` may only
    /// be `none`).
    pub fn from_openai(
        tools: Option<&[Value]>,
        choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Option<Self>, ApiError> {
        let tools = tools.unwrap_or_default();
        if tools.len() > MAX_TOOLS {
            return Err(ApiError::bad_param(
                "tools",
                format!("at most {MAX_TOOLS} tools per request, got {}", tools.len()),
            ));
        }
        let tools = tools
            .iter()
            .enumerate()
            .map(|(i, t)| openai_tool(i, t))
            .collect::<Result<Vec<_>, _>>()?;
        let choice = ToolChoice::from_openai(choice)?;
        Self::new(tools, choice, parallel.unwrap_or(true), "tool_choice")
    }

    /// Checks the choice against the tools. `choice` defaults to `auto`
    /// with tools; without tools only `none` is allowed.
    pub fn new(
        tools: Vec<Tool>,
        choice: Option<ToolChoice>,
        parallel: bool,
        choice_field: &'static str,
    ) -> Result<Option<Self>, ApiError> {
        if tools.is_empty() {
            return match choice {
                None | Some(ToolChoice::None) => Ok(None),
                Some(_) => Err(ApiError::bad_param(
                    choice_field,
                    format!("{choice_field} needs tools"),
                )),
            };
        }
        for (i, t) in tools.iter().enumerate() {
            if tools[..i].iter().any(|u| u.name == t.name) {
                return Err(ApiError::bad_param(
                    "tools",
                    format!("two tools are named `{}`", t.name),
                ));
            }
        }
        let choice = choice.unwrap_or(ToolChoice::Auto);
        if let ToolChoice::Named(name) = &choice {
            if !tools.iter().any(|t| &t.name == name) {
                return Err(ApiError::bad_param(
                    choice_field,
                    format!("{choice_field} names `{name}`, which is not among the tools"),
                ));
            }
        }
        Ok(Some(Self {
            tools,
            choice,
            parallel,
        }))
    }

    /// The tools as the chat template sees them: OpenAI's function tool
    /// objects, as transformers passes them.
    pub fn template_tools(&self) -> Vec<Value> {
        self.tools
            .iter()
            .map(|t| {
                let mut function = serde_json::Map::new();
                function.insert("name".into(), Value::String(t.name.clone()));
                if let Some(d) = &t.description {
                    function.insert("description".into(), Value::String(d.clone()));
                }
                function.insert("parameters".into(), t.parameters.clone());
                serde_json::json!({"type": "function", "function": function})
            })
            .collect()
    }

    /// Whether calls are parsed from the output at all.
    pub fn may_call(&self) -> bool {
        self.choice != ToolChoice::None
    }
}

fn openai_tool(i: usize, t: &Value) -> Result<Tool, ApiError> {
    let field = |f: &str| format!("tools[{i}].{f}");
    match t["type"].as_str() {
        Some("function") => {}
        other => {
            return Err(ApiError::bad_param(
                field("type"),
                format!("tool type must be `function`, got {other:?}"),
            ))
        }
    }
    let f = &t["function"];
    if !f.is_object() {
        return Err(ApiError::bad_param(
            field("function"),
            "a function tool needs a `function` object",
        ));
    }
    tool(
        f["name"].as_str(),
        f["description"].as_str(),
        f.get("parameters"),
        &field("function.name"),
        &field("function.parameters"),
    )
}

/// One tool, checked: its name is OpenAI's `[A-Za-z0-9_-]{1,64}`, its
/// parameters an object schema whose `type`s are JSON's types.
pub fn tool(
    name: Option<&str>,
    description: Option<&str>,
    parameters: Option<&Value>,
    name_field: &str,
    parameters_field: &str,
) -> Result<Tool, ApiError> {
    let name = name.ok_or_else(|| ApiError::bad_param(name_field.to_string(), "missing"))?;
    let valid_name = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !valid_name {
        return Err(ApiError::bad_param(
            name_field.to_string(),
            format!("a tool name is 1 to 64 of a-z, A-Z, 0-9, _ and -, got `{name}`"),
        ));
    }
    let parameters = match parameters {
        None | Some(Value::Null) => serde_json::json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(o)) => {
            if o.get("type").is_some_and(|t| t != "object") {
                return Err(ApiError::bad_param(
                    parameters_field.to_string(),
                    "the parameters schema must describe an object (`\"type\": \"object\"`)",
                ));
            }
            check_schema(p).map_err(|why| {
                ApiError::bad_param(
                    parameters_field.to_string(),
                    format!("not a usable JSON schema: {why}"),
                )
            })?;
            p.clone()
        }
        Some(_) => {
            return Err(ApiError::bad_param(
                parameters_field.to_string(),
                "the parameters schema must be a JSON object",
            ))
        }
    };
    Ok(Tool {
        name: name.to_string(),
        description: description.map(str::to_string),
        parameters,
    })
}

const JSON_TYPES: [&str; 7] = [
    "string", "number", "integer", "boolean", "object", "array", "null",
];

/// The mistakes a schema's author makes: a misspelt or non-string `type`,
/// `properties` that is not an object of schemas, `required` that is not
/// a list of names. (Everything else is left to the grammar compiler.)
fn check_schema(schema: &Value) -> Result<(), String> {
    check_schema_at(schema, "", 0)
}

fn check_schema_at(schema: &Value, at: &str, depth: usize) -> Result<(), String> {
    if depth > 64 {
        return Err(format!("nested deeper than 64 at {at}"));
    }
    let Value::Object(o) = schema else {
        return match schema {
            Value::Bool(_) => Ok(()),
            _ => Err(format!("{at}: a schema is an object or a boolean")),
        };
    };
    let type_ok = |t: &Value| t.as_str().is_some_and(|s| JSON_TYPES.contains(&s));
    match o.get("type") {
        None => {}
        Some(Value::Array(ts)) if ts.iter().all(type_ok) => {}
        Some(t) if type_ok(t) => {}
        Some(t) => return Err(format!("{at}/type: {t} is not a JSON type")),
    }
    if let Some(props) = o.get("properties") {
        let Value::Object(props) = props else {
            return Err(format!("{at}/properties: must be an object"));
        };
        for (k, v) in props {
            check_schema_at(v, &format!("{at}/properties/{k}"), depth + 1)?;
        }
    }
    if let Some(req) = o.get("required") {
        let names = req.as_array().filter(|r| r.iter().all(Value::is_string));
        if names.is_none() {
            return Err(format!("{at}/required: must be a list of property names"));
        }
    }
    if let Some(items) = o.get("items") {
        check_schema_at(items, &format!("{at}/items"), depth + 1)?;
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(list) = o.get(key) {
            let Value::Array(list) = list else {
                return Err(format!("{at}/{key}: must be a list of schemas"));
            };
            for (i, s) in list.iter().enumerate() {
                check_schema_at(s, &format!("{at}/{key}/{i}"), depth + 1)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather now",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}}})
    }

    #[test]
    fn reads_openai_tools_and_choices() {
        let tools = [weather()];
        let set = ToolSet::from_openai(Some(&tools), None, None)
            .expect("valid")
            .expect("some");
        assert_eq!(set.choice, ToolChoice::Auto);
        assert!(set.parallel);
        assert_eq!(set.template_tools(), vec![weather()]);
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let set = ToolSet::from_openai(Some(&tools), Some(&named), Some(false))
            .expect("valid")
            .expect("some");
        assert_eq!(set.choice, ToolChoice::Named("get_weather".into()));
        assert!(ToolSet::from_openai(None, Some(&json!("none")), None)
            .expect("none without tools is fine")
            .is_none());
    }

    #[test]
    fn bad_tools_name_their_field() {
        let field = |tools: Vec<Value>, choice: Option<Value>| {
            ToolSet::from_openai(Some(&tools), choice.as_ref(), None)
                .expect_err("refused")
                .param
                .map(|p| p.into_owned())
        };
        let mut bad_type = weather();
        bad_type["function"]["parameters"]["properties"]["city"]["type"] = json!("strnig");
        assert_eq!(
            field(vec![bad_type], None).as_deref(),
            Some("tools[0].function.parameters")
        );
        let mut bad_name = weather();
        bad_name["function"]["name"] = json!("get weather");
        assert_eq!(
            field(vec![weather(), bad_name], None).as_deref(),
            Some("tools[1].function.name")
        );
        let mut not_object = weather();
        not_object["function"]["parameters"] = json!([1]);
        assert_eq!(
            field(vec![not_object], None).as_deref(),
            Some("tools[0].function.parameters")
        );
        assert_eq!(
            field(vec![json!({"type": "retrieval"})], None).as_deref(),
            Some("tools[0].type")
        );
        let unknown = json!({"type": "function", "function": {"name": "get_time"}});
        assert_eq!(
            field(vec![weather()], Some(unknown)).as_deref(),
            Some("tool_choice")
        );
        assert_eq!(
            field(vec![weather()], Some(json!("sometimes"))).as_deref(),
            Some("tool_choice")
        );
        assert_eq!(
            field(vec![], Some(json!("required"))).as_deref(),
            Some("tool_choice")
        );
        assert_eq!(
            field(vec![weather(), weather()], None).as_deref(),
            Some("tools")
        );
    }

    #[test]
    fn detects_the_syntax_from_the_template() {
        assert_eq!(
            ToolSyntax::detect("{{ '<tool_call>\\n' }}"),
            Some(ToolSyntax::Hermes)
        );
        assert_eq!(
            ToolSyntax::detect("[TOOL_CALLS] "),
            Some(ToolSyntax::Mistral)
        );
        assert_eq!(
            ToolSyntax::detect("<|python_tag|>"),
            Some(ToolSyntax::Llama3Json)
        );
        assert_eq!(
            ToolSyntax::detect(tandem_engine::synth::CHAT_TEMPLATE),
            None
        );
    }
}
