"""Can values be compressed too, and does one budget over keys and values beat keys alone? Training-free (issue 41).

    python benchmarks/value_compression.py --out benchmarks/results-value-compression.md

A layer's values v (v_proj's output, all KV heads side by side) go through v -> P v, P = A B of rank r: a cache holding
the latent B v needs no reconstruction per step (no RoPE on values; A folds into o_proj). The criteria are the keys'
(hfcompress.keys.KeySubspace, layout `pre`): `pca` (M = I), `fisher` (M = G = E[g g^T], g = d loss / d v) and `output`
(M = what o_proj makes of each KV head's values: the sum of W_o,h^T W_o,h over the query heads reading it; data-free).
Rows: values alone at uniform widths; then one budget of cached values spent over keys and values together by the
Fisher surrogate (plan_sizes over both layers' subspaces, the loss units comparable), against keys alone at that budget.

Statistics: the keys' (benchmarks/key_compression.py, cached) and the values' own, on the same 32 x 256 calibration
tokens with gradients (cached). Perplexity: the gate's two texts, 4,096 tokens each, windows of 512.
"""

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from hfcompress.conversion.calibrate import load_or_compute
from hfcompress.evidence.validate import perplexity
from hfcompress.keys import KeySubspace, plan_sizes, projected_keys, projected_values
from hfcompress.keys.statistics import KeyStatistics, run_sequences
from hfcompress.sources.source import BUILTIN_SOURCE

from key_compression import model_and_key_statistics


def value_statistics(model: nn.Module, sequences: torch.Tensor) -> list[KeyStatistics]:
    """Per layer, C = E[v v^T] and G = E[g g^T] (g = d summed loss / d v) of v_proj's output over `sequences`."""
    layers = model.model.layers
    width = layers[0].self_attn.v_proj.out_features
    stats = [KeyStatistics(torch.zeros(width, width, dtype=torch.float64), torch.zeros(0),
                           torch.zeros(width, width, dtype=torch.float64)) for _ in layers]  # fmt: skip

    def hook(entry: KeyStatistics):
        def on_value(module, inputs, output):
            flat = output.detach().reshape(-1, width).double()
            entry.C += flat.T @ flat

            def on_grad(grad: torch.Tensor) -> None:
                flat_grad = grad.reshape(-1, width).double()
                entry.G.add_(flat_grad.T @ flat_grad)

            output.register_hook(on_grad)

        return on_value

    handles = [layer.self_attn.v_proj.register_forward_hook(hook(entry)) for layer, entry in zip(layers, stats)]
    try:
        tokens = run_sequences(model, sequences, gradients=True)
    finally:
        for handle in handles:
            handle.remove()
    for entry in stats:
        entry.C /= tokens
        entry.G /= tokens
        entry.tokens = tokens
    return stats


def output_metric(attention: nn.Module, head_dim: int) -> torch.Tensor:
    """Block-diagonal (KV x d)^2 metric: per KV head, sum over the query heads reading it of W_o,h^T W_o,h."""
    w = attention.o_proj.weight.detach().double()  # (hidden, heads x d)
    heads = w.shape[1] // head_dim
    kv_heads = attention.v_proj.out_features // head_dim
    per_head = w.reshape(w.shape[0], heads, head_dim).permute(1, 2, 0)  # (heads, d, hidden)
    grams = per_head @ per_head.transpose(1, 2)  # (heads, d, d)
    blocks = grams.reshape(kv_heads, heads // kv_heads, head_dim, head_dim).sum(1)
    return torch.block_diag(*blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=BUILTIN_SOURCE)
    parser.add_argument("--value-widths", type=int, nargs="+", default=[160, 128])
    parser.add_argument("--methods", nargs="+", default=["fisher", "pca", "output"])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.75, 0.6, 0.5], help="KV cache fractions")
    parser.add_argument("--calib-sequences", type=int, default=32)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    options, model, streams, key_stats, cache = model_and_key_statistics(args.source, args.calib_sequences)
    start = time.perf_counter()
    value_stats = load_or_compute(cache / "value_statistics.pt", lambda: value_statistics(model, streams.sequences))
    print(f"value statistics: {time.perf_counter() - start:.0f} s")
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = model.model.layers
    width = layers[0].self_attn.v_proj.out_features
    count = len(layers)

    def score(keys: dict[int, torch.Tensor], values: dict[int, torch.Tensor]) -> list[float]:
        with projected_values(model, values), projected_keys(model, keys), torch.no_grad():
            return [
                perplexity(model, ids, options.eval_context, max_tokens=args.eval_tokens, prefix=streams.prefix).perplexity
                for ids in streams.evaluations.values()
            ]

    names = [name.split(" (")[0] for name in streams.evaluations]
    base = score({}, {})
    header = "| what | K widths | V widths | KV | " + " | ".join(f"{n} ppl (ratio)" for n in names) + " |"
    lines = [header, "|" + "---|" * (header.count("|") - 1), f"| original | {width} | {width} | 1.000x | " + " | ".join(f"{p:.3f}" for p in base) + " |"]
    print("\n".join(lines), flush=True)
    if args.out:
        args.out.write_text(__doc__.split("\n\n")[0] + "\n\n" + "\n".join(lines) + "\n")

    def emit(what: str, k_sizes: list[int], v_sizes: list[int], keys: dict, values: dict) -> None:
        ppl = score(keys, values)
        kv = (sum(k_sizes) + sum(v_sizes)) / (2 * width * count)
        shown = lambda sizes: f"all {sizes[0]}" if len(set(sizes)) == 1 else ",".join(map(str, sizes))
        row = f"| {what} | {shown(k_sizes)} | {shown(v_sizes)} | {kv:.3f}x | " + " | ".join(f"{p:.3f} ({p / b:.3f}x)" for p, b in zip(ppl, base)) + " |"
        print(row, flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(row + "\n")

    def value_subspace(i: int, method: str) -> KeySubspace:
        stats = value_stats[i]
        if method == "output":
            stats = KeyStatistics(C=stats.C, q2=stats.q2, G=output_metric(layers[i].self_attn, head_dim))
            return KeySubspace(stats, None, "fisher", "pre", head_dim)  # the metric in G's place
        return KeySubspace(stats, None, method, "pre", head_dim)

    for method in args.methods:
        subs = [value_subspace(i, method) for i in range(count)]
        for w in args.value_widths:
            emit(f"values {method} uniform", [width] * count, [w] * count, {}, {i: s.projector(w) for i, s in enumerate(subs)})
    k_subs = [KeySubspace(key_stats[i], None, "fisher", "pre", head_dim) for i in range(count)]
    v_subs = [value_subspace(i, "fisher") for i in range(count)]
    for budget in args.budgets:
        total = int(budget * 2 * width * count)
        keys_only = plan_sizes(k_subs, total - width * count, floor=8)
        emit(f"keys alone {budget}", keys_only, [width] * count, {i: s.projector(n) for i, (s, n) in enumerate(zip(k_subs, keys_only))}, {})
        both = plan_sizes(k_subs + v_subs, total, floor=8)
        ks, vs = both[:count], both[count:]
        emit(f"keys + values {budget}", ks, vs, {i: s.projector(n) for i, (s, n) in enumerate(zip(k_subs, ks))},
             {i: s.projector(n) for i, (s, n) in enumerate(zip(v_subs, vs))})  # fmt: skip


if __name__ == "__main__":
    main()
