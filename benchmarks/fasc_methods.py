"""FASC methods side by side on the built-in SmolLM2-135M-Instruct: perplexity and factual recall at one budget.

    python benchmarks/fasc_methods.py --budgets 0.8 --methods fisher whiten pca svd

Statistics (C, G, rho probes) are collected once and cached; every method factorises the same targets under
the same parameter budget with the same allocator. Prints one markdown table.
"""

import argparse
import time
from pathlib import Path

from hfcompress.conversion.build import parameter_counts
from common import prepare
from hfcompress.conversion.config import ConvertOptions
from hfcompress.fasc import DEFAULT_TARGETS, FascOptions
from hfcompress.distill import DistillOptions
from hfcompress.evidence.probe import run_probe
from hfcompress.sources.source import BUILTIN_SOURCE
from hfcompress.evidence.validate import perplexity
from research.inmemory import build_converted_model, compress_linears, distill_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=BUILTIN_SOURCE)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.8])
    parser.add_argument("--methods", nargs="+", default=["fisher", "whiten", "pca", "svd"])
    parser.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS))
    parser.add_argument("--calib-sequences", type=int, default=16)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--distill-tokens", type=int, default=0, help="end-to-end KL distillation tokens after each conversion")
    args = parser.parse_args()

    prepared = prepare(
        ConvertOptions(source=args.source, out=Path("."), calib_sequences=args.calib_sequences, calib_text="builtin", eval_text="builtin")
    )
    model, tokenizer = prepared.model, prepared.tokenizer
    start = time.perf_counter()
    stats = prepared.linear_stats(tuple(args.targets), seed=0)
    stats_seconds = time.perf_counter() - start
    linears = {name: model.model.layers.get_submodule(name) for name in stats}
    targeted = sum(l.weight.numel() for l in linears.values())
    base_ppl = perplexity(model, prepared.eval_ids, 512, max_tokens=args.eval_tokens).perplexity
    base_probe = run_probe(model, tokenizer)
    rows = [("original", "-", base_ppl, base_probe.correct, base_probe.total, parameter_counts(model)["total"], targeted, 0.0)]
    for budget in args.budgets:
        for method in args.methods:
            start = time.perf_counter()
            factors, results = compress_linears(linears, stats, FascOptions(method=method, budget=budget, targets=tuple(args.targets)))
            converted = build_converted_model(model, [], factors)
            if args.distill_tokens:
                converted, _ = distill_model(converted, model, prepared.sequences.flatten(), DistillOptions(tokens=args.distill_tokens))
            seconds = time.perf_counter() - start
            kept = sum(a.numel() + b.numel() for a, b in factors.values()) + sum(
                linears[r.name].weight.numel() for r in results if r.rank is None
            )
            ppl = perplexity(converted, prepared.eval_ids, 512, max_tokens=args.eval_tokens).perplexity
            probe = run_probe(converted, tokenizer)
            rows.append((method, budget, ppl, probe.correct, probe.total, parameter_counts(converted)["total"], kept, seconds))
            print(f"{method} @ {budget}: ppl {ppl:.3f} probe {probe.correct}/{probe.total}", flush=True)
    print(f"\ndistill_tokens={args.distill_tokens} targets={' '.join(args.targets)} calib={args.calib_sequences}x256 eval_tokens={args.eval_tokens} "
          f"statistics {stats_seconds:.0f}s (0 = cached)")
    print("| method | budget | PPL | probe | params total | targeted params kept | factorise s |")
    print("|---|---|---|---|---|---|---|")
    for method, budget, ppl, correct, total, params, kept, seconds in rows:
        print(f"| {method} | {budget} | {ppl:.3f} | {correct}/{total} | {params:,} | {kept:,} ({100 * kept / targeted:.0f}%) | {seconds:.1f} |")


if __name__ == "__main__":
    main()
