"""Where an 8-bit KV cache's error comes from, simulated in transformers.

Runs the checkpoint of a `make_reference.py` reference in f32 with its
post-RoPE keys and values passed through tandem's 8-bit coding
(`engine/src/kv_cache/q8.rs`: fixed sign flips and an orthonormal Hadamard
rotation, one scale per row, int8 or OCP E4M3 codes) before attention, and
reports for each variant the perplexity over the reference windows, the
top-1 agreement and mean |Δ log p| against f32, and how many of the
reference's answers greedy decoding keeps. The variants ask which part of
the coding costs what:

- `int8`, `fp8`: both K and V coded (tandem's `--kv-dtype int8|fp8-e4m3`);
- `fp8-k-only`, `fp8-v-only`: one of them coded, the other exact;
- `fp8-sink1`, `fp8-sink16`: the first 1 or 16 positions kept exact;
- `fp8-mean-cal`, `fp8-mean-oracle`: a per (layer, KV head) key mean
  subtracted before coding and added back after (from a calibration text,
  or each window's own);
- `fp8-query-aware`: keys rounded one channel after another with the error
  fed forward to minimise `Δkᵀ C Δk`, `C` the covariance of the queries
  that meet that KV head (calibrated), as GPTQ does for weights;
- `fp8-unrotated`: no Hadamard rotation before coding;
- `fp8-recent16|32|64`: each query reads its last 16/32/64 positions
  exact and older ones coded (KIVI's 16-bit residual window).

    python bench/quality/kv_error_sources.py --model target/smollm2-135m \\
        --reference bench/quality/smollm2-135m.json --calibration README.md
"""

import argparse
import json
import math

import torch
import transformers.models.llama.modeling_llama as llama
from transformers import AutoModelForCausalLM, AutoTokenizer

VARIANTS = {
    "int8": {"k": "int8", "v": "int8"},
    "fp8": {"k": "fp8", "v": "fp8"},
    "fp8-k-only": {"k": "fp8"},
    "fp8-v-only": {"v": "fp8"},
    "fp8-sink1": {"k": "fp8", "v": "fp8", "sink": 1},
    "fp8-sink16": {"k": "fp8", "v": "fp8", "sink": 16},
    "fp8-mean-cal": {"k": "fp8", "v": "fp8", "mean": "calibrated"},
    "fp8-mean-oracle": {"k": "fp8", "v": "fp8", "mean": "oracle"},
    "fp8-query-aware": {"k": "fp8", "v": "fp8", "query_aware": True},
    "fp8-unrotated": {"k": "fp8", "v": "fp8", "unrotated": True},
    "fp8-recent16": {"k": "fp8", "v": "fp8", "recent": 16},
    "fp8-recent32": {"k": "fp8", "v": "fp8", "recent": 32},
    "fp8-recent64": {"k": "fp8", "v": "fp8", "recent": 64},
}


