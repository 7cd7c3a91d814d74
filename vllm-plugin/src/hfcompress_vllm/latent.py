"""The attention this plugin owns for layers with low-rank keys (config.json `key_ranks`): its paged cache holds what the
remote code caches, the key latent and V, and it rebuilds the keys from the latent at every step.

A layer with a key latent of width r computes z = B k (`key_latent.proj_in`: the pre-RoPE keys after any k_norm, all KV
heads side by side, KV * d -> r; one r-wide vector a token, not per head) and attends with the keys RoPE(A z)
(`proj_out`, r -> KV * d), every cached token's rotated at its position, the query at its own
(modeling/lisa_attention.py, `latent_query_key_value`). RoPE depends on position differences only, so the keys are
rotated at positions 0 .. T-1 (vLLM's positions are those of the sequence).

vLLM side: `LatentCacheAttention` is a vLLM `Attention` with the backend of the shared layers (lowrank.LowRankBackend:
vLLM sizes, allocates, binds and prefix-caches its cache like any other layer's) and a spec of head_size = w, the latent
spread over the KV heads (w = ceil(r / KV), zero-padded), and head_size_v = d. Its cache is [blocks, KV, block_size,
w + d] as vLLM allocates it, laid out per block as the block's latents, a token's whole latent (KV * w) in one row,
then the values per KV head (`latent_views`: the keys are rebuilt from the rows by one matmul), so a token costs
KV * (w + d) values against the original layer's 2 * KV * d (SmolLM2's default conversion: 0.75x in all).
An fp8 KV cache stores fp8 bytes (the latent divided by the layer's k scale, V by its v scale), dequantized as read.

The attention is the op `torch.ops.vllm.hfcompress_latent_attention` (opaque to torch.compile): it writes the current
tokens' latents and V into the layer's cache, then per request (decodes together, a prefill chunk alone) gathers the
blocks it needs (those holding the window where the layer has one), rebuilds the keys A z, rotates them, and attends:
scores masked causally (and by the window), softmax in fp32, times V, GQA by KV head. All in torch (matmuls): the
rebuild, KV * d * r multiply-adds per cached token and step, is what the latent costs, as in the remote code.

A key-latent layer below LISA shared layers (their root) hands the shared layers its rebuilt, rotated keys of the step
(`step_keys`): a scratch cache in the layout of vLLM's CPU backend ("vec": per block and KV head the keys as [d, block])
with a block table of its own, which lowrank.py's kernel and torch path read where they would read the root's paged
cache. Chunked prefill and prefix caching work unchanged: the rows of past tokens are complete in the cache, and every
key is rebuilt from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.utils.torch_utils import direct_register_custom_op

from .lowrank import FP8_FORMATS, LowRankBackend, attend_by_request, dequantize, quantize

ROWS = 128  # a prefill's query rows scored at once (bounds the score tensor: H x ROWS x keys)


def latent_width(rank: int, kv: int) -> int:
    """w: the latent's share per KV head (the cache spec's key head size)."""
    return -(-rank // kv)


@dataclass
class HandedKeys:
    """A root's rebuilt, rotated keys of one step, as a CPU-backend cache ("vec" layout) that lowrank.py reads: `kv_cache`
    [blocks, KV, block, 2 * d] (per block and KV head the keys as [d, block]; the value half is not read), and per
    request of the step its blocks (`block_table`)."""

    kv_cache: torch.Tensor
    block_table: torch.Tensor
    kv_cache_dtype: str = "auto"
    _k_scale_float: float = 1.0
    isa: str = "vec"


class LatentCacheAttention(Attention):
    """A key-latent layer's vLLM attention: its cache holds the latent and V ([blocks, KV, block, w + d])."""

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, rank: int, scale: float,
                 rotary: RotaryEmbedding, key_up: nn.Module, cache_config, sliding_window: int | None, prefix: str,
                 hands_keys: bool = False):  # fmt: skip
        width = latent_width(rank, num_kv_heads)
        super().__init__(
            num_heads, width, scale, num_kv_heads=num_kv_heads, cache_config=cache_config,
            per_layer_sliding_window=sliding_window, prefix=prefix, attn_backend=LowRankBackend, head_size_v=head_dim,
        )  # fmt: skip
        self.rank, self.key_width, self.head_dim, self.scaling = rank, width, head_dim, scale
        self.window = sliding_window
        self.rotary_dim, self.neox = rotary.rotary_dim, rotary.is_neox_style
        self.fp8 = FP8_FORMATS.get(self.kv_cache_dtype)  # None: the cache holds the model's dtype
        self.hands_keys = hands_keys  # LISA shared layers above read this step's keys (`step_keys`)
        self.step_keys: HandedKeys | None = None
        # A (the key latent's proj_out), not registered here (it is the layer's): called, since vLLM's CPU linears may
        # repack their weight and leave `weight` empty
        object.__setattr__(self, "key_up", key_up)

    def attend(self, query: torch.Tensor, latent: torch.Tensor, value: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """query (t, H * d) rotated at its positions, unscaled; latent (t, r); value (t, KV * d); cos_sin: the layer's
        RoPE cache (positions, rotary dim): the attention output (t, H * d)."""
        output = torch.empty_like(query)
        torch.ops.vllm.hfcompress_latent_attention(query.contiguous(), latent.contiguous(), value.contiguous(), cos_sin,
                                                   output, self.layer_name)  # fmt: skip
        return output


def latent_views(cache: torch.Tensor, key_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A LatentCacheAttention cache [blocks, KV, block, w + d] as its latents (blocks, block, KV * w) and values (blocks,
    KV, block, d) (views): per block, a token's whole latent is one row (the keys are rebuilt from it by one matmul),
    then the values per KV head."""
    num_blocks, kv, block, width = cache.shape
    flat = cache.view(num_blocks, kv * block * width)
    split = block * kv * key_width
    return flat[:, :split].view(num_blocks, block, kv * key_width), flat[:, split:].view(num_blocks, kv, block, -1)


def write_rows(layer, slot_mapping: torch.Tensor, latent: torch.Tensor, value: torch.Tensor) -> None:
    """The current tokens' latents (n, r) and values (n, KV * d) into the layer's cache at their slots (fp8: quantized
    with the layer's k / v scales, as the CPU backend scales a full layer's K and V)."""
    cache = layer.kv_cache
    num_blocks, kv, block, _ = cache.shape
    n, width = latent.shape[0], layer.key_width
    rows = torch.nn.functional.pad(latent, (0, kv * width - latent.shape[1]))
    values = value.reshape(n, kv, -1)
    if layer.fp8 is not None:
        rows = quantize(rows, layer._k_scale_float, layer.fp8)
        values = quantize(values, layer._v_scale_float, layer.fp8)
    slots = slot_mapping[:n].long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, rows, values = slots[valid], rows[valid], values[valid]
    latents, cached_values = latent_views(cache, width)
    latents[slots // block, slots % block] = rows.to(cache.dtype)
    cached_values[slots // block, :, slots % block] = values.to(cache.dtype)


def rotary_tables(layer, cos_sin: torch.Tensor, first: int, length: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """cos and sin (L, 1, rotary dim / 2) of positions first .. first + L - 1 from the layer's RoPE cache (vLLM's: per
    position cos then sin). Positions past the cache (a last block's tail near max_model_len) hold no token: any
    rotation will do."""
    positions = (first + torch.arange(length, device=cos_sin.device)).clamp_max(cos_sin.shape[0] - 1)
    table = cos_sin.index_select(0, positions).to(dtype)
    cos, sin = table.chunk(2, dim=-1)
    return cos.unsqueeze(1), sin.unsqueeze(1)


def rebuilt_keys(layer, latent: torch.Tensor, cos_sin: torch.Tensor, first: int) -> torch.Tensor:
    """latent (R, L, r) of positions first .. first + L - 1: the keys RoPE(A z) per KV head, (R, KV, L, d)."""
    requests, length, rank = latent.shape
    keys = layer.key_up(latent.reshape(requests * length, rank))
    keys = (keys[0] if isinstance(keys, tuple) else keys).view(requests, length, -1, layer.head_dim)
    out = torch.empty(requests, keys.shape[2], length, layer.head_dim, dtype=keys.dtype, device=keys.device)
    rotated = out.transpose(1, 2)  # written as (R, L, KV, d): the attention reads (R, KV, L, d)
    cos, sin = rotary_tables(layer, cos_sin, first, length, keys.dtype)
    half = layer.rotary_dim // 2
    if not layer.neox:
        raise NotImplementedError("key latents with GPT-J style RoPE")
    x1, x2 = keys[..., :half], keys[..., half : layer.rotary_dim]
    # neox RoPE as vLLM's (ApplyRotaryEmb): [x1 cos - x2 sin, x2 cos + x1 sin, the rest as it is]
    torch.mul(x1, cos, out=rotated[..., :half])
    rotated[..., :half].addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=rotated[..., half : layer.rotary_dim])
    rotated[..., half : layer.rotary_dim].addcmul_(x1, sin)
    if layer.rotary_dim < layer.head_dim:
        rotated[..., layer.rotary_dim :] = keys[..., layer.rotary_dim :]
    return out


def attend(layer, query: torch.Tensor, requests: list[int], lengths: list[int], block_table: torch.Tensor,
           cos_sin: torch.Tensor, handed: "HandedKeys | None" = None,
           handed_start: list[int] | None = None) -> torch.Tensor:  # fmt: skip
    """Attention of the queries (R, H, Q, d) (rotated, unscaled) of `requests` (R with one query each, or one with Q),
    the last Q of their `lengths` keys: (R, Q, H, d). `handed`: the step's scratch of a root, filled with these
    requests' keys at their blocks from `handed_start`."""
    cache = layer.kv_cache
    kv, block = cache.shape[1], cache.shape[2]
    count, heads, queries, d = query.shape
    group = heads // kv
    longest = max(lengths)
    # the first key any query sees: 0, or the oldest in the window of the earliest query
    first_key = 0
    if layer.window is not None:
        first_key = min(max(0, length - queries - layer.window + 1) for length in lengths)
    first_block = first_key // block
    start = first_block * block
    index = torch.tensor(requests, device=query.device)
    blocks = block_table.index_select(0, index)[:, first_block : -(-longest // block)].reshape(-1)
    span = blocks.numel() // count * block
    latents, values = latent_views(cache, layer.key_width)
    latent = latents.index_select(0, blocks).view(count, span, -1)[..., : layer.rank]  # (R, L, r)
    latent = dequantize(latent, layer._k_scale_float, layer.fp8, query.dtype)
    keys = rebuilt_keys(layer, latent, cos_sin, start)  # (R, KV, L, d)
    if handed is not None:  # the shared layers above read these keys: per block and KV head as [d, block]
        scratch = handed.kv_cache.view(handed.kv_cache.shape[0], kv, 2, d, block)
        per_block = keys.view(count, kv, -1, block, d).permute(0, 2, 1, 4, 3)  # (R, blocks, KV, d, block)
        for n, (first, length) in enumerate(zip(handed_start, lengths)):
            used = -(-length // block) - first_block
            scratch[first + first_block : first + first_block + used, :, 0] = per_block[n, :used]
    values = values.index_select(0, blocks).view(count, -1, kv, block, d).transpose(1, 2).reshape(count, kv, span, d)
    values = dequantize(values, layer._v_scale_float, layer.fp8, query.dtype)
    for n, length in enumerate(lengths):
        # a position past a request's keys holds no token of it (a stale row of a reused block, or another request's
        # block in a batch's padding): zero its V so that a 0 probability cannot meet a non-finite value
        values[n, :, length - start :] = 0
    lengths_t = torch.tensor(lengths, device=query.device).view(-1, 1, 1, 1)
    k_pos = (start + torch.arange(span, device=query.device)).view(1, 1, 1, -1)
    # query head h reads KV head h // group: (R, KV, group * Q, d), the softmax scale folded in
    q = (query * layer.scaling).view(count, kv, group, queries, d)
    keys_t = keys.transpose(2, 3)  # (R, KV, d, L)
    out = []
    for row in range(0, queries, ROWS):
        rows = min(ROWS, queries - row)
        q_rows = q[:, :, :, row : row + rows].reshape(count, kv, group * rows, d)
        scores = torch.matmul(q_rows, keys_t).view(count, kv, group, rows, span)
        q_pos = (lengths_t - queries + row + torch.arange(rows, device=query.device).view(1, 1, -1, 1)).unsqueeze(2)
        hidden = k_pos.unsqueeze(2) > q_pos
        if layer.window is not None:
            hidden = hidden | (q_pos - k_pos.unsqueeze(2) >= layer.window)
        probs = torch.softmax(scores.float().masked_fill_(hidden, float("-inf")), dim=-1).to(query.dtype)
        out.append(torch.matmul(probs.view(count, kv, group * rows, span), values).view(count, heads, rows, d))
    out = out[0] if len(out) == 1 else torch.cat(out, dim=2)
    return out.transpose(1, 2)


def torch_attention(layer, meta, query: torch.Tensor, cos_sin: torch.Tensor, output: torch.Tensor, n: int) -> None:
    """The attention of every request of the step (query (t, H, d)) into `output` (t, H, d): a prefill (chunk) alone,
    the decodes together. Where shared layers read this layer's keys, fills `layer.step_keys` first."""
    block = layer.kv_cache.shape[2]
    handed, handed_start = None, []
    if layer.hands_keys:
        counts = [-(-length // block) for length in meta.seq_lens]
        for count in counts:
            handed_start.append(sum(counts[: len(handed_start)]))
        kv, d = layer.kv_cache.shape[1], layer.head_dim
        # every block a request attends is written whole (its keys; the value halves are never read), except, with a
        # window, those before the window's first: zeros there, not stale memory
        shape = (max(sum(counts), 1), kv, block, 2 * d)
        scratch = query.new_zeros(shape) if layer.window is not None else query.new_empty(shape)
        table = torch.zeros(len(counts), max(counts, default=1), dtype=torch.int32)
        for r, (first, count) in enumerate(zip(handed_start, counts)):
            table[r, :count] = torch.arange(first, first + count, dtype=torch.int32)
        handed = HandedKeys(scratch, table.to(query.device))

    def attend_requests(q: torch.Tensor, requests: list[int]) -> torch.Tensor:
        starts = [handed_start[r] for r in requests] if handed is not None else None
        return attend(layer, q, requests, [meta.seq_lens[r] for r in requests], meta.block_table, cos_sin, handed, starts)

    attend_by_request(query, output, meta, n, attend_requests)
    layer.step_keys = handed


def latent_attention(query: torch.Tensor, latent: torch.Tensor, value: torch.Tensor, cos_sin: torch.Tensor,
                     output: torch.Tensor, layer_name: str) -> None:  # fmt: skip
    context = get_forward_context()
    metadata = context.attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0]
    layer: LatentCacheAttention = context.no_compile_layers[layer_name]
    layer.step_keys = None
    meta = metadata.get(layer_name) if isinstance(metadata, dict) else metadata
    if meta is None or layer.kv_cache.numel() == 0:  # the profile / warm-up run: no cache yet
        output.zero_()
        return
    n = meta.num_actual_tokens
    write_rows(layer, meta.slot_mapping, latent[:n], value[:n])
    t, heads, d = query.shape[0], layer.num_heads, layer.head_dim
    out = output.view(t, heads, d)
    if n < t:
        out[n:].zero_()
    torch_attention(layer, meta, query.view(t, heads, d), cos_sin, out, n)


def latent_attention_fake(query, latent, value, cos_sin, output, layer_name) -> None:
    return None


if not hasattr(torch.ops.vllm, "hfcompress_latent_attention"):
    direct_register_custom_op(
        op_name="hfcompress_latent_attention", op_func=latent_attention, mutates_args=["output"],
        fake_impl=latent_attention_fake,
    )  # fmt: skip
