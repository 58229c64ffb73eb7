#!/usr/bin/env python3
"""Multi-LoRA fixtures: PEFT LoRA adapters on the golden f32 checkpoints and
PEFT's own greedy continuations with them, for tandem's LoRA parity tests.

Each adapter is made by PEFT (`LoraConfig` + `get_peft_model`) on a golden
checkpoint made by make_golden.py, with every lora_A and lora_B set to
seeded random values (PEFT starts lora_B at zero, which would make the
adapter a no-op), and saved with `save_pretrained` (adapter_config.json +
adapter_model.safetensors) under tests/fixtures/lora/<base>/<adapter>/.
The four llama_gqa_f32 adapters differ in rank, alpha, rsLoRA, target
modules and layers, so that one batch can mix them with the base model.

tests/fixtures/lora/golden.json lists, per adapter, PEFT's greedy decoding
(unmerged; the merged model, `merge_and_unload`, is checked to agree) with
per-step logprobs (log_softmax of the f32 logits) and top-5, in
make_golden.py's step format, plus the base model's own greedy tokens (the
adapter is checked to change them within the first 10 steps).

`foreign/r4_attn` is an adapter made on a differently shaped Llama
(hidden_size 32) for the shape-mismatch test; it names llama_gqa_f32 as its
base, so loading it there must fail on the shapes. It has no golden output.

Pinned reference: torch==2.15.0, transformers==5.23.0, peft==0.21.2 (CPU).

    /tmp/golden/bin/pip install peft==0.21.2
    /tmp/golden/bin/python tests/golden/make_lora.py            # writes tests/fixtures/lora
    /tmp/golden/bin/python tests/golden/make_lora.py --out DIR
"""

import argparse
import copy
import json
import os
import shutil
import sys

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_golden import greedy as golden_greedy, router_gaps  # noqa: E402

GEN_TOKENS = 24
TOP_N = 5
# The adapter must change the base model's greedy output this early.
DIVERGE_WITHIN = 10
# Smallest allowed top-1 / top-2 logprob gap over the steps.
MIN_GAP = 1e-3
# Merged and unmerged PEFT models must agree this closely.
MERGE_TOL = 1e-5

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

# (base case, adapter name, LoraConfig arguments, seed). Seeds are fixed per
# adapter; a near tie in an adapter's greedy path is fixed by changing its seed
# (r2_layer1's first seed gave a 3e-4 gap). The tiny Gemma 3 repeats a token
# for a window's length (its golden does too); most seeds made its adapter
# echo the prompt's last token for all 24 steps, so 3156 was picked for a
# path that changes token.
ADAPTERS = [
    ("llama_gqa_f32", "r4_attn", dict(r=4, lora_alpha=8, target_modules=ATTN), 3001),
    ("llama_gqa_f32", "r8_all", dict(r=8, lora_alpha=16, target_modules=ATTN + MLP), 3002),
    ("llama_gqa_f32", "r16_rslora_mlp", dict(r=16, lora_alpha=8, use_rslora=True, target_modules=MLP), 3003),
    (
        "llama_gqa_f32",
        "r2_layer1",
        dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], layers_to_transform=[1]),
        3014,
    ),
    ("qwen2_bias_f32", "r8_all", dict(r=8, lora_alpha=16, target_modules=ATTN + MLP), 3005),
    ("gemma3_gqa_f32", "r4_all", dict(r=4, lora_alpha=8, target_modules=ATTN + MLP), 3156),
    # MoE: attention targets only.
    ("mixtral_top2_f32", "r4_attn", dict(r=4, lora_alpha=8, target_modules=ATTN), 3007),
]

# The shape-mismatch adapter: made on llama_gqa_f32's config with these
# changes, saved as if for llama_gqa_f32.
FOREIGN = dict(hidden_size=32, head_dim=16, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
FOREIGN_BASE = "llama_gqa_f32"
FOREIGN_SEED = 3100


def randomize_lora(model, seed):
    """Every lora_A ~ N(0, 1/sqrt(in)) and lora_B ~ N(0, 0.5/sqrt(r)), so
    the adapter's update is a sizeable fraction of the base weights (std
    0.25) and changes the greedy path, while logits stay in range."""
    g = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
                n += 1
            elif ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 / p.shape[1] ** 0.5)
                n += 1
            elif "lora" in name:
                raise AssertionError(f"unexpected LoRA parameter {name}")
    assert n > 0 and n % 2 == 0, n
    return n // 2


def make_adapter(base, lora_kwargs, seed, base_name):
    """PEFT model with random LoRA weights, its config naming the base by
    its fixture path relative to the repository root."""
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **lora_kwargs))
    model.peft_config["default"].base_model_name_or_path = f"tests/fixtures/golden/{base_name}"
    modules = randomize_lora(model, seed)
    return model.eval(), modules


def greedy(model, prompt):
    """make_golden.py's greedy decoding and step format (token, logprob,
    top-N, top-1 / top-2 gap), full forward each step."""
    return golden_greedy(model, prompt, tokens=GEN_TOKENS, top_n=TOP_N)


def load_base(golden, case):
    path = os.path.join(golden, case)
    with open(os.path.join(path, "golden.json")) as f:
        ref = json.load(f)
    # Eager attention, as make_golden.py's reference.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return model, ref


def max_diff(a, b):
    """Largest logprob difference between two step lists (chosen and top-N)."""
    diff = 0.0
    for x, y in zip(a, b):
        diff = max(diff, abs(x["logprob"] - y["logprob"]))
        diff = max(diff, max(abs(p[1] - q[1]) for p, q in zip(x["top"], y["top"])))
    return diff


