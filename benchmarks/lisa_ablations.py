"""LISA ablations on the built-in SmolLM2-135M-Instruct, side by side in one run: the same shared layers, the
same calibration and held-out tokens, one row per variant.

    python benchmarks/lisa_ablations.py --ratio 0.2 --steps 100

Variants (see hfcompress/lisa.py):
- direct: the previous layer's scores copied head for head (no alignment, no low-rank Q/K, nothing trained)
- align only: dense Align (head mix + FFN) trained, no low-rank Q/K
- dense + low-rank: dense Align (head mix + FFN) and low-rank Q/K (the DESIGN.md recommendation)
- linear + low-rank: dense head mix without the FFN, low-rank Q/K
- sparse + low-rank: one scaled source head per head, low-rank Q/K (SDPA fast path)
- linear + low-rank, probability space: the same parameters as "linear + low-rank", mixed after the softmax,
  P_l[h] = (1 - lam_h) sum_g w[h, g] P_{l-1}[g] + lam_h softmax(Q^lr K^lr^T / sqrt(r))[h], with w = the
  normalised positive part of the head mix and lam_h = sigmoid(bias_h - 2). Rows stay distributions. The
  modeling does not ship this variant: the benchmark swaps LisaSharedAttention.scores for log P_l while it
  fits and scores it (forward then computes softmax(log P_l) = P_l). No speed is measured for it.
Each row: held-out perplexity, fit seconds, and prefill/decode tokens/s against the original (speed.py).
"""

import argparse
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from hfcompress.build import build_converted_model
from common import prepare
from hfcompress.config import ConvertOptions
from hfcompress.lisa import LisaOptions, fit_lisa, select_layers
from hfcompress.remote import import_remote
from hfcompress.source import BUILTIN_SOURCE
from hfcompress.speed import hardware_description, measure_speed
from hfcompress.validate import perplexity

VARIANTS = {
    "direct": dict(align="identity", lowrank=False),
    "align only": dict(align="dense", lowrank=False),
    "dense + low-rank": dict(align="dense"),
    "linear + low-rank": dict(align="dense", align_hidden=0),
    "sparse + low-rank": dict(align="sparse"),
    "linear + low-rank, probability space": dict(align="dense", align_hidden=0),
}
PROBABILITY_SPACE = "linear + low-rank, probability space"


def probability_space_scores(self, prev_scores: torch.Tensor, q_lr: torch.Tensor, k_lr: torch.Tensor) -> torch.Tensor:
    """log P_l of the probability-space variant (see the module docstring); causal, no padding."""
    q_len, k_len = prev_scores.shape[-2:]
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=prev_scores.device).tril(k_len - q_len)
    prev_probs = torch.softmax(prev_scores.masked_fill(~allowed, float("-inf")), dim=-1)
    weights = self.align.mix.clamp_min(0) + 1e-6
    mixed = torch.einsum("hg,bgij->bhij", weights / weights.sum(-1, keepdim=True), prev_probs)
    lowrank = torch.matmul(q_lr, k_lr.transpose(2, 3)) * self.rank**-0.5
    lowrank_probs = torch.softmax(lowrank.masked_fill(~allowed, float("-inf")), dim=-1)
    share = torch.sigmoid(self.align.bias - 2.0)[None, :, None, None]
    return ((1 - share) * mixed + share * lowrank_probs).clamp_min(1e-30).log()


@contextmanager
def scores_replaced_by(function):
    shared = import_remote("modeling_lisa_llama").LisaSharedAttention
    original = shared.scores
    shared.scores = function
    try:
        yield
    finally:
        shared.scores = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=BUILTIN_SOURCE)
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--no-speed", action="store_true")
    args = parser.parse_args()

    prepared = prepare(ConvertOptions(source=args.source, out=Path("."), calib_text="builtin", eval_text="builtin"))
    model = prepared.model
    attn_inputs = prepared.attention_inputs()
    similarity = prepared.similarity(attn_inputs)
    base = perplexity(model, prepared.eval_ids, 512, max_tokens=args.eval_tokens, label="perplexity: original").perplexity
    chosen = select_layers(similarity, model.config.num_hidden_layers, LisaOptions(share_ratio=args.ratio))
    rows = []
    for name in args.variants:
        options = LisaOptions(share_ratio=args.ratio, steps=args.steps, **VARIANTS[name])
        probability_space = name == PROBABILITY_SPACE
        with scores_replaced_by(probability_space_scores) if probability_space else nullcontext():
            start = time.perf_counter()
            converted = build_converted_model(model, fit_lisa(model, attn_inputs, chosen, similarity, options), {})
            seconds = time.perf_counter() - start
            ppl = perplexity(converted, prepared.eval_ids, 512, max_tokens=args.eval_tokens, label=f"perplexity: {name}").perplexity
        speed = None if args.no_speed or probability_space else measure_speed(model, converted, prepared.eval_ids)
        rows.append((name, ppl, seconds, speed))
        print(f"{name}: ppl {ppl:.3f} ({100 * (ppl / base - 1):+.1f}%) fit {seconds:.0f}s "
              + (f"prefill {speed['prefill_speedup']:.2f}x decode {speed['decode_speedup']:.2f}x" if speed else ""), flush=True)

    print(f"\nlayers shared: {chosen} ({len(chosen)}/{model.config.num_hidden_layers}); steps={args.steps}; "
          f"eval {args.eval_tokens} held-out tokens; original PPL {base:.3f}; speed on {hardware_description()}, "
          "512-token prompt, 32 decoded tokens, medians of 3 interleaved runs")
    print("| variant | PPL | change | fit s | prefill vs original | decode vs original |")
    print("|---|---|---|---|---|---|")
    for name, ppl, seconds, speed in rows:
        ratios = (f"{speed['prefill_speedup']:.2f}x | {speed['decode_speedup']:.2f}x" if speed else "- | -")
        print(f"| {name} | {ppl:.3f} | {100 * (ppl / base - 1):+.1f}% | {seconds:.0f} | {ratios} |")


if __name__ == "__main__":
    main()
