//! The tool-call grammars compiled by llguidance over a real (generated)
//! byte-level vocabulary, followed token by token without a model: random
//! walks over the allowed tokens always end in calls that the output parser
//! reads back and whose arguments validate against the tool's schema; a
//! model's call text is accepted; with `auto`, free text is free until the
//! call marker and constrained after it.

use std::sync::Arc;

use serde_json::{json, Value};
use tandem_engine::tokenizer::Tokenizer;
use tandem_engine::{synth, Checkpoint, DType};
use tandem_openai::tools::parse::{OutputFormat, OutputParser, Piece};
use tandem_openai::tools::{grammar::grammar, ToolSet, ToolSyntax};
use tandem_structured::{CompiledGrammar, GrammarCompiler, ResponseFormat, Vocabulary};

struct Fixture {
    _dir: tempfile::TempDir,
    tokenizer: Tokenizer,
    vocab: Vocabulary,
    compiler: GrammarCompiler,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    synth::preset("tiny")
        .expect("preset")
        .write(dir.path(), 1, DType::F32)
        .expect("write");
    let ck = Checkpoint::open(dir.path()).expect("open");
    let tokenizer = Tokenizer::from_file(&dir.path().join("tokenizer.json")).expect("tokenizer");
    let vocab =
        Vocabulary::from_tokenizer(tokenizer.hf(), 512, &ck.eos_token_ids).expect("vocabulary");
    let compiler = GrammarCompiler::new(&vocab, 8).expect("compiler");
    Fixture {
        _dir: dir,
        tokenizer,
        vocab,
        compiler,
    }
}

fn weather_schema() -> Value {
    json!({"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": false})
}

