"""The attention of layers with low-rank keys or values (vllm-plugin/src/hfcompress_vllm/latent.py: the paged cache holds
the key latent z = B k (or the rotated keys) and the value latent z = B v (or V); the keys RoPE(A z) are rebuilt at every
step, the values read as A z) against a plain torch reference written from the remote code's math
(modeling/lisa_attention.py `latent_query_key_value`: keys A z of every token rotated at its position, the query at its
own; values A z (`value_latent`); causal (windowed) softmax, GQA), on random problems in the plugin's cache layout: several requests
of mixed lengths (decodes, a prefill chunk after cached keys, a whole prefill, rows past the block size), shuffled block
tables, latents whose width does not divide by the KV heads (zero-padded shares), sliding windows, padding rows; fp32
to 1e-5, fp8 caches (e4m3 / e5m2, non-unit scales) against the reference of the same rounded latents and values, and
the keys a root hands its shared layers (`step_keys`, read by lowrank.py as it reads a CPU-backend cache); value
latents alone or beside a key latent, fp32 and fp8, both orders of applying A (in the latent for decodes, rebuilt for
prefill chunks), and a value-latent root handing its rotated keys. Runs in .venv-vllm."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402

from hfcompress_vllm.latent import latent_width, torch_attention, write_rows  # noqa: E402
from hfcompress_vllm.lowrank import FP8_FORMATS, LowRankMetadata, dequantize, quantize, root_key_blocks  # noqa: E402

# (keys, query rows): decodes (one key, a block edge, long), a prefill chunk after 35 cached keys, a whole prefill
REQUESTS = [(1, 1), (33, 1), (100, 1), (75, 40), (50, 50), (300, 1), (129, 1)]
THETA = 10000.0


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Neox RoPE of x (T, heads, d) at `positions`, in float64 from the formula (not from vLLM's cache)."""
    d = x.shape[-1]
    inv_freq = 1.0 / THETA ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def problem(requests, *, heads=9, kv=3, d=64, rank=95, value_rank=0, block=32, window=None, kv_cache_dtype="auto",
            scales=(1.0, 1.0), padding_rows=0, hands_keys=False, seed=0):  # fmt: skip
    """A LatentCacheAttention as the attention reads it (a key latent of `rank`, 0: rotated keys cached; a value latent
    of `value_rank`, 0: V cached), its cache filled with every request's key and value rows (written by `write_rows` at
    shuffled blocks), rotated queries of each request's last rows, and the float64 reference's inputs per request (key
    latents or rotated keys, value latents or values, as stored: fp8-rounded where the cache is fp8)."""
    torch.manual_seed(seed)
    key_width = latent_width(rank, kv) if rank else d
    value_width = latent_width(value_rank, kv) if value_rank else d
    num_blocks = sum(-(-length // block) for length, _ in requests) + 3
    fp8 = FP8_FORMATS.get(kv_cache_dtype)
    cache = torch.zeros(num_blocks, kv, block, key_width + value_width, dtype=torch.float32 if fp8 is None else torch.uint8)
    with set_current_vllm_config(VllmConfig()):  # the model's own RoPE module (its cos / sin cache) as the plugin's has
        rotary = get_rope(d, max_position=512, rope_parameters={"rope_type": "default", "rope_theta": THETA},
                          is_neox_style=True)  # fmt: skip
    layer = SimpleNamespace(
        kv_cache=cache, key_rank=rank, key_width=key_width, value_rank=value_rank, value_width=value_width, head_dim=d,
        num_heads=heads, scaling=d**-0.5, window=window, rotary_dim=d, neox=True, fp8=fp8, _k_scale_float=scales[0],
        _v_scale_float=scales[1], hands_keys=hands_keys, step_keys=None,
    )  # fmt: skip
    weight = torch.randn(kv * d, rank) / max(rank, 1) ** 0.5
    value_weight = torch.randn(kv * d, value_rank) / max(value_rank, 1) ** 0.5
    layer.key_up = (lambda z: z @ weight.t()) if rank else None
    layer.value_up = (lambda z: z @ value_weight.t()) if value_rank else None
    order = torch.randperm(num_blocks)
    columns = max(-(-length // block) for length, _ in requests) + 2
    table, used, stored, queries = [], 0, [], []
    for length, rows in requests:
        count = -(-length // block)
        blocks = order[used : used + count]
        table.append(torch.cat([blocks, torch.randint(num_blocks, (columns - count,))]))  # vLLM pads with any block
        used += count
        if rank:
            keys = torch.randn(length, rank) * 2
        else:  # rotated at their positions, as the layer writes them
            keys = rope(torch.randn(length, kv, d).double(), torch.arange(length)).float().reshape(length, kv * d)
        values = torch.randn(length, value_rank) * 2 if value_rank else torch.randn(length, kv * d)
        slots = blocks.repeat_interleave(block)[:length] * block + torch.arange(length) % block
        write_rows(layer, slots, keys, values)
        if fp8 is not None:  # what the cache holds
            keys = dequantize(quantize(keys, scales[0], fp8), scales[0], fp8, torch.float32)
            values = dequantize(quantize(values, scales[1], fp8), scales[1], fp8, torch.float32)
        stored.append((keys, values))
        positions = torch.arange(length - rows, length)
        queries.append(rope(torch.randn(rows, heads, d).double(), positions).float())
    layer.value_weight = value_weight
    rows = [q for _, q in requests]
    n = sum(rows)
    query = torch.cat([*queries, torch.randn(padding_rows, heads, d)])
    query_start = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
    seq_lens = torch.tensor([length for length, _ in requests])
    meta = LowRankMetadata(
        num_actual_tokens=n, query_start=query_start.tolist(), seq_lens=seq_lens.tolist(),
        block_table=torch.stack(table).to(torch.int32), slot_mapping=torch.zeros(n, dtype=torch.long),
        query_start_t=query_start, seq_lens_t=seq_lens,
    )  # fmt: skip
    return layer, meta, query, weight, rotary.cos_sin_cache, stored


def reference(layer, query: torch.Tensor, weight: torch.Tensor, requests, stored) -> tuple[torch.Tensor, list]:
    """Per request: keys RoPE(A z) at 0..T-1 (or the rotated keys as stored), values A z (or V as stored), the query
    rows the last of T, causal (windowed) softmax, GQA; float64. (output (n, H, d), per request its rotated keys (T, KV,
    d))."""
    out, all_keys, start = [], [], 0
    heads, d = query.shape[1], query.shape[2]
    kv = layer.kv_cache.shape[1]
    for (length, rows), (keys, values) in zip(requests, stored):
        if layer.key_rank:
            keys = rope((keys.double() @ weight.double().t()).view(length, kv, d), torch.arange(length))
        keys = keys.double().view(length, kv, d)
        if layer.value_rank:
            values = values.double() @ layer.value_weight.double().t()
        values = values.double().view(length, kv, d)
        all_keys.append(keys)
        q = query[start : start + rows].double()
        start += rows
        k = keys.repeat_interleave(heads // kv, dim=1)  # (T, H, d)
        v = values.repeat_interleave(heads // kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * layer.scaling
        q_pos, k_pos = torch.arange(length - rows, length)[:, None], torch.arange(length)[None]
        hidden = k_pos > q_pos
        if layer.window is not None:
            hidden = hidden | (q_pos - k_pos >= layer.window)
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(out), all_keys


def run(layer, meta, query, cos_sin) -> torch.Tensor:
    output = torch.zeros_like(query)
    torch_attention(layer, meta, query, cos_sin, output, meta.num_actual_tokens)
    assert torch.equal(output[meta.num_actual_tokens :], torch.zeros_like(output[meta.num_actual_tokens :]))
    return output[: meta.num_actual_tokens]


SHAPES = {
    "smollm2": {},  # 9 heads of 64, 3 KV heads, rank 95: shares of 32 (one zero pad)
    "mha-block-16-window": {"heads": 4, "kv": 4, "d": 32, "rank": 24, "block": 16, "window": 7},
    "gqa-block-48-window-long": {"heads": 8, "kv": 2, "d": 16, "rank": 24, "block": 48, "window": 60},
    "one-kv-head-block-8": {"heads": 4, "kv": 1, "d": 24, "rank": 13, "block": 8},
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_latent_attention_matches_the_reference_fp32(shape):
    layer, meta, query, weight, cos_sin, stored = problem(REQUESTS, padding_rows=3, **SHAPES[shape])
    want, _ = reference(layer, query, weight, REQUESTS, stored)
    torch.testing.assert_close(run(layer, meta, query, cos_sin).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", sorted(FP8_FORMATS))
def test_latent_attention_matches_the_reference_fp8(kv_cache_dtype):
    """fp8 bytes in the cache (the latent divided by the layer's k scale, V by its v scale), dequantized as read: the
    reference of the same rounded latents and values to 1e-5."""
    layer, meta, query, weight, cos_sin, stored = problem(REQUESTS, kv_cache_dtype=kv_cache_dtype, scales=(0.37, 1.3),
                                                          window=60)  # fmt: skip
    assert layer.kv_cache.dtype == torch.uint8
    got = run(layer, meta, query, cos_sin).double()
    want, _ = reference(layer, query, weight, REQUESTS, stored)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 20])
def test_a_root_hands_its_rebuilt_keys_in_the_cpu_backends_layout(window):
    """A key-latent root of LISA shared layers: after its attention, `step_keys` holds every request's rotated keys (of
    its window, where it has one), read back by lowrank.root_key_blocks (the shared layers' torch path; the kernel reads
    the same layout) through its own block table."""
    layer, meta, query, weight, cos_sin, stored = problem(REQUESTS, hands_keys=True, window=window, block=16)
    run(layer, meta, query, cos_sin)
    _, keys = reference(layer, query, weight, REQUESTS, stored)
    handed = layer.step_keys
    assert handed is not None and handed.isa == "vec" and handed.kv_cache_dtype == "auto"
    block = handed.kv_cache.shape[2]
    for r, (length, rows) in enumerate(REQUESTS):
        count = -(-length // block)
        read = root_key_blocks(handed.kv_cache, handed.block_table[r : r + 1, :count], layer.head_dim)[0]
        read = read.permute(0, 3, 1, 2).reshape(count * block, -1, layer.head_dim)[:length]  # (T, KV, d)
        first = 0 if window is None else max(0, length - rows - window + 1)
        # fp32 RoPE angles at positions up to 300 are off by ~1e-5 rad against the float64 formula's
        torch.testing.assert_close(read[first:].double(), keys[r][first:], rtol=1e-4, atol=1e-4 * keys[r].abs().max())


# low-rank values (config `value_ranks`): the cache holds the value latent z = B v (one r-wide row a token, spread over
# the KV heads, zero-padded), the attention reads A z; alone (the rotated keys cached beside it) or with a key latent
VALUE_SHAPES = {
    "smollm2-values": {"rank": 0, "value_rank": 131},  # shares of 44 (one zero pad), keys 3 x 64 rotated
    "smollm2-keys-values": {"rank": 95, "value_rank": 160},
    "mha-block-16-window-values": {"heads": 4, "kv": 4, "d": 32, "rank": 0, "value_rank": 50, "block": 16, "window": 7},
    "gqa-block-48-window-long-keys-values": {"heads": 8, "kv": 2, "d": 16, "rank": 24, "value_rank": 17, "block": 48,
                                             "window": 60},  # fmt: skip
    "one-kv-head-block-8-values": {"heads": 4, "kv": 1, "d": 24, "rank": 0, "value_rank": 11, "block": 8},
}


@pytest.mark.parametrize("shape", sorted(VALUE_SHAPES))
def test_value_latent_attention_matches_the_reference_fp32(shape):
    layer, meta, query, weight, cos_sin, stored = problem(REQUESTS, padding_rows=3, **VALUE_SHAPES[shape])
    assert layer.kv_cache.shape[-1] == layer.key_width + layer.value_width < 2 * layer.head_dim
    want, _ = reference(layer, query, weight, REQUESTS, stored)
    torch.testing.assert_close(run(layer, meta, query, cos_sin).double(), want, rtol=1e-5, atol=1e-5)


def test_values_are_mixed_in_the_latent_for_decodes_and_rebuilt_for_long_prefills():
    """The two exact orders (probs times the latents, then A per KV head; or V = A z rebuilt first) are chosen by their
    multiply-adds: REQUESTS exercises both (its decodes in the latent, its prefill chunks rebuilt)."""
    from hfcompress_vllm.latent import values_in_latent

    layer, *_ = problem([(8, 1)], rank=0, value_rank=131)
    assert values_in_latent(layer, 9, 1, 320)  # a decode over 300 keys
    assert not values_in_latent(layer, 9, 40, 96)  # REQUESTS' prefill chunk of 40 rows over 75 keys


@pytest.mark.parametrize("kv_cache_dtype", sorted(FP8_FORMATS))
@pytest.mark.parametrize("rank", [0, 95])
def test_value_latent_attention_matches_the_reference_fp8(kv_cache_dtype, rank):
    """fp8 bytes in the cache: the value latent divided by the layer's v scale (and the key latent, or the rotated keys,
    by its k scale), dequantized as read: the reference of the same rounded rows to 1e-5."""
    layer, meta, query, weight, cos_sin, stored = problem(REQUESTS, kv_cache_dtype=kv_cache_dtype, scales=(0.37, 1.3),
                                                          window=60, rank=rank, value_rank=131)  # fmt: skip
    assert layer.kv_cache.dtype == torch.uint8
    got = run(layer, meta, query, cos_sin).double()
    want, _ = reference(layer, query, weight, REQUESTS, stored)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 20])
def test_a_value_latent_root_hands_its_rotated_keys(window):
    """A root of LISA shared layers with a value latent and no key latent caches its rotated keys in its own layout:
    it hands them (`step_keys`) as a key-latent root hands its rebuilt ones."""
    layer, meta, query, weight, cos_sin, stored = problem(REQUESTS, hands_keys=True, window=window, block=16, rank=0,
                                                          value_rank=100)  # fmt: skip
    run(layer, meta, query, cos_sin)
    _, keys = reference(layer, query, weight, REQUESTS, stored)
    handed = layer.step_keys
    block = handed.kv_cache.shape[2]
    for r, (length, rows) in enumerate(REQUESTS):
        count = -(-length // block)
        read = root_key_blocks(handed.kv_cache, handed.block_table[r : r + 1, :count], layer.head_dim)[0]
        read = read.permute(0, 3, 1, 2).reshape(count * block, -1, layer.head_dim)[:length]  # (T, KV, d)
        first = 0 if window is None else max(0, length - rows - window + 1)
        assert torch.equal(read[first:], keys[r][first:].float())  # the cached keys themselves
