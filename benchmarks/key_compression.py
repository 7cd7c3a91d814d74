"""Low-rank keys in every attention layer, training-free: which layout, which criterion, which per-layer widths (issue 41).

    python benchmarks/key_compression.py --widths 96 64 144 --out benchmarks/results-key-compression.md

Every layer's pre-RoPE keys go through k -> P k (hfcompress.keys: the layouts `pre` and `rope`, the criteria svd, pca,
query and fisher, the Fisher surrogate of each layer's loss change). Widths: `uniform` (every layer caches the same
number of key values) or `planned` (one budget of cached key values for all layers, spent by `plan_sizes` where the
surrogate falls most). The keys are projected by forward hooks in transformers' own model (`projected_keys`): the
perplexity is the one the cached latent gives, in both layouts.

Statistics: 32 x 256 calibration tokens of the conversion's default text (`mix`), with gradients (cached). Perplexity:
the gate's texts and windows (the held-out calibration text and numpy-docs, which no step sees; 4,096 tokens each,
windows of 512). KV: cached values a token against the original's K + V. Rows are appended to --out as they finish.
"""

import argparse
import math
import time
from pathlib import Path

import torch

from hfcompress.conversion.calibrate import cache_key, load_or_compute, tensor_fingerprint
from hfcompress.conversion.config import ConvertOptions
from hfcompress.keys import KeySubspace, key_module, key_statistics, plan_sizes, projected_keys
from hfcompress.sources.source import BUILTIN_SOURCE, load_source, resolve_source, source_identity
from hfcompress.sources.token_streams import token_streams
from hfcompress.evidence.validate import perplexity

def spearman(a: list[float], b: list[float]) -> float:
    rank = lambda xs: torch.tensor(xs).argsort().argsort().double()
    ra, rb = rank(a), rank(b)
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def model_and_key_statistics(source_name: str, calib_sequences: int):
    """(options, transformers' model, its token streams, its per-layer KeyStatistics with gradients, the benchmark cache
    directory of this source and calibration text): the statistics on `calib_sequences` x 256 calibration tokens of
    the conversion's default text, cached."""
    options = ConvertOptions(source=source_name, out=Path("."), calib_sequences=calib_sequences, seq_len=256)
    source = resolve_source(options.source, options.revision, None, options.trust_remote_code)
    model, tokenizer = load_source(source)
    streams = token_streams(options, tokenizer)
    cache = options.cache_dir / "benchmarks" / cache_key(source_identity(source), tensor_fingerprint(streams.sequences))
    start = time.perf_counter()
    stats = load_or_compute(cache / "key_statistics-v2.pt", lambda: key_statistics(model, streams.sequences, gradients=True))
    print(f"key statistics: {time.perf_counter() - start:.0f} s ({streams.sequences.numel():,} tokens of {streams.calib_name})")
    return options, model, streams, stats, cache


