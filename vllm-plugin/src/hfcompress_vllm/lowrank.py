"""The attention this plugin owns for LISA shared layers: each caches what the remote code caches, its low-rank keys
and its V in their own widths, and reads the layer below's keys where they lie, in the root layer's paged cache.

A shared layer l (sparse Align) scores query head h as
    S_l[h] = scale[h] S_{l-1}[source[h]] + q_lr[h] . k_lr[key(h)] / sqrt(r),
one attention over concatenated features: the query [scale q_{l-1}[source] | q_lr / sqrt(r)], the key [K_root[root head
of h] | k_lr of the chain's earlier shared layers | k_lr of this layer] (`SharedQuery`: the layer below's features,
source, scale and q_lr / sqrt(r), as the model hands them; the kernel scores each source once). Only the last part is
this layer's; the root's K sits in the root layer's cache (vLLM's CPU attention backend, read in its layout), the earlier
shared layers' low-rank keys in their own caches (this module's layout). So a shared layer's cache per token and KV head
is its low-rank keys (r, or g * r with one low-rank key per query head) and V (d): on SmolLM2 3 x (20 + 64) = 252 values
a token against the original layer's 384, what the remote code holds.

vLLM side: `LowRankCacheAttention` is a vLLM `Attention` (so vLLM sizes, allocates, binds and prefix-caches its cache
like any other: a `FullAttentionSpec` / `SlidingWindowSpec` with head_size = key width and head_size_v = d; the layers
of one attention type share one block table, each with its own page size) whose backend (`LowRankBackend`) is this
module: its cache is [blocks, KV, block_size, key width + d], per block and KV head the low-rank keys transposed
([key width, block_size], as the CPU backend lays out the root's K: a key feature's positions are one vector), then V
([block_size, d]) (`own_views`); the attention is the op
`torch.ops.vllm.hfcompress_lisa_attention` (opaque to torch.compile). It runs a C++ kernel (lisa_attention.cpp, built
at first use by `lisa_kernel`) that walks each request's block table and reads every part where it lies (no copies),
with an online softmax; `attend` is the torch reference and the fallback (no compiler, a failed build, an unsupported
layout, HFCOMPRESS_VLLM_ATTENTION=torch): per request, the keys and values of its blocks gathered, the scores masked
causally (and by the window), softmax, times V.

The root's cache is the CPU backend's: per block and KV head the keys, then the values. The keys are laid out as its
ISA packs them (`ROOT_LAYOUTS`): "vec" / "vec16" (fp32, fp16, bf16 without AMX) as [head size, block_size]
(transposed); "amx" (bf16 on CPUs with AMX tiles) in tiles of 16 positions, per tile the head's features in pairs,
[block_size / 16, head size / 2, 16, 2]. The same with an fp8 KV cache (`kv_cache_dtype` fp8 / fp8_e4m3 / fp8_e5m2:
bytes of e4m3fn / e5m2, the value divided by the layer's k / v scale). There a shared layer's own cache holds fp8 bytes
too (quantized with its own layer's scales on write), and every part is dequantized (times its layer's scale) as it is
read. A root with a key or value latent (latent.py) caches its key latent (or its rotated keys) in a layout of its
own, not the CPU backend's: it hands the step's rotated keys (`step_keys`: a scratch cache in the "vec" layout with its
own block table), read in place of its cache. GPU backends
have their own layouts: there the model falls back to the concatenated-feature layouts
(model.plan_layers); the layer also checks, on its first call, that the root's attention runs an ISA whose layout it
reads.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from .configs import UnservableModel

# the CPU attention ISAs whose key layout `root_key_blocks` and the kernel read -> that layout (the kernel's code for it)
ROOT_LAYOUTS = {"vec": "transposed", "vec16": "transposed", "amx": "amx"}
ROOT_LAYOUT_CODES = {"transposed": 1, "amx": 2}

# vLLM's fp8 KV cache dtypes: the cache tensor is uint8, holding these formats (the CPU backend's "fp8" is e4m3)
FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_CODES = {None: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # the kernel's names for them

KERNEL_SOURCE = Path(__file__).with_name("lisa_attention.cpp")
logger = logging.getLogger("vllm.hfcompress")  # under vllm's logger: printed with the engine's messages


def root_cache_readable(dtype: torch.dtype, block_size: int | None, head_size: int,
                        kv_cache_dtype: str = "auto") -> bool:  # fmt: skip
    """Whether a full layer's paged cache (vLLM's CPU attention backend at this dtype, block size, head size and KV
    cache dtype) is in a layout `root_key_blocks` reads: the CPU platform, an ISA of `ROOT_LAYOUTS`, and a KV cache
    dtype of the model's dtype or an fp8 format."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or kv_cache_dtype not in ("auto", *FP8_FORMATS):
        return False
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        return _get_attn_isa(dtype, block_size or 128, head_size, kv_cache_dtype) in ROOT_LAYOUTS
    except Exception:  # noqa: BLE001 - an ISA this vLLM cannot pick (fp8 without AVX-512, head size): not readable
        return False


