#!/usr/bin/env python3
"""Parity fixtures for the built-in models: tests/fixtures/builtin/<model>.json.

Same conventions as tests/golden/make_golden.py: transformers runs in float32
compute from the committed bf16 weights (widened exactly, i.e. the
checkpoint's own function, which is also what tandem computes), greedy
continuation without stopping at eos, per-step logprob of the chosen token,
the top TOP_N alternatives and the gap between the best two. Each entry of
`cases` has the fields of a golden.json there (case, architecture, dtype,
prompt_ids, steps, min_gap); the file adds the checkpoint's path relative to
the repository root (the checkpoint is not copied).

Prompts are real text encoded with the model's tokenizer (with <s>). Trained
models can nearly tie between their two best tokens; a prompt whose greedy
path has a gap under MIN_GAP anywhere would make an exact-token parity check
depend on rounding, so such prompts are skipped and the next candidate used.

    /tmp/train-venv/bin/python models/make_golden.py
"""

import argparse
import json
import os
import sys

import torch
import transformers
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

import corpus


def _golden_module():
    """tests/golden/make_golden.py, by path (this file has the same name)."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "tests", "golden", "make_golden.py")
    spec = importlib.util.spec_from_file_location("golden_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


golden = _golden_module()

GEN_TOKENS = 16
TOP_N = 8
CASES = 3
MIN_GAP = 0.02
CANDIDATES = [
    "ROMEO.\nBut soft, what light",
    "To be, or not to be, that is the question:",
    "KING.\nMy lords,",
    "Shall I compare thee to a summer's day?",
    "FIRST CITIZEN.\nWe are accounted poor citizens,",
    "Now is the winter of our discontent",
    "HAMLET.\nGood my lord,",
    "O, that this too too solid flesh would melt,",
    "Enter the KING and QUEEN.",
    "All the world's a stage,",
    "What's in a name?",
    "Friends, Romans, countrymen,",
]
REPO = os.path.dirname(corpus.HERE)


def greedy(model, prompt):
    """The golden fixtures' greedy loop (a full forward per step), shared."""
    return golden.greedy(model, prompt, tokens=GEN_TOKENS, top_n=TOP_N)


def fixture(model_dir, name):
    ref = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    cases = []
    for i, text in enumerate(CANDIDATES):
        prompt = tok.encode(text).ids
        steps = greedy(ref, prompt)
        gap = min(s["gap"] for s in steps)
        if gap < MIN_GAP:
            print(f"{name}: skipping {text!r} (min gap {gap:.4f})", file=sys.stderr)
            continue
        cases.append(
            {
                "case": f"{name}_{len(cases)}",
                "architecture": type(ref).__name__,
                "dtype": "bf16",
                "prompt_text": text,
                "prompt_ids": prompt,
                "steps": steps,
                "min_gap": gap,
                "output_text": tok.decode([s["token"] for s in steps]),
            }
        )
        print(f"{name}: {text!r} -> {cases[-1]['output_text']!r} (min gap {gap:.4f})", file=sys.stderr)
        if len(cases) == CASES:
            break
    if len(cases) < CASES:
        raise SystemExit(f"{name}: only {len(cases)} prompts with a min gap >= {MIN_GAP}")
    return {
        "model": name,
        "checkpoint": os.path.relpath(os.path.abspath(model_dir), REPO),
        "dtype": "bf16",
        "gen_tokens": GEN_TOKENS,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cases": cases,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "fixtures", "builtin"))
    ap.add_argument("--models", nargs="*", default=[corpus.TARGET_DIR, corpus.DRAFT_DIR])
    args = ap.parse_args()
    torch.set_num_threads(2)
    os.makedirs(args.out, exist_ok=True)
    for d in args.models:
        name = os.path.basename(os.path.normpath(d))
        record = fixture(d, name)
        path = os.path.join(args.out, f"{name}.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
