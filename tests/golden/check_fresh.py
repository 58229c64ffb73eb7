#!/usr/bin/env python3
"""Checks `tandem generate --json` against transformers on fresh random models.

Unlike the committed fixtures, these models are made on the spot with sizes
the test suite never saw (head_dim 32/64/128, several GQA ratios, rope
thetas, f32 and bf16), so the check cannot pass by construction. For each
model it runs transformers' greedy `generate` and tandem's CLI and compares
tokens and per-token logprobs.

    /tmp/golden/bin/python tests/golden/check_fresh.py --tandem target/release/tandem
"""

import argparse
import json
import subprocess
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

ARCH = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}

# (arch, heads, kv_heads, head_dim, layers, theta, extra)
MODELS = [
    ("llama", 4, 4, 32, 2, 10000.0, {}),
    ("llama", 8, 2, 64, 2, 500000.0, {}),
    ("llama", 4, 1, 128, 2, 1e6, {}),
    ("llama", 6, 3, 32, 3, 50000.0, {"tie_word_embeddings": True}),
    ("llama", 8, 4, 32, 2, 500000.0, {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 128}}),
    ("mistral", 8, 2, 32, 2, 1e6, {"sliding_window": 24}),
    ("qwen2", 4, 2, 64, 2, 1e6, {"use_sliding_window": False}),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tandem", default="target/release/tandem")
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(2)
    failures = 0
    for n, (arch, heads, kv, hd, layers, theta, extra) in enumerate(MODELS):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(n)
            cfg_cls, model_cls = ARCH[arch]
            hidden = 96 + 32 * n
            cfg = cfg_cls(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, vocab_size=300,
                          max_position_embeddings=512, rope_theta=theta, initializer_range=0.2,
                          bos_token_id=1, eos_token_id=2, **extra)
            model = model_cls(cfg).to(dtype).eval()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith(".bias"):
                        p.normal_(0.0, 0.2)
            with tempfile.TemporaryDirectory() as d:
                model.save_pretrained(d)
                ref = model_cls.from_pretrained(d, dtype=torch.float32).eval()
                prompt = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(n)).tolist()
                with torch.no_grad():
                    out = ref.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens, do_sample=False,
                                       output_logits=True, return_dict_in_generate=True, pad_token_id=0)
                want = out.sequences[0, len(prompt):].tolist()
                want_lp = [float(torch.log_softmax(l[0].float(), -1)[t]) for l, t in zip(out.logits, want)]
                res = subprocess.run([args.tandem, "generate", "--model", d, "--prompt-ids", ",".join(map(str, prompt)),
                                      "--max-tokens", str(args.new_tokens), "--logprobs", "1", "--json"],
                                     capture_output=True, text=True)
                if res.returncode != 0:
                    print(f"FAIL {arch} h{heads}/kv{kv}/d{hd} {dtype}: {res.stderr}")
                    failures += 1
                    continue
                got = json.loads(res.stdout)
                same = got["output_ids"] == want
                diff = max((abs(a["logprob"] - b) for a, b in zip(got["logprobs"], want_lp)), default=0.0)
                ok = same and diff < 1e-4
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {arch:8} heads {heads} kv {kv} head_dim {hd:3} theta {theta:g} "
                      f"{str(dtype)[6:]:8} tokens {len(want)} identical={same} max|dlogprob|={diff:.2e}")
    print(f"{failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
