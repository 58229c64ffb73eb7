#!/usr/bin/env python3
"""GGUF fixtures, made by llama.cpp's own tools (none of it is ours).

1. Golden checkpoints (tests/fixtures/golden, made by make_golden.py) are
   converted with llama.cpp's `convert_hf_to_gguf.py` to F32, BF16 and F16
   GGUF files: tests/gguf.rs loads them and must reproduce the same golden
   tokens and logprobs as the safetensors. The golden checkpoints carry no
   tokenizer, so each gets a word-level one of its vocabulary size, and the
   converter's tokenizer fingerprint is told "gpt-2" (metadata only: the
   tensors are converted as the converter always does, Llama's Q/K
   permutation included). Gemma's golden checkpoints are left out: their
   query_pre_attn_scalar and layer pattern are not what a GGUF can say
   (llama.cpp derives both from the model size); step 7 makes Gemma models
   in the shape llama.cpp assumes, with their own transformers reference.
2. A random Llama with 256-wide rows (K-quants need them) is converted to
   F32 and quantized with `llama-quantize --pure` to each block type tandem
   reads; transformers' GGUF loader (the `gguf` package dequantizes)
   scores fixed token sequences on each file: quant_reference.json.
3. A tiny random Llama with models/shakespeare-target's vocabulary and
   chat template, quantized to Q8_0, for the cluster test's chat.
4. llama_gqa_f32.gguf cut into shards by `llama-gguf-split`.
5. A SentencePiece vocabulary (`--vocab-only`) beside transformers'
   tokenizer.json of the same tokenizer.model.
6. The vocabulary of models/shakespeare-target (a byte-level BPE) is
   converted alone (`--vocab-only`): tests/gguf.rs encodes text with the
   tokenizer built from it and with the tokenizer.json it came from.

    python3 -m venv /tmp/qv && /tmp/qv/bin/pip install torch==2.15.0 transformers==5.25.0 gguf==0.19.0 cmake ninja sentencepiece protobuf
    # llama.cpp from the llama-cpp-python 0.3.36 sdist (vendor/llama.cpp):
    cmake -S $LLAMA -B $LLAMA/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF
    ninja -C $LLAMA/build llama-quantize llama-gguf-split
    LLAMA_CPP=$LLAMA /tmp/qv/bin/python tests/golden/make_gguf.py [golden quant vocab chat split spm gemma family_vocab]
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests/fixtures/golden"
OUT = REPO / "tests/fixtures/gguf"
LLAMA = pathlib.Path(os.environ["LLAMA_CPP"])
sys.path.insert(0, str(LLAMA))
sys.path.insert(1, str(LLAMA / "gguf-py"))

import convert_hf_to_gguf  # noqa: E402
from conversion import base as conversion_base  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

# (golden case, GGUF out type, fixture name)
GOLDEN_CASES = [
    ("llama_gqa_f32", "f32", "llama_gqa_f32"),
    ("llama_gqa_bf16", "bf16", "llama_gqa_bf16"),
    ("llama_gqa_bf16", "f16", "llama_gqa_f16"),
    ("llama_tied_f32", "f32", "llama_tied_f32"),
    ("llama3_rope_f32", "f32", "llama3_rope_f32"),
    ("qwen2_bias_f32", "f32", "qwen2_bias_f32"),
    ("qwen3_gqa_f32", "f32", "qwen3_gqa_f32"),
    ("phi3_fused_f32", "f32", "phi3_fused_f32"),
    ("phi3_longrope_f32", "f32", "phi3_longrope_f32"),
]
QUANT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


def word_level_tokenizer(dir_, vocab_size):
    # The last id is named as Qwen2's tokenizer class names its end token,
    # which it would otherwise add past the vocabulary.
    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {"<|endoftext|>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(dir_ / "tokenizer.json"))
    (dir_ / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def convert(src, outtype, outfile, vocab_only=False):
    argv = [str(src), "--outtype", outtype, "--outfile", str(outfile)]
    if vocab_only:
        argv.append("--vocab-only")
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()


ORIGINAL_GET_MODEL_CLASS = convert_hf_to_gguf.get_model_class


def patch_converter():
    # Every family takes its vocabulary from tokenizer.json as a GPT-2 BPE,
    # labelled with the plain GPT-2 pre-tokenizer.
    conversion_base.TextModel.get_vocab_base_pre = lambda self, tok: "gpt-2"
    lookup = ORIGINAL_GET_MODEL_CLASS

    def gpt2_vocab(*args, **kwargs):
        family = lookup(*args, **kwargs)
        return type(family.__name__, (family,), {"model_arch": family.model_arch, "set_vocab": lambda self: self._set_vocab_gpt2()})

    convert_hf_to_gguf.get_model_class = gpt2_vocab


def golden_fixtures(tmp):
    for case, outtype, name in GOLDEN_CASES:
        src = tmp / case
        if not src.exists():
            shutil.copytree(GOLDEN / case, src)
            config = json.loads((src / "config.json").read_text())
            vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
            word_level_tokenizer(src, vocab)
        convert(src, outtype, OUT / f"{name}.gguf")


def quant_fixtures(tmp):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    config = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        initializer_range=0.1, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    src = tmp / "quant_src"
    model.save_pretrained(src)
    word_level_tokenizer(src, config.vocab_size)
    f32 = tmp / "quant_f32.gguf"
    convert(src, "f32", f32)
    gen = torch.Generator().manual_seed(5)
    sequences = [torch.randint(3, 256, (48,), generator=gen).tolist() for _ in range(4)]
    reference = {"sequences": sequences, "types": {}}
    for ty in QUANT_TYPES:
        out = OUT / f"llama256_{ty.lower()}.gguf"
        subprocess.run([str(LLAMA / "build/bin/llama-quantize"), "--pure", str(f32), str(out), ty],
                       check=True, capture_output=True)
        shutil.copy(out, tmp / out.name)
        m = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=out.name, dtype=torch.float32).eval()
        rows = []
        for seq in sequences:
            with torch.no_grad():
                logits = m(torch.tensor([seq])).logits[0].float()
            logp = torch.log_softmax(logits, -1)
            rows.append({
                "top1": logits.argmax(-1).tolist(),
                "next_logprob": [logp[i, seq[i + 1]].item() for i in range(len(seq) - 1)],
            })
        reference["types"][ty] = rows
    (OUT / "quant_reference.json").write_text(json.dumps(reference) + "\n")


def chat_fixture(tmp):
    """A tiny random Llama with the built-in model's vocabulary and chat
    template, F32 then Q8_0: what cli/tests/gguf_cluster.rs serves."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        initializer_range=0.1, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1,
    )
    src = tmp / "chat_src"
    LlamaForCausalLM(config).save_pretrained(src)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(REPO / "models/shakespeare-target" / f, src / f)
    f32 = tmp / "chat_f32.gguf"
    convert(src, "f32", f32)
    subprocess.run([str(LLAMA / "build/bin/llama-quantize"), "--pure", str(f32),
                    str(OUT / "shakespeare_chat_q8_0.gguf"), "Q8_0"], check=True, capture_output=True)


