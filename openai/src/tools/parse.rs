//! Splitting a choice's output text, as it streams, into reasoning, content
//! and tool calls.
//!
//! [`OutputParser::push`] takes each text delta and returns the [`Piece`]s
//! it completes; text that might be the start of a marker (`<think>`,
//! `</think>`, `<tool_call>`, …) is held back until it is known not to be.
//! A call is reported as [`Piece::CallStart`] once its `name` is read, then
//! as [`Piece::CallArguments`] fragments: the raw bytes of its arguments
//! value as they arrive, so the fragments concatenate to exactly the text
//! the model wrote. Nothing is ever re-parsed or re-serialised, and nothing
//! fails mid-stream: text that turns out not to be a call is content.

use super::ToolSyntax;

/// What a request's output is parsed for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutputFormat {
    /// Split `open … close` reasoning from the content.
    pub reasoning: Option<ReasoningMarkers>,
    /// Parse tool calls written in this syntax.
    pub tools: Option<ToolSyntax>,
}

/// A reasoning model's markers, e.g. `<think>` / `</think>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReasoningMarkers {
    pub open: String,
    pub close: String,
    /// The prompt already opened the reasoning (the template ends its
    /// generation prompt with `open`), so the output starts inside it.
    pub starts_inside: bool,
}

impl ReasoningMarkers {
    /// `<think>` / `</think>` (Qwen3, DeepSeek-R1), when the template uses
    /// them; inside from the start when `prompt` ends with `<think>`.
    pub fn think(prompt: &str) -> Self {
        Self {
            open: "<think>".into(),
            close: "</think>".into(),
            starts_inside: prompt.trim_end().ends_with("<think>"),
        }
    }
}

/// One parsed piece of a choice's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Content(String),
    Reasoning(String),
    /// Call `index` (0-based within the choice) to function `name` begins.
    CallStart {
        index: usize,
        name: String,
    },
    /// More bytes of call `index`'s arguments.
    CallArguments {
        index: usize,
        fragment: String,
    },
}

