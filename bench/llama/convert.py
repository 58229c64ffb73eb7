#!/usr/bin/env python3
"""A Hugging Face checkpoint to GGUF with llama.cpp's own converter, for peer-bench.

    python bench/llama/convert.py LLAMA_SRC MODEL_DIR OUTTYPE OUTFILE

LLAMA_SRC is llama.cpp's source tree (the llama-cpp-python sdist's
vendor/llama.cpp); OUTTYPE is one of the converter's --outtype values (f16,
bf16, f32). The tensors go through `convert_hf_to_gguf.py` unchanged. Only the
vocabulary may be stood in for: the converter refuses tokenizers whose
fingerprint it does not know (tandem's random bench models carry one), so
such a checkpoint is converted from a directory of links to its files with a
byte-pair tokenizer of the same size and one merge (llama.cpp refuses a
GPT-2 vocabulary without merges), labelled GPT-2, as tests/golden/make_gguf.py
labels its word-level ones. Speed does not depend on the vocabulary's strings.

Needs torch, numpy, sentencepiece and protobuf (the converter's imports); its own gguf
package comes from LLAMA_SRC/gguf-py.
"""

import json
import pathlib
import sys
import tempfile

LLAMA, MODEL, OUTTYPE, OUTFILE = sys.argv[1:5]
sys.path.insert(0, LLAMA)
sys.path.insert(1, str(pathlib.Path(LLAMA) / "gguf-py"))

import convert_hf_to_gguf  # noqa: E402
from conversion import base as conversion_base  # noqa: E402


def convert(src):
    sys.argv = ["convert_hf_to_gguf.py", str(src), "--outtype", OUTTYPE, "--outfile", OUTFILE]
    convert_hf_to_gguf.main()


def with_word_level_vocab(src, dst):
    from tokenizers import Tokenizer, models, pre_tokenizers

    for f in src.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
            (dst / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    size = config["vocab_size"]
    # A byte-pair vocabulary with one merge: llama.cpp refuses a GPT-2
    # vocabulary without merges.
    vocab = {"a": 0, "b": 1, "ab": 2} | {f"t{i}": i for i in range(3, size - 1)} | {"<|endoftext|>": size - 1}
    tok = Tokenizer(models.BPE(vocab, [("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    conversion_base.TextModel.get_vocab_base_pre = lambda self, tok: "gpt-2"
    lookup = convert_hf_to_gguf.get_model_class

    def gpt2_vocab(*args, **kwargs):
        family = lookup(*args, **kwargs)
        return type(family.__name__, (family,), {"model_arch": family.model_arch, "set_vocab": lambda self: self._set_vocab_gpt2()})

    convert_hf_to_gguf.get_model_class = gpt2_vocab


src = pathlib.Path(MODEL)
try:
    convert(src)
except (NotImplementedError, ValueError, KeyError) as e:
    print(f"convert.py: the converter refused the vocabulary ({e}); using a stand-in", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        with_word_level_vocab(src, pathlib.Path(tmp))
        convert(pathlib.Path(tmp))
