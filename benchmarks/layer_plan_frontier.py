"""The layer plan's frontier: conversions of one model, each beside the training-free peers `convert` computes for it.

    python benchmarks/layer_plan_frontier.py run smollm2 share-6      # one conversion (hfcompress convert), report kept
    python benchmarks/layer_plan_frontier.py table                    # results-layer-plan-frontier.md from the reports
    python benchmarks/layer_plan_frontier.py peers smollm2            # results-peers-smollm2.md: the peers alone (default gate)

`run` calls `hfcompress convert` with the run's flags (RUNS) into a scratch directory and copies its report to
benchmarks/frontier/<model>-<run>.json; `table` reads every such report and writes results-layer-plan-frontier.md: per
conversion, what its plan shares and drops, its KV cache a token, perplexity on each gated text, decode speed, and the
peers at its KV saving (attention and layer dropping by block influence, the 4-bit KV cache), with the verdict.
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
REPORTS = HERE / "frontier"
RESULTS = HERE / "results-layer-plan-frontier.md"
# the gates: the default (no flags: the held-out part of the calibration mixture and numpy-docs, a technical domain no
# step sees), and the earlier offline default (Wikipedia held out, and news)
WIKI_NEWS = ["--calib-text", "wiki", "--ood-text", "news"]
RECIPE_15 = ["--share-ratio", "0.5", "--lisa-max-chain", "2", "--calib-sequences", "256", "--seq-len", "512"]
MODELS = ["smollm2", "gemma3"]
RUNS = {
    "share-6": [],  # the default: 6 shared layers
    "share-6-group-heads": ["--lisa-group-heads"],
    "mixed-6": ["--layer-plan", "mixed"],
    "mixed-9": ["--layer-plan", "mixed", "--share-ratio", "0.3"],
    "drop-3": ["--layer-plan", "drop", "--share-ratio", "0.1"],
    "recipe-15": RECIPE_15,  # the README's 15-layer recipe
    "share-6-back-off": ["--back-off", "--max-ppl-increase", "10"],  # the default, fewer layers until the gate passes
    "recipe-15-back-off": [*RECIPE_15, "--back-off", "--max-ppl-increase", "10"],
    # the attempt --back-off makes after recipe-15's gate (numpy-docs +13.05%): floor(15 x 10 / 13.05) = 11 layers
    "recipe-15-backed-off-11": [*RECIPE_15[2:], "--share-ratio", str(11 / 30)],
    "share-6-wiki-news": WIKI_NEWS,
}


def model_source(model: str) -> str:
    """The conversion's source: SmolLM2 by its built-in name, Gemma-3-270M assembled from its GGUF (tests/gemma3.py)."""
    if model == "smollm2":
        return "smollm2-135m-instruct"
    sys.path.insert(0, str(ROOT / "tests"))
    from gemma3 import gemma3_gguf

    return str(gemma3_gguf())


def run(model: str, name: str, scratch: Path) -> None:
    out = scratch / f"{model}-{name}"
    command = [sys.executable, "-m", "hfcompress.cli", "convert", model_source(model), "--out", str(out), "--overwrite",
               "--max-ppl-increase", "1000", *RUNS[name]]  # fmt: skip
    print(" ".join(command), flush=True)
    if subprocess.run(command).returncode not in (0, 3):  # 3: the gate failed (this run's own, with --back-off)
        sys.exit(f"{' '.join(command)} failed")
    REPORTS.mkdir(exist_ok=True)
    shutil.copyfile(out / "hfcompress_report.json", REPORTS / f"{model}-{name}.json")


