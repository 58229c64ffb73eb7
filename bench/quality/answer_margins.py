"""How close each reference answer came to being another answer.

For every question of a `make_reference.py` reference, feeds transformers'
own greedy answer back teacher-forced (f32) and prints the smallest gap
between the top two log-probabilities at the answer tokens before the fact
first appears: a precision mode whose per-token error (`quality-bench`'s
mean |Δ log p|) is of that size changes such an answer by chance.

    python bench/quality/answer_margins.py --model target/smollm2-135m \
        --reference bench/quality/smollm2-135m.json
"""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--reference", required=True)
    args = parser.parse_args()
    reference = json.load(open(args.reference))
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    for q in reference["questions"]:
        ids = q["prompt"] + q["answer_tokens"]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
        gaps = []
        for i in range(len(q["answer_tokens"])):
            top2 = torch.topk(logprobs[len(q["prompt"]) - 1 + i], 2).values
            gaps.append((float(top2[0] - top2[1]), i))
            if q["fact"].lower() in tokenizer.decode(q["answer_tokens"][: i + 1]).lower():
                break
        gap, at = min(gaps)
        print(f"{q['question']:60s} gap {gap:.3f} nats at answer token {at}")


if __name__ == "__main__":
    main()
