"""Long-context speed of an original model against its conversion: KV cache after the prompt, decode and prefill
tokens/s, in one process, repetitions interleaved, medians (research/long_context.py: long_context_speed).

    python benchmarks/long_context.py --converted DIR [--original smollm2-135m-instruct] [--repeats 3]
        [--long-repeats 1] [--new-tokens 16] [--grid decode:1x512,decode:4x2048,...] [--threads N]
        [--markdown FILE] [--card DIR]

The original loads as transformers' LlamaForCausalLM (hfcompress.sources.source), the conversion as users load it:
AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True). Both in float32 on the CPU. --card DIR stores the
rows in DIR/hfcompress_report.json under speed["long_context"] and re-renders DIR/README.md.
"""

import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hfcompress.evidence.card import write_card
from hfcompress.evidence.report import REPORT_FILE
from hfcompress.sources.source import BUILTIN_SOURCE, load_source, resolve_source
from hfcompress.evidence.speed import hardware_description
from research.long_context import LONG_CONTEXT_GRID, cell_name, long_context_speed, long_context_table


def parse_grid(text: str) -> list[tuple[str, int, int]]:
    """"decode:4x2048,prefill:1x512" -> [("decode", 4, 2048), ("prefill", 1, 512)]."""
    cells = []
    for item in text.split(","):
        phase, _, shape = item.strip().partition(":")
        batch, _, context = shape.partition("x")
        if phase not in ("decode", "prefill") or not (batch.isdigit() and context.isdigit()):
            raise argparse.ArgumentTypeError(f"grid cell {item!r}: expected decode:BxT or prefill:BxT")
        cells.append((phase, int(batch), int(context)))
    return cells


def store_in_card(directory: Path, record: dict) -> None:
    """speed["long_context"] of the conversion's report, then its README.md rendered again from the report."""
    path = directory / REPORT_FILE
    report = json.loads(path.read_text())
    report["speed"] = {**(report.get("speed") or {}), "long_context": record}
    path.write_text(json.dumps(report, indent=2, default=str))
    write_card(report, (report.get("push") or {}).get("repo_id") or directory.name, directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--original", default=BUILTIN_SOURCE, help="source model (anything `hfcompress convert` takes)")
    parser.add_argument("--converted", type=Path, required=True, help="a `hfcompress convert` output directory")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long-repeats", type=int, default=1, help="repetitions of prefill cells of 8192+ tokens")
    parser.add_argument("--new-tokens", type=int, default=16, help="decode steps timed per repetition")
    default_grid = ",".join(f"{p}:{b}x{t}" for p, b, t in LONG_CONTEXT_GRID)
    parser.add_argument("--grid", type=parse_grid, default=parse_grid(default_grid), help=f"default {default_grid}")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--markdown", type=Path, help="append the table (with command, date, hardware) to FILE")
    parser.add_argument("--card", type=Path, help="store the rows in DIR's report and re-render DIR/README.md")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f} s] {message}", file=sys.stderr, flush=True)

    original, _ = load_source(resolve_source(args.original))
    converted = AutoModelForCausalLM.from_pretrained(args.converted, trust_remote_code=True, dtype=torch.float32)
    models = {"original": original.eval(), "converted": converted.eval()}
    progress(f"loaded; cells: {', '.join(cell_name(*cell) for cell in args.grid)}")
    rows = long_context_speed(
        models, args.grid, args.new_tokens, args.repeats, args.long_repeats, vocab_size=original.config.vocab_size,
        progress=progress,
    )  # fmt: skip
    hardware = hardware_description(torch.device("cpu"))
    command = shlex.join(["python", *sys.argv])
    table = long_context_table(rows)
    print(f"\n{hardware}; float32; medians of interleaved repetitions; decode: {args.new_tokens} steps\n\n{table}")
    if args.markdown:
        date = datetime.date.today().isoformat()
        with args.markdown.open("a") as out:
            out.write(f"\n`{command}` ({date}; {hardware}; float32)\n\n{table}\n")
    if args.card:
        record = {
            "hardware": hardware, "dtype": "float32", "new_tokens": args.new_tokens, "command": command, "rows": rows,
        }  # fmt: skip
        store_in_card(args.card, record)


if __name__ == "__main__":
    main()
