"""The vLLM plugin's LISA attention (lowrank.torch_attention, over the concatenated features, and the C++ kernel,
lowrank.kernel_attention) against the one reference formula, modeling/lisa_reference.py, evaluated in float64 on the
same tensors: random problems in vLLM's real cache layouts (lisa_problem.random_problem: a root layer's CPU-backend
cache, the low-rank caches of a chain of shared layers, shuffled block tables, requests of mixed lengths).

Per request, the test reads its keys and values out of the paged caches itself (per position: its block in the
cache's block table, its offset in the block; the root's keys as the CPU backend lays them out, transposed or
AMX-packed; a low-rank cache's keys transposed then V; fp8 bytes times their layer's scale), and builds the
reference's inputs. The plugin scores query head h of shared layer l as one dot product over concatenated features,

    [scale[h] below[source[h]] | q_lr[h] / sqrt(r)] . [K_root | k_lr of the chain's earlier layers | k_lr of layer l],

where `below` are the layer below's query features, their parts already scaled and routed by the Aligns below (so
each part of below head g reads its own head of that part's key, `part.heads[h]` = map[source[h]]). The reference
takes one shared layer at a time, so the chain is composed as the remote code composes it, layer by layer, each
handing its pre-softmax scores up, and with lisa_reference functions only:

    S_root[g]  = below[g, :d] . K_root[map_root[g]]          (the root is a plain attention layer: its scores from its
                                                               handed features, as tests/test_lisa_reference.py does)
    S_{p}      = shared_attention_reference(S_{p-1}, q_lr = below part p * sqrt(r_p), k_lr_p, source = arange(H),
                                            scale = 1)[1]     (each earlier shared layer: its Align is the identity
                                                               here, the real one being folded into `below`)
    out, S_l   = shared_attention_reference(S_{last}, own * sqrt(r), k_lr_l, V, source, scale, mask)

A part's low-rank keys go in with the reference's own GQA grouping (Hk key heads, head h reads h // (H / Hk)) where the
problem's head map is that grouping (`model_head_maps`: the maps the served model has), else gathered per head (Hk = H)
as the map says (random_problem's free maps). Below heads no query head's source names do not reach the output; their
root / low-rank maps (which the problem leaves undefined) are filled arbitrarily. The mask is causal with the request's
Q query rows at the last Q of its L positions (decodes, prefill chunks after cached keys, whole prefills, a chunk
longer than lowrank.ROWS), and with a window w key j is visible from position i when i - j < w (transformers' sliding
window, as the remote code masks). Plugin outputs are fp32, compared at 1e-5 (fp32 caches, and fp8 caches e4m3 / e5m2
with non-unit scales against the reference on the dequantized values); padding rows past the actual tokens stay 0.
The kernel cases are skipped where the kernel does not build (no compiler) or HFCOMPRESS_VLLM_ATTENTION=torch.
Runs in .venv-vllm."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm")

from lisa_problem import Problem, random_problem  # noqa: E402

from hfcompress_vllm.lowrank import head_groups, kernel_attention, lisa_kernel, torch_attention  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "lisa_reference", Path(__file__).resolve().parents[2] / "modeling" / "lisa_reference.py"
)
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)  # imports only torch

# the KV cache dtypes' byte formats (lowrank's module docstring: the CPU backend's "fp8" is e4m3)
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

# (keys, query rows): decodes (one key, a block edge, long), prefill chunks after cached keys (one longer than the
# torch path's 128 rows at once), a whole prefill
REQUESTS = [(1, 1), (33, 1), (100, 1), (75, 40), (50, 50), (200, 150), (17, 1)]


# ---- reading the caches, per position (independent of lowrank's views) ----


def positions(table_row: torch.Tensor, length: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position of a request of `length` keys: its block (from the block table) and its offset in the block."""
    pos = torch.arange(length)
    return table_row[pos // block].long(), pos % block


def as_float64(stored: torch.Tensor, cache_dtype: str, scale: float) -> torch.Tensor:
    """Cache values in float64: fp8 bytes as their format's value times the layer's scale, others as they are."""
    fp8 = FP8.get(cache_dtype)
    if fp8 is None:
        return stored.double()
    return stored.contiguous().view(fp8).double() * scale


def root_keys(layer, table_row: torch.Tensor, length: int, width: int) -> torch.Tensor:
    """(KV, L, width): the root's keys. Its cache is [blocks, KV, block, 2 * size]; per block and KV head the keys, then
    the values; the keys [size, block] (transposed: vec ISAs) or [block / 16, size / 2, 16, 2] (AMX)."""
    cache = layer.kv_cache
    num_blocks, kv, block, double = cache.shape
    size = double // 2
    blocks, offsets = positions(table_row, length, block)
    o, f = offsets.view(-1, 1), torch.arange(width).view(1, -1)
    if layer.isa == "amx":
        index = (o // 16) * (size // 2 * 32) + (f // 2) * 32 + (o % 16) * 2 + f % 2
    else:
        index = f * block + o
    flat = cache.reshape(num_blocks, kv, block * double)[blocks]  # (L, KV, block * 2 * size)
    keys = torch.gather(flat, 2, index.unsqueeze(1).expand(length, kv, width))
    return as_float64(keys, layer.kv_cache_dtype, layer._k_scale_float).transpose(0, 1)


def lowrank_entries(layer, table_row: torch.Tensor, length: int, key_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored keys (L, KV, key_width) and values (L, KV, d) of a low-rank cache [blocks, KV, block, key_width + d]:
    per block and KV head the keys [key_width, block] (transposed), then V [block, d]."""
    cache = layer.kv_cache
    num_blocks, kv, block, width = cache.shape
    d = width - key_width
    blocks, offsets = positions(table_row, length, block)
    flat = cache.reshape(num_blocks, kv, block * width)[blocks]  # (L, KV, block * width)
    o = offsets.view(-1, 1)
    key_index = torch.arange(key_width).view(1, -1) * block + o
    value_index = key_width * block + o * d + torch.arange(d).view(1, -1)
    keys = torch.gather(flat, 2, key_index.unsqueeze(1).expand(length, kv, key_width))
    values = torch.gather(flat, 2, value_index.unsqueeze(1).expand(length, kv, d))
    return keys, values


def lowrank_keys(layer, table_row: torch.Tensor, length: int, key_heads: int, rank: int) -> torch.Tensor:
    """(key_heads, L, r): a low-rank cache's keys; cache head c holds key heads c * per .. c * per + per - 1."""
    kv = layer.kv_cache.shape[1]
    keys, _ = lowrank_entries(layer, table_row, length, key_heads // kv * rank)
    keys = as_float64(keys, layer.kv_cache_dtype, layer._k_scale_float)
    return keys.reshape(length, key_heads, rank).transpose(0, 1)


def own_values(layer, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """(KV, L, d): this layer's V, dequantized with its v scale."""
    _, values = lowrank_entries(layer, table_row, length, layer.key_width)
    return as_float64(values, layer.kv_cache_dtype, layer._v_scale_float).transpose(0, 1)


# ---- the reference's inputs ----


def below_map(part_heads: list[int], source: torch.Tensor, count: int) -> list[int]:
    """A below part's head per below head g (the problem gives it per query head: map[source[h]]). Heads no source
    names are filled with the GQA grouping (they do not reach the output)."""
    heads = source.numel()
    mapping = [g // (heads // count) if heads % count == 0 else 0 for g in range(heads)]
    for h, g in enumerate(source.tolist()):
        assert mapping[g] == part_heads[h] or g not in source[:h].tolist(), "a below part's map is per below head"
        mapping[g] = part_heads[h]
    return mapping


def key_input(keys: torch.Tensor, mapping: list[int]) -> torch.Tensor:
    """Low-rank keys (Hk, L, r) as the reference's `k_lr` (1, Hk', L, r): as they are when `mapping` is the reference's
    grouping (head h reads h // (H / Hk)), else one per head as the map says."""
    heads, count = len(mapping), keys.shape[0]
    if heads % count == 0 and mapping == [h // (heads // count) for h in range(heads)]:
        return keys.unsqueeze(0)
    return keys[mapping].unsqueeze(0)


def window_mask(queries: int, length: int, window: int | None) -> torch.Tensor | None:
    """None (the reference's causal mask) without a window; else causal and i - j < window, additive."""
    if window is None:
        return None
    q_pos = torch.arange(length - queries, length).view(-1, 1)
    k_pos = torch.arange(length).view(1, -1)
    hidden = (k_pos > q_pos) | (q_pos - k_pos >= window)
    return torch.zeros(queries, length, dtype=torch.float64).masked_fill(hidden, float("-inf"))


def reference_output(problem: Problem, request: int) -> torch.Tensor:
    """The reference's attention output (Q, H, d) of one request, in float64 (module docstring)."""
    layer, query, meta = problem.layer, problem.query, problem.meta
    start, stop = meta.query_start[request], meta.query_start[request + 1]
    length, rows = meta.seq_lens[request], stop - start
    below = query.below[start:stop].double().transpose(0, 1).unsqueeze(0)  # (1, H, Q, width below)
    own = query.own[start:stop].double().transpose(0, 1).unsqueeze(0)  # (1, H, Q, r): q_lr / sqrt(r)
    source, heads = query.source, query.source.numel()
    *below_parts, own_part = layer.parts
    root_part, *chain = below_parts
    assert root_part.kind == "root" and own_part.kind == "lowrank" and own_part.layer_name == layer.layer_name
    tables = [source_meta.block_table[request] for _, source_meta in problem.sources]

    root, _ = problem.sources[0]
    keys = root_keys(root, tables[0], length, root_part.width)  # (KV, L, d)
    mapping = below_map(root_part.heads, source, keys.shape[0])
    scores = below[..., : root_part.width] @ keys[mapping].unsqueeze(0).transpose(-1, -2)  # (1, H, Q, L)
    offset = root_part.width
    identity = {"source": torch.arange(heads), "scale": torch.ones(heads, dtype=torch.float64)}
    no_values = torch.zeros(1, 1, length, 1, dtype=torch.float64)
    for n, part in enumerate(chain, start=1):
        keys = lowrank_keys(problem.sources[n][0], tables[n], length, part.key_heads, part.width)
        q_lr = below[..., offset : offset + part.width] * math.sqrt(part.width)
        k_lr = key_input(keys, below_map(part.heads, source, part.key_heads))
        _, scores = reference.shared_attention_reference(scores, q_lr, k_lr, no_values, **identity)
        offset += part.width
    assert offset == below.shape[-1]

    keys = lowrank_keys(layer, tables[-1], length, own_part.key_heads, own_part.width)
    values = own_values(layer, tables[-1], length).unsqueeze(0)  # (1, KV, L, d)
    out, _ = reference.shared_attention_reference(
        scores, own * math.sqrt(own_part.width), key_input(keys, own_part.heads), values,
        source=source, scale=query.scale.double(), mask=window_mask(rows, length, layer.window),
    )  # fmt: skip
    return out[0].transpose(0, 1)


def model_head_maps(problem: Problem) -> Problem:
    """The problem with the head maps a served model has: below head g reads root KV head g // (H / KV) and low-rank
    key head g // (H / Hk) (so query head h the ones of source[h]); this layer's own h // (H / Hk)."""
    layer, source = problem.layer, problem.query.source
    heads, kv = source.numel(), problem.sources[0][0].kv_cache.shape[1]
    for n, part in enumerate(layer.parts):
        count = part.key_heads if part.kind == "lowrank" else kv
        natural = torch.arange(heads) // (heads // count)
        part.heads = (natural if n == len(layer.parts) - 1 else natural[source]).tolist()
        slots, pick = head_groups(part.heads, count)  # as LowRankCacheAttention.__init__
        setattr(layer, f"part_slots_{n}", torch.tensor(slots))
        setattr(layer, f"part_pick_{n}", torch.tensor(pick))
        setattr(layer, f"part_heads_{n}", torch.tensor(part.heads, dtype=torch.long))
    return problem


# ---- the plugin against it ----


@pytest.fixture(params=["torch", "kernel"])
def path(request):
    if request.param == "kernel" and not lisa_kernel():
        pytest.skip("the C++ kernel is unavailable (no compiler, a failed build, or HFCOMPRESS_VLLM_ATTENTION=torch)")
    return request.param


def plugin_output(problem: Problem, path: str) -> torch.Tensor:
    out = problem.output()
    if path == "kernel":
        assert kernel_attention(problem.layer, problem.sources, problem.query, out, problem.meta, problem.n) is None
    else:
        torch_attention(problem.layer, problem.sources, problem.query.concatenated(), out, problem.meta, problem.n)
    assert not out[problem.n :].any()  # padding rows untouched
    return out


def assert_matches_reference(problem: Problem, path: str) -> None:
    out = plugin_output(problem, path)
    assert out.dtype == torch.float32
    for request in range(len(problem.meta.seq_lens)):
        start, stop = problem.meta.query_start[request], problem.meta.query_start[request + 1]
        expected = reference_output(problem, request)
        torch.testing.assert_close(
            out[start:stop].double(), expected, rtol=1e-5, atol=1e-5,
            msg=lambda m, r=request: f"request {r} {problem.meta.seq_lens[r], stop - start} (keys, rows): {m}",
        )  # fmt: skip


SHAPES = {
    # 9 heads of 64, 3 KV heads; a chain: keys per KV group (3 x 20), then one per query head (9 x 20)
    "smollm2": {},
    "block-16-window-7": {"block": 16, "window": 7},
    # GQA groups of 4; split blocks (a part's smaller than another's); a window
    "gqa4-blocks-32-16-8-window": {"heads": 8, "kv": 2, "d": 32, "chain": ((2, 8), (8, 8)), "block": (32, 16, 8),
                                   "window": 40},
    # MHA with a chain of three shared layers below this one, blocks of 8 (past several blocks)
    "mha-chain-of-4-block-8": {"heads": 4, "kv": 4, "d": 16, "chain": ((4, 6), (4, 6), (4, 6), (4, 6)), "block": 8,
                               "scales": (1.0,) * 6},
    # no earlier shared layer; keys per KV group; the root's head size padded past d; a block size not of 16 lanes
    "padded-root-block-24-window": {"heads": 4, "kv": 2, "d": 24, "root_head_size": 32, "chain": ((2, 8),), "block": 24,
                                    "window": 5},
}


@pytest.mark.parametrize("maps", ["free", "model"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_plugin_matches_the_reference_fp32(shape, maps, path):
    problem = random_problem(REQUESTS, padding_rows=3, seed=len(shape), **SHAPES[shape])
    if maps == "model":
        problem = model_head_maps(problem)
    assert_matches_reference(problem, path)


@pytest.mark.parametrize("root_isa", ["vec", "amx"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_plugin_matches_the_reference_fp8(kv_cache_dtype, root_isa, path):
    """fp8 caches (non-unit k scales per layer, this layer's v scale; the root's keys transposed or AMX-packed) against
    the reference on the dequantized values."""
    problem = random_problem(REQUESTS, kv_cache_dtype=kv_cache_dtype, scales=(0.37, 0.8, 1.3, 0.6), block=(32, 16, 16),
                             window=60, root_isa=root_isa, padding_rows=2)  # fmt: skip
    assert_matches_reference(problem, path)
