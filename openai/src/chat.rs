//! Chat templates: a model's `chat_template` (Jinja, from
//! `tokenizer_config.json`) rendered with minijinja the way Hugging Face
//! renders it (`trim_blocks`, `lstrip_blocks`, Python string methods,
//! `raise_exception`).
//!
//! The rendered text already spells out the template's special tokens, so
//! it is tokenized without adding any (as vLLM and transformers'
//! `apply_chat_template` do).
//!
//! Tools reach the template as transformers passes them: `tools` is the
//! list of `{"type": "function", "function": {...}}` objects, an assistant
//! turn's calls are `message.tool_calls`, a tool's answer is a `tool`
//! message with `tool_call_id`. `tojson` is transformers' (Python's
//! `json.dumps` with `ensure_ascii=False`: `", "` and `": "` separators,
//! keys in the given order), not minijinja's HTML-safe one, so a tool
//! schema is spelled in the prompt the way the model saw it in training.

use std::path::Path;

use minijinja::{Environment, ErrorKind};
use serde::Serialize;

/// Why a template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("reading {path}: {message}")]
    Config { path: String, message: String },
    #[error("chat template: {0}")]
    Template(#[from] minijinja::Error),
}

/// One chat message, its content already flattened to text. The optional
/// fields are absent from the template's view (Jinja `is defined` is
/// false) when `None`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant turn's tool calls, in OpenAI's shape
    /// (`{"id", "type": "function", "function": {"name", "arguments"}}`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` message: the call it answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A `tool` message: the function's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's reasoning, for templates that replay it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl Message {
    /// A plain text message.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            ..Self::default()
        }
    }
}

/// A compiled chat template and the special tokens it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`.
    pub fn new(
        source: &str,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, _> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", python_tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The template of the checkpoint in `dir`: `tokenizer_config.json`'s
    /// `chat_template` (a string, or a list of named templates of which
    /// `default` is taken), else a `chat_template.jinja` file. `None` when
    /// the checkpoint has neither.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>, ChatTemplateError> {
        Self::from_model_dir_with(dir, None)
    }

    /// As [`ChatTemplate::from_model_dir`], with `source` (a template a
    /// user supplied, vLLM's `--chat-template`) in place of the
    /// checkpoint's; the special tokens still come from the checkpoint.
    pub fn from_model_dir_with(
        dir: &Path,
        source: Option<&str>,
    ) -> Result<Option<Self>, ChatTemplateError> {
        if tandem_gguf::is_gguf(dir) {
            return Self::from_gguf(dir, source);
        }
        let path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| ChatTemplateError::Config {
                path: path.display().to_string(),
                message: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => {
                return Err(ChatTemplateError::Config {
                    path: path.display().to_string(),
                    message: e.to_string(),
                })
            }
        };
        let source = match (source, &config["chat_template"]) {
            (Some(s), _) => Some(s.to_string()),
            (None, checkpoint) => Self::checkpoint_source(dir, checkpoint),
        };
        let Some(source) = source else {
            return Ok(None);
        };
        Self::new(
            &source,
            special_token(&config["bos_token"]),
            special_token(&config["eos_token"]),
        )
        .map(Some)
    }

    /// A GGUF file's template (`tokenizer.chat_template`) and its BOS and
    /// EOS tokens' text.
    fn from_gguf(path: &Path, source: Option<&str>) -> Result<Option<Self>, ChatTemplateError> {
        use tandem_gguf::Value;
        let g = tandem_gguf::Gguf::open(path).map_err(|e| ChatTemplateError::Config {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let template = g.get("tokenizer.chat_template").and_then(Value::as_str);
        let Some(source) = source.or(template) else {
            return Ok(None);
        };
        let tokens = g.get("tokenizer.ggml.tokens").and_then(Value::as_array);
        let token = |key: &str| -> String {
            let id = g.get(key).and_then(Value::as_u64);
            id.and_then(|id| tokens?.get(usize::try_from(id).ok()?)?.as_str())
                .unwrap_or_default()
                .to_string()
        };
        Self::new(
            source,
            token("tokenizer.ggml.bos_token_id"),
            token("tokenizer.ggml.eos_token_id"),
        )
        .map(Some)
    }

    fn checkpoint_source(dir: &Path, config: &serde_json::Value) -> Option<String> {
        match config {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(named) => named
                .iter()
                .find(|t| t["name"] == "default")
                .or_else(|| named.first())
                .and_then(|t| t["template"].as_str())
                .map(str::to_string),
            _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        }
    }

    /// The template's Jinja source (tool-call and reasoning syntax are
    /// recognised from it).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`, ending with the assistant's turn opened when
    /// `add_generation_prompt` is set.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Renders `messages` with `tools` (OpenAI's function tool objects)
    /// defined for the template when given.
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let template = self.env.get_template(TEMPLATE_NAME)?;
        Ok(template.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })?)
    }
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent)`.
fn python_tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_python_json(&json, indent, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

/// Python's `json.dumps` layout: `", "`/`": "` separators inline, `","` and
/// newlines with an indent; non-ASCII characters kept as they are.
fn write_python_json(v: &serde_json::Value, indent: Option<usize>, level: usize, out: &mut String) {
    use serde_json::Value;
    let newline = |out: &mut String, level: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', width * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                write_python_json(item, indent, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                write_python_json(item, indent, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
        // Scalars and empty containers: serde_json's spelling is Python's
        // (`[]`, `{}`, `true`, `null`, strings with `\"` escapes).
        other => out.push_str(&other.to_string()),
    }
}

