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
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
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


def legacy_qwen3_moe(cfg):
    """A published Qwen3-MoE config.json: Qwen3's legacy spelling, and the
    experts counted under `num_experts` (transformers 5 writes
    `num_local_experts`)."""
    cfg = legacy_qwen3(cfg)
    cfg["num_experts"] = cfg.pop("num_local_experts")
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


def legacy_rope(cfg):
    """A published config.json's RoPE: rope_theta at the top and the
    scaling under rope_scaling with the old `type` key."""
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    rope.pop("partial_rotary_factor", None)
    cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


# Position-dependent RoPE (dynamic NTK, LongRoPE) recomputes its frequencies
# from the longest position in each forward pass, so transformers' answer
# depends on how a sequence is split into passes. The reference for these
# cases decodes as a server does: the prompt in one pass, then one token per
# pass with the KV cache, crossing the original context while generating.
INCREMENTAL = {"llama_dynamic", "phi3_longrope"}

# gpt-oss cases whose experts are rewritten as MXFP4 blocks and scales
# after saving (the published checkpoints' format).
MXFP4 = {"gptoss_mxfp4"}

# LongRoPE's per-pair divisors for head_dim 16 (8 pairs), short and long.
SHORT_FACTOR = [1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0]
LONG_FACTOR = [1.0, 1.5, 2.5, 4.0, 8.0, 12.0, 16.0, 24.0]


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
        # OLMo 2: norms on block outputs only, q/k norms over whole projections.
        "olmo2_gqa": (Olmo2Config, Olmo2ForCausalLM, dict(BASE)),
        # OLMo 2 with multi-query attention, a tied head and q/k/v/o biases.
        "olmo2_mqa_tied": (
            Olmo2Config,
            Olmo2ForCausalLM,
            dict(BASE, num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True),
        ),
        # Granite: embedding, attention, residual and logit multipliers.
        "granite_gqa": (
            GraniteConfig,
            GraniteForCausalLM,
            dict(
                BASE, embedding_multiplier=3.0, attention_multiplier=0.2,
                residual_multiplier=0.6, logits_scaling=2.5,
            ),
        ),
        # Granite with multi-head attention, a tied head, head_dim 32.
        "granite_mha_tied": (
            GraniteConfig,
            GraniteForCausalLM,
            dict(
                BASE, num_key_value_heads=4, tie_word_embeddings=True, embedding_multiplier=12.0,
                attention_multiplier=0.0625, residual_multiplier=0.22, logits_scaling=8.0,
            ),
        ),
        # Qwen3 with YaRN over a small original context, so the ramp spans
        # the pairs at head_dim 32 and the attention factor is not 1.
        "qwen3_yarn": (
            Qwen3Config,
            Qwen3ForCausalLM,
            dict(
                BASE, head_dim=32,
                rope_parameters=dict(
                    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                ),
            ),
        ),
        # Llama with YaRN in the published spelling (rope_scaling, `type`),
        # DeepSeek-style mscale / mscale_all_dim.
        "llama_yarn_legacy": (
            LlamaConfig,
            LlamaForCausalLM,
            dict(
                BASE,
                rope_parameters=dict(
                    rope_type="yarn", rope_theta=50000.0, factor=8.0, original_max_position_embeddings=16,
                    mscale=1.0, mscale_all_dim=0.5, beta_fast=16, beta_slow=2,
                ),
            ),
            legacy_rope,
        ),
        # Llama with dynamic NTK past a 24-token context: theta grows with
        # every generated token from position 24 on.
        "llama_dynamic": (
            LlamaConfig,
            LlamaForCausalLM,
            dict(
                BASE, max_position_embeddings=24,
                rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0),
            ),
        ),
        # Phi-3 with LongRoPE: short factors within 24 tokens, long ones
        # after, and the attention factor of a 256 / 24 extension.
        "phi3_longrope": (
            Phi3Config,
            Phi3ForCausalLM,
            dict(
                BASE, pad_token_id=0, original_max_position_embeddings=24,
                rope_parameters=dict(
                    rope_type="longrope", rope_theta=10000.0,
                    short_factor=SHORT_FACTOR, long_factor=LONG_FACTOR,
                ),
            ),
        ),
        # Mixtral: 4 experts, top-2 renormalised, a window shorter than
        # prompt + generation.
        "mixtral_top2": (
            MixtralConfig,
            MixtralForCausalLM,
            dict(BASE, num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
        ),
        # Qwen2-MoE: 8 experts, top-2 unnormalised, a gated shared expert,
        # q/k/v biases.
        "qwen2moe_shared": (
            Qwen2MoeConfig,
            Qwen2MoeForCausalLM,
            dict(
                BASE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, norm_topk_prob=False,
            ),
        ),
        # Qwen3-MoE: top-2 of 8 renormalised, head_dim 32, and a dense
        # layer between sparse ones (mlp_only_layers); experts 64 wide, so
        # INT4 (64-column blocks) covers them.
        "qwen3moe_norm": (
            Qwen3MoeConfig,
            Qwen3MoeForCausalLM,
            dict(
                BASE, num_hidden_layers=3, head_dim=32, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1],
            ),
        ),
        # Qwen3-MoE with every second layer sparse (decoder_sparse_step),
        # top-3 of 6 unnormalised, MQA, a tied head, the published spelling.
        "qwen3moe_step2": (
            Qwen3MoeConfig,
            Qwen3MoeForCausalLM,
            dict(
                BASE, num_hidden_layers=4, head_dim=16, num_key_value_heads=1, tie_word_embeddings=True,
                num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=False,
                decoder_sparse_step=2,
            ),
            legacy_qwen3_moe,
        ),
        # gpt-oss: attention sinks, q/k/v/o biases, sliding (window 8) and
        # full layers alternating, YaRN over a 16-token original context
        # (no truncation), 4 stacked experts with biases, top-2 by logit,
        # and a SwiGLU clamp small enough to bind.
        "gptoss_sinks": (
            GptOssConfig,
            GptOssForCausalLM,
            dict(
                BASE, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                swiglu_limit=1.5,
                rope_parameters=dict(
                    rope_type="yarn", rope_theta=150000.0, factor=8.0, original_max_position_embeddings=16,
                    beta_fast=32.0, beta_slow=1.0, truncate=False,
                ),
            ),
        ),
        # gpt-oss with its experts in MXFP4 (the published format), MQA,
        # 4 of 8 experts per token, the default clamp and YaRN.
        "gptoss_mxfp4": (
            GptOssConfig,
            GptOssForCausalLM,
            dict(
                BASE, head_dim=16, num_key_value_heads=1, num_local_experts=8, num_experts_per_tok=4,
                sliding_window=8,
            ),
        ),
        # Mixtral with 8 experts, multi-query attention, a tied head and no
        # window.
        "mixtral_mqa_tied": (
            MixtralConfig,
            MixtralForCausalLM,
            dict(
                BASE, num_local_experts=8, num_experts_per_tok=2, num_key_value_heads=1,
                tie_word_embeddings=True, head_dim=32,
            ),
        ),
        # Qwen2-MoE with top-4 of 6 renormalised, every second layer sparse
        # and the rest dense (decoder_sparse_step), a narrow shared expert.
        "qwen2moe_step2": (
            Qwen2MoeConfig,
            Qwen2MoeForCausalLM,
            dict(
                BASE, num_hidden_layers=4, num_experts=6, num_experts_per_tok=4, moe_intermediate_size=16,
                shared_expert_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=2,
            ),
        ),
        # DeepSeek-V2 with multi-head latent attention (no q_lora_rank: one
        # q_proj), one dense layer then two sparse ones (first_k_dense_replace),
        # greedy top-2 of 6 softmax scores scaled by routed_scaling_factor,
        # one shared expert.
        "deepseekv2_lite": (
            DeepseekV2Config,
            DeepseekV2ForCausalLM,
            dict(
                BASE, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=6,
                num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.5,
            ),
        ),
        # DeepSeek-V2 with a low-rank query (q_lora_rank) and
        # group_limited_greedy routing: 3 groups of 2, the best 2 groups, top-3.
        "deepseekv2_group": (
            DeepseekV2Config,
            DeepseekV2ForCausalLM,
            dict(
                BASE, num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=6,
                num_experts_per_tok=3, moe_intermediate_size=16, n_shared_experts=2,
                first_k_dense_replace=0, topk_method="group_limited_greedy", n_group=3, topk_group=2,
            ),
        ),
        # DeepSeek-V3: low-rank query, interleaved RoPE under YaRN with
        # mscale/mscale_all_dim (the score scale and the rotated parts'
        # factor both move), sigmoid routing with e_score_correction_bias,
        # 4 groups of 2 ranked by their top two, the best 2 groups, top-2
        # renormalised and scaled by 2.5, one dense layer first.
        "deepseekv3_yarn": (
            DeepseekV3Config,
            DeepseekV3ForCausalLM,
            dict(
                BASE, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                routed_scaling_factor=2.5, rope_interleave=True,
                rope_parameters=dict(
                    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                    mscale=1.0, mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0,
                ),
            ),
        ),
        # DeepSeek-V3 without q_lora_rank, RoPE pairs not interleaved, every
        # layer sparse, top-3 of 6 in 2 groups (both kept), unnormalised.
        "deepseekv3_plain": (
            DeepseekV3Config,
            DeepseekV3ForCausalLM,
            dict(
                BASE, num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=24,
                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=6,
                num_experts_per_tok=3, moe_intermediate_size=16, n_shared_experts=1,
                first_k_dense_replace=0, n_group=2, topk_group=2, norm_topk_prob=False,
                routed_scaling_factor=1.0, rope_interleave=False,
            ),
        ),
    }


FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def mxfp4_quantize(w):
    """gpt-oss's published expert format from an `[E, out, in]` float
    tensor: per 32 inputs one power-of-two scale (`uint8`, bias 127) and 32
    FP4 (E2M1) codes, two per byte, the lower nibble first. Returns
    (blocks `[E, out, in/32, 16]`, scales `[E, out, in/32]`)."""
    e, out, inp = w.shape
    g = w.float().reshape(e, out, inp // 32, 32)
    amax = g.abs().amax(dim=-1).clamp(min=1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-126, 127)
    scaled = g / torch.exp2(exp)[..., None]
    lut = torch.tensor(FP4_VALUES)
    codes = (scaled[..., None] - lut).abs().argmin(dim=-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def mxfp4_checkpoint(path):
    """Rewrites a saved bf16 gpt-oss checkpoint's experts as MXFP4 blocks
    and scales, as the published checkpoints store them."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj")]:
        # Stored input-major [E, in, out]; MXFP4 is output-major.
        blocks, scales = mxfp4_quantize(tensors.pop(name).transpose(1, 2))
        tensors[name + "_blocks"] = blocks
        tensors[name + "_scales"] = scales
    save_file(tensors, file, metadata={"format": "pt"})
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def router_gaps(model):
    """Hooks every MoE router: the smallest gap, over the tokens routed,
    between the k-th and (k+1)-th expert's probability (how close a routing
    decision came to flipping; the golden check is only meaningful when it
    is well above float error)."""
    gaps = []

    def hook(module, args, output):
        probs = torch.softmax(output[0].float(), dim=-1)
        top = torch.sort(probs, dim=-1, descending=True).values
        k = module.top_k
        if k < probs.shape[-1]:
            gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            m.register_forward_hook(hook)
    return gaps


def build(config_cls, model_cls, kwargs, seed):
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    model = model_cls(config)
    with torch.no_grad():
        # Biases are zero-initialised by HF; give them values so they matter.
        for name, p in model.named_parameters():
            if name.endswith(".bias") or name.endswith("_bias") or name.endswith(".sinks"):
                p.normal_(0.0, INIT_STD)
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.eval()
    return model


@torch.no_grad()
def greedy(model, prompt, incremental=False, tokens=GEN_TOKENS, top_n=TOP_N):
    ids = list(prompt)
    steps = []
    past = None
    for _ in range(tokens):
        if incremental:
            new = ids if past is None else ids[-1:]
            out = model(torch.tensor([new]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
        else:
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(lp, top_n)
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
        # the same models as a full one (new cases go at the end).
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
            extra = {}
            if name in MXFP4:
                # The reference dequantizes the MXFP4 experts at load, as
                # transformers does on a CPU.
                mxfp4_checkpoint(path)
                extra["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
            ref = model_cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **extra).eval()
            gaps = router_gaps(ref)
            steps = greedy(ref, prompt, incremental=name in INCREMENTAL)
            record = {
                "case": case,
                "architecture": model_cls.__name__,
                "dtype": dtype_name,
                "prompt_ids": prompt,
                "steps": steps,
                "min_gap": min(s["gap"] for s in steps),
                **({"min_router_gap": min(gaps)} if gaps else {}),
                "reference": "incremental" if name in INCREMENTAL else "full",
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            }
            with open(os.path.join(path, "golden.json"), "w") as f:
                json.dump(record, f, indent=1)
            index.append(case)
            router = f", min router gap {min(gaps):.2e}" if gaps else ""
            print(f"{case}: min gap {record['min_gap']:.4f}{router}", file=sys.stderr)
            base_model = base_model.to(torch.float32)
    with open(index_path, "w") as f:
        json.dump(index, f, indent=1)


if __name__ == "__main__":
    main()