def rotation(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q8.rs's sign flips `D` and orthonormal Hadamard `H` (d a power of two)."""
    signs = torch.ones(d)
    for i in range(d):
        h = (i * 0x9E3779B9) & 0xFFFFFFFF
        h = ((h << 7) | (h >> 25)) & 0xFFFFFFFF
        if h & 0x100:
            signs[i] = -1.0
    had = torch.ones(1, 1)
    while had.shape[0] < d:
        had = torch.cat([torch.cat([had, had], 1), torch.cat([had, -had], 1)], 0)
    return signs, had / math.sqrt(d)


class Coder:
    def __init__(self, d: int):
        self.signs, self.had = rotation(d)
        self.d = d
        self.cfg: dict = {}
        self.mean: dict[int, torch.Tensor] = {}
        self.chol: dict[int, torch.Tensor] = {}
        self.collect: dict[int, list] | None = None

    def rotate(self, x):
        if self.cfg.get("unrotated"):
            return x
        return (x * self.signs) @ self.had.T

    def unrotate(self, r):
        if self.cfg.get("unrotated"):
            return r
        return (r @ self.had) * self.signs

    @staticmethod
    def fp8_scale(amax):
        s = amax / 448.0
        return torch.where(s > 0, 2.0 ** torch.ceil(torch.log2(s.clamp_min(1e-30))), torch.ones_like(s))

    @staticmethod
    def fp8(v, s):
        return (v / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s

    def code(self, x, kind: str, layer: int | None = None):
        r = self.rotate(x)
        amax = r.abs().amax(-1, keepdim=True)
        if kind == "int8":
            s = (amax / 127.0).half().float()
            s = torch.where(s * 127 < amax, s * (1 + 2**-10), s).clamp_min(1e-30)
            return self.unrotate(torch.round(r / s).clamp(-127, 127) * s)
        s = self.fp8_scale(amax)
        if layer is None:
            return self.unrotate(self.fp8(r, s))
        # Sequential rounding with the error fed forward (GPTQ's update with
        # the upper Cholesky factor of the inverse query covariance).
        u = self.chol[layer]
        w, out = r.clone(), torch.zeros_like(r)
        for i in range(self.d):
            q = self.fp8(w[..., i : i + 1], s)
            out[..., i : i + 1] = q
            err = (w[..., i] - q[..., 0]) / u[:, i, i][None, :, None]
            w[..., i + 1 :] -= err[..., None] * u[:, i, i + 1 :][None, :, None, :]
        return self.unrotate(out)

    def attention(self, original):
        def forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
            layer = module.layer_idx
            if self.collect is not None:
                self.observe(module, layer, query, key)
            cfg, sink = self.cfg, self.cfg.get("sink", 0)
            exact_key, exact_value = key, value
            if cfg.get("k"):
                mean = None
                if cfg.get("mean") == "calibrated":
                    mean = self.mean[layer][None, :, None, :]
                elif cfg.get("mean") == "oracle":
                    mean = key[:, :, 1:, :].mean(2, keepdim=True)
                shifted = key - mean if mean is not None else key
                coded = self.code(shifted, cfg["k"], layer if cfg.get("query_aware") else None)
                coded = coded + mean if mean is not None else coded
                if sink:
                    coded[:, :, :sink] = key[:, :, :sink]
                key = coded
            if cfg.get("v"):
                coded = self.code(value, cfg["v"])
                if sink:
                    coded[:, :, :sink] = value[:, :, :sink]
                value = coded
            if cfg.get("recent"):
                return self.recent_window(module, query, (exact_key, key), (exact_value, value),
                                          attention_mask, scaling, cfg["recent"])
            return original(module, query, key, value, attention_mask, scaling, dropout, **kw)

        return forward

    @staticmethod
    def recent_window(module, query, keys, values, mask, scaling, window):
        """Attention where each query reads its last `window` positions exact (KIVI's residual)."""
        groups = module.num_key_value_groups
        (ek, ck), (ev, cv) = [[llama.repeat_kv(t, groups) for t in pair] for pair in (keys, values)]
        n = query.shape[2]
        i = torch.arange(n)[:, None] + (ek.shape[2] - n)
        j = torch.arange(ek.shape[2])[None, :]
        near = (i - j) < window
        scores = torch.where(near, query @ ek.transpose(2, 3), query @ ck.transpose(2, 3)) * scaling
        if mask is not None:
            scores = scores + mask
        p = torch.softmax(scores, -1, dtype=torch.float32)
        out = (p * near) @ ev + (p * ~near) @ cv
        return out.transpose(1, 2).contiguous(), p

    def observe(self, module, layer, query, key):
        groups = module.num_key_value_groups
        rq = self.rotate(query[0])
        cov = torch.stack(
            [
                sum(rq[h * groups + j].T @ rq[h * groups + j] for j in range(groups)) / rq.shape[1]
                for h in range(key.shape[1])
            ]
        )
        self.collect.setdefault(layer, []).append((key[0, :, 1:, :].mean(1), cov))

    def calibrate(self, damp: float = 0.01):
        for layer, seen in self.collect.items():
            self.mean[layer] = torch.stack([m for m, _ in seen]).mean(0)
            cov = torch.stack([c for _, c in seen]).mean(0).double()
            factors = []
            for c in cov:
                c = c + damp * c.diagonal().mean() * torch.eye(self.d, dtype=torch.float64)
                factors.append(torch.linalg.cholesky(torch.linalg.inv(c), upper=True).float())
            self.chol[layer] = torch.stack(factors)
        self.collect = None


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--reference", required=True)
    parser.add_argument("--calibration", required=True, help="a text file not in the corpus")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--answer-tokens", type=int, default=40, help="as quality-bench")
    args = parser.parse_args()
    torch.set_num_threads(2)
    reference = json.load(open(args.reference))
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    coder = Coder(model.config.head_dim if hasattr(model.config, "head_dim") else
                  model.config.hidden_size // model.config.num_attention_heads)
    llama.eager_attention_forward = coder.attention(llama.eager_attention_forward)

    def logprobs(ids):
        return torch.log_softmax(model(torch.tensor([ids]), use_cache=False).logits[0].float(), -1)

    coder.collect = {}
    logprobs(tok(open(args.calibration).read()).input_ids[:512])
    coder.calibrate()

    base = [logprobs(w["tokens"]) for w in reference["windows"]]
    base_nll = sum(-b[:-1].gather(1, torch.tensor(w["tokens"][1:])[:, None]).sum().item()
                   for b, w in zip(base, reference["windows"]))
    positions = sum(len(w["tokens"]) - 1 for w in reference["windows"])
    base_ppl = math.exp(base_nll / positions)
    print(f"{'f32':16s} ppl {base_ppl:.4f}")
    for name in args.variants.split(","):
        coder.cfg = VARIANTS[name]
        nll = dlp = top = 0.0
        for b, w in zip(base, reference["windows"]):
            lp = logprobs(w["tokens"])
            nxt = torch.tensor(w["tokens"][1:])[:, None]
            nll -= lp[:-1].gather(1, nxt).sum().item()
            dlp += (lp[:-1] - b[:-1]).gather(1, nxt).abs().sum().item()
            top += (lp[:-1].argmax(-1) == b[:-1].argmax(-1)).sum().item()
        lost = []
        for q in reference["questions"]:
            ids, out = list(q["prompt"]), []
            for _ in range(args.answer_tokens):
                nxt = int(logprobs(ids)[-1].argmax())
                if nxt == reference["eos_token_id"]:
                    break
                ids.append(nxt)
                out.append(nxt)
            if q["fact"].lower() not in tok.decode(out, skip_special_tokens=True).lower():
                lost.append(q["fact"])
        ppl = math.exp(nll / positions)
        kept = len(reference["questions"]) - len(lost)
        print(
            f"{name:16s} ppl {ppl:.4f} ({100 * (ppl / base_ppl - 1):+.3f}%) top1 {top / positions:.4f} "
            f"mean|dlogp| {dlp / positions:.4f} answers {kept}/{len(reference['questions'])} lost {lost}",
            flush=True,
        )


if __name__ == "__main__":
    main()
