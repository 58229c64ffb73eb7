//! Arbitrary bytes as a GGUF file: the header parser must return an error
//! or a table whose every tensor lies inside the bytes, and a parsed
//! tensor's first row must decode; never a panic, a hang or an allocation
//! the input's size does not bound.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_gguf::{dequantize, parse};

fuzz_target!(|data: &[u8]| {
    let Ok(header) = parse(data) else {
        return;
    };
    for t in header.tensors.iter().take(8) {
        assert!(t.start <= t.end && t.end <= data.len(), "{t:?}");
        let row = t.dims[0].min(1 << 16);
        let row = row - row % t.ty.block_len();
        let bytes = t.ty.bytes_for(row);
        if row > 0 && t.start + bytes <= t.end {
            let mut out = vec![0f32; row];
            dequantize(t.ty, &data[t.start..t.start + bytes], &mut out);
        }
    }
});
