"""The attention this plugin owns for layers with low-rank keys (config.json `key_ranks`) or low-rank values
(`value_ranks`): its paged cache holds what the remote code caches, the key latent (else the rotated keys) and the value
latent (else V), and it rebuilds what it reads from the latents at every step.

A layer with a key latent of width r computes z = B k (`key_latent.proj_in`: the pre-RoPE keys after any k_norm, all KV
heads side by side, KV * d -> r; one r-wide vector a token, not per head) and attends with the keys RoPE(A z)
(`proj_out`, r -> KV * d), every cached token's rotated at its position, the query at its own
(modeling/lisa_attention.py, `latent_query_key_value`). RoPE depends on position differences only, so the keys are
rotated at positions 0 .. T-1 (vLLM's positions are those of the sequence). A layer with a value latent of width r
computes z = B v (`value_latent.proj_in`: V of all KV heads side by side) and attends over the values A z (`proj_out`,
reshaped to KV heads of d; no RoPE on values).

vLLM side: `LatentCacheAttention` is a vLLM `Attention` with the backend of the shared layers (lowrank.LowRankBackend:
vLLM sizes, allocates, binds and prefix-caches its cache like any other layer's) and a spec of head_size = the key
part, w_k = ceil(r_k / KV) (the key latent spread over the KV heads, zero-padded) or d (rotated keys, a layer with a
value latent only), and head_size_v = the value part, w_v = ceil(r_v / KV) or d (V, a layer with a key latent only).
Its cache is [blocks, KV, block_size, key part + value part] as vLLM allocates it, laid out per block as the block's
key rows, a token's whole key latent (KV * w_k) or rotated keys (KV * d) in one row, then its value rows, a token's
whole value latent or V in one row (`latent_views`), so a token costs KV * (key part + value part) values against the
original layer's 2 * KV * d (SmolLM2's default conversion, key latents only: 0.75x in all; `--kv-plan keys-values
--kv-budget 0.6`: ~0.6x). An fp8 KV cache stores fp8 bytes (the key rows divided by the layer's k scale, the value
rows by its v scale), dequantized as read.

The attention is the op `torch.ops.vllm.hfcompress_latent_attention` (opaque to torch.compile): it writes the current
tokens' key and value rows into the layer's cache, then per request (decodes together, a prefill chunk alone) gathers
the blocks it needs (those holding the window where the layer has one), rebuilds the keys A z and rotates them (or
reads the rotated keys), and attends: scores masked causally (and by the window), softmax in fp32, times V, GQA by KV
head. With a value latent, one of two exact orders (sum_t p_t A z_t = A sum_t p_t z_t), whichever costs fewer
multiply-adds (`values_in_latent`): a decode multiplies the probabilities by the latents and applies A after, per KV
head (A does not grow with the context: the value latent costs no rebuild per cached token), a long prefill chunk
rebuilds V = A z of every cached token first (then its many query rows mix d-wide values, not r-wide latents). All in
torch (matmuls): the key rebuild, KV * d * r multiply-adds per cached token and step, is what the key latent costs, as
in the remote code.

A latent layer below LISA shared layers (their root) hands the shared layers its rotated keys of the step, rebuilt or
as cached (`step_keys`): a scratch cache in the layout of vLLM's CPU backend ("vec": per block and KV head the keys as
[d, block]) with a block table of its own, which lowrank.py's kernel and torch path read where they would read the
root's paged cache (the shared layers read the root's keys only, never its values). Chunked prefill and prefix caching
work unchanged: the rows of past tokens are complete in the cache, and every key and value is rebuilt from it.
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
    """w: a latent's share per KV head (the cache spec's key / value head size)."""
    return -(-rank // kv)


def run_linear(linear, x: torch.Tensor) -> torch.Tensor:
    """A vLLM linear's output (it returns the output and a skipped bias) or any callable's."""
    out = linear(x)
    return out[0] if isinstance(out, tuple) else out


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
    """A layer with a key latent, a value latent or both: its cache holds the latents, and the rotated keys / V where
    the layer has no latent for them ([blocks, KV, block, key width + value width])."""

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, rotary: RotaryEmbedding,
                 cache_config, sliding_window: int | None, prefix: str, key_rank: int = 0, key_up: nn.Module | None = None,
                 value_rank: int = 0, value_up: nn.Module | None = None, hands_keys: bool = False):  # fmt: skip
        if not key_rank and not value_rank:
            raise ValueError("a LatentCacheAttention needs a key latent, a value latent or both")
        key_width = latent_width(key_rank, num_kv_heads) if key_rank else head_dim
        value_width = latent_width(value_rank, num_kv_heads) if value_rank else head_dim
        super().__init__(
            num_heads, key_width, scale, num_kv_heads=num_kv_heads, cache_config=cache_config,
            per_layer_sliding_window=sliding_window, prefix=prefix, attn_backend=LowRankBackend, head_size_v=value_width,
        )  # fmt: skip
        self.key_rank, self.key_width, self.value_rank, self.value_width = key_rank, key_width, value_rank, value_width
        self.head_dim, self.scaling = head_dim, scale
        self.window = sliding_window
        self.rotary_dim, self.neox = rotary.rotary_dim, rotary.is_neox_style
        self.fp8 = FP8_FORMATS.get(self.kv_cache_dtype)  # None: the cache holds the model's dtype
        self.hands_keys = hands_keys  # LISA shared layers above read this step's keys (`step_keys`)
        self.step_keys: HandedKeys | None = None
        # A of the key latent / of the value latent (their proj_out), not registered here (they are the layer's):
        # called, since vLLM's CPU linears may repack their weight and leave `weight` empty
        object.__setattr__(self, "key_up", key_up)
        object.__setattr__(self, "value_up", value_up)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """query (t, H * d) rotated at its positions, unscaled; key: the key latent (t, r_k), or the rotated keys (t, KV *
        d) of a layer without one; value: the value latent (t, r_v), or V (t, KV * d); cos_sin: the layer's RoPE cache
        (positions, rotary dim): the attention output (t, H * d)."""
        output = torch.empty_like(query)
        torch.ops.vllm.hfcompress_latent_attention(query.contiguous(), key.contiguous(), value.contiguous(), cos_sin,
                                                   output, self.layer_name)  # fmt: skip
        return output


def latent_views(cache: torch.Tensor, key_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A LatentCacheAttention cache [blocks, KV, block, key width + value width] as its key rows (blocks, block, KV * key
    width) and value rows (blocks, block, KV * value width) (views): per block, a token's whole key latent (or its
    rotated keys, all KV heads) is one row, then its whole value latent (or V) is one row: a latent is rebuilt from its
    rows by one matmul."""
    num_blocks, kv, block, width = cache.shape
    flat = cache.view(num_blocks, kv * block * width)
    split = block * kv * key_width
    return flat[:, :split].view(num_blocks, block, kv * key_width), flat[:, split:].view(num_blocks, block, -1)


