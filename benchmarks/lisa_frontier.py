"""LISA frontier on the built-in SmolLM2-135M-Instruct: shared layers vs held-out perplexity, one run.

    python benchmarks/lisa_frontier.py --ratios 0.2 0.33 0.5 --steps 100

Prints one table: share ratio, layers shared, Q/K parameters, perplexity (original and converted, same tokens),
fit time. Ablation flags: --align-hidden 0 (linear head mix only), --steps 0 (aligned sharing, no training).
"""

import argparse
import time
from pathlib import Path

from hfcompress.conversion.build import parameter_counts
from common import prepare
from hfcompress.conversion.config import ConvertOptions
from hfcompress.distill import DistillOptions
from hfcompress.lisa import LisaOptions, select_layers
from hfcompress.sources.source import BUILTIN_SOURCE
from hfcompress.evidence.validate import perplexity
from research.inmemory import build_converted_model, distill_model, fit_lisa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=BUILTIN_SOURCE)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.2, 0.33, 0.5])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--align-hidden", type=int, default=16)
    parser.add_argument("--distill-tokens", type=int, default=0, help="end-to-end KL distillation tokens after each conversion")
    parser.add_argument("--calib-sequences", type=int, default=16)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    args = parser.parse_args()

    options = ConvertOptions(
        source=args.source, out=Path("."), calib_sequences=args.calib_sequences, calib_text="builtin", eval_text="builtin"
    )
    prepared = prepare(options)
    model = prepared.model
    attn_inputs = prepared.attention_inputs()
    similarity = prepared.similarity(attn_inputs)
    base = perplexity(model, prepared.eval_ids, 512, max_tokens=args.eval_tokens).perplexity
    qk_original = parameter_counts(model)["attention_qk"]
    rows = []
    for ratio in args.ratios:
        lisa = LisaOptions(share_ratio=ratio, steps=args.steps, lr=args.lr, align_hidden=args.align_hidden)
        chosen = select_layers(similarity, model.config.num_hidden_layers, lisa)
        start = time.perf_counter()
        fitted = fit_lisa(model, attn_inputs, chosen, similarity, lisa)
        converted = build_converted_model(model, fitted, {})
        if args.distill_tokens:
            converted, _ = distill_model(converted, model, prepared.sequences.flatten(), DistillOptions(tokens=args.distill_tokens))
        seconds = time.perf_counter() - start
        ppl = perplexity(converted, prepared.eval_ids, 512, max_tokens=args.eval_tokens).perplexity
        rows.append((ratio, chosen, parameter_counts(converted)["attention_qk"], ppl, seconds))
        print(f"ratio {ratio}: layers {chosen} ppl {ppl:.3f} fit {seconds:.0f}s", flush=True)
    print(f"\ndistill_tokens={args.distill_tokens} steps={args.steps} lr={args.lr} align_hidden={args.align_hidden} calib={args.calib_sequences}x256 "
          f"eval_tokens={args.eval_tokens}")
    print("| share ratio | layers shared | Q/K params (orig {:,}) | PPL orig | PPL converted | change | fit s |".format(qk_original))
    print("|---|---|---|---|---|---|---|")
    for ratio, chosen, qk, ppl, seconds in rows:
        print(f"| {ratio} | {len(chosen)} | {qk:,} | {base:.3f} | {ppl:.3f} | {100 * (ppl / base - 1):+.1f}% | {seconds:.0f} |")


if __name__ == "__main__":
    main()
