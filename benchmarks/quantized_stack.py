"""Quantization stacked on a conversion, on the real SmolLM2-135M: held-out perplexity and KV bytes per token of the
original, the original with a 4-bit KV cache (transformers' QuantizedCache), a converted model, the converted model
with a 4-bit KV cache (its remote code's LisaQuantizedCache), with int8 weights (torchao), and with both.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quantized_stack.py CONVERTED_DIR [--tokens 4096] [--backend quanto]
        [--text numpy-docs|news]

CONVERTED_DIR is an `hfcompress convert` output of the built-in SmolLM2 (e.g. `hfcompress convert --out DIR`).
Perplexity: numpy-docs (technical documentation, which no step of a conversion sees; `--text news`: the Lee news
corpus, one of the offline calibration mixture's four domains), windows of 512 tokens read
through the cache 32 tokens at a time (every chunk attends to the quantized past: hfcompress.serving.quantize.cached_perplexity).
KV bytes per token: read from the cache tensors (packed codes, scales, zeros, residual window) after a 512-token
prefill, float32 model. Weights: the bytes of the parameters as stored. One torch thread. Writes
benchmarks/results-quantized-stack.md (quanto, 4 bits; other settings: results-quantized-stack-BACKEND-NBITSbit.md).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from hfcompress.serving.quantize import (
    cached_perplexity, check_kv_backend, kv_bytes_per_token, lisa_quantized_cache, load_quantized, weight_bytes,
)  # fmt: skip
from hfcompress.sources.source import BUILTIN_SOURCE, load_source, resolve_source
from hfcompress.sources.text import news_text, numpy_docs_text

OUT = Path(__file__).with_name("results-quantized-stack.md")  # quanto 4-bit; another KV setting: -BACKEND-NBITbit.md
CONTEXT, CHUNK = 512, 32


def converted_by(directory: Path) -> str:
    """The command recorded in the conversion's report."""
    import json

    report = directory / "hfcompress_report.json"
    return json.loads(report.read_text()).get("command", "?") if report.is_file() else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("converted", type=Path)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--backend", default="quanto", choices=["quanto", "hqq"])
    parser.add_argument("--nbits", type=int, default=4)
    parser.add_argument("--axis", type=int, default=None, help="axis_key and axis_value of the cache (default: transformers')")
    parser.add_argument("--text", default="numpy-docs", choices=["numpy-docs", "news"])
    args = parser.parse_args()
    check_kv_backend(args.backend, args.nbits)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, DynamicCache, QuantizedCache

    original, tokenizer = load_source(resolve_source(BUILTIN_SOURCE))
    converted = AutoModelForCausalLM.from_pretrained(args.converted, trust_remote_code=True, dtype=torch.float32).eval()
    int8 = load_quantized(args.converted, "int8")
    text = numpy_docs_text() if args.text == "numpy-docs" else news_text()
    ids = torch.tensor(tokenizer(text.text).input_ids[: args.tokens])
    kv = {"nbits": args.nbits, **({"axis_key": args.axis, "axis_value": args.axis} if args.axis is not None else {})}
    bits = f"{args.nbits}-bit KV ({args.backend}{'' if args.axis is None else f', axis {args.axis}'})"
    rows = [
        ("original", original, lambda m: DynamicCache(config=m.config)),
        (f"original + {bits}", original, lambda m: QuantizedCache(backend=args.backend, config=m.config, **kv)),
        ("converted", converted, lambda m: DynamicCache(config=m.config)),
        (f"converted + {bits}", converted, lambda m: lisa_quantized_cache(m, args.backend, **kv)),
        ("converted + int8 weights", int8, lambda m: DynamicCache(config=m.config)),
        (f"converted + int8 weights + {bits}", int8, lambda m: lisa_quantized_cache(m, args.backend, **kv)),
    ]
    results = []
    for name, model, new_cache in rows:
        start = time.perf_counter()
        ppl, scored = cached_perplexity(model, ids, lambda: new_cache(model), CONTEXT, CHUNK)
        kv_bytes = kv_bytes_per_token(model, ids[:CONTEXT], new_cache(model))
        results.append((name, ppl, kv_bytes, weight_bytes(model)))
        print(f"{name:48s} ppl {ppl:8.3f}  KV {kv_bytes:8.1f} B/token  weights {weight_bytes(model) / 1e6:6.1f} MB  "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    base_ppl, base_kv, base_w = results[0][1:]
    command = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quantized_stack.py " + " ".join(sys.argv[1:])
    lines = [
        "# Quantization stacked on a conversion (SmolLM2-135M)",
        "",
        f"Command: `{command}`",
        "",
        f"Converted model: `{args.converted}` (lisa_layers {sorted(int(k) for k in converted.config.lisa_layers)}, "
        f"dropped_attention_layers {getattr(converted.config, 'dropped_attention_layers', None) or []}, "
        f"fasc_ranks {len(converted.config.fasc_ranks)} linears, key_ranks {len(converted.config.key_ranks)} layers), "
        f"written by `{converted_by(args.converted)}`.",
        f"Perplexity: {text.name}, {scored} tokens, windows of {CONTEXT} read through the cache {CHUNK} tokens at a time. "
        f"KV bytes per token: read from the cache tensors after a {CONTEXT}-token prefill (float32 model; a quantized "
        "cache's packed codes, scales and zeros). Weights: parameters as stored. 1 torch thread.",
        "",
        "| model | perplexity | vs original | KV bytes / token | vs original | weights (MB) | vs original |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, ppl, kv_bytes, w in results:
        lines.append(
            f"| {name} | {ppl:.3f} | {ppl / base_ppl:.3f}x | {kv_bytes:.1f} | {kv_bytes / base_kv:.3f}x | "
            f"{w / 1e6:.1f} | {w / base_w:.3f}x |"
        )
    axis = "" if args.axis is None else f"-axis{args.axis}"
    out = OUT if (args.backend, args.nbits, args.axis) == ("quanto", 4, None) else OUT.with_stem(f"{OUT.stem}-{args.backend}-{args.nbits}bit{axis}")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
