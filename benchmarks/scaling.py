"""Scaling study on the built-in SmolLM2-135M-Instruct: held-out perplexity against distillation tokens and
calibration tokens, on the calibration domain's held-out text and on news text of another domain.

    python benchmarks/scaling.py run lisa15-sparse-distill256k      # one conversion, hours on 2 CPU cores
    python benchmarks/scaling.py report        # tables, plot and power-law budgets from every finished run

Each run is one `hfcompress convert` command (listed in RUNS, so every figure has its command); its report is copied
to benchmarks/scaling/NAME.json and its log is benchmarks/scaling/NAME.log (not in git). The distillation curve comes from the
stage's own learning curve (perplexity on both texts at 0, 16k, 64k, 256k, ... tokens trained, 4,096 tokens each);
the calibration axis from separate runs with no distillation. `report` also fits power laws through the final figures
of runs that differ only in calibration and distillation tokens (EXTRAPOLATE) and prints the budget they put at each
target, with its cost on this machine and in FLOPs.
"""

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent / "scaling"
COMMON = ["--no-probe", "--no-speed", "--distill-curve-tokens", "4096"]
BUILTIN_TEXTS = ["--calib-text", "builtin", "--eval-text", "builtin", "--ood-text", "news"]
WIKI_TEXTS = ["--calib-text", "wiki", "--eval-text", "wiki", "--ood-text", "news"]  # ~560k calibration tokens
LISA15 = ["--share-ratio", "0.5", "--lisa-align", "sparse", "--max-ppl-increase", "10"]
# the local fit's defaults before this round (rank 6 per head, 100 steps of 4 sequences): pinned in the runs measured
# with them, so that each name still reruns its figures
OLD_FIT = ["--qk-compression", "6", "--lisa-lowrank-keys", "head", "--lisa-steps", "100", "--lisa-batch-size", "4"]
# today's local fit (the defaults, spelled out): rank 20 per KV group, 600 steps of one sequence
NEW_FIT = ["--qk-compression", "3", "--lisa-lowrank-keys", "group", "--lisa-steps", "600", "--lisa-batch-size", "1"]
FASC09 = ["--share-ratio", "0", "--fasc-budget", "0.9", "--fasc-method", "fisher", "--max-ppl-increase", "15"]
RUNS = {
    **{
        f"wiki-lisa15-calib{size}": LISA15 + OLD_FIT + WIKI_TEXTS + ["--distill-tokens", "0", "--calib-sequences", str(n), "--seq-len", str(t)]
        for size, n, t in (("4k", 16, 256), ("16k", 32, 512), ("33k", 64, 512), ("131k", 256, 512))
    },
    # every other layer: each shared layer reads an unshared layer's scores (no chains of approximations)
    "wiki-lisa15-alternate-calib4k": ["--lisa-layers", ",".join(str(i) for i in range(1, 30, 2)), "--lisa-align", "sparse",
                                      "--max-ppl-increase", "10", "--distill-tokens", "0"] + OLD_FIT + WIKI_TEXTS,
    "wiki-lisa15-group-calib4k": LISA15 + OLD_FIT + WIKI_TEXTS + ["--lisa-lowrank-keys", "group", "--distill-tokens", "0"],
    # the local fit's budget and capacity: 4x the Adam steps per layer (it overfits 4k tokens); Q/K 3x instead of 6x
    # smaller, on a calibration it cannot overfit
    "wiki-lisa15-steps400-calib4k": LISA15 + OLD_FIT + WIKI_TEXTS + ["--lisa-steps", "400", "--distill-tokens", "0"],
    "wiki-lisa15-qk3-calib33k": LISA15 + OLD_FIT + WIKI_TEXTS + ["--qk-compression", "3", "--distill-tokens", "0", "--calib-sequences", "64", "--seq-len", "512"],
    **{
        f"wiki-lisa15-group-qk3-steps600b1-calib33k-distill{size}": LISA15 + NEW_FIT + WIKI_TEXTS + [
            "--calib-sequences", "64", "--seq-len", "512", "--distill-tokens", str(tokens)]
        for size, tokens in (("16k", 16384), ("64k", 65536))
    },
    **{
        f"wiki-lisa15-group-qk3-steps600b1-calib{calib}-distill{size}": LISA15 + NEW_FIT + WIKI_TEXTS + [
            "--calib-sequences", str(sequences), "--seq-len", "512", "--distill-tokens", str(tokens)]
        for calib, sequences, size, tokens in (("131k", 256, "16k", 16384), ("131k", 256, "64k", 65536), ("262k", 512, "16k", 16384))
    },
    # where the power law through those puts news at +10% (`report`). A fit reads only the first steps x batch
    # calibration sequences (lisa.fit_inputs), so 1,024 sequences need more than 600 steps; not run on this 24 GB
    # machine: the convert step's peak grew ~33 KB per calibration token from 131k to 262k
    "wiki-lisa15-group-qk3-steps1200b1-calib524k-distill96k": LISA15 + NEW_FIT + WIKI_TEXTS + [
        "--lisa-steps", "1200", "--calib-sequences", "1024", "--seq-len", "512", "--distill-tokens", "98304"],
    # capacity the distillation can add at no size cost: LoRA on the dense linears, merged before saving
    "wiki-lisa15-group-qk3-steps600b1-calib33k-distill16k-lora16": LISA15 + NEW_FIT + WIKI_TEXTS + [
        "--calib-sequences", "64", "--seq-len", "512", "--distill-tokens", "16384", "--distill-lora-rank", "16"],
    # no more than 2 shared layers in a row: a chain's errors compound (the alternating 4k run lost less on news)
    **{
        f"wiki-lisa15-group-qk3-steps600b1-calib{calib}-distill{size}-chain2": LISA15 + NEW_FIT + WIKI_TEXTS + [
            "--calib-sequences", str(sequences), "--seq-len", "512", "--distill-tokens", str(tokens), "--lisa-max-chain", "2"]
        for calib, sequences, size, tokens in (("33k", 64, "16k", 16384), ("131k", 256, "16k", 16384), ("131k", 256, "64k", 65536))
    },
    # distillation on text of no particular domain: windows the original writes itself (LLM-QAT), with Wikipedia
    "wiki-lisa15-group-qk3-steps600b1-calib33k-distill16k-mixed": LISA15 + NEW_FIT + WIKI_TEXTS + [
        "--calib-sequences", "64", "--seq-len", "512", "--distill-tokens", "16384", "--distill-data", "mixed"],
    "wiki-lisa15-distill64k": LISA15 + OLD_FIT + WIKI_TEXTS + ["--distill-tokens", "65536"],
    "wiki-lisa15-group-distill64k": LISA15 + OLD_FIT + WIKI_TEXTS + ["--lisa-lowrank-keys", "group", "--distill-tokens", "65536"],
    "wiki-fasc09-fisher-distill16k": FASC09 + WIKI_TEXTS + ["--distill-tokens", "16384"],
    "wiki-fasc09-fisher-distill64k": FASC09 + WIKI_TEXTS + ["--distill-tokens", "65536"],
    "wiki-lisa15-calib131k-distill64k": LISA15 + OLD_FIT + WIKI_TEXTS + ["--calib-sequences", "256", "--seq-len", "512", "--distill-tokens", "65536"],
    "wiki-fasc09-fisher-calib33k-distill16k": FASC09 + WIKI_TEXTS + ["--calib-sequences", "64", "--seq-len", "512", "--distill-tokens", "16384"],
    "wiki-fasc09-fisher-calib131k-distill16k": FASC09 + WIKI_TEXTS + ["--calib-sequences", "256", "--seq-len", "512", "--distill-tokens", "16384"],
}
RUNS |= {name: args + BUILTIN_TEXTS for name, args in {
    "lisa15-sparse-distill64k": LISA15 + OLD_FIT + ["--distill-tokens", "65536"],
    "lisa15-sparse-distill256k": LISA15 + OLD_FIT + ["--distill-tokens", "262144"],
    "fasc09-fisher-distill64k": FASC09 + ["--distill-tokens", "65536"],
    "lisa15-sparse-distill16k": LISA15 + OLD_FIT + ["--distill-tokens", "16384"],
    "lisa15-dense-distill16k": LISA15[:2] + ["--lisa-align", "dense"] + LISA15[4:] + OLD_FIT + ["--distill-tokens", "16384"],
    "lisa15-sparse-calib16k": LISA15 + OLD_FIT + ["--calib-sequences", "32", "--seq-len", "512"],
    "lisa15-sparse-calib64k": LISA15 + OLD_FIT + ["--calib-sequences", "128", "--seq-len", "512"],
    "lisa15-sparse-calib84k": LISA15 + OLD_FIT + ["--calib-sequences", "165", "--seq-len", "512"],  # all of builtin's 75%
}.items()}


