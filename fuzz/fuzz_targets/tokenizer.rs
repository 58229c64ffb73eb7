//! Arbitrary text and token ids through the built-in model's tokenizer:
//! encoding, decoding, and the engine's streaming detokenizer, whose deltas
//! must add up to a one-shot decode of the same ids (up to a last character
//! still incomplete when the ids ran out).

#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tandem_engine::tokenizer::{StreamDecoder, Tokenizer};

fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../models/shakespeare-target/tokenizer.json");
        Tokenizer::from_file(&path).expect("the built-in tokenizer")
    })
}

fuzz_target!(|data: &[u8]| {
    let tok = tokenizer();
    let text = String::from_utf8_lossy(data);
    let Ok(ids) = tok.encode(&text) else {
        return;
    };
    // Ids from the raw bytes too, out of range ones included.
    let raw: Vec<u32> = data
        .chunks(2)
        .map(|c| u32::from(c[0]) | u32::from(*c.get(1).unwrap_or(&0)) << 8)
        .collect();
    for ids in [ids, raw] {
        let Ok(whole) = tok.decode(&ids) else {
            continue;
        };
        let mut inc = StreamDecoder::after_prompt(&[]);
        let mut streamed = String::new();
        for &id in &ids {
            match inc.push(tok, id) {
                Ok(piece) => streamed.push_str(&piece),
                Err(_) => return,
            }
        }
        // What was streamed is the one-shot text, up to a last character
        // still incomplete when the ids ran out (held back, never split).
        assert!(
            whole.starts_with(&streamed),
            "streamed {streamed:?} is not a prefix of {whole:?}"
        );
        let held = &whole[streamed.len()..];
        assert!(
            held.is_empty() || held.contains('\u{FFFD}'),
            "{held:?} was held back without an incomplete character"
        );
    }
});
