//! The Lark grammar (llguidance's dialect) that constrains a request's tool
//! calls.
//!
//! Each tool becomes one alternative spelling its call object literally up
//! to the arguments, which are an embedded `%json` of the tool's own schema
//! (so a schema's `$ref`s stay relative to its own root), compact and in
//! the model's usual spacing (`", "`, `": "`):
//!
//! ```text
//! call_0: "{\"name\": \"get_weather\", \"arguments\": " %json {…} "}"
//! ```
//!
//! `required` / a named function: the whole output is one call (or, with
//! parallel calls, several) in the syntax's framing. `auto`, for syntaxes
//! whose calls open with a marker: free text, or free text up to the first
//! marker (a lazy lexeme that ends at it) followed by constrained calls.
//! Llama 3's bare-JSON calls have no marker to wait for, so `auto` leaves
//! its output free.

use serde_json::{json, Value};

use super::{ToolChoice, ToolSet, ToolSyntax};

/// A Lark string literal (JSON string syntax).
fn lit(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// The arguments' schema with llguidance told to write compact JSON, and
/// objects that list their properties closed to others (see
/// [`close_objects`]).
fn compact(schema: &Value) -> Value {
    let mut schema = schema.clone();
    close_objects(&mut schema, 0);
    if let Value::Object(o) = &mut schema {
        o.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// An object schema that lists `properties` but says nothing of others
/// allows any others (JSON schema's default): the model could invent keys
/// without end. A function takes the parameters it declares, so the
/// grammar closes such objects (`additionalProperties: false`), as
/// OpenAI's strict mode asks of every schema. The output still validates
/// against the schema as given.
fn close_objects(schema: &mut Value, depth: usize) {
    let Value::Object(o) = schema else {
        return;
    };
    if depth > 64 {
        return;
    }
    if o.contains_key("properties") && !o.contains_key("additionalProperties") {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    if let Some(Value::Object(props)) = o.get_mut("properties") {
        for v in props.values_mut() {
            close_objects(v, depth + 1);
        }
    }
    if let Some(items) = o.get_mut("items") {
        close_objects(items, depth + 1);
    }
    // Not `allOf`: closing each part would refuse the others' properties.
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(list)) = o.get_mut(key) {
            for v in list {
                close_objects(v, depth + 1);
            }
        }
    }
}

/// The grammar for `set`'s calls in `syntax`; `None` when the output is
/// left free (`tool_choice: none`, or `auto` without an opening marker).
pub fn grammar(set: &ToolSet, syntax: ToolSyntax) -> Option<String> {
    let tools: Vec<usize> = match &set.choice {
        ToolChoice::None => return None,
        ToolChoice::Named(name) => set
            .tools
            .iter()
            .position(|t| &t.name == name)
            .into_iter()
            .collect(),
        ToolChoice::Auto | ToolChoice::Required => (0..set.tools.len()).collect(),
    };
    let auto = set.choice == ToolChoice::Auto;
    // Further calls after the first, when parallel calls are allowed.
    let more = |sep: &str, close: &str| {
        if !set.parallel {
            String::new()
        } else if close.is_empty() {
            format!(" ({} call)*", lit(sep))
        } else {
            format!(" ({} call {})*", lit(sep), lit(close))
        }
    };
    let mut rules = Vec::new();
    let (open, calls) = match syntax {
        ToolSyntax::Hermes => {
            let close = "\n</tool_call>";
            let calls = format!(
                "{} call {}{}",
                lit("\n"),
                lit(close),
                more("\n<tool_call>\n", close)
            );
            ("<tool_call>", calls)
        }
        ToolSyntax::Mistral => {
            let calls = format!("{} call{} {}", lit(" ["), more(", ", ""), lit("]"));
            ("[TOOL_CALLS]", calls)
        }
        ToolSyntax::Llama3Json => {
            if auto {
                return None;
            }
            ("", format!("call{}", more("; ", "")))
        }
    };
    if auto {
        rules.push("start: TEXT | prose calls".to_string());
        rules.push(format!("prose[suffix={}]: /(.|\\n)*/", lit(open)));
        rules.push("TEXT: /(.|\\n)*/".to_string());
        rules.push(format!("calls: {calls}"));
    } else if open.is_empty() {
        rules.push(format!("start: {calls}"));
    } else {
        rules.push(format!("start: {} {calls}", lit(open)));
    }
    let alternatives: Vec<String> = tools.iter().map(|i| format!("call_{i}")).collect();
    rules.push(format!("call: {}", alternatives.join(" | ")));
    for &i in &tools {
        let tool = &set.tools[i];
        let head = format!(
            "{{\"name\": {}, \"{}\": ",
            Value::String(tool.name.clone()),
            syntax.arguments_key()
        );
        rules.push(format!(
            "call_{i}: {} %json {} {}",
            lit(&head),
            compact(&tool.parameters),
            lit("}")
        ));
    }
    Some(rules.join("\n"))
}