def command(name: str, out: Path) -> list[str]:
    return ["hfcompress", "convert", "--out", str(out), "--overwrite", *RUNS[name], *COMMON]


def run(name: str, out_root: Path) -> None:
    out = out_root / name
    HERE.mkdir(exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    argv = command(name, out)
    executable = Path(sys.executable).parent / argv[0]
    with open(HERE / f"{name}.log", "w") as log:
        log.write(" ".join(argv) + "\n")
        log.flush()
        code = subprocess.call([str(executable), *argv[1:]], stdout=log, stderr=subprocess.STDOUT, env=env)
    if (out / "hfcompress_report.json").is_file():  # written also when the gate failed (exit 3)
        shutil.copy(out / "hfcompress_report.json", HERE / f"{name}.json")
    print(f"{name}: exit {code}")


def short(text: str) -> str:
    return text.split(" (")[0]


HEADER = """# Scaling study (SmolLM2-135M-Instruct): perplexity against distillation and calibration tokens

`python benchmarks/scaling.py report > benchmarks/results-scaling.md` prints this file from the run reports in
`benchmarks/scaling/NAME.json` (and draws `benchmarks/scaling/scaling.png`); `python benchmarks/scaling.py run NAME`
redoes one run, whose command is printed above its table.
"""


def report() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = {p.stem: json.loads(p.read_text()) for p in sorted(HERE.glob("*.json"))}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    print(HEADER)
    print("## Distillation tokens (learning curve of the distillation stage, 4,096 tokens per text)\n")
    for name, data in results.items():
        distill = data["finishers"].get("distillation")
        if not distill or distill["curve_tokens"] != 4096:  # the curve and the baseline on the same 4,096 tokens
            continue
        texts = [row["eval_text"] for row in data["validation"]["texts"]]
        base = {row["eval_text"]: row["original"]["perplexity"] for row in data["validation"]["texts"]}
        print(f"`{name}`: `{data['command']}`, {distill['seconds']:.0f} s of training, {distill['tokens_per_s']:.0f} tokens/s\n")
        print("| tokens trained | " + " | ".join(short(t) for t in texts) + " |")
        print("|---|" + "---|" * len(texts))
        for point in distill["perplexity"]:
            cells = [f"{point[t]:.3f} ({100 * (point[t] / base[t] - 1):+.1f}%)" for t in texts]
            print(f"| {point['tokens']:,} | " + " | ".join(cells) + " |")
        print()
        for text, style in zip(texts, ("-o", "--s")):
            xs = [max(p["tokens"], 4096) for p in distill["perplexity"]]  # 0 drawn at 4k on the log axis
            ys = [100 * (p[text] / base[text] - 1) for p in distill["perplexity"]]
            axes[0].plot(xs, ys, style, label=f"{name.split('-distill')[0]}: {short(text)}")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("distillation tokens (0 drawn at 4k)")
    axes[0].set_ylabel("perplexity increase (%)")
    axes[0].axhline(10, color="gray", linewidth=0.8)
    axes[0].legend(fontsize=6)
    rows = []
    for name, data in results.items():
        if data["finishers"].get("distillation") or data.get("lisa", {}).get("layers") is None:
            continue
        increases = {row["eval_text"]: row["perplexity_increase_pct"] for row in data["validation"]["texts"]}
        rows.append((data["calibration"]["tokens"], name, increases, data["timings"]))
    wiki_rows = [r for r in rows if r[1].startswith("wiki-")]
    rows = wiki_rows or rows  # one set of texts per table and plot: the Wikipedia calibration when it has runs
    if rows:
        rows.sort()
        print("## Calibration tokens (no distillation)\n")
        texts = list(rows[0][2])
        print("| calibration tokens | run | " + " | ".join(short(t) for t in texts) + " | calibrate s | convert s |")
        print("|---|---|" + "---|" * len(texts) + "---|---|")
        for tokens, name, increases, timings in rows:
            calibrate_s = sum(v for k, v in timings.items() if k.startswith("calibrate"))
            cells = [f"{increases[t]:+.1f}%" for t in texts]
            print(f"| {tokens:,} | {name} | " + " | ".join(cells) + f" | {calibrate_s:.0f} | {timings.get('convert', 0):.0f} |")
        curve = [r for r in rows if re.fullmatch(r"(wiki-)?lisa15-(sparse-)?calib\d+k", r[1])]  # variants: table only
        for text, style in zip(texts, ("-o", "--s")):
            axes[1].plot([r[0] for r in curve], [r[2][text] for r in curve], style, label=f"rank 6 per head: {short(text)}")
        # the larger local fits (rank 14 per head, rank 20 per KV group), before distillation, as points
        drawn = set()
        for name, data in results.items():
            fit = "rank 20 per group, 600x1" if "group" in name else "rank 14 per head"
            if "qk3" not in name or not name.startswith("wiki-") or fit in drawn:
                continue  # runs that differ only in distillation tokens share their 0-token point
            drawn.add(fit)
            base = {row["eval_text"]: row["original"]["perplexity"] for row in data["validation"]["texts"]}
            distill = data["finishers"].get("distillation")
            start = distill["perplexity"][0] if distill else None
            for text, marker in zip(texts, ("^", "v")):
                value = 100 * (start[text] / base[text] - 1) if start else data["validation"]["texts"][texts.index(text)]["perplexity_increase_pct"]
                axes[1].plot([data["calibration"]["tokens"]], [value], marker, label=f"{fit}: {short(text)}")
        axes[1].axhline(10, color="gray", linewidth=0.8)
        axes[1].set_xscale("log")
        axes[1].set_xlabel("calibration tokens")
        axes[1].set_ylabel("perplexity increase (%)")
        axes[1].legend(fontsize=7)
        axes[1].set_title("15 shared layers, no distillation", fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct: held-out perplexity, calibration domain and another domain", fontsize=9)
    fig.tight_layout()
    fig.savefig(HERE / "scaling.png", dpi=110)
    extrapolation(results)


# Run families whose finished runs differ only in calibration and distillation tokens, and the target each aims at.
# Each run's final figures (not its mid-schedule curve points: the learning rate decays to the run's own length) are
# one point (C calibration tokens, D distilled tokens, E % excess perplexity) per text.
EXTRAPOLATE = {
    "15 of 30 layers shared, today's local fit": (r"wiki-lisa15-group-qk3-steps600b1-calib\d+k-distill\d+k", 10.0),
    "FASC fisher at budget 0.9": (r"wiki-fasc09-fisher(-calib\d+k)?-distill16k", 15.0),
}
WIKI_TRAIN_TOKENS = 551_758  # the most calibration `wiki` holds (its first 75%, SmolLM2 tokens)


def extrapolation(results: dict[str, dict]) -> None:
    """Power laws E = k C^a D^b (least squares in log-log) through each family's runs, the budget they put at the
    target, and what that budget costs: here, at the family's measured seconds per token, and in FLOPs. An
    extrapolation past the measured points: a plan for a bigger run, not a result."""
    import numpy as np

    print("## What budget would reach the targets (power laws through the measured runs)\n")
    for family, (pattern, target) in EXTRAPOLATE.items():
        runs = {n: d for n, d in results.items() if re.fullmatch(pattern, n) and d["finishers"].get("distillation")}
        if len(runs) < 2:
            continue
        texts = [row["eval_text"] for row in next(iter(runs.values()))["validation"]["texts"]]
        points = [(d["calibration"]["tokens"], d["finishers"]["distillation"]["tokens"],
                   {row["eval_text"]: row["perplexity_increase_pct"] for row in d["validation"]["texts"]}) for d in runs.values()]
        axes = [axis for axis in (0, 1) if len({p[axis] for p in points}) > 1]  # a law only along axes that vary
        # this CPU's cost of a budget, from the family's largest run: calibration and distillation seconds per token
        # (calibration: every pass over the calibration tokens), the rest (layer fits, validation) as measured
        big = max(runs.values(), key=lambda d: (d["calibration"]["tokens"], d["finishers"]["distillation"]["tokens"]))
        calib_s = sum(v for k, v in big["timings"].items() if k.startswith("calibrate")) / big["calibration"]["tokens"]
        distill_s = big["finishers"]["distillation"]["seconds"] / big["finishers"]["distillation"]["tokens"]
        other_s = big["wall_seconds"] - calib_s * big["calibration"]["tokens"] - big["finishers"]["distillation"]["seconds"]
        params = big["parameters"]["original"]["total"]

        def cost(c: float, d: float) -> str:
            hours = (calib_s * c + distill_s * d + other_s) / 3600
            # calibration: forward (2 N per token, 6 N with the backward statistics); distillation: teacher forward
            # and student forward + backward (8 N per token)
            flops = (6 if "calibrate: backward" in big["timings"] else 2) * params * c + 8 * params * d
            return f"{hours:.1f} h here, {flops:.1e} FLOPs"

        print(f"**{family}** (target +{target:.0f}%), {len(points)} runs: " + ", ".join(
            f"C {c:,} / D {d:,}: " + " / ".join(f"{e[t]:+.1f}%" for t in texts) for c, d, e in sorted(points)) + "\n")
        design = np.array([[1.0] + [math.log(p[axis]) for axis in axes] for p in points])
        for text in texts:
            observed = np.log([p[2][text] for p in points])
            coef, *_ = np.linalg.lstsq(design, observed, rcond=None)
            law = " ".join(f"{'CD'[axis]}^{c:+.3f}" for axis, c in zip(axes, coef[1:]))
            fit = (f"worst fit {100 * (math.exp(np.abs(design @ coef - observed).max()) - 1):.0f}% of E"
                   if len(points) > len(coef) else f"exact through {len(points)} points")
            line = f"- {short(text)}: E = {math.exp(coef[0]):.3g} {law} ({fit})"
            if min(p[2][text] for p in points) <= target:
                line += f"; measured at or under +{target:.0f}% already"
            elif axes == [0, 1] and coef[1] < 0 and coef[2] < 0:
                needs = []
                for c in (131_072, 262_144, 524_288):
                    d = math.exp((math.log(target) - coef[0] - coef[1] * math.log(c)) / coef[2])
                    needs.append(f"C {c:,} with D {d:,.0f} ({cost(c, d)})")
                line += f"; +{target:.0f}% at " + "; ".join(needs)
            elif axes == [0] and coef[1] < 0:
                c = math.exp((math.log(target) - coef[0]) / coef[1])
                d = points[0][1]
                line += f"; +{target:.0f}% at C {c:,.0f} with D {d:,} ({cost(c, d)})"
                line += " (more than the text holds)" if c > WIKI_TRAIN_TOKENS else ""
            print(line)
        print()
    print(f"(C: calibration tokens, D: distilled tokens, E: % excess perplexity of the run's final model; `wiki` holds "
          f"{WIKI_TRAIN_TOKENS:,} calibration tokens. FLOPs count the model's parameters only, no attention.)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    runner = sub.add_parser("run")
    runner.add_argument("names", nargs="+", choices=sorted(RUNS))
    runner.add_argument("--out-root", type=Path, default=Path("/tmp/hfcompress-scaling"))
    sub.add_parser("report")
    args = parser.parse_args()
    if args.what == "run":
        for name in args.names:
            run(name, args.out_root)
    else:
        report()


if __name__ == "__main__":
    main()