def row(name: str, report: dict) -> str:
    texts = report["validation"]["texts"]
    peers = report["peers"]
    values = peers["kv_values_per_token"]
    lisa = report.get("lisa") or {}

    def ppl(entry: dict, text: dict) -> str:
        value = entry["perplexity"][text["eval_text"]]
        return f"{value:.3f} ({100 * (value / text['original']['perplexity'] - 1):+.1f}%)"

    cells = [f"{t['converted']['perplexity']:.3f} ({t['perplexity_increase_pct']:+.1f}%)" for t in texts]
    speed = report.get("speed") or {}
    decode = f"{speed['decode_speedup']:.2f}x" if speed.get("decode_speedup") else "-"
    tried = report.get("back_off") or []
    if tried:  # --back-off: the counts its failed attempts changed
        counts = [sum(len(layers) for layers in a["changed_layers"].values()) for a in tried[:-1]]
        name += f" (gate failed at {', '.join(map(str, counts))} layers)"
    lines = [
        f"| **{name}** | {len(lisa.get('layers', []))} / {len(lisa.get('dropped_attention_layers', []))} | "
        f"{values['converted'] / values['original']:.3f}x | {' | '.join(cells)} | {decode} | "
        f"{'dominated by ' + '; '.join(peers['dominated_by']) if peers.get('dominated_by') else 'not dominated'} | "
        f"{report['wall_seconds'] / 60:.1f} min |"
    ]
    for peer in peers["peers"]:
        timed = speed.get("peers", {}).get(peer["name"])  # the peers the speed step timed (peers.speed_peers)
        peer_decode = f"{timed['decode_speedup']:.2f}x" if timed else ""
        lines.append(
            f"| &nbsp; {peer['name']} | | {peer['kv_ratio']:.3f}x | {' | '.join(ppl(peer, t) for t in texts)} | {peer_decode} | | |"
        )
    return "\n".join(lines)


def short(text: str) -> str:
    """A gated text's name for a column: the mixture by its word, the rest by name."""
    name = text.split(" (")[0]
    return "mixture (held out)" if name.startswith("mixture of") else name


def table() -> None:
    """One section per model and gate (the runs' gated texts), each run followed by its peers."""
    sections: dict[tuple, dict[str, dict]] = {}
    for path in sorted(REPORTS.glob("*.json")):
        report = json.loads(path.read_text())
        model = path.stem.split("-")[0]
        gate = tuple(short(t["eval_text"]) for t in report["validation"]["texts"])
        sections.setdefault((model, gate), {})[path.stem[len(model) + 1 :]] = report
    lines = [
        "# The layer plan's frontier, against the training-free peers",
        "",
        "Regenerated by `python benchmarks/layer_plan_frontier.py table` from the reports that",
        "`python benchmarks/layer_plan_frontier.py run MODEL RUN` keeps in benchmarks/frontier/ (each run's flags: RUNS in",
        "the script). KV cache a token relative to the original's; decode speed is the converted model's over the",
        "original's, batch 1, side by side (speed.py). Each conversion is followed by its peers at its KV saving, computed",
        "by the same `convert` run (peers.py). The verdict: dominated when a dropping peer saves at least as much KV with",
        "no higher perplexity on every gated text.",
    ]
    for (model, gate), reports in sections.items():
        first = next(iter(reports.values()))["validation"]["texts"]
        originals = ", ".join(f"{name} {t['original']['perplexity']:.3f}" for name, t in zip(gate, first))
        lines += [
            "",
            f"## {model}, gated on {' and '.join(gate)}",
            "",
            f"Original perplexity: {originals}.",
            "",
            f"| run / peer | shared / dropped | KV a token | {' | '.join(gate)} | decode | verdict | wall |",
            f"|---|---|---|{'---|' * len(gate)}---|---|---|",
        ]
        lines += [row(name, report) for name, report in reports.items()]
    RESULTS.write_text("\n".join(lines) + "\n")
    print(RESULTS.read_text())