def vocab_fixture(tmp):
    src = tmp / "vocab"
    src.mkdir()
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(REPO / "models/shakespeare-target" / f, src / f)
    convert(src, "f32", OUT / "shakespeare_vocab.gguf", vocab_only=True)


def split_fixture(tmp):
    """llama_gqa_f32.gguf cut by llama.cpp's gguf-split into three shards."""
    subprocess.run([str(LLAMA / "build/bin/llama-gguf-split"), "--split", "--split-max-tensors", "8",
                    str(OUT / "llama_gqa_f32.gguf"), str(OUT / "split/llama_gqa_f32")],
                   check=True, capture_output=True)


def spm_fixture(tmp):
    """A SentencePiece BPE vocabulary (byte fallback, as Llama 2's) trained
    on the repository's held-out prompts and licence texts, converted
    alone by llama.cpp's SentencePiece path, beside the tokenizer.json that
    transformers makes from the same tokenizer.model."""
    import sentencepiece as spm
    from transformers import LlamaConfig, LlamaTokenizer

    src = tmp / "spm"
    src.mkdir()
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(
        pathlib.Path(p).read_text() for p in [REPO / "bench/prompts/held-out.txt",
                                               "/usr/share/common-licenses/Apache-2.0"]))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(src / "tokenizer"), vocab_size=600, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        user_defined_symbols=["\u2581\u2581", "\u2581\u2581\u2581\u2581", "<think>"],
        minloglevel=2)
    LlamaConfig(vocab_size=600, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, architectures=["LlamaForCausalLM"]).save_pretrained(src)
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    # transformers' own SentencePiece conversion (needs protobuf).
    tok = LlamaTokenizer.from_pretrained(src)
    tok.save_pretrained(src)
    shutil.copy(src / "tokenizer.json", OUT / "spm_tokenizer.json")
    (src / "tokenizer.json").unlink()  # the converter reads tokenizer.model
    convert_hf_to_gguf.get_model_class = ORIGINAL_GET_MODEL_CLASS
    try:
        convert(src, "f32", OUT / "spm_vocab.gguf", vocab_only=True)
    finally:
        patch_converter()


