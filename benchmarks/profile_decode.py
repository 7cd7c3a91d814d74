"""Where does CPU time go? torch.profiler over cached decode steps and one prefill, original vs converted.

    python benchmarks/profile_decode.py CONVERTED_DIR [--baseline smollm2-135m-instruct] [--steps 32]

Prints, per model and phase, wall ms per call and the share of operator self time by category:
weight matmuls (aten::mm/addmm: the linears), attention (bmm, softmax, SDPA), cache and copies, elementwise and
norms, and what no operator accounts for (Python and framework overhead = wall - sum of operator self time).
"""

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from hfcompress.evidence.evaluate import load_converted
from hfcompress.sources.source import BUILTIN_SOURCE, load_source, resolve_source
from hfcompress.evidence.speed import hardware_description
from hfcompress.sources.text import BUILTIN_TEXT_NAME, builtin_text, tokenize_split

CATEGORIES = {
    "weight matmuls": ("aten::mm", "aten::addmm"),
    "attention": ("aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::_scaled_dot_product", "aten::_safe_softmax"),
    "cache and copies": ("aten::cat", "aten::copy_", "aten::index", "aten::clone", "aten::contiguous", "aten::_to_copy"),
}


def category(op: str) -> str:
    for name, prefixes in CATEGORIES.items():
        if op.startswith(prefixes):
            return name
    return "elementwise and norms"


@torch.no_grad()
def profile_phase(model, ids: torch.Tensor, steps: int, phase: str) -> dict:
    out = model(ids, use_cache=True, logits_to_keep=1)
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)

    def run():
        nonlocal cache, token
        if phase == "prefill":
            model(ids, use_cache=False, logits_to_keep=1)
            return
        for _ in range(steps):
            out = model(token, cache=cache, use_cache=True)
            cache, token = out.cache, out.logits[:, -1:].argmax(-1)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run()
        wall_us = (time.perf_counter() - start) * 1e6
    shares = defaultdict(float)
    for event in prof.key_averages():
        shares[category(event.key)] += event.self_cpu_time_total
    shares["overhead (no operator)"] = max(0.0, wall_us - sum(shares.values()))
    calls = 1 if phase == "prefill" else steps
    return {"ms_per_call": wall_us / calls / 1000, "share": {k: v / wall_us for k, v in shares.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("converted")
    parser.add_argument("--baseline", default=BUILTIN_SOURCE)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    args = parser.parse_args()
    converted, tokenizer = load_converted(args.converted, trust_remote_code=False)
    original, _ = load_source(resolve_source(args.baseline))
    ids = tokenize_split(tokenizer, builtin_text(), BUILTIN_TEXT_NAME).held_out[: args.prompt].unsqueeze(0)
    columns = ["weight matmuls", "attention", "cache and copies", "elementwise and norms", "overhead (no operator)"]
    print(f"{hardware_description()}; prompt {args.prompt} tokens, {args.steps} decode steps after it; batch 1, float32")
    print("| model | phase | ms per call | " + " | ".join(columns) + " |")
    print("|---" * (3 + len(columns)) + "|")
    for phase in ("prefill", "decode"):
        for name, model in (("original", original), ("converted", converted)):
            profile_phase(model, ids, 2, phase)  # warm-up
            result = profile_phase(model, ids, args.steps, phase)
            print(f"| {name} | {phase} | {result['ms_per_call']:.1f} | "
                  + " | ".join(f"{100 * result['share'].get(c, 0):.0f}%" for c in columns) + " |", flush=True)


if __name__ == "__main__":
    main()