def check_merged(model, steps, prompt, label):
    """The merged model (LoRA folded into the weights, `merge_and_unload`)
    decodes the same tokens. In float64 (merged in float64 too) the merged
    and unmerged logprobs agree within MERGE_TOL; in float32 they differ by
    float error only (the merge reorders the sums; up to ~2e-5 here), about
    the size of the f32 reference's own distance from float64. (transformers'
    RMSNorm computes in float32 whatever the dtype, so "float64" is float64
    between the norms.) Returns the f32 merged, f64 merged and f32-vs-f64
    differences."""
    merged = copy.deepcopy(model).merge_and_unload().eval()
    got = greedy(merged, prompt)
    tokens = [s["token"] for s in steps]
    assert [s["token"] for s in got] == tokens, f"{label}: merged tokens differ"
    f32 = max_diff(got, steps)
    assert f32 < 10 * MERGE_TOL, f"{label}: merged f32 logprobs differ by {f32:.2e}"
    # Along the recorded path, so a float64 near tie cannot fork it.
    unmerged64 = forced(to_f64(copy.deepcopy(model)), prompt, tokens)
    merged64 = forced(to_f64(copy.deepcopy(model)).merge_and_unload().eval(), prompt, tokens)
    f64 = max_diff(merged64, unmerged64)
    assert f64 < MERGE_TOL, f"{label}: merged f64 logprobs differ by {f64:.2e}"
    return f32, f64, max_diff(steps, unmerged64)


def to_f64(model):
    """A float64 copy; MoE experts switch from grouped_mm (no float64) to
    the eager loop."""
    model = model.double()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "_experts_implementation", None) not in (None, "eager"):
            cfg._experts_implementation = "eager"
    return model


@torch.no_grad()
def forced(model, prompt, tokens):
    """greedy()'s steps along a given token path (top-N by value)."""
    ids = list(prompt)
    steps = []
    for tok in tokens:
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double(), dim=-1)
        top = torch.topk(lp, TOP_N)
        pairs = [[int(i), float(v)] for i, v in zip(top.indices, top.values)]
        steps.append({"token": tok, "logprob": float(lp[tok]), "top": pairs})
        ids.append(tok)
    return steps


def save(model, path):
    if os.path.exists(path):
        shutil.rmtree(path)
    model.save_pretrained(path, safe_serialization=True)
    # PEFT keeps target_modules as a set and writes it in hash order, which
    # changes from run to run; sort it (the file is otherwise PEFT's own:
    # indent 2, sorted keys, no trailing newline).
    cfg_path = os.path.join(path, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["target_modules"] = sorted(cfg["target_modules"])
    with open(cfg_path, "w") as f:
        f.write(json.dumps(cfg, indent=2, sort_keys=True))
    # PEFT writes a README.md model card; the fixtures are just the adapter.
    card = os.path.join(path, "README.md")
    if os.path.exists(card):
        os.remove(card)


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--golden", default=os.path.join(here, "..", "fixtures", "golden"))
    ap.add_argument("--out", default=os.path.join(here, "..", "fixtures", "lora"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    records = []
    for case, name, lora_kwargs, seed in ADAPTERS:
        label = f"{case}/{name}"
        base, ref = load_base(args.golden, case)
        prompt = ref["prompt_ids"]
        base_steps = greedy(base, prompt)
        base_tokens = [s["token"] for s in base_steps]
        # The base reference is make_golden.py's own.
        assert base_tokens == [s["token"] for s in ref["steps"][:GEN_TOKENS]], f"{label}: base differs from golden"
        model, modules = make_adapter(base, lora_kwargs, seed, case)
        gaps = router_gaps(model)
        steps = greedy(model, prompt)
        # Taken now: the hooks travel with the copies check_merged makes.
        router = min(gaps) if gaps else None
        tokens = [s["token"] for s in steps]
        diverge = next((i for i, (a, b) in enumerate(zip(tokens, base_tokens)) if a != b), None)
        assert diverge is not None and diverge < DIVERGE_WITHIN, f"{label}: adapter diverges at {diverge}"
        min_gap = min(s["gap"] for s in steps)
        assert min_gap >= MIN_GAP, f"{label}: near tie (gap {min_gap:.2e}); change its seed"
        merge_f32, merge_f64, err_f32 = check_merged(model, steps, prompt, label)
        save(model, os.path.join(args.out, case, name))
        records.append(
            {
                "base": case,
                "adapter": name,
                "prompt_ids": prompt,
                "steps": steps,
                "base_tokens": base_tokens,
                "min_gap": min_gap,
                **({"min_router_gap": router} if router is not None else {}),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "peft": peft.__version__,
            }
        )
        router = f", min router gap {router:.2e}" if router is not None else ""
        print(
            f"{label}: {modules} modules, diverges at step {diverge}, min gap {min_gap:.4f}{router}, "
            f"merged diff f32 {merge_f32:.1e} / f64 {merge_f64:.1e}, f32 vs f64 {err_f32:.1e}",
            file=sys.stderr,
        )

    with open(os.path.join(args.golden, FOREIGN_BASE, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(FOREIGN)
    torch.manual_seed(FOREIGN_SEED)
    foreign = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model, modules = make_adapter(
        foreign, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), FOREIGN_SEED, FOREIGN_BASE
    )
    save(model, os.path.join(args.out, "foreign", "r4_attn"))
    print(f"foreign/r4_attn: {modules} modules (hidden_size {FOREIGN['hidden_size']})", file=sys.stderr)

    with open(os.path.join(args.out, "golden.json"), "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