/// `bos_token` / `eos_token` are a string or an added-token object.
fn special_token(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> Message {
        Message::text(role, content)
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let t = ChatTemplate::new(
            "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}",
            "",
            "",
        )
        .expect("compiles");
        let tools = [serde_json::json!({"name": "f", "parameters": {"b": [1, "é<"], "a": {}}})];
        let text = t
            .render_with_tools(&[], Some(&tools), false)
            .expect("renders");
        assert_eq!(
            text,
            "[{\"name\": \"f\", \"parameters\": {\"b\": [1, \"é<\"], \"a\": {}}}]|{\n  \"name\": \"f\",\n  \"parameters\": {\n    \"b\": [\n      1,\n      \"é<\"\n    ],\n    \"a\": {}\n  }\n}"
        );
    }

    #[test]
    fn renders_the_generated_models_template() {
        let t = ChatTemplate::new(tandem_engine::synth::CHAT_TEMPLATE, "<s>", "</s>")
            .expect("compiles");
        let text = t
            .render(&[msg("system", "be brief"), msg("user", "hi")], true)
            .expect("renders");
        assert_eq!(text, "<s>system: be brief</s>\nuser: hi</s>\nassistant:");
        let text = t.render(&[msg("user", "hi")], false).expect("renders");
        assert_eq!(text, "<s>user: hi</s>\n");
    }

    /// The Qwen2/ChatML style: Python string methods, `raise_exception`,
    /// loop variables and whitespace control.
    #[test]
    fn renders_hugging_face_style_templates() {
        let src = "{% for message in messages %}{% if message.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + message.role) }}{% endif %}\
                   {{ '<|im_start|>' + message['role'] + '\\n' + message['content'].strip() + '<|im_end|>' + '\\n' }}{% endfor %}\
                   {% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
        let t = ChatTemplate::new(src, "", "<|im_end|>").expect("compiles");
        let text = t.render(&[msg("user", "  hello ")], true).expect("renders");
        assert_eq!(
            text,
            "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
        );
        let err = t
            .render(&[msg("wizard", "x")], true)
            .expect_err("raise_exception fails the render");
        assert!(err.to_string().contains("bad role wizard"), "{err}");
    }

    /// A GGUF file's embedded template (llama.cpp's converter copied it
    /// from the checkpoint's tokenizer_config.json) renders as the
    /// checkpoint's own.
    #[test]
    fn loads_a_gguf_files_template() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let from_gguf =
            ChatTemplate::from_model_dir(&root.join("tests/fixtures/gguf/shakespeare_vocab.gguf"))
                .expect("loads")
                .expect("the file carries a template");
        let from_dir = ChatTemplate::from_model_dir(&root.join("models/shakespeare-target"))
            .expect("loads")
            .expect("has a template");
        let chat = [msg("system", "be brief"), msg("user", "who art thou?")];
        assert_eq!(
            from_gguf.render(&chat, true).expect("renders"),
            from_dir.render(&chat, true).expect("renders")
        );
        assert!(
            ChatTemplate::from_model_dir(&root.join("tests/fixtures/gguf/llama_gqa_f32.gguf"))
                .expect("loads")
                .is_none()
        );
    }

    #[test]
    fn loads_from_tokenizer_config() {
        let dir = std::env::temp_dir().join(format!("tandem-chat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        assert!(ChatTemplate::from_model_dir(&dir).expect("ok").is_none());
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "<B>"}, "eos_token": "<E>",
                "chat_template": [{"name": "tool_use", "template": "x"},
                                  {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}]}"#,
        )
        .expect("write");
        let t = ChatTemplate::from_model_dir(&dir)
            .expect("loads")
            .expect("has a template");
        assert_eq!(
            t.render(&[msg("user", "q")], true).expect("renders"),
            "<B>q<E>"
        );
        std::fs::write(dir.join("tokenizer_config.json"), "{not json").expect("write");
        assert!(ChatTemplate::from_model_dir(&dir).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