def peers(model: str, counts: list[int], wiki_news: bool) -> None:
    """The dropping peers alone at several sizes, on the runs' gate texts and windows (no conversion): what `convert`
    computes at one KV saving, here at every count, so the frontier of the training-free alternatives is visible."""
    import torch

    from hfcompress.conversion.build import assemble
    from hfcompress.conversion.checkpoint import open_checkpoint
    from hfcompress.conversion.config import ConvertOptions
    from hfcompress.families import family_of
    from hfcompress.evidence.peers import block_influence, head_dim, removed
    from hfcompress.sources.token_streams import token_streams
    from hfcompress.sources.source import load_tokenizer, resolve_source
    from hfcompress.evidence.validate import perplexity

    texts = {"calib_text": WIKI_NEWS[1], "ood_text": WIKI_NEWS[3]} if wiki_news else {}
    options = ConvertOptions(source=model_source(model), out=Path("unused"), **texts)
    source = resolve_source(options.source, None, None, False)
    checkpoint, config = open_checkpoint(source, options.cache_dir)
    streams = token_streams(options, load_tokenizer(source))
    _, causal_lm = family_of(config).transformers_classes()
    original = assemble(config, checkpoint.load(list(checkpoint.files)), cls=causal_lm).eval()
    attention, layer = block_influence(original, streams.sequences)
    ranked = {"attention": sorted(range(1, len(attention)), key=attention.__getitem__), "layers": sorted(range(1, len(layer)), key=layer.__getitem__)}

    def scored(**removal) -> list[float]:
        with torch.no_grad(), removed(original, **removal):
            return [perplexity(original, ids, options.eval_context, max_tokens=options.eval_tokens, prefix=streams.prefix).perplexity
                    for ids in streams.evaluations.values()]  # fmt: skip

    base = scored()
    texts = [name.split(" (")[0] for name in streams.evaluations]
    suffix = "-wiki-news" if wiki_news else ""
    per_layer = 2 * config.num_key_value_heads * head_dim(config)
    lines = [
        f"# Training-free peers of {model}: attention and layer dropping by block influence",
        "",
        f"Regenerated by `python benchmarks/layer_plan_frontier.py peers {model}{suffix.replace('-', ' --', 1)}`: the original in transformers' classes,",
        "blocks removed by forward hooks (hfcompress/evidence/peers.py), ranked by ShortGPT's block influence on the calibration",
        f"sequences, scored on the gate texts ({', '.join(texts)}; {options.eval_tokens} tokens, context",
        f"{options.eval_context}). KV a token relative to the original ({per_layer} values a layer).",
        "",
        f"| removed | layers | KV a token | {' | '.join(texts)} |",
        f"|---|---|---|{'---|' * len(texts)}",
        f"| nothing | | 1.000x | {' | '.join(f'{v:.3f}' for v in base)} |",
    ]
    for kind, key in (("attention block", "attention"), ("layer", "layers")):
        for k in counts:
            chosen = sorted(ranked[key][:k])
            values = scored(**{key: chosen})
            cells = " | ".join(f"{v:.3f} ({100 * (v / b - 1):+.1f}%)" for v, b in zip(values, base))
            lines.append(f"| {k} {kind}{'s' if k > 1 else ''} | {', '.join(map(str, chosen))} | {1 - k / config.num_hidden_layers:.3f}x | {cells} |")
            print(lines[-1], flush=True)
    out = HERE / f"results-peers-{model}{suffix}.md"
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run")
    one.add_argument("model", choices=MODELS)
    one.add_argument("name", choices=RUNS)
    one.add_argument("--scratch", type=Path, default=Path("/tmp/hfcompress-frontier"))
    sub.add_parser("table")
    alone = sub.add_parser("peers")
    alone.add_argument("model", choices=MODELS)
    alone.add_argument("--counts", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    alone.add_argument("--wiki-news", action="store_true", help="gate on Wikipedia and news (the earlier default)")
    args = parser.parse_args()
    if args.command == "run":
        run(args.model, args.name, args.scratch)
    elif args.command == "peers":
        peers(args.model, args.counts, args.wiki_news)
    else:
        table()


if __name__ == "__main__":
    main()
