"""LISA ablations on the built-in SmolLM2-135M-Instruct, side by side in one run: the same shared layers, the
same calibration and held-out tokens, one row per registered variant (`research.inmemory.ABLATIONS`: named
LisaOptions; "direct" and "align only" are ablations the CLI does not offer).

    python benchmarks/lisa_ablations.py --ratio 0.2 --steps 100

Each row: held-out perplexity, fit seconds, and prefill/decode tokens/s against the original (speed.py).
The probability-space mixing variant in benchmarks/results-lisa-ablations.md was measured at commit 9f4fe28 by
swapping the modeling's score function in the benchmark; it is not a variant the modeling ships, so it is no longer
run here.
"""

import argparse
import time
from pathlib import Path

from common import prepare

from hfcompress.conversion.config import ConvertOptions
from hfcompress.lisa import LisaOptions, select_layers
from hfcompress.sources.source import BUILTIN_SOURCE
from hfcompress.evidence.speed import hardware_description, measure_speed
from hfcompress.evidence.validate import perplexity
from research.inmemory import ABLATIONS, build_converted_model, fit_lisa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=BUILTIN_SOURCE)
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--variants", nargs="+", default=list(ABLATIONS), choices=list(ABLATIONS))
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
        options = LisaOptions(share_ratio=args.ratio, steps=args.steps, **ABLATIONS[name])
        start = time.perf_counter()
        converted = build_converted_model(model, fit_lisa(model, attn_inputs, chosen, similarity, options), {})
        seconds = time.perf_counter() - start
        ppl = perplexity(converted, prepared.eval_ids, 512, max_tokens=args.eval_tokens, label=f"perplexity: {name}").perplexity
        speed = None if args.no_speed else measure_speed(model, converted, prepared.eval_ids)
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
