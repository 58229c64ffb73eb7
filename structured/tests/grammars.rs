//! Compiling formats and following them token by token, without a model:
//! random walks over the allowed tokens must always end in valid output,
//! bad formats must be refused with the grammar engine's message, and the
//! cache, forks and the speculative seam must behave.

use std::str::FromStr;
use std::sync::Arc;

use tandem_structured::{
    Constraint, GrammarCompiler, ResponseFormat, StructuredError, TokenMask, Vocabulary,
};

const EOS: u32 = 256;

/// A byte-level BPE tokenizer: ids 0–255 are bytes, 256 is `</s>`, then
/// some merges, and the vocabulary is padded to 300 logits.
fn vocab() -> Vocabulary {
    let mut direct: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut chars = vec!['\0'; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        if let Some(p) = direct.iter().position(|&d| d == b) {
            direct.remove(p);
            chars[b as usize] = char::from_u32(b).expect("char");
        } else {
            chars[b as usize] = char::from_u32(256 + extra).expect("char");
            extra += 1;
        }
    }
    let mut v = serde_json::Map::new();
    for (b, c) in chars.iter().enumerate() {
        v.insert(c.to_string(), serde_json::json!(b));
    }
    let pairs = [
        ("\"", "a"),
        ("a", "b"),
        ("{", "\""),
        ("\"", ":"),
        ("1", "2"),
    ];
    let mut merges = Vec::new();
    for (i, (a, b)) in pairs.iter().enumerate() {
        v.insert(format!("{a}{b}"), serde_json::json!(257 + i));
        merges.push(format!("{a} {b}"));
    }
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": EOS, "content": "</s>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": v, "merges": merges}
    });
    let tok = tokenizers::Tokenizer::from_str(&json.to_string()).expect("tokenizer");
    Vocabulary::from_tokenizer(&tok, 300, &[EOS]).expect("vocabulary")
}

fn compiler() -> (Vocabulary, GrammarCompiler) {
    let v = vocab();
    let c = GrammarCompiler::new(&v, 8).expect("compiler");
    (v, c)
}

/// xorshift, enough for picking tokens.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// Follows the grammar with uniformly random allowed tokens until it stops
/// or end-of-sequence is drawn; returns the text and whether it ended.
fn walk(v: &Vocabulary, mut c: Constraint, rng: &mut Rng, max: usize) -> (String, bool) {
    let mut bytes = Vec::new();
    for _ in 0..max {
        c.compute_mask().expect("mask");
        let allowed = c.mask().expect("computed").allowed_tokens();
        assert!(!allowed.is_empty());
        let t = allowed[rng.below(allowed.len())];
        let commit = c.commit(t).expect("commit");
        if t == EOS {
            return (String::from_utf8(bytes).expect("utf-8"), true);
        }
        bytes.extend_from_slice(v.token_bytes(t));
        if commit.stopped {
            return (String::from_utf8(bytes).expect("utf-8"), true);
        }
    }
    (String::from_utf8_lossy(&bytes).into_owned(), false)
}

#[test]
fn random_walks_over_a_schema_always_validate() {
    let (v, c) = compiler();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    });
    let g = c
        .compile(&ResponseFormat::JsonSchema(schema.to_string()))
        .expect("compiles");
    let validator = jsonschema::validator_for(&schema).expect("schema");
    let mut rng = Rng(7);
    let mut ended = 0;
    for _ in 0..40 {
        let (text, done) = walk(&v, g.start(), &mut rng, 400);
        if !done {
            continue;
        }
        ended += 1;
        let value: serde_json::Value = serde_json::from_str(&text).expect(&text);
        assert!(validator.is_valid(&value), "{text}");
    }
    assert!(ended >= 30, "only {ended} of 40 walks ended");
}

#[test]
fn choices_and_regexes_and_lark_are_followed() {
    let (v, c) = compiler();
    let mut rng = Rng(11);
    let choices = vec!["yes".to_string(), "no".into(), "maybe \"so\"".into()];
    let g = c
        .compile(&ResponseFormat::Choice(choices.clone()))
        .expect("choice");
    for _ in 0..20 {
        let (text, done) = walk(&v, g.start(), &mut rng, 50);
        assert!(done && choices.contains(&text), "{text:?}");
    }
    let rx = regex::Regex::new(r"^[a-c]{2,4}-[0-9]{3}$").expect("regex");
    let g = c
        .compile(&ResponseFormat::Regex(r"[a-c]{2,4}-[0-9]{3}".into()))
        .expect("regex");
    for _ in 0..20 {
        let (text, done) = walk(&v, g.start(), &mut rng, 50);
        assert!(done && rx.is_match(&text), "{text:?}");
    }
    let lark = r#"
        start: item ("," item)*
        item: NUM | "x"
        NUM: /[0-9]{1,2}/
    "#;
    let g = c
        .compile(&ResponseFormat::Grammar(lark.into()))
        .expect("lark");
    let rx = regex::Regex::new(r"^([0-9]{1,2}|x)(,([0-9]{1,2}|x))*$").expect("regex");
    for _ in 0..20 {
        let (text, done) = walk(&v, g.start(), &mut rng, 200);
        if done {
            assert!(rx.is_match(&text), "{text:?}");
        }
    }
}

