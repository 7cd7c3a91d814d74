"""The whole SmolLM2 conversion with the README defaults, and one summary table of quality and speed ratios.

    python benchmarks/summary.py [--out /tmp/summary-run] [convert flags...]

Runs `hfcompress convert` (built-in SmolLM2-135M-Instruct, README defaults, plus any flags given) in this process,
under one peak-RSS measurement, then prints a markdown table from the conversion's own report: the README's
results table comes from this script.
"""

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

from typer.testing import CliRunner

from hfcompress.cli import app
from hfcompress.evidence.report import REPORT_FILE
from hfcompress.evidence.validate import read_json


def summary_table(report: dict, wall: float, peak_rss_mb: float) -> str:
    validation, params, speed = report["validation"], report["parameters"], report["speed"]
    lisa = report["lisa"]
    probe = validation.get("probe", {})
    rows = [
        ("layers shared (LISA)", f"{len(lisa['layers'])}/{report['num_layers']}: {lisa['layers']}"),
        ("shared Q/K smaller by", f"{lisa['qk_compression_measured']:.2f}x" if lisa["qk_compression_measured"] else "-"),
        ("parameters", f"{params['original']['total']:,} -> {params['converted']['total']:,}"),
        *((f"perplexity, {row['eval_text'].split(' (')[0]}", f"{row['original']['perplexity']:.3f} -> "
           f"{row['converted']['perplexity']:.3f} ({row['perplexity_increase_pct']:+.2f}%)") for row in validation["texts"]),
        ("distillation", f"{distill['steps'] * distill['seq_len'] * distill['batch_size']:,} tokens, {distill['seconds']:.0f} s"
         if (distill := report["finishers"].get("distillation")) else "-"),
        ("factual probe", f"{probe['original']['correct']} -> {probe['converted']['correct']} / {probe['original']['total']}"
         if probe else "-"),
        ("prefill tok/s", f"{speed['original']['prefill_tokens_per_s']:.1f} -> {speed['converted']['prefill_tokens_per_s']:.1f} "
                          f"({speed['prefill_speedup']:.2f}x)" if speed else "-"),
        ("decode tok/s", f"{speed['original']['decode_tokens_per_s']:.2f} -> {speed['converted']['decode_tokens_per_s']:.2f} "
                         f"({speed['decode_speedup']:.2f}x)" if speed else "-"),
        ("KV cache after 512+32 tokens", f"{speed['original']['cache_mb']:.1f} -> {speed['converted']['cache_mb']:.1f} MB" if speed else "-"),
        ("conversion wall time", f"{wall:.0f} s"),
        ("peak RSS", f"{peak_rss_mb:,.0f} MB"),
    ]
    lines = [
        f"`{report['command']}` on {report['hardware']}; eval text: {validation['eval_text']}",
        "",
        "| measure | original -> converted |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in rows),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="output directory [default: a temporary one]")
    parser.add_argument("--from-report", type=Path, default=None, help="print the table of an existing report, convert nothing")
    args, convert_flags = parser.parse_known_args()
    if args.from_report:
        report = read_json(args.from_report)
        print(summary_table(report, report["wall_seconds"], report["memory"]["peak_rss_mb"]))
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="hfcompress-summary-")) / "smollm2-lisa"
    argv = ["convert", "--out", str(out), "--overwrite", *convert_flags]
    sys.argv = ["hfcompress", *argv]  # the report records the command as the user would type it
    start = time.perf_counter()
    result = CliRunner().invoke(app, argv)
    wall = time.perf_counter() - start
    if result.exit_code not in (0, 3):  # 3: gate failed, the output and report still exist
        sys.exit(f"convert failed (exit {result.exit_code}): {result.output[-2000:]}")
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(summary_table(read_json(out / REPORT_FILE), wall, peak_rss_mb))


if __name__ == "__main__":
    main()
