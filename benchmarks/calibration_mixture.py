"""Perplexity of converted models and their original on every domain's held-out text and on the third domain.

For issue 28 point 6 (quality on text no step of the conversion saw): the same windows `convert` scores (disjoint,
context 512, [BOS] first where the tokenizer adds one), on
* each domain of the calibration mixture (`mix`): the first --tokens tokens of its held-out last 25%, which no
  conversion calibrated on (a `--calib-text wiki` conversion calibrated on the first 75% of Wikipedia only);
* the mixture's held-out stream: what the gate of a `mix` conversion scores (its first --gate-tokens tokens);
* numpy-docs, the third domain (technical documentation), in no calibration text: its first --gate-tokens tokens
  (what the gate scores) and its first --tokens tokens.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/calibration_mixture.py wiki=/tmp/cm/x-wiki mix=/tmp/cm/x-mix \
        --json benchmarks/results-calibration-mixture.json
"""

import argparse
import json
import time
from pathlib import Path

import torch

from hfcompress.evidence.evaluate import load_converted
from hfcompress.sources.source import load_source, resolve_source
from hfcompress.sources.text import (
    mixture_split,
    mixture_text,
    numpy_docs_text,
    short_name,
    tokenize,
    tokenize_split,
    window_prefix,
)
from hfcompress.evidence.validate import perplexity


def texts(tokenizer, tokens: int, gate_tokens: int) -> dict[str, torch.Tensor]:
    mixture = mixture_text()
    out = {}
    for domain in mixture.parts:
        out[f"{short_name(domain.name)} (held-out 25%)"] = tokenize_split(tokenizer, domain.text, domain.name).held_out[:tokens]
    out["mixture held-out (the mix gate's text)"] = mixture_split(tokenizer, mixture).held_out[:gate_tokens]
    docs = tokenize(tokenizer, numpy_docs_text().text)
    out["numpy-docs (the gate's third domain)"] = docs[:gate_tokens]
    out[f"numpy-docs (first {tokens:,})"] = docs[:tokens]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="LABEL=DIR of converted models")
    parser.add_argument("--baseline", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per domain's held-out text")
    parser.add_argument("--gate-tokens", type=int, default=4096, help="tokens the gate scores (convert's --eval-tokens)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--json", default=None)
    parser.add_argument("--reuse", default=None, help="a JSON this script wrote: keep its models' figures (same texts)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    started = time.time()
    baseline, tokenizer = load_source(resolve_source(args.baseline))
    prefix = window_prefix(tokenizer)
    scored = texts(tokenizer, args.tokens, args.gate_tokens)
    results: dict[str, dict] = {"original": {}}
    if args.reuse:
        saved = json.loads(Path(args.reuse).read_text())
        assert saved["tokens"] == {n: len(i) for n, i in scored.items()}, "--reuse: other texts"
        results = saved["perplexity"]
    else:
        for name, ids in scored.items():
            results["original"][name] = perplexity(baseline, ids, args.context, prefix=prefix).perplexity
    del baseline
    for label, directory in (m.split("=", 1) for m in args.models):
        model, _ = load_converted(directory, True)
        report = json.loads((Path(directory) / "hfcompress_report.json").read_text())
        results[label] = {name: perplexity(model, ids, args.context, prefix=prefix).perplexity for name, ids in scored.items()}
        results[label]["_calibration"] = report["calibration"]["text"]
        results[label]["_gate"] = [
            (row["eval_text"], row["original"]["perplexity"], row["converted"]["perplexity"], row["perplexity_increase_pct"])
            for row in report["validation"]["texts"]
        ]
        del model

    labels = [label for label in results if label != "original"]
    print(f"| text | tokens | original | " + " | ".join(labels) + " |")
    print("|---|---|---|" + "---|" * len(labels))
    for name, ids in scored.items():
        base = results["original"][name]
        cells = [f"{results[l][name]:.3f} ({100 * (results[l][name] / base - 1):+.1f}%)" for l in labels]
        print(f"| {name} | {len(ids):,} | {base:.3f} | " + " | ".join(cells) + " |")
    for label in labels:
        print(f"\n{label}: calibration {results[label]['_calibration']}")
        for text, original, converted, pct in results[label]["_gate"]:
            print(f"  gate: {text.split(' (')[0]} {original:.3f} -> {converted:.3f} ({pct:+.2f}%)")
    print(f"\n{time.time() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": {n: len(i) for n, i in scored.items()}, "context": args.context, "perplexity": results}, f, indent=2)


if __name__ == "__main__":
    main()
