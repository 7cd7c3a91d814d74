"""The KV frontier of a model: one row per conversion (plan, KV cache, both gate texts, decode tok/s), from the outputs'
reports (issue 41).

    python benchmarks/kv_frontier.py --title "SmolLM2-135M" DIR [DIR ...] --markdown benchmarks/results-kv-frontier.md

Each DIR is a `hfcompress convert` output. KV: cached values a token against the original's (the report's
`keys.kv_values_per_token`, else the peers'). Texts: the gate's rows. Decode: the long-context speed rows stored by
`benchmarks/long_context.py --card DIR` (decode tok/s against the original's, side by side), else the conversion's own
speed step, else "-". The peers of each run (training-free, at that run's saving) are listed below the table, then the
frontier of each run's plan that its card draws (the plan at other budgets, training-free), where the report has one.
"""

import argparse
import datetime
import json
from pathlib import Path

from hfcompress.evidence.report import REPORT_FILE


def plan_of(report: dict) -> str:
    """The conversion's KV plan in words: what it changed and by which plan."""
    keys, lisa = report.get("keys") or {}, report.get("lisa") or {}
    parts = []
    if lisa.get("layers"):
        parts.append(f"{len(lisa['layers'])} shared")
    if keys:
        chosen = keys.get("chosen_plan", keys.get("plan", "keys"))
        named = f"--kv-plan {keys.get('plan', 'keys')}" + (f" (kept {chosen})" if chosen != keys.get("plan", "keys") else "")
        search = keys.get("search")
        found = f" --kv-ppl-budget {search['ppl_budget']:g} (found {keys['kv_budget']:g})" if search else ""
        parts.append(f"{named} --kv-budget {search['floor'] if search else keys['kv_budget']:g}{found}")
    dropped = sorted({*(lisa.get("dropped_attention_layers") or []), *(keys.get("dropped_attention_layers") or [])})
    if dropped:
        parts.append(f"attention dropped {dropped}")
    if report.get("back_off"):
        parts.append(f"after {len(report['back_off'])} back-off attempts")
    return ", ".join(parts) or "nothing changed"


def kv_ratio(report: dict) -> float:
    values = (report.get("keys") or {}).get("kv_values_per_token") or (report.get("peers") or {}).get("kv_values_per_token")
    return values["converted"] / values["original"]


def decode(report: dict) -> str:
    """Decode tok/s, converted against original, of each measured cell."""
    speed = report.get("speed") or {}
    rows = (speed.get("long_context") or {}).get("rows")
    if rows:
        cells = [row for row in rows if row["phase"] == "decode"]
        return "; ".join(
            f"{row['batch']}x{row['context']}: {row['converted']['tokens_per_s']:.1f} vs "
            f"{row['original']['tokens_per_s']:.1f} ({row['speedup']:.2f}x)"
            for row in cells
        )
    return "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", type=Path, nargs="+")
    parser.add_argument("--title", required=True, help="the model, as the section's heading names it")
    parser.add_argument("--markdown", type=Path, help="append the section to FILE")
    args = parser.parse_args()

    reports = [(d, json.loads((d / REPORT_FILE).read_text())) for d in args.dirs]
    reports.sort(key=lambda item: -kv_ratio(item[1]))
    texts = [row["eval_text"].split(" (")[0] for row in reports[0][1]["validation"]["texts"]]
    header = "| plan | KV cache | " + " | ".join(texts) + " | gate | decode tok/s (converted vs original) | wall |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    originals = " | ".join(f"{row['original']['perplexity']:.3f}" for row in reports[0][1]["validation"]["texts"])
    lines.append(f"| original | 1.000x | {originals} | | | |")
    peers, frontier = [], []
    for directory, report in reports:
        validation = report["validation"]
        changes = " | ".join(
            f"{row['converted']['perplexity']:.3f} ({row['perplexity_increase_pct']:+.2f}%)" for row in validation["texts"]
        )
        gate = "passed" if validation["gate_passed"] else "failed"
        lines.append(
            f"| {plan_of(report)} | {kv_ratio(report):.3f}x | {changes} | {gate} | {decode(report)} | "
            f"{report['wall_seconds'] / 60:.0f} min |"
        )
        originals = [row["original"]["perplexity"] for row in validation["texts"]]
        for peer in (report.get("peers") or {}).get("peers", []):
            scores = ", ".join(f"{100 * (p / o - 1):+.1f}%" for p, o in zip(peer["perplexity"].values(), originals))
            peers.append(f"- {directory.name}: {peer['name']} at {peer['kv_ratio']:.3f}x: {scores}")
        for point in (report.get("peers") or {}).get("frontier", []):
            scores = ", ".join(f"{100 * (p / o - 1):+.1f}%" for p, o in zip(point["perplexity"].values(), originals))
            frontier.append(f"- {directory.name}: {point['name']} at {point['kv_ratio']:.3f}x: {scores}")
    section = [
        f"## {args.title}", "", f"`python {' '.join(['benchmarks/kv_frontier.py', *map(str, args.dirs)])}` "
        f"({datetime.date.today().isoformat()})", "", *lines, "", "Training-free peers at each run's saving:", "",
        *peers, "",
        *(["The card's frontier: each run's plan at other budgets, training-free (peers step):", "", *frontier, ""] if frontier else []),
    ]  # fmt: skip
    print("\n".join(section))
    if args.markdown:
        with args.markdown.open("a") as out:
            out.write("\n".join(section) + "\n")


if __name__ == "__main__":
    main()
