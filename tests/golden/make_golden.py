#!/usr/bin/env python3
"""Golden fixtures for tandem's Hugging Face parity tests.

Builds small random models with transformers (one per architecture variant,
each in float32 and bfloat16), saves them as Hugging Face checkpoints, and
records a greedy continuation with per-step logprobs computed by transformers
itself. The Rust tests in tests/tests/golden_parity.rs load the same
checkpoints and must reproduce the tokens and logprobs.

Pinned reference: torch==2.15.0, transformers==5.23.0 (CPU).

    python3 -m venv /tmp/golden && /tmp/golden/bin/pip install torch==2.15.0 transformers==5.23.0
    /tmp/golden/bin/python tests/golden/make_golden.py            # writes tests/fixtures/golden
    /tmp/golden/bin/python tests/golden/make_golden.py --out DIR --cases llama_gqa

Reference numerics: every reference runs transformers in float32 compute. For
the bfloat16 checkpoints that means the saved bf16 weights widened exactly to
f32, i.e. the checkpoint's own function, which is also what tandem computes.
(transformers' native bf16 arithmetic differs from that by up to ~0.3 in
logprob on these peaked models and its logits often tie exactly, so its
greedy path is ill-defined; it is not a reference for a kernel.)
"""

import argparse
import json
import os
import sys

import torch
import transformers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SiglipVisionConfig,
)

PROMPT_LEN = 12
GEN_TOKENS = 40
TOP_N = 8
# Larger than HF's 0.02 so the random models have peaked, well-separated
# next-token distributions: greedy argmax is then a meaningful check.
INIT_STD = 0.25

BASE = dict(
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=INIT_STD,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


# Gemma 3 text, two layers: a sliding one (window 8, shorter than prompt +
# generation) rotating with the local base, and a global one with linear
# long-context scaling, as the 4B+ checkpoints have. query_pre_attn_scalar
# differs from head_dim so the scale is checked.
GEMMA3 = dict(
    BASE,
    tie_word_embeddings=True,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    query_pre_attn_scalar=24,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    pad_token_id=0,
)


def legacy_qwen3(cfg):
    """A published Qwen3 config.json: rope_theta at the top, torch_dtype,
    no layer_types."""
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg.pop("layer_types", None)
    cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


def legacy_gemma3(cfg):
    """A published Gemma 3 config.json: rope_theta + rope_scaling for the
    global layers, rope_local_base_freq, sliding_window_pattern instead of
    layer_types, torch_dtype."""
    rope = cfg.pop("rope_parameters")
    full, local = rope["full_attention"], rope["sliding_attention"]
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_scaling"] = full
    cfg["rope_local_base_freq"] = local["rope_theta"]
    cfg.pop("layer_types")
    cfg.pop("_sliding_window_pattern", None)
    cfg["sliding_window_pattern"] = 2
    cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


def gemma3_multimodal(**text):
    """A Gemma 3 text + vision config with a tiny SigLIP tower (the loader
    must serve the text tower and ignore the rest)."""
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )
    return Gemma3Config(
        text_config=Gemma3TextConfig(**text), vision_config=vision.to_dict(), mm_tokens_per_image=4,
    )