def quantize(x: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    """x / scale as fp8 bytes (uint8), saturated at the format's largest value as the CPU backend does (it rounds toward
    zero; this rounds to nearest)."""
    largest = torch.finfo(fp8).max
    return (x.float() / scale).clamp(-largest, largest).to(fp8).view(torch.uint8)


def dequantize(stored: torch.Tensor, scale: float, fp8: torch.dtype | None, dtype: torch.dtype) -> torch.Tensor:
    """A cache slice read back in `dtype`: fp8 bytes times the layer's scale; unquantized ones as they are."""
    if fp8 is None:
        return stored
    values = stored.view(fp8).to(dtype)
    return values if scale == 1.0 else values * scale


@dataclass
class LowRankMetadata:
    num_actual_tokens: int
    query_start: list[int]  # per request, its first query token (num_reqs + 1 entries)
    seq_lens: list[int]  # per request, its keys (cached + current)
    block_table: torch.Tensor  # (num_reqs, blocks)
    slot_mapping: torch.Tensor  # (tokens,)
    query_start_t: torch.Tensor  # query_start and seq_lens as int64 tensors (the kernel's arguments)
    seq_lens_t: torch.Tensor


class LowRankMetadataBuilder(AttentionMetadataBuilder[LowRankMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        meta = common_attn_metadata
        query_start = meta.query_start_loc_cpu[: meta.num_reqs + 1].long()
        seq_lens = meta.seq_lens[: meta.num_reqs].cpu().long()
        return LowRankMetadata(
            num_actual_tokens=meta.num_actual_tokens,
            query_start=query_start.tolist(),
            seq_lens=seq_lens.tolist(),
            block_table=meta.block_table_tensor[: meta.num_reqs],
            slot_mapping=meta.slot_mapping,
            query_start_t=query_start.contiguous(),
            seq_lens_t=seq_lens.contiguous(),
        )


class LowRankImpl(AttentionImpl):
    """vLLM builds one per layer; the attention itself is `lisa_attention` (the layer calls it with its features)."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, **kwargs):  # fmt: skip
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
        raise NotImplementedError("LISA low-rank cache layers attend through torch.ops.vllm.hfcompress_lisa_attention")


class LowRankBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", *FP8_FORMATS]
    forward_includes_kv_cache_update: bool = True  # the op writes the current tokens' rows itself

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return LowRankImpl

    @staticmethod
    def get_builder_cls():
        return LowRankMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True


@dataclass
class SharedQuery:
    """A shared layer's query features, factored: head h's are [scale[h] * below[:, source[h]] | own[:, h]], so the
    layer below's scores of a source read by several heads are computed once (the kernel)."""

    below: torch.Tensor  # (t, H, width below): the layer below's query features
    source: torch.Tensor  # (H,) int64
    scale: torch.Tensor  # (H,)
    own: torch.Tensor  # (t, H, r): this layer's rotated low-rank queries / sqrt(r)

    def concatenated(self) -> torch.Tensor:
        """(t, H, width): the features as one tensor (the torch path; the handoff to a shared layer above)."""
        heads = self.source.numel()
        scaled = self.below.index_select(1, self.source) * self.scale.to(self.below.dtype).view(1, heads, 1)
        return torch.cat([scaled, self.own], dim=-1) if self.own.shape[-1] else scaled


@dataclass
class KeyPart:
    """One part of a shared layer's logical key: the root's K ("root": read from a CPU-backend cache) or an earlier /
    this shared layer's low-rank keys ("lowrank": read from a LowRankCacheAttention cache), and, per query head, which of
    that part's heads it reads."""

    layer_name: str  # the vLLM attention layer holding it
    kind: str  # root | lowrank
    heads: list[int]
    width: int  # d (root) or r (lowrank)
    key_heads: int = 0  # lowrank: the layer's low-rank key heads


def head_groups(heads: list[int], count: int) -> tuple[list[int], list[int]]:
    """The query heads grouped by the part head they read (`heads[h]` of `count`), each group padded to the largest
    (its first head repeated): a part's scores are one matmul of (count, most) queries against its `count` heads (no
    key copied per query head), then each query head picks its row. (slots: the query head at each of count * most
    rows; pick: per query head, its row.)"""
    readers = [[h for h in range(len(heads)) if heads[h] == p] for p in range(count)]
    most = max(len(r) for r in readers)
    slots = [r[i] if i < len(r) else (r or [0])[0] for r in readers for i in range(most)]
    pick = [heads[h] * most + readers[heads[h]].index(h) for h in range(len(heads))]
    return slots, pick


class LowRankCacheAttention(Attention):
    """A shared layer's vLLM attention: its cache holds its low-rank keys and V ([blocks, KV, block, key_width + d])."""

    def __init__(self, *, num_heads: int, num_kv_heads: int, key_width: int, head_dim: int, parts: list[KeyPart],
                 cache_config, sliding_window: int | None, prefix: str):  # fmt: skip
        super().__init__(
            num_heads, key_width, 1.0, num_kv_heads=num_kv_heads, cache_config=cache_config,
            per_layer_sliding_window=sliding_window, prefix=prefix, attn_backend=LowRankBackend, head_size_v=head_dim,
        )  # fmt: skip
        self.parts = parts
        self.key_width, self.head_dim = key_width, head_dim
        self.window = sliding_window
        for n, part in enumerate(parts):
            slots, pick = head_groups(part.heads, part.key_heads if part.kind == "lowrank" else num_kv_heads)
            self.register_buffer(f"part_slots_{n}", torch.tensor(slots), persistent=False)
            self.register_buffer(f"part_pick_{n}", torch.tensor(pick), persistent=False)
            self.register_buffer(f"part_heads_{n}", torch.tensor(part.heads, dtype=torch.long), persistent=False)
        self.checked = False
        self.fp8 = FP8_FORMATS.get(self.kv_cache_dtype)  # None: the cache holds the model's dtype
        lisa_kernel()  # built (or loaded from torch's extension cache) while the engine starts, not at its first step

    def attend(self, query: SharedQuery, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """key (t, KV, key_width) this layer's low-rank keys as cached, value (t, KV, d): the attention output (t, H,
        d)."""
        below = query.below
        output = torch.empty(below.shape[0], self.num_heads, self.head_dim, dtype=below.dtype, device=below.device)
        torch.ops.vllm.hfcompress_lisa_attention(below.contiguous(), query.source, query.scale, query.own.contiguous(), key,
                                                 value, output, self.layer_name)  # fmt: skip
        return output


def root_key_blocks(cache: torch.Tensor, blocks: torch.Tensor, width: int, layout: str = "transposed") -> torch.Tensor:
    """The keys, transposed per block, (R, blocks, KV, width, block_size) a CPU-backend layer cached in `blocks` (R,
    blocks): its cache is [blocks, KV, block_size, 2 * head_size], per block and KV head the keys, then the values; the
    keys as [head_size, block_size] ("transposed": the vec ISAs) or [block_size / 16, head_size / 2, 16, 2] ("amx");
    an fp8 cache the same in bytes (uint8: `dequantize` them). One copy (whole blocks, index_select: a memcpy), then
    views (and, for amx, a permute)."""
    num_blocks, kv, block, double = cache.shape
    size = double // 2
    requests, count = blocks.shape
    keys = cache.view(num_blocks, kv, 2, size * block)[:, :, 0]  # the key halves (a view)
    keys = keys.index_select(0, blocks.reshape(-1))
    if layout == "amx":  # (.., tile, pair, position in tile, element of pair) -> (.., feature, position)
        keys = keys.view(-1, kv, block // 16, size // 2, 16, 2).permute(0, 1, 3, 5, 2, 4)
    return keys.reshape(requests, count, kv, size, block)[:, :, :, :width]


def root_layout(layer) -> str:
    """The key layout of a root layer's cache: its ISA's (vLLM's CPU backend sets `isa` on its layers)."""
    return ROOT_LAYOUTS[layer.isa]


def own_views(cache: torch.Tensor, key_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A LowRankCacheAttention cache [blocks, KV, block_size, key_width + d] as its keys (blocks, KV, key_width,
    block_size) and values (blocks, KV, block_size, d): per block and KV head the keys transposed, then V (views)."""
    num_blocks, kv, block, width = cache.shape
    flat = cache.view(num_blocks, kv, block * width)
    keys = flat[:, :, : key_width * block].unflatten(-1, (key_width, block))
    return keys, flat[:, :, key_width * block :].unflatten(-1, (block, width - key_width))


def own_blocks(cache: torch.Tensor, blocks: torch.Tensor, key_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (R, blocks, KV, key_width, block_size) and values (R, blocks, KV, block_size, d) a LowRankCacheAttention
    cache holds in `blocks` (R, blocks)."""
    requests, count = blocks.shape
    picked = cache.index_select(0, blocks.reshape(-1))
    keys, values = own_views(picked, key_width)
    return keys.unflatten(0, (requests, count)), values.unflatten(0, (requests, count))


ROWS = 128  # a prefill's query rows scored at once (bounds the score tensor: H x ROWS x keys)


def attend(layer: "LowRankCacheAttention", sources: list, query: torch.Tensor, requests: list[int], lengths: list[int]) -> torch.Tensor:
    """Attention of the queries (R, H, Q, width) of `requests` (R of them with one query each, or one with Q) over their
    `lengths` keys: (R, Q, H, d). Per part of the key, its heads' keys per block (R, blocks, P, width, block), and the
    query head -> part head map; the scores are the sum over parts. `sources`: per part, (the vLLM attention layer whose
    cache holds it, the metadata whose block table addresses that cache)."""
    longest = max(lengths)
    index = torch.tensor(requests, device=query.device)
    parts, own, offset = [], None, 0
    for n_part, (part, (source, source_meta)) in enumerate(zip(layer.parts, sources)):
        cache, fp8 = source.kv_cache, FP8_FORMATS.get(source.kv_cache_dtype)
        blocks = source_meta.block_table.index_select(0, index)[:, : -(-longest // cache.shape[2])]
        if part.kind == "root":
            stored = root_key_blocks(cache, blocks, part.width, root_layout(source))
            keys = dequantize(stored, source._k_scale_float, fp8, query.dtype)
        else:
            kv = cache.shape[1]
            stored, values = own_blocks(cache, blocks, part.key_heads // kv * part.width)
            if part.layer_name == layer.layer_name:
                own = values
            keys = dequantize(stored, source._k_scale_float, fp8, query.dtype)
            # one low-rank key per query head: cache head c holds key heads c * per .. c * per + per - 1
            keys = keys.unflatten(3, (part.key_heads // kv, part.width)).flatten(2, 3)  # (R, blocks, key heads, r, block)
        parts.append((keys, getattr(layer, f"part_slots_{n_part}"), getattr(layer, f"part_pick_{n_part}"), offset))
        offset += part.width
    count, heads, queries = query.shape[:3]
    count, nb, kv, block = own.shape[:4]
    group = heads // kv
    padded = nb * block
    # (R, blocks, KV, block, d): query head h reads V of KV head h // group
    values = dequantize(own, layer._v_scale_float, layer.fp8, query.dtype)
    lengths_t = torch.tensor(lengths, device=query.device).view(-1, 1, 1, 1)
    k_pos = torch.arange(longest, device=query.device).view(1, 1, 1, -1)
    out = []
    for first in range(0, queries, ROWS):
        rows = min(ROWS, queries - first)
        q = query[:, :, first : first + rows]
        scores = None
        for keys, slots, pick, start in parts:
            heads_p, width = keys.shape[2], keys.shape[3]
            q_part = q[..., start : start + width].index_select(1, slots)  # (R, P * most, rows, width)
            q_part = q_part.reshape(count, 1, heads_p, -1, width)  # (R, 1, P, most * rows, width)
            part_scores = torch.matmul(q_part, keys)  # (R, blocks, P, most * rows, block)
            blocks_p, block_p = part_scores.shape[1], part_scores.shape[-1]
            part_scores = part_scores.view(count, blocks_p, -1, rows, block_p).index_select(2, pick)  # (R, blocks, H, rows, block)
            part_scores = part_scores.permute(0, 2, 3, 1, 4).reshape(count, heads, rows, blocks_p * block_p)[..., :longest]
            scores = part_scores if scores is None else scores + part_scores
        q_pos = lengths_t - queries + first + torch.arange(rows, device=query.device).view(1, 1, -1, 1)
        hidden = k_pos > q_pos
        if layer.window is not None:
            hidden = hidden | (q_pos - k_pos >= layer.window)
        probs = torch.softmax(scores.float().masked_fill(hidden, float("-inf")), dim=-1).to(query.dtype)
        if padded > longest:
            probs = torch.nn.functional.pad(probs, (0, padded - longest))
        # (R, H, rows, blocks * block) -> per block and KV head (R, blocks, KV, group * rows, block), times V, summed
        probs = probs.view(count, kv, group * rows, nb, block).permute(0, 3, 1, 2, 4)
        out.append(torch.matmul(probs, values).sum(1).view(count, heads, rows, -1))
    out = out[0] if len(out) == 1 else torch.cat(out, dim=2)
    return out.transpose(1, 2)


def cpu_tag() -> str:
    """A short hash of this CPU's feature flags: the kernel is built with -march=native, and torch's extension cache
    (keyed by sources and flags) may sit in a home directory shared by other CPUs."""
    try:
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def attention_choice() -> str:
    choice = os.environ.get("HFCOMPRESS_VLLM_ATTENTION", "auto")
    if choice not in ("auto", "kernel", "torch"):
        raise UnservableModel(f"HFCOMPRESS_VLLM_ATTENTION={choice!r}: use auto (the default), kernel or torch.")
    return choice


@functools.cache
def lisa_kernel() -> bool:
    """Whether the C++ kernel (`torch.ops.hfcompress.lisa_attention`) is loaded: built once per machine into torch's
    extension directory (about half a minute), loaded once per process. HFCOMPRESS_VLLM_ATTENTION: auto (the default:
    a missing compiler or a failed build gives one warning and the torch path), kernel (required: they raise), torch
    (the torch path)."""
    choice = attention_choice()
    if choice == "torch":
        return False
    try:
        from torch.utils.cpp_extension import load

        flags = ["-O3", "-march=native", "-fopenmp"]  # compiled on the machine that runs it: native is its own CPU
        load(name=f"hfcompress_lisa_attention_{cpu_tag()}", sources=[str(KERNEL_SOURCE)], extra_cflags=flags,
             extra_ldflags=["-fopenmp"], is_python_module=False)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: serve with the torch path
        if choice == "kernel":
            raise UnservableModel(f"HFCOMPRESS_VLLM_ATTENTION=kernel: the C++ LISA attention kernel did not build: {exc}") from exc
        lines = str(exc).strip().splitlines()
        reason = next((l.strip() for l in lines if "error:" in l or "not found" in l), lines[0][:200] if lines else type(exc).__name__)
        logger.warning("hfcompress: the C++ LISA attention kernel is unavailable (%s); shared layers attend in torch "
                       "(slower).", reason)  # fmt: skip
        return False
    return True


def kernel_attention(layer: "LowRankCacheAttention", sources: list, query: SharedQuery, output: torch.Tensor,
                     meta: LowRankMetadata, n: int) -> str | None:  # fmt: skip
    """The attention of every request of the step by the C++ kernel, written into `output` (rows < n); None when done,
    else why it does not apply (nothing done): a query dtype other than fp32 / bf16 / fp16, caches whose block sizes
    do not divide each other or with rows it cannot address."""
    own = layer.kv_cache
    caches = [source.kv_cache for source, _ in sources]
    if query.below.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"query dtype {query.below.dtype}"
    smallest = min(c.shape[2] for c in [*caches, own])  # vLLM may split a backend's blocks (kernel block sizes)
    if any(c.shape[2] % smallest or c.stride(3) != 1 or c.stride(2) != c.shape[3] for c in [*caches, own]):
        return "caches (shape, strides): " + ", ".join(f"{tuple(c.shape)} {c.stride()}" for c in [*caches, own])
    tables = [source_meta.block_table.to(torch.int32) for _, source_meta in sources]
    torch.ops.hfcompress.lisa_attention(
        query.below, query.source, query.scale.float().contiguous(), query.own, output, meta.query_start_t,
        meta.seq_lens_t, n, layer.window or 0, caches, tables,
        [ROOT_LAYOUT_CODES[root_layout(source)] if part.kind == "root" else 0
         for part, (source, _) in zip(layer.parts, sources)],
        [getattr(layer, f"part_heads_{i}") for i in range(len(caches))],
        [part.width for part in layer.parts],
        [part.key_heads // cache.shape[1] if part.kind == "lowrank" else 1 for part, cache in zip(layer.parts, caches)],
        [float(source._k_scale_float) for source, _ in sources],
        [FP8_CODES[FP8_FORMATS.get(source.kv_cache_dtype)] for source, _ in sources],
        own, meta.block_table.to(torch.int32), layer.key_width, float(layer._v_scale_float), FP8_CODES[layer.fp8],
    )  # fmt: skip
    return None


def lisa_attention(below: torch.Tensor, source: torch.Tensor, scale: torch.Tensor, own: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:  # fmt: skip
    context = get_forward_context()
    metadata = context.attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0]
    layer: LowRankCacheAttention = context.no_compile_layers[layer_name]
    meta = metadata.get(layer_name) if isinstance(metadata, dict) else metadata
    if meta is None or layer.kv_cache.numel() == 0:  # the profile / warm-up run: no cache yet
        output.zero_()
        return
    n = meta.num_actual_tokens
    cache = layer.kv_cache
    # this layer's keys and values of the current tokens
    slots = meta.slot_mapping[:n].long()
    block = cache.shape[2]
    valid = slots >= 0
    key_rows, value_rows = key[:n], value[:n]
    if layer.fp8 is not None:  # scaled as the CPU backend scales the root's K and V
        key_rows = quantize(key_rows, layer._k_scale_float, layer.fp8)
        value_rows = quantize(value_rows, layer._v_scale_float, layer.fp8)
    if not bool(valid.all()):
        slots, key_rows, value_rows = slots[valid], key_rows[valid], value_rows[valid]
    keys, values = own_views(cache, layer.key_width)
    keys[slots // block, :, :, slots % block] = key_rows.to(cache.dtype)
    values[slots // block, :, slots % block] = value_rows.to(cache.dtype)
    if n < output.shape[0]:
        output[n:].zero_()

    if not layer.checked:
        for part in layer.parts:
            root = context.no_compile_layers[part.layer_name]
            if part.kind == "root" and not getattr(root, "hands_keys", False):  # a latent root hands its keys
                isa = getattr(root, "isa", None)
                if isa not in ROOT_LAYOUTS:
                    raise UnservableModel(
                        f"{layer_name}: the layer below runs vLLM's CPU attention with ISA {isa!r}, whose cache layout "
                        "the hfcompress plugin does not read; serve with dtype float32 (or set HFCOMPRESS_VLLM_KV=concat)."
                    )
        layer.checked = True

    sources = []  # per part: (the layer whose cache holds it, metadata whose block table addresses that cache)
    for part in layer.parts:
        source_meta = metadata[part.layer_name] if isinstance(metadata, dict) else metadata
        holder = context.no_compile_layers[part.layer_name]
        handed = getattr(holder, "step_keys", None) if part.kind == "root" else None
        if handed is None and part.kind == "root" and getattr(holder, "hands_keys", False):
            raise RuntimeError(f"{layer_name}: its root {part.layer_name} handed no keys this step")
        # a latent root (latent.py) caches its keys in its own layout: it hands this step's keys in a "vec" layout of their
        # own, with their own block table
        sources.append((handed, handed) if handed is not None else (holder, source_meta))
    query = SharedQuery(below, source, scale, own)
    if lisa_kernel():
        why_not = kernel_attention(layer, sources, query, output, meta, n)
        if why_not is None:
            return
        if attention_choice() == "kernel":
            raise UnservableModel(f"HFCOMPRESS_VLLM_ATTENTION=kernel: the C++ kernel does not apply to {layer_name}: {why_not}.")
    torch_attention(layer, sources, query.concatenated(), output, meta, n)


def torch_attention(layer: "LowRankCacheAttention", sources: list, query: torch.Tensor, output: torch.Tensor,
                    meta: LowRankMetadata, n: int) -> None:  # fmt: skip
    """`kernel_attention` in torch (`attend`, over the concatenated features): the reference and the fallback."""
    attend_by_request(query, output, meta, n, lambda q, requests: attend(layer, sources, q, requests, [meta.seq_lens[r] for r in requests]))


def attend_by_request(query: torch.Tensor, output: torch.Tensor, meta: LowRankMetadata, n: int, attend_requests) -> None:
    """Into `output` (tokens, H, d), the attention of each request of `meta` over its query rows (query_start; the
    first `n` rows are real): a prefill (chunk) alone, the decodes (one row each) together. `attend_requests(q,
    requests)`: q (R, H, Q, width) of those requests -> their outputs (R, Q, H, d)."""
    decodes = []
    for r, (start, stop) in enumerate(zip(meta.query_start[:-1], meta.query_start[1:])):
        stop = min(stop, n)
        if stop <= start:
            continue
        if stop - start == 1:
            decodes.append((r, start))
            continue
        output[start:stop] = attend_requests(query[start:stop].transpose(0, 1).unsqueeze(0), [r])[0]  # q (1, H, Q, width)
    if decodes:
        rows = torch.tensor([start for _, start in decodes], device=query.device)
        out = attend_requests(query.index_select(0, rows).unsqueeze(2), [r for r, _ in decodes])  # q (R, H, 1, width)
        output.index_copy_(0, rows, out[:, 0])


def lisa_attention_fake(below, source, scale, own, key, value, output, layer_name) -> None:
    return None


if not hasattr(torch.ops.vllm, "hfcompress_lisa_attention"):
    direct_register_custom_op(
        op_name="hfcompress_lisa_attention", op_func=lisa_attention, mutates_args=["output"], fake_impl=lisa_attention_fake
    )