def gemma_fixtures(tmp):
    """Random Gemma 2 and 3 models in the shape llama.cpp assumes of a
    Gemma GGUF (query_pre_attn_scalar = head_dim; Gemma 3 global every 6th
    layer), each with transformers' greedy continuation in the golden
    format, converted to F32 GGUF."""
    sys.path.insert(0, str(REPO / "tests/golden"))
    import make_golden as mg
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    cases = {
        "gemma2_llamacpp": (Gemma2Config, Gemma2ForCausalLM, dict(
            mg.BASE, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0, final_logit_softcapping=10.0, pad_token_id=0,
            tie_word_embeddings=True)),  # the converter drops an untied head, as Gemma ties it
        "gemma3_llamacpp": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
            mg.GEMMA3, head_dim=16, query_pre_attn_scalar=16, num_hidden_layers=6,
            layer_types=["sliding_attention"] * 5 + ["full_attention"])),
    }
    for i, (name, (config_cls, model_cls, kwargs)) in enumerate(cases.items()):
        model = mg.build(config_cls, model_cls, kwargs, seed=3000 + i)
        g = torch.Generator().manual_seed(4000 + i)
        prompt = torch.randint(3, kwargs["vocab_size"], (mg.PROMPT_LEN,), generator=g).tolist()
        src = tmp / name
        model.save_pretrained(src)
        ref = model_cls.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
        steps = mg.greedy(ref, prompt)
        (OUT / f"{name}.golden.json").write_text(json.dumps(
            {"case": name, "prompt_ids": prompt, "steps": steps, "min_gap": min(x["gap"] for x in steps)}, indent=1))
        word_level_tokenizer(src, kwargs["vocab_size"])
        convert(src, "f32", OUT / f"{name}_f32.gguf")


def family_vocab_fixtures(tmp):
    """The same trained SentencePiece model converted as a Gemma 3 and as a
    Phi-3 vocabulary (llama.cpp's own per-family vocabulary paths), each
    beside the tokenizer.json transformers' GGUF loader builds from the
    file (its Gemma and Phi-3 rules)."""
    from transformers import AutoTokenizer

    for arch, hidden in [("Gemma3ForCausalLM", {"head_dim": 16}), ("Phi3ForCausalLM", {})]:
        name = arch.removesuffix("ForCausalLM").lower()
        src = tmp / f"{name}_vocab"
        src.mkdir()
        shutil.copy(tmp / "spm/tokenizer.model", src / "tokenizer.model")
        (src / "config.json").write_text(json.dumps({
            "architectures": [arch], "vocab_size": 600, "hidden_size": 64, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "sliding_window": 8, "original_max_position_embeddings": 256, **hidden}))
        out = OUT / f"{name}_vocab.gguf"
        convert_hf_to_gguf.get_model_class = ORIGINAL_GET_MODEL_CLASS
        try:
            convert(src, "f32", out, vocab_only=True)
        finally:
            patch_converter()
        shutil.copy(out, tmp / out.name)
        AutoTokenizer.from_pretrained(tmp, gguf_file=out.name).save_pretrained(tmp / f"{name}_ref")
        shutil.copy(tmp / f"{name}_ref/tokenizer.json", OUT / f"{name}_tokenizer.json")


STEPS = {"family_vocab": family_vocab_fixtures, "gemma": gemma_fixtures, "spm": spm_fixture, "split": split_fixture, "golden": golden_fixtures, "quant": quant_fixtures, "vocab": vocab_fixture, "chat": chat_fixture}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    patch_converter()
    with tempfile.TemporaryDirectory() as t:
        tmp = pathlib.Path(t)
        (OUT / "split").mkdir(exist_ok=True)
        for step in sys.argv[1:] or ["golden", "quant", "vocab", "chat", "split", "spm", "gemma",
                                     "family_vocab"]:
            STEPS[step](tmp)
    for p in sorted(OUT.iterdir()):
        print(p.name, p.stat().st_size)


if __name__ == "__main__":
    main()