def cases():
    return {
        # Llama with grouped-query attention (4 query heads share 2 KV heads).
        "llama_gqa": (LlamaConfig, LlamaForCausalLM, dict(BASE)),
        # Multi-head attention, non-default theta.
        "llama_mha": (LlamaConfig, LlamaForCausalLM, dict(BASE, num_key_value_heads=4, rope_theta=1000.0)),
        # Multi-query attention with an explicit head_dim != hidden / heads.
        "llama_mqa": (LlamaConfig, LlamaForCausalLM, dict(BASE, num_key_value_heads=1, head_dim=32)),
        # Llama 3.1 rope scaling; small original context so all three
        # frequency bands (kept, scaled, smoothed) occur at head_dim 16.
        "llama3_rope": (
            LlamaConfig,
            LlamaForCausalLM,
            dict(
                BASE,
                rope_theta=500000.0,
                rope_scaling=dict(
                    rope_type="llama3",
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=64,
                ),
            ),
        ),
        # Mistral with a sliding window shorter than prompt + generation.
        "mistral_window": (MistralConfig, MistralForCausalLM, dict(BASE, sliding_window=16)),
        # Qwen2: q/k/v projections carry biases.
        "qwen2_bias": (Qwen2Config, Qwen2ForCausalLM, dict(BASE, use_sliding_window=False)),
        # Tied input/output embeddings.
        "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(BASE, tie_word_embeddings=True)),
        # Qwen3: per-head q/k RMSNorm; head_dim 32 (!= hidden / heads), GQA.
        "qwen3_gqa": (Qwen3Config, Qwen3ForCausalLM, dict(BASE, head_dim=32)),
        # Qwen3 with multi-query attention and a tied head.
        "qwen3_mqa_tied": (
            Qwen3Config,
            Qwen3ForCausalLM,
            dict(BASE, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, rope_theta=1e6),
        ),
        # Qwen3 with its config.json rewritten in the published spelling.
        "qwen3_legacy": (Qwen3Config, Qwen3ForCausalLM, dict(BASE, head_dim=16), legacy_qwen3),
        # Gemma 3 text, GQA, tied (the family's default).
        "gemma3_gqa": (Gemma3TextConfig, Gemma3ForCausalLM, dict(GEMMA3, head_dim=16)),
        # Gemma 3 at head_dim 256 with MQA and an untied head; hidden 16 keeps it small.
        "gemma3_hd256": (
            Gemma3TextConfig,
            Gemma3ForCausalLM,
            dict(
                GEMMA3, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, tie_word_embeddings=False,
            ),
        ),
        # Gemma 3 with its config.json rewritten in the published spelling.
        "gemma3_legacy": (Gemma3TextConfig, Gemma3ForCausalLM, dict(GEMMA3, head_dim=16), legacy_gemma3),
        # The text tower of a Gemma 3 text + vision checkpoint.
        "gemma3_multimodal": (
            gemma3_multimodal,
            Gemma3ForConditionalGeneration,
            dict(GEMMA3, head_dim=16, num_key_value_heads=1),
        ),
        # Gemma 2: attention and final-logit soft caps small enough to bind,
        # alternating sliding (window 8) and global layers, untied head.
        "gemma2_softcap": (
            Gemma2Config,
            Gemma2ForCausalLM,
            dict(
                BASE, head_dim=16, sliding_window=8, query_pre_attn_scalar=32,
                attn_logit_softcapping=5.0, final_logit_softcapping=10.0, pad_token_id=0,
            ),
        ),
        # Phi-3: fused qkv_proj and gate_up_proj, GQA, a window on every layer.
        "phi3_fused": (Phi3Config, Phi3ForCausalLM, dict(BASE, sliding_window=16, pad_token_id=0)),
        # Phi-3 with multi-head attention and a tied head.
        "phi3_mha_tied": (
            Phi3Config,
            Phi3ForCausalLM,
            dict(BASE, num_key_value_heads=4, tie_word_embeddings=True, pad_token_id=0),
        ),
    }


def build(config_cls, model_cls, kwargs, seed):
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    model = model_cls(config)
    with torch.no_grad():
        # Biases are zero-initialised by HF; give them values so they matter.
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, INIT_STD)
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.eval()
    return model


@torch.no_grad()
def greedy(model, prompt):
    ids = list(prompt)
    steps = []
    for _ in range(GEN_TOKENS):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(lp, TOP_N)
        tok = int(top.indices[0])
        sorted_lp = torch.sort(lp, descending=True).values
        steps.append(
            {
                "token": tok,
                "logprob": float(lp[tok]),
                "top": [[int(i), float(v)] for i, v in zip(top.indices, top.values)],
                "gap": float(sorted_lp[0] - sorted_lp[1]),
            }
        )
        ids.append(tok)
    return steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden"))
    ap.add_argument("--cases", nargs="*", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    all_cases = cases()
    names = args.cases or list(all_cases)
    index_path = os.path.join(args.out, "index.json")
    # A partial run keeps the other cases in the index.
    index = []
    if args.cases and os.path.exists(index_path):
        with open(index_path) as f:
            index = [c for c in json.load(f) if c.rsplit("_", 1)[0] not in names]
    for name in names:
        # Seeds follow the case's place in cases(), so a partial run makes
        # the same models as a full one.
        i = list(all_cases).index(name)
        config_cls, model_cls, kwargs, *rewrite = all_cases[name]
        base_model = build(config_cls, model_cls, kwargs, seed=1000 + i)
        g = torch.Generator().manual_seed(2000 + i)
        prompt = torch.randint(3, kwargs["vocab_size"], (PROMPT_LEN,), generator=g).tolist()
        for dtype_name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
            model = base_model.to(dtype)
            case = f"{name}_{dtype_name}"
            path = os.path.join(args.out, case)
            model.save_pretrained(path)
            if rewrite:
                cfg_path = os.path.join(path, "config.json")
                with open(cfg_path) as f:
                    cfg = json.load(f)
                with open(cfg_path, "w") as f:
                    json.dump(rewrite[0](cfg), f, indent=2, sort_keys=True)
            # Reload with float32 compute: for bf16 this widens the stored
            # weights exactly, so the reference is the checkpoint's function.
            ref = model_cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
            steps = greedy(ref, prompt)
            record = {
                "case": case,
                "architecture": model_cls.__name__,
                "dtype": dtype_name,
                "prompt_ids": prompt,
                "steps": steps,
                "min_gap": min(s["gap"] for s in steps),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            }
            with open(os.path.join(path, "golden.json"), "w") as f:
                json.dump(record, f, indent=1)
            index.append(case)
            print(f"{case}: min gap {record['min_gap']:.4f}", file=sys.stderr)
            base_model = base_model.to(torch.float32)
    with open(index_path, "w") as f:
        json.dump(index, f, indent=1)


if __name__ == "__main__":
    main()