def check_surrogate(model, stats, weights, head_dim: int, width: int, streams, context: int, out: Path | None) -> None:
    """Does the Fisher surrogate rank layers as the loss does? Per layer alone: its keys on `width` Fisher directions,
    the selection tokens' mean loss change against the original's, beside the surrogate tr(G (I-P) C (I-P)^T)."""

    def loss() -> float:
        with torch.no_grad():
            return math.log(perplexity(model, streams.selection_ids, context, prefix=streams.prefix, label="selection").perplexity)

    base = loss()
    rows, surrogates, changes = [], [], []
    for index in range(len(model.model.layers)):
        sub = KeySubspace(stats[index], weights[index], "fisher", "pre", head_dim)
        with projected_keys(model, {index: sub.projector(width)}):
            change = loss() - base
        surrogates.append(sub.cost(width))
        changes.append(change)
        rows.append(f"| {index} | {surrogates[-1]:.4f} | {change:+.5f} |")
        print(rows[-1], flush=True)
    lines = [f"Keys of one layer at a time on {width} Fisher directions (pre-RoPE); loss: mean NLL of "
             f"{len(streams.selection_ids):,} selection tokens, original {base:.4f}.", "",
             "| layer | surrogate | measured loss change |", "|---|---|---|", *rows, "",
             f"Spearman rank correlation, surrogate vs measured: {spearman(surrogates, changes):.3f}"]  # fmt: skip
    print(lines[-1])
    if out:
        out.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=BUILTIN_SOURCE)
    parser.add_argument("--widths", type=int, nargs="+", default=[144, 96, 64], help="mean cached key values per layer")
    parser.add_argument("--methods", nargs="+", default=["fisher", "pca", "query", "svd"])
    parser.add_argument("--layouts", nargs="+", default=["pre", "rope"])
    parser.add_argument("--allocations", nargs="+", default=["uniform", "planned"])
    parser.add_argument("--calib-sequences", type=int, default=32)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="markdown file the rows are appended to")
    parser.add_argument(
        "--check-surrogate", type=int, default=0, metavar="WIDTH",
        help="instead of the table: per layer, the Fisher surrogate of keeping WIDTH key values (fisher, pre) against "
        "the measured loss change of that layer alone on the calibration text's selection tokens (no fit saw them)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    options, model, streams, stats, _ = model_and_key_statistics(args.source, args.calib_sequences)

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = model.model.layers
    kv_width = layers[0].self_attn.k_proj.out_features
    if key_module(layers[0].self_attn) is not layers[0].self_attn.k_proj and "svd" in args.methods:
        parser.error("svd needs keys straight from k_proj (this family normalises them with k_norm)")
    weights = [layer.self_attn.k_proj.weight.detach() for layer in layers]

    def score() -> list[float]:
        with torch.no_grad():
            return [
                perplexity(model, ids, options.eval_context, max_tokens=args.eval_tokens, prefix=streams.prefix).perplexity
                for ids in streams.evaluations.values()
            ]

    if args.check_surrogate:
        check_surrogate(model, stats, weights, head_dim, args.check_surrogate, streams, options.eval_context, args.out)
        return
    names = [name.split(" (")[0] for name in streams.evaluations]  # "mixture of ...", "numpy-docs"
    base = score()
    header = "| layout | method | widths | K width (mean) | KV | " + " | ".join(f"{n} ppl (ratio)" for n in names) + " | surrogate |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    lines.append(f"| original | - | - | {kv_width} | 1.000x | " + " | ".join(f"{p:.3f}" for p in base) + " | 0 |")
    print("\n".join(lines), flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    for layout in args.layouts:
        for method in args.methods:
            subspaces = [KeySubspace(stats[i], weights[i], method, layout, head_dim) for i in range(len(layers))]
            step = subspaces[0].values_per_step
            for width in args.widths:
                for allocation in args.allocations:
                    if allocation == "uniform":
                        sizes = [width // step] * len(layers)
                    else:
                        sizes = plan_sizes(subspaces, width * len(layers))
                    surrogate = sum(sub.cost(n) for sub, n in zip(subspaces, sizes))
                    with projected_keys(model, {i: sub.projector(n) for i, (sub, n) in enumerate(zip(subspaces, sizes))}):
                        ppl = score()
                    cached = [n * step for n in sizes]
                    mean = sum(cached) / len(cached)
                    kv = (mean + kv_width) / (2 * kv_width)
                    shown = f"all {cached[0]}" if allocation == "uniform" else ",".join(map(str, cached))
                    row = (
                        f"| {layout} | {method} | {allocation}: {shown} | {mean:.1f} | {kv:.3f}x | "
                        + " | ".join(f"{p:.3f} ({p / b:.3f}x)" for p, b in zip(ppl, base))
                        + f" | {surrogate:.1f} |"
                    )
                    print(row, flush=True)
                    if args.out:
                        with args.out.open("a") as f:
                            f.write(row + "\n")


if __name__ == "__main__":
    main()