#[test]
fn invalid_formats_carry_the_engine_message() {
    let (_v, c) = compiler();
    for (f, want) in [
        (ResponseFormat::Regex("(unclosed".into()), "regex"),
        (ResponseFormat::Grammar("start: foo".into()), "grammar"),
        (
            ResponseFormat::JsonSchema(r#"{"type": "integer", "minimum": 5, "maximum": 2}"#.into()),
            "json_schema",
        ),
        (
            ResponseFormat::JsonSchema(r#"{"type": "nonsense"}"#.into()),
            "json_schema",
        ),
    ] {
        match c.compile(&f) {
            Err(StructuredError::InvalidFormat { kind, message }) => {
                assert_eq!(kind, want);
                assert!(!message.is_empty());
            }
            other => panic!("{f:?}: expected InvalidFormat, got {other:?}"),
        }
    }
}

/// A format past `MAX_FORMAT_BYTES` is refused before anything parses it,
/// however valid; one at the limit's side compiles.
#[test]
fn oversized_formats_are_refused_before_compiling() {
    use tandem_structured::MAX_FORMAT_BYTES;
    let (_v, c) = compiler();
    // A valid schema: an object with many optional properties.
    let schema = |props: usize| {
        let fields: Vec<String> = (0..props)
            .map(|i| format!(r#""field_{i:06}": {{"type": "integer"}}"#))
            .collect();
        format!(
            r#"{{"type": "object", "properties": {{{}}}}}"#,
            fields.join(", ")
        )
    };
    let big = schema(MAX_FORMAT_BYTES / 20);
    assert!(big.len() > MAX_FORMAT_BYTES);
    match c.compile(&ResponseFormat::JsonSchema(big)) {
        Err(StructuredError::InvalidFormat { kind, message }) => {
            assert_eq!(kind, "json_schema");
            assert!(message.contains("at most"), "{message}");
        }
        other => panic!("expected InvalidFormat, got {other:?}"),
    }
    let choices: Vec<String> = (0..MAX_FORMAT_BYTES / 4 + 1)
        .map(|i| format!("{i:04}"))
        .collect();
    assert!(matches!(
        c.compile(&ResponseFormat::Choice(choices)),
        Err(StructuredError::InvalidFormat { kind: "choice", .. })
    ));
    c.compile(&ResponseFormat::JsonSchema(schema(20)))
        .expect("a small schema compiles");
}

#[test]
fn the_cache_hits_and_is_bounded() {
    let v = vocab();
    let c = GrammarCompiler::new(&v, 2).expect("compiler");
    let a = ResponseFormat::Regex("a+".into());
    let g1 = c.compile(&a).expect("a");
    let g2 = c.compile(&a).expect("a again");
    assert!(Arc::ptr_eq(&g1, &g2));
    c.compile(&ResponseFormat::Regex("b+".into())).expect("b");
    c.compile(&ResponseFormat::Regex("c+".into())).expect("c");
    let s = c.cache_stats();
    assert_eq!((s.hits, s.misses, s.entries), (1, 3, 2));
    // "a+" was least recently used: evicted, compiled anew.
    let g3 = c.compile(&a).expect("a evicted");
    assert!(!Arc::ptr_eq(&g1, &g3));
    assert_ne!(c.fingerprint(), 0);
}

#[test]
fn forks_are_independent_and_drafts_can_be_checked_and_undone() {
    let (_v, c) = compiler();
    let g = c
        .compile(&ResponseFormat::Choice(vec!["ab".into(), "ba".into()]))
        .expect("choice");
    let mut a = g.start();
    let mut b = a.fork();
    assert!(!a.commit(u32::from(b'a')).expect("a").stopped);
    assert!(
        b.commit(u32::from(b'a')).is_ok(),
        "the fork has its own parser"
    );
    let mut c2 = g.start();
    // Drafted "b", "b": only the first fits.
    assert_eq!(
        c2.accept_prefix(&[u32::from(b'b'), u32::from(b'b')])
            .expect("draft"),
        1
    );
    c2.rollback(1).expect("rollback");
    assert_eq!(c2.committed(), 0);
    assert!(c2.rollback(1).is_err());
    c2.compute_mask().expect("mask");
    let m = c2.mask().expect("mask");
    assert!(m.allows(u32::from(b'a')) && m.allows(u32::from(b'b')));
    assert!(!m.allows(EOS));
    let mut d = g.start();
    assert!(d.commit(u32::from(b'z')).is_err(), "not allowed here");
    let _ = TokenMask::from_tokens(4, &[1]);
}
