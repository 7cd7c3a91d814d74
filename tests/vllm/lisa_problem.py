"""Random LISA shared-layer attention problems in vLLM's real cache layouts, for the kernel test
(test_lisa_kernel.py) and its benchmark (benchmarks/vllm_lowrank_kernel.py): a root layer's CPU-backend cache (per
block and KV head the keys as its ISA lays them out, then V), the low-rank caches of a chain of shared layers
([blocks, KV, block, key width + d]), each with its own shuffled block table, and requests of mixed lengths (decodes
and prefill chunks) as `lowrank.kernel_attention` / `lowrank.torch_attention` take them."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from hfcompress_vllm.lowrank import FP8_FORMATS, KeyPart, LowRankMetadata, SharedQuery, head_groups, quantize


@dataclass
class Problem:
    layer: SimpleNamespace  # what the attention reads of a LowRankCacheAttention
    sources: list  # per key part: (the layer holding it, metadata with its block table)
    query: SharedQuery  # the layer below's features (tokens, H, width below), source, scale; own (tokens, H, r)
    meta: LowRankMetadata
    n: int  # actual tokens (query rows past n are padding)

    def output(self) -> torch.Tensor:
        below = self.query.below
        return torch.zeros(below.shape[0], self.layer.num_heads, self.layer.head_dim, dtype=below.dtype)


def random_cache(shape: tuple, dtype: torch.dtype, kv_cache_dtype: str, scale: float) -> torch.Tensor:
    values = torch.randn(shape)
    fp8 = FP8_FORMATS.get(kv_cache_dtype)
    return values.to(dtype) if fp8 is None else quantize(values, scale, fp8)


def random_problem(requests: list[tuple[int, int]], *, heads: int = 9, kv: int = 3, d: int = 64,
                   root_head_size: int | None = None, chain: tuple = ((3, 20), (9, 20)), block: int | tuple = 32,
                   window: int | None = None, dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto",
                   scales: tuple = (1.0, 1.0, 1.0), padding_rows: int = 0, seed: int = 0,
                   root_isa: str = "vec") -> Problem:  # fmt: skip
    """`requests`: per request (keys, query rows): a decode has 1 row, a prefill chunk more, the last rows of its keys.
    `chain`: the low-rank parts after the root's K, (key heads, rank) each, the last this layer's own. `block`: the
    block size, or one per layer (the root's first; vLLM splits blocks for backends that take smaller ones). `scales`:
    the layers' k scales (the root's first, used with fp8) and, last, this layer's v scale. `root_isa`: the CPU
    backend's ISA whose key layout the root's cache has ("vec": transposed; "amx": packed). Align: each query head
    takes a random below head's features (sources repeat, as Align's do) times a random scale; a below part's head
    map is per below head, so the query heads of one source read one head of it."""
    torch.manual_seed(seed)
    sizes = list(block) if isinstance(block, tuple) else [block] * (len(chain) + 1)
    num_blocks = sum(-(-length // min(sizes)) for length, _ in requests) + 5
    layers = []

    def table(block: int) -> torch.Tensor:  # distinct blocks per request, shuffled; past its blocks, any (vLLM pads)
        width = max(-(-length // block) for length, _ in requests) + 2
        order = torch.randperm(num_blocks)
        rows, used = [], 0
        for length, _ in requests:
            count = -(-length // block)
            rows.append(torch.cat([order[used : used + count], torch.randint(num_blocks, (width - count,))]))
            used += count
        return torch.stack(rows).to(torch.int32)

    root_size = root_head_size or d
    root = SimpleNamespace(kv_cache=random_cache((num_blocks, kv, sizes[0], 2 * root_size), dtype, kv_cache_dtype, scales[0]),
                           kv_cache_dtype=kv_cache_dtype, _k_scale_float=scales[0], isa=root_isa)  # fmt: skip
    layers.append((root, SimpleNamespace(block_table=table(sizes[0]))))
    source = torch.randint(heads, (heads,))
    parts = [KeyPart("root", "root", torch.randint(kv, (heads,))[source].tolist(), d)]
    for n, (key_heads, rank) in enumerate(chain):
        own = n == len(chain) - 1
        name = "own" if own else f"shared{n}"
        key_width = key_heads * rank // kv
        cache = random_cache((num_blocks, kv, sizes[n + 1], key_width + d), dtype, kv_cache_dtype, scales[n + 1])
        layer = SimpleNamespace(kv_cache=cache, kv_cache_dtype=kv_cache_dtype, _k_scale_float=scales[n + 1], layer_name=name)
        layers.append((layer, SimpleNamespace(block_table=table(sizes[n + 1]))))
        read = torch.randint(key_heads, (heads,))
        parts.append(KeyPart(name, "lowrank", (read if own else read[source]).tolist(), rank, key_heads))
    layer = layers[-1][0]
    layer.parts, layer.window, layer.num_heads, layer.head_dim = parts, window, heads, d
    layer.key_width = chain[-1][0] * chain[-1][1] // kv
    layer._v_scale_float = scales[-1]
    layer.fp8 = FP8_FORMATS.get(kv_cache_dtype)
    for n, part in enumerate(parts):
        slots, pick = head_groups(part.heads, part.key_heads if part.kind == "lowrank" else kv)
        setattr(layer, f"part_slots_{n}", torch.tensor(slots))
        setattr(layer, f"part_pick_{n}", torch.tensor(pick))
        setattr(layer, f"part_heads_{n}", torch.tensor(part.heads, dtype=torch.long))
    rows = [q for _, q in requests]
    n = sum(rows)
    features = d + sum(rank for _, rank in chain)
    below_width, rank = features - chain[-1][1], chain[-1][1]
    # scaled as the model scales its query features (the softmax scale folded in): scores of unit spread
    query = SharedQuery(
        (torch.randn(n + padding_rows, heads, below_width) * features**-0.5).to(dtype), source,
        (0.5 + torch.rand(heads)).to(dtype), (torch.randn(n + padding_rows, heads, rank) * features**-0.5).to(dtype),
    )  # fmt: skip
    query_start = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.long)
    seq_lens = torch.tensor([length for length, _ in requests], dtype=torch.long)
    meta = LowRankMetadata(
        num_actual_tokens=n, query_start=query_start.tolist(), seq_lens=seq_lens.tolist(),
        block_table=layers[-1][1].block_table, slot_mapping=torch.zeros(n, dtype=torch.long),
        query_start_t=query_start, seq_lens_t=seq_lens,
    )  # fmt: skip
    return Problem(layer, layers, query, meta, n)
