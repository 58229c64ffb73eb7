#!/usr/bin/env python3
"""Writes the committed seed corpora under fuzz/corpus/<target>/.

Seeds are small valid inputs, so the fuzzer starts past the formats'
framing: a KV-transfer connection (hello, WRITE, FINISH, ABORT), encoded
GenerateRequest bodies (token ids, text, sampling, stop strings, grammars)
and tokenizer text. Run from the repository root: python3 fuzz/make_seeds.py
"""
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")

# --- kv_listener: the layout in fuzz_targets/kv_listener.rs -------------
LAYOUT = struct.pack("<IIIIB3x", 2, 1, 4, 2, 0)  # layers, heads, dim, block, f32
HALF = 1 * 2 * 4 * 4  # kv heads x block size x head dim x 4 bytes


def hello():
    """A version-2 hello (the listener then challenges; the proof needs the secret)."""
    return b"TDMKVXF1" + struct.pack("<HH", 2, 0) + LAYOUT + bytes(range(32))


def frame(kind, body):
    return struct.pack("<BI", kind, len(body)) + body


def write(transfer, blocks):
    head = struct.pack("<QI", transfer, len(blocks))
    head += b"".join(struct.pack("<II", layer, block) for layer, block in blocks)
    payload = b"".join(bytes([i]) * HALF + bytes([0x80 | i]) * HALF for i in range(len(blocks)))
    return frame(1, head + payload)


def control(kind, transfer):
    return frame(kind, struct.pack("<Q", transfer))


KV = {
    "raw-hello": b"\x00" + hello(),
    "write-finish": b"\x01" + write(7, [(0, 0), (1, 3)]) + control(2, 7),
    "write-abort": b"\x01" + write(9, [(1, 7)]) + control(3, 9),
    "two-transfers": b"\x01" + write(1, [(0, 1)]) + write(2, [(0, 2)]) + control(2, 2) + control(2, 1),
}


# --- generate_request: protobuf by hand (field numbers from generate.proto)
def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(num, wire, payload):
    return varint(num << 3 | wire) + payload


def vint(num, n):
    return field(num, 0, varint(n))


def blob(num, data):
    return field(num, 2, varint(len(data)) + data)


def f32(num, x):
    return field(num, 5, struct.pack("<f", x))


def packed(num, xs):
    return blob(num, b"".join(varint(x) for x in xs))


def sampling(**kw):
    out = b""
    if "temperature" in kw:
        out += f32(1, kw["temperature"])
    if "top_p" in kw:
        out += f32(2, kw["top_p"])
    if "top_k" in kw:
        out += vint(3, kw["top_k"])
    if "seed" in kw:
        out += vint(8, kw["seed"])
    return blob(4, out)


GEN = {
    "token-ids": blob(3, packed(1, [1, 2, 3, 4, 5])) + vint(5, 8),
    "text-greedy": blob(2, b"To be, or not to be") + sampling(temperature=0.0) + vint(5, 16),
    "sampled-n": blob(2, b"ROMEO:") + sampling(temperature=0.8, top_p=0.9, top_k=40, seed=7)
    + vint(5, 4) + vint(6, 3) + vint(10, 2),
    "stops": blob(2, b"KING:") + blob(7, b"\n\n") + packed(8, [0]) + vint(9, 1) + vint(5, 32),
    "regex": blob(2, b"Answer:") + blob(11, blob(3, b"(yes|no)")) + vint(5, 4),
    "json-schema": blob(2, b"{") + blob(11, blob(1, b'{"type":"object","properties":{"a":{"type":"integer"}}}')),
    "empty": b"",
}

TOKENIZER = {
    "ascii": b"O Romeo, Romeo! wherefore art thou Romeo?",
    "utf8": "caf\u00e9 \u2014 \u00fcber na\u00efve \U0001F600".encode(),
    "invalid": b"\xff\xfe\xc3(\xe2\x82",
    "newlines": b"\n\nHAMLET:\n\tTo be\r\n",
}


# --- gguf_header: the GGUF v3 layout (tandem-gguf's parse.rs) -------------
def gguf_string(s):
    return struct.pack("<Q", len(s)) + s


def gguf_file(tensor_type, block_bytes, kvs):
    """One tensor of 32 elements (one block) of `tensor_type`, data aligned to 32."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 1, len(kvs))
    for key, code, value in kvs:
        out += gguf_string(key) + struct.pack("<I", code) + value
    out += gguf_string(b"w") + struct.pack("<IQIQ", 1, 32, tensor_type, 0)
    out += b"\0" * (-len(out) % 32)
    return out + bytes(range(block_bytes))


ARCH = (b"general.architecture", 8, gguf_string(b"llama"))
TOKENS = (b"tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + gguf_string(b"a") + gguf_string(b"b"))
GGUF = {
    "q8_0": gguf_file(8, 34, [ARCH]),
    "q4_1-array": gguf_file(3, 20, [ARCH, TOKENS]),
    "f32-nested": gguf_file(0, 128, [(b"x", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 1) + struct.pack("<I", 7))]),
    "q6_k-truncated": gguf_file(14, 210, [ARCH])[:-10],
}


def main():
    targets = [("kv_listener", KV), ("generate_request", GEN), ("tokenizer", TOKENIZER), ("gguf_header", GGUF)]
    for target, seeds in targets:
        d = os.path.join(ROOT, target)
        os.makedirs(d, exist_ok=True)
        for name, data in seeds.items():
            with open(os.path.join(d, f"seed-{name}"), "wb") as f:
                f.write(data)
        print(f"{target}: {len(seeds)} seeds in {d}")


if __name__ == "__main__":
    main()
