"""The attention of a LISA shared layer in vLLM (vllm-plugin/src/hfcompress_vllm/lowrank.py): the C++ kernel
(lisa_attention.cpp, reading the paged caches in place) against the torch reference (`attend`: gathers, matmuls) and
against what the layer costs unshared (vLLM's own CPU attention of a full layer over the root's cache, the same
requests), one call on SmolLM2-135M's shapes (9 query heads of 64, 3 KV heads, low-rank keys per KV group at rank 20,
Align sources drawn at random: 6 of 9 heads distinct), interleaved, medians. Runs in .venv-vllm:

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_lowrank_kernel.py [--seqs 16] [--context 528]
        [--block 128] [--chain 1] [--prefill 0] [--dtype float32] [--kv-cache-dtype auto] [--repeats 31]

A decode step of `--seqs` requests of `--context` keys each (their last token the query), or, with `--prefill N`, one
request's chunk of N query rows (its last N keys of `--context`). `--chain 2`: the second shared layer of a chain (its
key has three parts: the root's K, the first shared layer's low-rank keys, its own).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))

from lisa_problem import random_problem  # noqa: E402

from hfcompress_vllm.lowrank import kernel_attention, lisa_kernel, torch_attention  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=528)
    parser.add_argument("--block", type=int, default=128, help="KV block size (vLLM's CPU default: 128)")
    parser.add_argument("--chain", type=int, default=1, help="the shared layer's place in its chain (1 or 2)")
    parser.add_argument("--prefill", type=int, default=0, help="query rows of one request's prefill chunk (0: decode)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=31)
    args = parser.parse_args()
    if not lisa_kernel():
        sys.exit("the C++ kernel did not build (see the warning above)")
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    requests = [(args.context, args.prefill)] if args.prefill else [(args.context, 1)] * args.seqs
    dtype = getattr(torch, args.dtype)
    isa = _get_attn_isa(dtype, args.block, 64, args.kv_cache_dtype)  # the root's: its cache is in this ISA's layout
    problem = random_problem(requests, chain=((3, 20),) * args.chain, block=args.block, dtype=dtype,
                             kv_cache_dtype=args.kv_cache_dtype, scales=(1.0,) * (args.chain + 2), root_isa=isa)  # fmt: skip
    outputs = {"kernel": problem.output(), "torch": problem.output()}
    concatenated = problem.query.concatenated()  # the torch path's query (the op builds it outside the timing too)

    def kernel() -> None:
        kernel_attention(problem.layer, problem.sources, problem.query, outputs["kernel"], problem.meta, problem.n)

    def reference() -> None:
        torch_attention(problem.layer, problem.sources, concatenated, outputs["torch"], problem.meta, problem.n)

    root = problem.sources[0][0].kv_cache
    blocks, kv, block, double = root.shape
    key_cache, value_cache = root.view(blocks, kv, 2 * block, double // 2).chunk(2, dim=2)
    full_query = torch.randn(problem.n, problem.layer.num_heads, double // 2).to(root.dtype)
    outputs["vllm"] = torch.empty_like(full_query)
    meta = problem.meta
    query_start, seq_lens = meta.query_start_t.to(torch.int32), meta.seq_lens_t.to(torch.int32)
    schedule = ops.cpu_attn_get_scheduler_metadata(len(requests), problem.layer.num_heads, kv, double // 2, seq_lens, root.dtype,
                                                   query_start, True, -1, isa, False, kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip

    def full_layer() -> None:
        ops.cpu_attention_with_kv_cache(full_query, key_cache, value_cache, outputs["vllm"], query_start, seq_lens, 0.125, True,
                                        None, -1, problem.sources[0][1].block_table, 0.0, schedule, None,
                                        kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip

    methods = {"kernel": kernel, "torch": reference, "vllm": full_layer}
    times: dict[str, list[float]] = {name: [] for name in methods}
    for rep in range(args.repeats + 2):  # the first two rounds warm up
        for name, run in methods.items():
            start = time.perf_counter()
            run()
            if rep >= 2:
                times[name].append(time.perf_counter() - start)
    error = (outputs["kernel"].float() - outputs["torch"].float()).abs().max().item()
    shape = f"prefill chunk of {args.prefill} rows" if args.prefill else f"decode, {args.seqs} sequences"
    print(f"{shape}, {args.context} keys, block {args.block}, chain part {args.chain}, {args.dtype}, KV {args.kv_cache_dtype}, ISA {isa}, "
          f"{torch.get_num_threads()} thread(s), median of {args.repeats}:")  # fmt: skip
    base = statistics.median(times["torch"])
    for name, values in times.items():
        median = statistics.median(values)
        label = {"vllm": "vLLM, a full layer"}.get(name, name)
        print(f"  {label:18s} {median * 1e3:8.3f} ms  ({base / median:.1f}x the torch reference)")
    print(f"  max |kernel - torch| {error:.2e}")


if __name__ == "__main__":
    main()