fn tools(choice: Value, parallel: bool) -> ToolSet {
    let list = [
        json!({"type": "function", "function": {"name": "get_weather", "parameters": weather_schema()}}),
        json!({"type": "function", "function": {"name": "get_time",
               "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                              "required": ["tz"], "additionalProperties": false}}}),
    ];
    ToolSet::from_openai(Some(&list), Some(&choice), Some(parallel))
        .expect("valid")
        .expect("tools")
}

fn compile(f: &Fixture, set: &ToolSet, syntax: ToolSyntax) -> Arc<CompiledGrammar> {
    let lark = grammar(set, syntax).expect("a grammar");
    f.compiler
        .compile(&ResponseFormat::Grammar(lark.clone()))
        .unwrap_or_else(|e| panic!("{e}\n{lark}"))
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// Random allowed tokens until the grammar stops or EOS is drawn.
fn walk(f: &Fixture, g: &Arc<CompiledGrammar>, rng: &mut Rng) -> Option<String> {
    let mut c = g.start();
    let mut bytes = Vec::new();
    for _ in 0..600 {
        c.compute_mask().expect("mask");
        let allowed = c.mask().expect("mask").allowed_tokens();
        let t = allowed[rng.below(allowed.len())];
        let stopped = c.commit(t).expect("commit").stopped;
        if f.vocab.eos().contains(&t) {
            return Some(String::from_utf8(bytes).expect("utf-8"));
        }
        bytes.extend_from_slice(f.vocab.token_bytes(t));
        if stopped {
            return Some(String::from_utf8(bytes).expect("utf-8"));
        }
    }
    None
}

/// (content, calls) as the output parser reads `text`.
fn parse(syntax: ToolSyntax, text: &str) -> (String, Vec<(String, String)>) {
    let mut p = OutputParser::new(&OutputFormat {
        reasoning: None,
        tools: Some(syntax),
    });
    let mut pieces = p.push(text);
    pieces.extend(p.finish());
    let (mut content, mut calls) = (String::new(), Vec::<(String, String)>::new());
    for piece in pieces {
        match piece {
            Piece::Content(t) => content.push_str(&t),
            Piece::CallStart { name, .. } => calls.push((name, String::new())),
            Piece::CallArguments { index, fragment } => calls[index].1.push_str(&fragment),
            Piece::Reasoning(_) => unreachable!(),
        }
    }
    (content, calls)
}

#[test]
fn required_and_named_calls_always_parse_and_validate() {
    let f = fixture();
    let weather = jsonschema::validator_for(&weather_schema()).expect("schema");
    for syntax in [
        ToolSyntax::Hermes,
        ToolSyntax::Mistral,
        ToolSyntax::Llama3Json,
    ] {
        for (choice, parallel) in [
            (json!("required"), false),
            (json!("required"), true),
            (
                json!({"type": "function", "function": {"name": "get_weather"}}),
                false,
            ),
        ] {
            let set = tools(choice.clone(), parallel);
            let g = compile(&f, &set, syntax);
            let mut rng = Rng(11);
            let mut ended = 0;
            for _ in 0..20 {
                let Some(text) = walk(&f, &g, &mut rng) else {
                    continue;
                };
                ended += 1;
                let (content, calls) = parse(syntax, &text);
                assert!(
                    content.trim().is_empty(),
                    "{syntax:?}: content {content:?} in {text:?}"
                );
                assert!(!calls.is_empty(), "{syntax:?}: no call in {text:?}");
                assert!(parallel || calls.len() == 1, "{text:?}");
                for (name, args) in calls {
                    let args: Value = serde_json::from_str(&args).expect(&text);
                    match name.as_str() {
                        "get_weather" => assert!(weather.is_valid(&args), "{text}"),
                        "get_time" => {
                            assert!(choice == json!("required"), "{text}");
                            assert!(args["tz"] == "UTC" || args["tz"] == "CET", "{text}");
                        }
                        other => panic!("called {other}"),
                    }
                }
            }
            assert!(
                ended >= 15,
                "{syntax:?} {choice}: {ended} of 20 walks ended"
            );
        }
    }
}

/// Follows `text`'s tokens; returns whether each was allowed.
fn follows(f: &Fixture, g: &Arc<CompiledGrammar>, text: &str) -> bool {
    let mut c = g.start();
    for t in f.tokenizer.encode_plain(text).expect("encodes") {
        c.compute_mask().expect("mask");
        if !c.mask().expect("mask").allows(t) {
            return false;
        }
        c.commit(t).expect("commit");
    }
    true
}

#[test]
fn auto_is_free_until_the_marker_and_constrained_after() {
    let f = fixture();
    let g = compile(&f, &tools(json!("auto"), true), ToolSyntax::Hermes);
    assert!(follows(&f, &g, "Any text at all, <tool even { this }"));
    let call = "Let me look.<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}\n</tool_call>";
    assert!(follows(&f, &g, call));
    let (content, calls) = parse(ToolSyntax::Hermes, call);
    assert_eq!(content, "Let me look.");
    assert_eq!(
        calls,
        vec![("get_time".to_string(), "{\"tz\": \"UTC\"}".to_string())]
    );
    // After the marker, only a call may follow.
    assert!(!follows(&f, &g, "Hi <tool_call>\nnot json"));
    assert!(!follows(&f, &g, "<tool_call>\n{\"name\": \"launch\""));
    assert!(!follows(
        &f,
        &g,
        "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"PST\"}}"
    ));
    // A named choice never lets free text in.
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    let g = compile(&f, &tools(named, false), ToolSyntax::Hermes);
    assert!(!follows(&f, &g, "Sure"));
    assert!(grammar(&tools(json!("none"), true), ToolSyntax::Hermes).is_none());
    assert!(grammar(&tools(json!("auto"), true), ToolSyntax::Llama3Json).is_none());
}

#[test]
fn open_objects_are_closed_so_calls_end() {
    let f = fixture();
    let list = [
        json!({"type": "function", "function": {"name": "f", "parameters":
        {"type": "object", "properties": {"a": {"enum": ["x", "y"]},
                                          "b": {"type": "object", "properties": {"c": {"type": "boolean"}}}}}}}),
    ];
    let set = ToolSet::from_openai(Some(&list), Some(&json!("required")), Some(false))
        .expect("valid")
        .expect("tools");
    let g = compile(&f, &set, ToolSyntax::Hermes);
    let mut rng = Rng(5);
    for _ in 0..20 {
        let Some(text) = walk(&f, &g, &mut rng) else {
            continue;
        };
        let (_, calls) = parse(ToolSyntax::Hermes, &text);
        let args: Value = serde_json::from_str(&calls[0].1).expect(&text);
        let keys: Vec<&String> = args.as_object().expect("object").keys().collect();
        assert!(keys.iter().all(|k| *k == "a" || *k == "b"), "{text}");
        if let Some(b) = args.get("b") {
            assert!(
                b.as_object().expect("object").keys().all(|k| k == "c"),
                "{text}"
            );
        }
    }
}
