#!/usr/bin/env python3
"""Beam-search fixtures: transformers' `num_beams=4` output on the golden
f32 checkpoints, for tests/tests/beam_search.rs.

Each checkpoint (made by make_golden.py) is run through transformers'
`generate` with beam search (`do_sample=False`) under several settings:
no end-of-sequence token (every beam runs to `max_new_tokens`), one or two
end-of-sequence tokens picked so that beams do finish early, and the
`length_penalty` / `early_stopping` variants (`False`, `True`, `"never"`).
The returned sequences (generated part, end-of-sequence token included) and
their length-normalised scores are recorded in
tests/fixtures/golden/beams.json.

Pinned reference: torch==2.15.0, transformers==5.23.0 (CPU), as make_golden.py.

    /tmp/golden/bin/python tests/golden/make_beams.py
"""

import argparse
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

CASES = [
    "llama_gqa_f32",
    "qwen3_gqa_f32",
    "gemma3_gqa_f32",
    "mixtral_top2_f32",
    "mistral_window_f32",
    "gptoss_sinks_f32",
]
NUM_BEAMS = 4
MAX_NEW = 20


def beam_search(model, prompt, eos, n, length_penalty, early_stopping):
    """transformers' beam search; eos None means no end-of-sequence token."""
    gc = model.generation_config
    gc.eos_token_id = eos
    gc.pad_token_id = 0
    gc.bos_token_id = None
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        generation_config=gc,
        do_sample=False,
        num_beams=NUM_BEAMS,
        num_return_sequences=n,
        max_new_tokens=MAX_NEW,
        min_new_tokens=0,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        return_dict_in_generate=True,
        output_scores=True,
    )
    beams = []
    for i in range(n):
        length = int((out.beam_indices[i] >= 0).sum())
        tokens = out.sequences[i, len(prompt) : len(prompt) + length].tolist()
        beams.append({"tokens": tokens, "score": float(out.sequences_scores[i])})
    return beams


def settings(model, prompt):
    """The settings of one checkpoint: end-of-sequence tokens come from the
    no-eos run, so that beams really do meet them."""
    plain = beam_search(model, prompt, None, NUM_BEAMS, 1.0, False)
    best = plain[0]["tokens"]
    second = plain[1]["tokens"]
    eos_a = best[3]
    eos_b = next(t for t in second[2:] if t != eos_a)
    yield {"eos": None, "n": 4, "length_penalty": 1.0, "early_stopping": False}, plain
    for eos, n, lp, es in [
        ([eos_a], 2, 1.0, False),
        ([eos_a, eos_b], 3, 2.0, "never"),
        ([eos_a], 4, 0.5, True),
        ([eos_b], 4, -1.0, False),
    ]:
        yield (
            {"eos": eos, "n": n, "length_penalty": lp, "early_stopping": es},
            beam_search(model, prompt, eos, n, lp, es),
        )


def main():
    ap = argparse.ArgumentParser()
    root = os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden")
    ap.add_argument("--fixtures", default=root)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    records = []
    for case in CASES:
        path = os.path.join(args.fixtures, case)
        with open(os.path.join(path, "golden.json")) as f:
            prompt = json.load(f)["prompt_ids"]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for setting, beams in settings(model, prompt):
            finished_early = sum(len(b["tokens"]) < MAX_NEW for b in beams)
            print(f"{case} {setting}: {finished_early} of {len(beams)} end early", file=sys.stderr)
            records.append(
                {"case": case, "prompt_ids": prompt, "num_beams": NUM_BEAMS, "max_new_tokens": MAX_NEW}
                | setting
                | {"beams": beams}
            )
    out = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "runs": records,
    }
    with open(os.path.join(args.fixtures, "beams.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
