#!/usr/bin/env python3
"""Held-out evaluation of the built-in models; writes models/metrics.json.

* perplexity of target and draft on the held-out works (corpus.HELD_OUT),
  float32 compute from the saved bf16 weights, non-overlapping windows;
* a unigram baseline on the same predicted tokens (counts from the training
  works, add-one smoothing over the vocabulary);
* the draft's greedy acceptance rate: for held-out prompts of PROMPT_LEN
  tokens the target greedily generates GEN_LEN tokens; acceptance is the
  fraction of those positions where the draft's argmax, given the same
  prefix, equals the target's token;
* sample continuations from the target (greedy and temperature 0.8).

    /tmp/train-venv/bin/python models/evaluate.py
"""

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

import corpus

WINDOW = 512
PROMPTS = 50
PROMPT_LEN = 32
GEN_LEN = 64
SAMPLE_PROMPTS = [
    "ROMEO.\n",
    "To be, or not to be,",
    "KING.\nMy lords, ",
    "Shall I compare thee to a summer's day?\n",
]
SAMPLE_TOKENS = 80


def load(path):
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def nll_per_token(model, ids):
    """-log p of ids[1:], each given everything before it in its window."""
    out = []
    for s in range(0, len(ids) - 1, WINDOW):
        x = torch.tensor([ids[s : s + WINDOW + 1]])
        if x.size(1) < 2:
            break
        logp = F.log_softmax(model(input_ids=x[:, :-1]).logits.float(), -1)
        out.append(-logp[0].gather(-1, x[0, 1:, None])[:, 0])
    return torch.cat(out)


def unigram_nll(tok, train_ids, held_ids):
    counts = torch.bincount(torch.tensor(train_ids), minlength=tok.get_vocab_size()).double() + 1.0
    logp = torch.log(counts / counts.sum())
    # The same predicted positions as the windows above: every id but the first.
    return -logp[torch.tensor(held_ids[1:])]


@torch.no_grad()
def greedy(model, prompt, n):
    ids = list(prompt)
    past = None
    x = torch.tensor([ids])
    for _ in range(n):
        out = model(input_ids=x, past_key_values=past, use_cache=True)
        past = out.past_key_values
        tok = int(out.logits[0, -1].argmax())
        ids.append(tok)
        x = torch.tensor([[tok]])
    return ids[len(prompt):]


@torch.no_grad()
def sample(model, prompt, n, temperature, gen):
    ids = list(prompt)
    past = None
    x = torch.tensor([ids])
    for _ in range(n):
        out = model(input_ids=x, past_key_values=past, use_cache=True)
        past = out.past_key_values
        probs = torch.softmax(out.logits[0, -1].float() / temperature, -1)
        tok = int(torch.multinomial(probs, 1, generator=gen))
        ids.append(tok)
        x = torch.tensor([[tok]])
    return ids[len(prompt):]


def held_out_prompts(held_docs, tok):
    """PROMPTS prompts of PROMPT_LEN tokens, evenly spaced over the held-out
    works, each starting at the beginning of a line."""
    per = [PROMPTS // len(held_docs) + (1 if i < PROMPTS % len(held_docs) else 0) for i in range(len(held_docs))]
    prompts = []
    for (name, text), k in zip(held_docs, per):
        for j in range(k):
            at = text.find("\n", int(len(text) * (j + 0.5) / k)) + 1
            ids = tok.encode(text[at:at + 4000], add_special_tokens=False).ids[:PROMPT_LEN]
            prompts.append((name, ids))
    return prompts


@torch.no_grad()
def acceptance(target, draft, prompts):
    hits = total = 0
    per_prompt = []
    for _, p in prompts:
        gen = greedy(target, p, GEN_LEN)
        x = torch.tensor([p + gen])
        d = draft(input_ids=x).logits[0].argmax(-1)
        # Position PROMPT_LEN - 1 + i predicts generated token i.
        pred = d[len(p) - 1 : len(p) - 1 + GEN_LEN]
        h = int((pred == torch.tensor(gen)).sum())
        hits += h
        total += GEN_LEN
        per_prompt.append(h / GEN_LEN)
    return hits / total, per_prompt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=corpus.TARGET_DIR)
    ap.add_argument("--draft", default=corpus.DRAFT_DIR)
    ap.add_argument("--out", default=os.path.join(corpus.HERE, "metrics.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.time()

    tok = Tokenizer.from_file(os.path.join(args.target, "tokenizer.json"))
    train_docs, held_docs = corpus.split()
    train_ids = corpus.encode_docs(tok, train_docs)
    held_ids = corpus.encode_docs(tok, held_docs)
    target, draft = load(args.target), load(args.draft)

    # Perplexity.
    t_nll = nll_per_token(target, held_ids)
    d_nll = nll_per_token(draft, held_ids)
    u_nll = unigram_nll(tok, train_ids, held_ids)
    assert t_nll.numel() == d_nll.numel() == u_nll.numel()
    ppl = {k: math.exp(float(v.double().mean())) for k, v in (("target", t_nll), ("draft", d_nll), ("unigram", u_nll))}
    print(f"held-out perplexity over {t_nll.numel()} tokens: " + ", ".join(f"{k} {v:.2f}" for k, v in ppl.items()),
          flush=True)

    # Acceptance.
    prompts = held_out_prompts(held_docs, tok)
    rate, per_prompt = acceptance(target, draft, prompts)
    print(f"draft greedy acceptance over {len(prompts)} prompts x {GEN_LEN} tokens: {rate:.3f}", flush=True)

    # Samples.
    gen = torch.Generator().manual_seed(7)
    samples = []
    for text in SAMPLE_PROMPTS:
        p = tok.encode(text).ids  # with <s>, as a served request
        g = tok.decode(greedy(target, p, SAMPLE_TOKENS))
        s = tok.decode(sample(target, p, SAMPLE_TOKENS, 0.8, gen))
        samples.append({"prompt": text, "greedy": g, "temperature_0.8": s})
        print(f"--- {text!r}\n[greedy] {text}{g}\n[t=0.8] {text}{s}", flush=True)
    # One held-out prompt, to show what acceptance is measured on.
    name, p = prompts[0]
    held_example = {"work": name, "prompt": tok.decode(p), "target_greedy": tok.decode(greedy(target, p, GEN_LEN))}

    metrics = {
        "held_out_works": [n for n, _ in held_docs],
        "held_out_tokens": t_nll.numel(),
        "window": WINDOW,
        "perplexity": ppl,
        "acceptance": {
            "rate": rate,
            "prompts": len(prompts),
            "prompt_len": PROMPT_LEN,
            "gen_len": GEN_LEN,
            "min_prompt_rate": min(per_prompt),
            "max_prompt_rate": max(per_prompt),
        },
        "held_out_example": held_example,
        "samples": samples,
        "eval_s": round(time.time() - t0, 1),
        "torch": torch.__version__,
    }
    with open(args.out, "w") as f:
        json.dump(metrics, f, indent=1)
    print(f"wrote {args.out} ({time.time() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
