"""The C++ attention kernel of LISA shared layers (vllm-plugin/src/hfcompress_vllm/lisa_attention.cpp) against its torch
reference (lowrank.torch_attention), on random caches in vLLM's layouts with shuffled block tables (lisa_problem.py):
several requests of mixed lengths (decodes, a prefill chunk after cached keys, a whole prefill, rows past the block
size, block sizes differing per cache), GQA with free head maps per part, chains of two low-rank parts, one low-rank key per query head, a root head size
padded past the head dim, sliding windows, block sizes that are not multiples of the kernel's 16 lanes, padding rows;
fp32 to 1e-5, fp8 caches (e4m3 / e5m2, non-unit scales) at fp32, bf16 and fp16 against the fp32 reference of the same
caches, a root cache packed as vLLM's AMX ISA packs keys (bf16, fp8). Runs in .venv-vllm."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm")

from lisa_problem import Problem, random_problem  # noqa: E402

from hfcompress_vllm.lowrank import FP8_FORMATS, SharedQuery, kernel_attention, lisa_kernel, torch_attention  # noqa: E402

# (keys, query rows): decodes (one key, a block edge, long), a prefill chunk after 35 cached keys, a whole prefill
REQUESTS = [(1, 1), (33, 1), (100, 1), (75, 40), (50, 50), (300, 1), (129, 1)]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not lisa_kernel():
        pytest.fail("the C++ kernel did not build (g++ and ninja are needed; see the warning above)")


def run_both(problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    kernel_out, torch_out = problem.output(), problem.output()
    assert kernel_attention(problem.layer, problem.sources, problem.query, kernel_out, problem.meta, problem.n) is None
    torch_attention(problem.layer, problem.sources, problem.query.concatenated(), torch_out, problem.meta, problem.n)
    assert torch.equal(kernel_out[problem.n :], torch_out[problem.n :])  # padding rows untouched by both
    return kernel_out[: problem.n], torch_out[: problem.n]


def fp32_reference(problem: Problem) -> torch.Tensor:
    """The torch reference in fp32 on the same (upcast) caches and queries: the first n rows."""
    q = problem.query
    exact = Problem(problem.layer, problem.sources, SharedQuery(q.below.float(), q.source, q.scale.float(), q.own.float()),
                    problem.meta, problem.n)  # fmt: skip
    saved = [(source, source.kv_cache) for source, _ in problem.sources]
    for source, cache in saved:
        if cache.is_floating_point():  # fp8 bytes stay bytes (dequantized to the query's fp32 as read)
            source.kv_cache = cache.float()
    try:
        exact_out = exact.output()
        torch_attention(exact.layer, exact.sources, exact.query.concatenated(), exact_out, exact.meta, exact.n)
    finally:
        for source, cache in saved:
            source.kv_cache = cache
    return exact_out[: problem.n]


SHAPES = {
    "smollm2": {},  # 9 heads of 64, 3 KV heads; a chain: keys per KV group (3 x 20), then per query head (9 x 20)
    "block-16-window": {"block": 16, "window": 7},
    "padded-root-block-8-window": {"heads": 4, "kv": 2, "d": 24, "root_head_size": 32, "chain": ((2, 8),), "block": 8, "window": 5},
    "block-48": {"block": 48, "chain": ((3, 20),)},
    "blocks-32-64-16": {"block": (32, 64, 16), "window": 50},  # vLLM's split blocks: a part's smaller than another's
    "mha-window-long": {"heads": 4, "kv": 4, "d": 32, "chain": ((4, 6), (4, 6)), "block": 32, "window": 40},
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_kernel_matches_the_torch_reference_fp32(shape):
    kernel_out, torch_out = run_both(random_problem(REQUESTS, padding_rows=3, **SHAPES[shape]))
    torch.testing.assert_close(kernel_out, torch_out, rtol=1e-5, atol=1e-5)


def test_kernel_splits_heads_across_threads():
    """Fewer (request, row tile) items than threads: one item per KV head's query heads, in parallel."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for requests in ([(300, 1)], [(75, 20)]):
            kernel_out, torch_out = run_both(random_problem(requests, window=50))
            torch.testing.assert_close(kernel_out, torch_out, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kv_cache_dtype", sorted(FP8_FORMATS))
def test_kernel_matches_the_torch_reference_fp8(kv_cache_dtype):
    """fp8 caches dequantized as read (the format's value times each layer's k scale, this layer's v scale)."""
    problem = random_problem(REQUESTS, kv_cache_dtype=kv_cache_dtype, scales=(0.37, 0.8, 1.3, 0.6), block=16)
    kernel_out, torch_out = run_both(problem)
    torch.testing.assert_close(kernel_out, torch_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_kernel_reads_an_amx_packed_root(kv_cache_dtype):
    """The root's K as vLLM's AMX ISA packs it (bf16 on CPUs with AMX tiles: [block / 16, head size / 2, 16, 2] per
    block and KV head; fp8 bytes the same way): the kernel against the reference (which reads it with
    `root_key_blocks(..., "amx")`), in bf16 and with fp8 caches, blocks of 32 and 64 (vLLM's split blocks)."""
    problem = random_problem(REQUESTS, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype, block=(64, 32, 32),
                             scales=(0.37, 0.8, 1.3, 0.6), window=60, root_isa="amx")  # fmt: skip
    kernel_out, _ = run_both(problem)
    exact_out = fp32_reference(problem)
    assert (kernel_out.float() - exact_out).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * exact_out.abs().max()
    transposed = problem.output()  # the same cache read as if transposed: another result (the layout matters)
    problem.sources[0][0].isa = "vec"
    assert kernel_attention(problem.layer, problem.sources, problem.query, transposed, problem.meta, problem.n) is None
    assert (transposed[: problem.n].float() - kernel_out.float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_in_half_precision_is_at_least_as_close_as_the_reference(dtype):
    """bf16 / fp16 caches and queries: the kernel computes in fp32 (the reference in the dtype), so against the fp32
    reference of the same (upcast) caches it is no further off than the torch path."""
    problem = random_problem(REQUESTS, dtype=dtype, window=60)
    kernel_out, torch_out = run_both(problem)
    exact_out = fp32_reference(problem)
    kernel_error = (kernel_out.float() - exact_out).abs().max()
    torch_error = (torch_out.float() - exact_out).abs().max()
    assert kernel_error <= torch_error, (kernel_error, torch_error)
    assert kernel_error <= 2 * torch.finfo(dtype).eps * exact_out.abs().max()


def test_without_a_compiler_the_plugin_warns_once_and_attends_in_torch(tmp_path):
    """A failed build (here: no compiler, an empty extension cache) is one warning and the torch path, not an error."""
    code = "from hfcompress_vllm.lowrank import lisa_kernel; print(lisa_kernel(), lisa_kernel())"
    env = dict(os.environ, CXX=str(tmp_path / "no-g++"), TORCH_EXTENSIONS_DIR=str(tmp_path), HFCOMPRESS_VLLM_ATTENTION="auto")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "False"]
    assert proc.stderr.count("the C++ LISA attention kernel is unavailable") == 1
