//! Our parser and decoders against llama.cpp's own `gguf` package: the
//! fixture (`fixtures/make_blocks.py`) holds random blocks of every type
//! with that package's dequantization beside each.

use std::path::PathBuf;

use tandem_gguf::{dequantize, four_bit_groups, GgmlType, Gguf, GgufError, Value};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/blocks.gguf")
}

fn decode(g: &Gguf, name: &str) -> Vec<f32> {
    let t = g.tensor(name).expect("tensor");
    let mut out = vec![0.0; t.len()];
    dequantize(t.ty, g.bytes(name).expect("bytes"), &mut out);
    out
}

#[test]
fn every_type_decodes_as_the_gguf_package_does() {
    let g = Gguf::open(&fixture()).expect("open");
    for ty in GgmlType::ALL {
        let name = ty.name();
        let t = g.tensor(name).expect("tensor");
        assert_eq!(t.ty, ty);
        assert_eq!(t.shape(), vec![3, 512], "{name}");
        let expected = match ty {
            GgmlType::F32 => decode(&g, "F32"),
            _ => decode(&g, &format!("{name}.expected")),
        };
        let got = decode(&g, name);
        for (i, (a, b)) in got.iter().zip(&expected).enumerate() {
            // The package computes in f32 too, in the same order, for all
            // but Q6_K (d · scale first): allow an ulp or two.
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
                "{name}[{i}]: {a} vs {b}"
            );
        }
    }
}

#[test]
fn four_bit_groups_match_the_decoded_weights() {
    let g = Gguf::open(&fixture()).expect("open");
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q4_K] {
        let expected = decode(&g, &format!("{}.expected", ty.name()));
        let groups: Vec<_> = four_bit_groups(ty, g.bytes(ty.name()).expect("bytes")).collect();
        assert_eq!(groups.len(), 3 * 512 / 32);
        for (gi, group) in groups.iter().enumerate() {
            for (j, &q) in group.codes.iter().enumerate() {
                let w = group.scale * f32::from(q) + group.min;
                let e = expected[gi * 32 + j];
                assert!(
                    (w - e).abs() <= 1e-6 * e.abs().max(1e-3),
                    "{ty:?} {gi}/{j}: {w} vs {e}"
                );
            }
        }
    }
}

#[test]
fn metadata_of_every_type_reads_back() {
    let g = Gguf::open(&fixture()).expect("open");
    assert_eq!(g.version(), 3);
    assert_eq!(g.str("general.architecture").expect("arch"), "test");
    assert_eq!(g.u64("test.u32").expect("u32"), 7);
    assert_eq!(g.get("test.i32").and_then(Value::as_i64), Some(-3));
    assert_eq!(g.f64("test.f32").expect("f32"), 0.25);
    assert_eq!(g.f64("test.f64").expect("f64"), -1.5);
    assert_eq!(g.get("test.bool").and_then(Value::as_bool), Some(true));
    assert_eq!(g.str("test.string").expect("string"), "héllo");
    let strings: Vec<_> = g
        .get("test.strings")
        .and_then(Value::as_array)
        .expect("array")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(strings, ["a", "", "ünï"]);
    assert_eq!(g.u64("test.u64").expect("u64"), 1 << 40);
    assert_eq!(g.get("test.i8").and_then(Value::as_i64), Some(-8));
    assert_eq!(g.u64("test.u16").expect("u16"), 65535);
    let err = g.u64("test.string").expect_err("wrong type");
    assert!(err.to_string().contains("test.string"), "{err}");
    let err = g.u64("test.absent").expect_err("missing");
    assert!(
        err.to_string().contains("test.absent") && err.to_string().contains("missing"),
        "{err}"
    );
}

/// Every prefix of the file is refused with an error (never a panic), and
/// so is the file with any one header byte flipped, or parses to tensors
/// inside the file.
#[test]
fn truncated_and_corrupted_headers_are_errors() {
    let bytes = std::fs::read(fixture()).expect("read");
    let header_end = bytes.len()
        - tandem_gguf::parse(&bytes)
            .expect("parse")
            .tensors
            .iter()
            .map(|t| t.end - t.start)
            .sum::<usize>();
    for cut in (0..bytes.len()).step_by(97) {
        let err = tandem_gguf::parse(&bytes[..cut]).expect_err("truncated");
        assert!(!err.to_string().is_empty());
    }
    for at in 0..header_end.min(4096) {
        let mut bad = bytes.clone();
        bad[at] ^= 0x5A;
        if let Ok(h) = tandem_gguf::parse(&bad) {
            assert!(h.tensors.iter().all(|t| t.end <= bad.len()));
        }
    }
}

#[test]
fn unsupported_types_and_bad_magic_name_the_problem() {
    let bytes = std::fs::read(fixture()).expect("read");
    let mut bad = bytes.clone();
    bad[0] = b'X';
    assert!(matches!(
        tandem_gguf::parse(&bad),
        Err(GgufError::BadMagic(_))
    ));
    let mut old = bytes.clone();
    old[4] = 1;
    assert!(matches!(
        tandem_gguf::parse(&old),
        Err(GgufError::Version(1))
    ));
    // The first tensor's type code: after its name and its two dims.
    let h = tandem_gguf::parse(&bytes).expect("parse");
    let name = h.tensors[0].name.as_bytes();
    let at = find(&bytes, name) + name.len() + 4 + 16;
    assert_eq!(
        u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4")),
        GgmlType::Q4_0.code()
    );
    let mut iq = bytes.clone();
    iq[at..at + 4].copy_from_slice(&16u32.to_le_bytes());
    let err = tandem_gguf::parse(&iq).expect_err("IQ2_XXS");
    assert!(
        err.to_string().contains("IQ2_XXS") && err.to_string().contains("Q4_0"),
        "{err}"
    );
    iq[at..at + 4].copy_from_slice(&999u32.to_le_bytes());
    let err = tandem_gguf::parse(&iq).expect_err("unknown");
    assert!(err.to_string().contains("999"), "{err}");
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len())
        .position(|w| w == needle)
        .expect("found")
}