/// The longest suffix of `text` that is a proper prefix of `marker`, as a
/// byte index into `text` where it starts.
fn held_from(text: &str, marker: &str) -> usize {
    let max = marker.len().saturating_sub(1).min(text.len());
    (1..=max)
        .rev()
        .find(|&k| {
            text.is_char_boundary(text.len() - k) && marker.starts_with(&text[text.len() - k..])
        })
        .map_or(text.len(), |k| text.len() - k)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reasoning {
    /// At the start: the open marker may still come.
    Start,
    Inside,
    /// Just closed: newlines before the content are dropped.
    JustClosed,
    Done,
}

/// The parser of one choice's output.
#[derive(Debug)]
pub struct OutputParser {
    markers: Option<ReasoningMarkers>,
    reasoning: Reasoning,
    pending: String,
    calls: Option<CallParser>,
}

impl OutputParser {
    pub fn new(format: &OutputFormat) -> Self {
        let reasoning = match &format.reasoning {
            None => Reasoning::Done,
            Some(m) if m.starts_inside => Reasoning::Inside,
            Some(_) => Reasoning::Start,
        };
        Self {
            markers: format.reasoning.clone(),
            reasoning,
            pending: String::new(),
            calls: format.tools.map(CallParser::new),
        }
    }

    /// Calls completed so far.
    pub fn completed_calls(&self) -> usize {
        self.calls.as_ref().map_or(0, |c| c.completed)
    }

    /// The pieces `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        self.pending.push_str(text);
        self.split_reasoning(&mut out, false);
        out
    }

    /// The pieces held back at the end of the output.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.split_reasoning(&mut out, true);
        if let Some(c) = &mut self.calls {
            c.finish(&mut out);
        }
        out
    }

    fn split_reasoning(&mut self, out: &mut Vec<Piece>, end: bool) {
        loop {
            let Some(m) = &self.markers else {
                self.reasoning = Reasoning::Done;
                break;
            };
            match self.reasoning {
                Reasoning::Start => {
                    let lead = self.pending.trim_start();
                    if lead.starts_with(m.open.as_str()) {
                        let at = self.pending.len() - lead.len() + m.open.len();
                        self.pending.drain(..at);
                        self.reasoning = Reasoning::Inside;
                    } else if m.open.starts_with(lead) && !end {
                        return; // maybe the marker, not yet whole
                    } else {
                        self.reasoning = Reasoning::Done;
                    }
                }
                Reasoning::Inside => match self.pending.find(m.close.as_str()) {
                    Some(at) => {
                        let thought: String = self.pending.drain(..at).collect();
                        self.pending.drain(..m.close.len());
                        if !thought.is_empty() {
                            out.push(Piece::Reasoning(thought));
                        }
                        self.reasoning = Reasoning::JustClosed;
                    }
                    None => {
                        let keep = if end {
                            self.pending.len()
                        } else {
                            held_from(&self.pending, &m.close)
                        };
                        let thought: String = self.pending.drain(..keep).collect();
                        if !thought.is_empty() {
                            out.push(Piece::Reasoning(thought));
                        }
                        return;
                    }
                },
                Reasoning::JustClosed => {
                    let lead = self.pending.trim_start_matches('\n');
                    let dropped = self.pending.len() - lead.len();
                    self.pending.drain(..dropped);
                    if self.pending.is_empty() && !end {
                        return;
                    }
                    self.reasoning = Reasoning::Done;
                }
                Reasoning::Done => break,
            }
        }
        let text = std::mem::take(&mut self.pending);
        match &mut self.calls {
            Some(c) => c.push(&text, out),
            None if text.is_empty() => {}
            None => out.push(Piece::Content(text)),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallState {
    /// Free text; a call may open.
    Text,
    /// After an opening marker or separator: a call object must begin.
    Open,
    /// Inside a call object.
    Object,
    /// After a call object: its framing closes or the next one follows.
    After,
}

/// Finds calls in content text.
#[derive(Debug)]
struct CallParser {
    syntax: ToolSyntax,
    state: CallState,
    buf: String,
    /// The marker text that opened the current call region, given back as
    /// content when no call follows it.
    opened_with: String,
    object: ObjectScan,
    /// Calls started (a name was read).
    started: usize,
    completed: usize,
    /// Llama 3's calls are the whole output: only its start may open one.
    at_start: bool,
}

impl CallParser {
    fn new(syntax: ToolSyntax) -> Self {
        Self {
            syntax,
            state: CallState::Text,
            buf: String::new(),
            opened_with: String::new(),
            object: ObjectScan::new(syntax.arguments_key()),
            started: 0,
            completed: 0,
            at_start: true,
        }
    }

    fn marker(&self) -> &'static str {
        match self.syntax {
            ToolSyntax::Hermes => "<tool_call>",
            ToolSyntax::Mistral => "[TOOL_CALLS]",
            ToolSyntax::Llama3Json => "<|python_tag|>",
        }
    }

    fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        self.buf.push_str(text);
        while self.step(out) {}
    }

    /// One state transition over the buffer; false when it needs more text.
    fn step(&mut self, out: &mut Vec<Piece>) -> bool {
        match self.state {
            CallState::Text => self.step_text(out),
            CallState::Open => {
                let lead = self.buf.trim_start();
                let skipped = self.buf.len() - lead.len();
                if lead.is_empty() {
                    false
                } else if lead.starts_with('[') && self.syntax == ToolSyntax::Mistral {
                    self.opened_with.push_str(&self.buf[..skipped + 1]);
                    self.buf.drain(..skipped + 1);
                    true
                } else if lead.starts_with('{') {
                    self.opened_with.push_str(&self.buf[..skipped]);
                    self.buf.drain(..skipped);
                    self.object = ObjectScan::new(self.syntax.arguments_key());
                    self.state = CallState::Object;
                    true
                } else {
                    // Not a call after all: the marker was content.
                    let text = std::mem::take(&mut self.opened_with);
                    out.push(Piece::Content(text));
                    self.state = CallState::Text;
                    true
                }
            }
            CallState::Object => {
                let text = std::mem::take(&mut self.buf);
                let used = self.object.feed(&text);
                self.emit_call(out);
                self.buf = text[used..].to_string();
                if self.object.complete {
                    if self.object.started {
                        self.completed += 1;
                        self.state = CallState::After;
                    } else {
                        // No name: not a call, and what follows is text.
                        let mut text = std::mem::take(&mut self.opened_with);
                        text.push_str(&self.object.raw);
                        out.push(Piece::Content(text));
                        self.state = CallState::Text;
                    }
                    self.opened_with.clear();
                    return true;
                }
                false
            }
            CallState::After => self.step_after(),
        }
    }

    fn step_text(&mut self, out: &mut Vec<Piece>) -> bool {
        if self.completed > 0 || self.started > 0 {
            // Whitespace between calls is framing, not content.
            let lead = self.buf.trim_start();
            let skipped = self.buf.len() - lead.len();
            if lead.is_empty() {
                return false;
            }
            self.buf.drain(..skipped);
        }
        let marker = self.marker();
        if self.syntax == ToolSyntax::Llama3Json {
            if !self.at_start {
                let text = std::mem::take(&mut self.buf);
                if !text.is_empty() {
                    out.push(Piece::Content(text));
                }
                return false;
            }
            let lead = self.buf.trim_start();
            if lead.is_empty() || (marker.starts_with(lead) && lead != marker) {
                return false;
            }
            self.at_start = false;
            let skipped = self.buf.len() - lead.len();
            let open = if lead.starts_with(marker) {
                skipped + marker.len()
            } else if lead.starts_with('{') {
                skipped
            } else {
                return true; // plain text: Text state, no longer at the start
            };
            self.opened_with = self.buf.drain(..open).collect();
            self.state = CallState::Open;
            return true;
        }
        match self.buf.find(marker) {
            Some(at) => {
                let text: String = self.buf.drain(..at).collect();
                if !text.is_empty() {
                    out.push(Piece::Content(text));
                }
                self.opened_with = self.buf.drain(..marker.len()).collect();
                self.state = CallState::Open;
                true
            }
            None => {
                let keep = held_from(&self.buf, marker);
                let text: String = self.buf.drain(..keep).collect();
                if !text.is_empty() {
                    out.push(Piece::Content(text));
                }
                false
            }
        }
    }

    fn step_after(&mut self) -> bool {
        let lead = self.buf.trim_start();
        let skipped = self.buf.len() - lead.len();
        let (sep, close): (&[&str], &str) = match self.syntax {
            ToolSyntax::Hermes => (&[], "</tool_call>"),
            ToolSyntax::Mistral => (&[","], "]"),
            ToolSyntax::Llama3Json => (&[";"], ""),
        };
        if lead.is_empty() {
            return false;
        }
        if let Some(s) = sep.iter().find(|s| lead.starts_with(**s)) {
            self.buf.drain(..skipped + s.len());
            self.state = CallState::Open;
            return true;
        }
        if !close.is_empty() {
            if lead.starts_with(close) {
                self.buf.drain(..skipped + close.len());
                self.state = CallState::Text;
                return true;
            }
            if close.starts_with(lead) {
                return false;
            }
        }
        self.state = CallState::Text;
        true
    }

    /// Reports the current object's name and new argument bytes.
    fn emit_call(&mut self, out: &mut Vec<Piece>) {
        let o = &mut self.object;
        if !o.started {
            let Some(name) = o.name.clone() else {
                return;
            };
            o.started = true;
            self.started += 1;
            out.push(Piece::CallStart {
                index: self.started - 1,
                name,
            });
        }
        if let Some((start, end)) = o.args {
            let end = end.unwrap_or(o.raw.len());
            let from = o.args_emitted.max(start);
            if end > from {
                out.push(Piece::CallArguments {
                    index: self.started - 1,
                    fragment: o.raw[from..end].to_string(),
                });
                o.args_emitted = end;
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<Piece>) {
        let mut rest = String::new();
        match self.state {
            CallState::Text | CallState::Open => rest.push_str(&self.opened_with),
            CallState::Object if !self.object.started => {
                rest.push_str(&self.opened_with);
                rest.push_str(&self.object.raw);
            }
            CallState::Object | CallState::After => {}
        }
        if self.state == CallState::Text || self.state == CallState::Open {
            rest.push_str(&self.buf);
        }
        self.buf.clear();
        self.opened_with.clear();
        if !rest.is_empty() {
            out.push(Piece::Content(rest));
        }
    }
}

/// Where a call object's top level is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Key,
    Colon,
    Value,
    Comma,
}

/// An incremental scan of one JSON call object: its `name` and the byte
/// span of its arguments value, found without parsing the rest.
#[derive(Debug)]
struct ObjectScan {
    args_key: &'static str,
    raw: String,
    depth: usize,
    in_string: bool,
    escape: bool,
    slot: Slot,
    /// Start of the top-level string or value being read.
    token_start: usize,
    key: Option<String>,
    /// A top-level scalar value is being read.
    in_scalar: bool,
    name: Option<String>,
    /// Arguments value: start, and end once closed.
    args: Option<(usize, Option<usize>)>,
    args_emitted: usize,
    started: bool,
    complete: bool,
}

impl ObjectScan {
    fn new(args_key: &'static str) -> Self {
        Self {
            args_key,
            raw: String::new(),
            depth: 0,
            in_string: false,
            escape: false,
            slot: Slot::Key,
            token_start: 0,
            key: None,
            in_scalar: false,
            name: None,
            args: None,
            args_emitted: 0,
            started: false,
            complete: false,
        }
    }

    fn key_is_args(&self) -> bool {
        self.key.as_deref() == Some(self.args_key)
    }

    /// Consumes `text` up to the end of the object; returns the bytes used.
    fn feed(&mut self, text: &str) -> usize {
        for (i, c) in text.char_indices() {
            let at = self.raw.len();
            self.raw.push(c);
            self.char(at, c);
            if self.complete {
                return i + c.len_utf8();
            }
        }
        text.len()
    }

    fn end_value(&mut self, end: usize) {
        if self.key_is_args() {
            if let Some((start, None)) = self.args {
                self.args = Some((start, Some(end)));
            }
        }
        self.in_scalar = false;
        self.slot = Slot::Comma;
    }

    fn char(&mut self, at: usize, c: char) {
        if self.in_string {
            if self.escape {
                self.escape = false;
            } else if c == '\\' {
                self.escape = true;
            } else if c == '"' {
                self.in_string = false;
                if self.depth == 1 {
                    let token = &self.raw[self.token_start..=at];
                    let decoded = serde_json::from_str::<String>(token).ok();
                    match self.slot {
                        Slot::Key => {
                            self.key = decoded;
                            self.slot = Slot::Colon;
                        }
                        Slot::Value => {
                            if self.key.as_deref() == Some("name") {
                                self.name = decoded;
                            }
                            self.end_value(at + 1);
                        }
                        Slot::Colon | Slot::Comma => {}
                    }
                }
            }
            return;
        }
        if self.depth == 1 && self.in_scalar && matches!(c, ',' | '}' | ' ' | '\n' | '\t' | '\r') {
            self.end_value(at);
        }
        match c {
            '"' => {
                self.in_string = true;
                if self.depth == 1 {
                    self.token_start = at;
                    if self.slot == Slot::Value && self.key_is_args() {
                        self.args = Some((at, None));
                    }
                }
            }
            '{' | '[' => {
                if self.depth == 1 && self.slot == Slot::Value && self.key_is_args() {
                    self.args = Some((at, None));
                }
                self.depth += 1;
            }
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                if self.depth == 1 {
                    self.end_value(at + 1);
                } else if self.depth == 0 {
                    self.complete = true;
                }
            }
            ':' if self.depth == 1 => self.slot = Slot::Value,
            ',' if self.depth == 1 => self.slot = Slot::Key,
            c if self.depth == 1
                && self.slot == Slot::Value
                && !c.is_whitespace()
                && !self.in_scalar =>
            {
                self.in_scalar = true;
                if self.key_is_args() {
                    self.args = Some((at, None));
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` in pieces of `step` bytes (at char boundaries) and
    /// returns (content, reasoning, calls as (name, arguments)).
    fn run(
        format: &OutputFormat,
        text: &str,
        step: usize,
    ) -> (String, String, Vec<(String, String)>) {
        let mut p = OutputParser::new(format);
        let mut pieces = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let mut cut = step.min(rest.len());
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            pieces.extend(p.push(&rest[..cut]));
            rest = &rest[cut..];
        }
        pieces.extend(p.finish());
        let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
        for piece in pieces {
            match piece {
                Piece::Content(t) => content.push_str(&t),
                Piece::Reasoning(t) => reasoning.push_str(&t),
                Piece::CallStart { index, name } => {
                    assert_eq!(index, calls.len());
                    calls.push((name, String::new()));
                }
                Piece::CallArguments { index, fragment } => calls[index].1.push_str(&fragment),
            }
        }
        (content, reasoning, calls)
    }

    fn tools(syntax: ToolSyntax) -> OutputFormat {
        OutputFormat {
            reasoning: None,
            tools: Some(syntax),
        }
    }

    fn call(name: &str, args: &str) -> (String, String) {
        (name.to_string(), args.to_string())
    }

    #[test]
    fn hermes_calls_in_any_chunking() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa}ri\\\"s\", \"n\": [1, {}]}}\n</tool_call>\n<tool_call>\n{\"arguments\": {}, \"name\": \"now\"}\n</tool_call>";
        for step in [1, 2, 3, 7, 1000] {
            let (content, _, calls) = run(&tools(ToolSyntax::Hermes), text, step);
            assert_eq!(content, "Let me check.\n", "step {step}");
            assert_eq!(
                calls,
                vec![
                    call("get_weather", "{\"city\": \"Pa}ri\\\"s\", \"n\": [1, {}]}"),
                    call("now", "{}")
                ],
                "step {step}"
            );
        }
    }

    #[test]
    fn text_that_is_not_a_call_stays_content() {
        for text in [
            "a <tool_ca",
            "a <tool_call> oops",
            "x <tool_call>\n{\"city\": 1}\n</tool_call>",
            "plain < text",
        ] {
            for step in [1, 4, 100] {
                let (content, _, calls) = run(&tools(ToolSyntax::Hermes), text, step);
                assert_eq!(content, text, "step {step}");
                assert!(calls.is_empty());
            }
        }
    }

    #[test]
    fn a_call_cut_off_keeps_what_arrived() {
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"bc";
        let (content, _, calls) = run(&tools(ToolSyntax::Hermes), text, 3);
        assert_eq!(content, "");
        assert_eq!(calls, vec![call("f", "{\"a\": \"bc")]);
    }

    #[test]
    fn mistral_and_llama3_calls() {
        let text = "[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": {}}]";
        for step in [1, 5, 1000] {
            let (content, _, calls) = run(&tools(ToolSyntax::Mistral), text, step);
            assert_eq!(content, "");
            assert_eq!(calls, vec![call("a", "{\"x\": 1}"), call("b", "{}")]);
        }
        let text = "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": true}}; {\"name\": \"b\", \"parameters\": {}}";
        for step in [1, 5, 1000] {
            let (content, _, calls) = run(&tools(ToolSyntax::Llama3Json), text, step);
            assert_eq!(content, "");
            assert_eq!(calls, vec![call("a", "{\"x\": true}"), call("b", "{}")]);
        }
        let (content, _, calls) = run(&tools(ToolSyntax::Llama3Json), "Hi {\"name\"", 2);
        assert_eq!((content.as_str(), calls.len()), ("Hi {\"name\"", 0));
    }

    #[test]
    fn reasoning_is_split_from_content_and_calls() {
        let format = OutputFormat {
            reasoning: Some(ReasoningMarkers::think("")),
            tools: Some(ToolSyntax::Hermes),
        };
        let text = "<think>\nweigh it</think>\n\nSure.<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        for step in [1, 3, 1000] {
            let (content, reasoning, calls) = run(&format, text, step);
            assert_eq!(reasoning, "\nweigh it");
            assert_eq!(content, "Sure.");
            assert_eq!(calls, vec![call("f", "{}")]);
        }
        let inside = OutputFormat {
            reasoning: Some(ReasoningMarkers::think("<|im_start|>assistant\n<think>\n")),
            tools: None,
        };
        let (content, reasoning, _) = run(&inside, "hmm</think>ok", 2);
        assert_eq!((content.as_str(), reasoning.as_str()), ("ok", "hmm"));
        let (content, reasoning, _) = run(&format, "no thinking <think>", 2);
        assert_eq!(
            (content.as_str(), reasoning.as_str()),
            ("no thinking <think>", "")
        );
        let (content, reasoning, _) = run(&format, "<thi", 1);
        assert_eq!((content.as_str(), reasoning.as_str()), ("<thi", ""));
    }
}