def write_rows(layer, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """The current tokens' key rows (n, r_k: the latent, or n, KV * d: rotated keys) and value rows (n, r_v or KV * d)
    into the layer's cache at their slots, zero-padded to the cache's widths (fp8: quantized with the layer's k / v
    scales, as the CPU backend scales a full layer's K and V)."""
    cache = layer.kv_cache
    num_blocks, kv, block, _ = cache.shape
    n = key.shape[0]
    rows = torch.nn.functional.pad(key, (0, kv * layer.key_width - key.shape[1]))
    values = torch.nn.functional.pad(value, (0, kv * layer.value_width - value.shape[1]))
    if layer.fp8 is not None:
        rows = quantize(rows, layer._k_scale_float, layer.fp8)
        values = quantize(values, layer._v_scale_float, layer.fp8)
    slots = slot_mapping[:n].long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, rows, values = slots[valid], rows[valid], values[valid]
    key_rows, value_rows = latent_views(cache, layer.key_width)
    key_rows[slots // block, slots % block] = rows.to(cache.dtype)
    value_rows[slots // block, slots % block] = values.to(cache.dtype)


def values_in_latent(layer, heads: int, queries: int, span: int) -> bool:
    """Whether a value-latent layer multiplies the probabilities by the latents and applies A after (probs Z, then per
    KV head A_kv (probs Z)), rather than rebuilding every cached token's V = A z first: the fewer multiply-adds (a
    decode: the latent, by far; a long prefill chunk: the rebuild). Both are exact (sum_t p_t A z_t = A sum_t p_t z_t)."""
    kv, d, r = layer.kv_cache.shape[1], layer.head_dim, layer.value_rank
    rebuild = kv * span * d * r + heads * queries * span * d
    latent = heads * queries * span * r + heads * queries * kv * d * r  # A applied for all KV heads, one kept
    return latent < rebuild


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
    keys = run_linear(layer.key_up, latent.reshape(requests * length, rank)).view(requests, length, -1, layer.head_dim)
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
    key_rows, value_rows = latent_views(cache, layer.key_width)
    stored = key_rows.index_select(0, blocks).view(count, span, -1)
    if layer.key_rank:  # the keys RoPE(A z), rebuilt from the latent
        latent = dequantize(stored[..., : layer.key_rank], layer._k_scale_float, layer.fp8, query.dtype)  # (R, L, r)
        keys = rebuilt_keys(layer, latent, cos_sin, start)  # (R, KV, L, d)
    else:  # the keys as cached, rotated
        keys = dequantize(stored, layer._k_scale_float, layer.fp8, query.dtype).view(count, span, kv, d).transpose(1, 2)
    if handed is not None:  # the shared layers above read these keys: per block and KV head as [d, block]
        scratch = handed.kv_cache.view(handed.kv_cache.shape[0], kv, 2, d, block)
        per_block = keys.reshape(count, kv, -1, block, d).permute(0, 2, 1, 4, 3)  # (R, blocks, KV, d, block)
        for n, (first, length) in enumerate(zip(handed_start, lengths)):
            used = -(-length // block) - first_block
            scratch[first + first_block : first + first_block + used, :, 0] = per_block[n, :used]
    stored = value_rows.index_select(0, blocks).view(count, span, -1)
    rank = layer.value_rank
    values = dequantize(stored[..., : rank or None], layer._v_scale_float, layer.fp8, query.dtype)  # (R, L, r_v or KV * d)
    for n, length in enumerate(lengths):
        # a position past a request's keys holds no token of it (a stale row of a reused block, or another request's
        # block in a batch's padding): zero its V (its latent) so that a 0 probability cannot meet a non-finite value
        values[n, length - start :] = 0
    in_latent = bool(rank) and values_in_latent(layer, heads, queries, span)
    if not rank:
        values = values.view(count, span, kv, d).transpose(1, 2)  # (R, KV, L, d)
    elif in_latent:
        values = values.unsqueeze(1)  # (R, 1, L, r): every KV head's
    else:  # V = A z of every cached token
        values = run_linear(layer.value_up, values.reshape(count * span, rank)).view(count, span, kv, d).transpose(1, 2)
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
        mixed = torch.matmul(probs.view(count, kv, group * rows, span), values)  # (R, KV, group * rows, d or r)
        if in_latent:  # A_kv (probs Z) per KV head: A applied for all heads, each KV head's block kept
            up = run_linear(layer.value_up, mixed.reshape(-1, rank)).view(count, kv, group * rows, kv, d)
            mixed = torch.diagonal(up, dim1=1, dim2=3).permute(0, 3, 1, 2)  # (R, KV, group * rows, d)
        out.append(mixed.reshape(count, heads, rows, d))
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


def latent_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos_sin: torch.Tensor,
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
    write_rows(layer, meta.slot_mapping, key[:n], value[:n])
    t, heads, d = query.shape[0], layer.num_heads, layer.head_dim
    out = output.view(t, heads, d)
    if n < t:
        out[n:].zero_()
    torch_attention(layer, meta, query.view(t, heads, d), cos_sin, out, n)


def latent_attention_fake(query, key, value, cos_sin, output, layer_name) -> None:
    return None


if not hasattr(torch.ops.vllm, "hfcompress_latent_attention"):
    direct_register_custom_op(
        op_name="hfcompress_latent_attention", op_func=latent_attention, mutates_args=["output"],
        fake_impl=latent_attention_fake,
    )  # fmt: skip
