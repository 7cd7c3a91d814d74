"""The shared-layer attention's reference (modeling/lisa_reference.py) against the formula written out entry by entry,
and the remote code's fast paths against the reference, layer by layer: block-wise scores (one block and several,
scores or features handed in), the feature SDPA call of a sparse layer, and a decode step through the cache. The
layers run in float64 (their softmax in float32). The fused Triton decode kernel is compared with the reference in
tests/test_kernels.py (Triton's interpreter); whole models, prefill and decode, in tests/test_shared_paths.py."""

import math

import pytest
import torch
from test_modeling import random_lisa_model, tiny_config

from hfcompress.remote import import_remote

modeling = import_remote("lisa_attention")
reference = import_remote("lisa_reference")

LAYERS = {  # layer 2 of a 4-head, 2-KV-head model
    "sparse": {"rank": 4, "align": "sparse"},
    "sparse, grouped keys": {"rank": 4, "align": "sparse", "key_heads": 2},
    "sparse, rank 0": {"rank": 0, "align": "sparse"},
    "dense": {"rank": 4, "align": "dense", "align_hidden": 8},
    "dense, grouped keys": {"rank": 6, "align": "dense", "align_hidden": 8, "key_heads": 2},
    "dense, no FFN, rank 0": {"rank": 0, "align": "dense", "align_hidden": 0},
}  # fmt: skip
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def assert_output_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Outputs: the layers take the softmax in float32 (as transformers' eager attention), even in float64."""
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)


def shared_layer(spec: dict) -> torch.nn.Module:
    """Layer 2 of a random LisaLlama (random Align: permuted sources and scales, or mix, bias and FFN), in float64."""
    model = random_lisa_model(tiny_config(num_hidden_layers=4), lisa_layers={"2": spec})
    return model.model.layers[2].self_attn.double()


def align_params(attn: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A layer's Align as the reference's keyword arguments."""
    align = attn.align
    if attn.sparse:
        return {"source": align.source, "scale": align.scale}
    ffn = {}
    if align.ffn_in is not None:
        ffn = {"ffn_in_weight": align.ffn_in.weight, "ffn_in_bias": align.ffn_in.bias, "ffn_out_weight": align.ffn_out.weight}
    return {"mix": align.mix, "bias": align.bias, **ffn}


def inputs(attn: torch.nn.Module, batch: int, q_len: int, kv_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float64 previous scores, the previous layer's (query, key) features, low-rank q/k and values."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "prev_scores": rand(batch, HEADS, q_len, kv_len) * 2,
        "q_prev": rand(batch, HEADS, q_len, HEAD_DIM) / 2,
        "k_prev": rand(batch, KV_HEADS, kv_len, HEAD_DIM),
        "q_lr": rand(batch, HEADS, q_len, attn.rank),
        "k_lr": rand(batch, attn.key_heads, kv_len, attn.rank),
        "value": rand(batch, KV_HEADS, kv_len, HEAD_DIM),
    }


def padding_mask(batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """The model's additive (B, 1, Tq, Tk) mask (finfo.min): causal at the last Tq positions, batch row 1 has its first
    two keys padded."""
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len).expand(batch, 1, q_len, kv_len).clone()
    allowed[1, :, :, :2] = False
    return torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)


def feature_scores(q_prev: torch.Tensor, k_prev: torch.Tensor) -> torch.Tensor:
    """The previous layer's scores from its handed features (its key on the KV heads)."""
    return q_prev @ k_prev.repeat_interleave(q_prev.shape[1] // k_prev.shape[1], dim=1).transpose(-1, -2)


def visible(q_len: int, kv_len: int) -> torch.Tensor:
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)


def test_reference_is_the_formula_written_out():
    """Entry by entry, in plain loops: sparse and dense Align (FFN included), low-rank keys per KV group, a mask."""
    g = torch.Generator().manual_seed(1)
    batch, q_len, kv_len, rank, hidden = 2, 3, 5, 2, 3
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    prev, q_lr, k_lr, value = rand(batch, 4, q_len, kv_len), rand(batch, 4, q_len, rank), rand(batch, 2, kv_len, rank), rand(batch, 2, kv_len, 3)
    mask = padding_mask(batch, q_len, kv_len)
    sparse = {"source": torch.tensor([2, 0, 3, 3]), "scale": rand(4)}
    dense = {"mix": rand(4, 4), "bias": rand(4), "ffn_in_weight": rand(hidden, 4), "ffn_in_bias": rand(hidden), "ffn_out_weight": rand(4, hidden)}
    for align in (sparse, dense):
        out, scores = reference.shared_attention_reference(prev, q_lr, k_lr, value, **align, mask=mask)
        for b in range(batch):
            for h in range(4):
                for i in range(q_len):
                    row = torch.zeros(kv_len, dtype=torch.float64)
                    for j in range(kv_len):
                        column = prev[b, :, i, j]
                        if align is sparse:
                            s = sparse["scale"][h] * column[sparse["source"][h]]
                        else:
                            x = dense["ffn_in_weight"] @ column + dense["ffn_in_bias"]
                            gelu = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
                            s = dense["mix"][h] @ column + dense["bias"][h] + dense["ffn_out_weight"][h] @ gelu
                        row[j] = s + q_lr[b, h, i] @ k_lr[b, h // 2, j] / math.sqrt(rank)
                    torch.testing.assert_close(scores[b, h, i], row)
                    weights = torch.softmax(row + mask[b, 0, i], dim=0)
                    torch.testing.assert_close(out[b, h, i], sum(weights[j] * value[b, h // 2, j] for j in range(kv_len)))


def test_reference_without_a_mask_is_causal_at_the_last_positions():
    g = torch.Generator().manual_seed(2)
    prev, q_lr, k_lr, value = (torch.randn(*s, generator=g) for s in ((1, 4, 3, 7), (1, 4, 3, 2), (1, 4, 7, 2), (1, 2, 7, 5)))
    align = {"source": torch.arange(4), "scale": torch.ones(4)}
    causal = torch.zeros(3, 7).masked_fill(~visible(3, 7), -math.inf)
    unmasked = reference.shared_attention_reference(prev, q_lr, k_lr, value, **align)
    masked = reference.shared_attention_reference(prev, q_lr, k_lr, value, **align, mask=causal)
    torch.testing.assert_close(unmasked, masked)


@pytest.mark.parametrize("handed", ["scores", "features"])
@pytest.mark.parametrize("blocks", ["one block", "blocks of 2 rows"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padding mask"])
@pytest.mark.parametrize("spec", LAYERS.values(), ids=LAYERS.keys())
def test_blockwise_attention_equals_reference(spec, masked, blocks, handed, monkeypatch):
    """The materialising path (dense layers, sparse layers given scores, decode): 5 queries after 3 cached keys."""
    attn = shared_layer(spec)
    batch, q_len, kv_len = 2, 5, 8
    x = inputs(attn, batch, q_len, kv_len)
    if blocks != "one block":
        monkeypatch.setattr(modeling, "SCORE_BLOCK_ELEMENTS", batch * HEADS * kv_len * 2)
    prev, prev_scores = x["prev_scores"], x["prev_scores"]
    if handed == "features":
        prev, prev_scores = (x["q_prev"], x["k_prev"]), feature_scores(x["q_prev"], x["k_prev"])
    mask = padding_mask(batch, q_len, kv_len) if masked else None
    with torch.no_grad():
        out, scores, probs = attn.blockwise_attention(prev, x["q_lr"], x["k_lr"], x["value"], mask, True, True)
    expect_out, expect_scores = reference.shared_attention_reference(
        prev_scores, x["q_lr"], x["k_lr"], x["value"], **align_params(attn), mask=mask
    )
    assert_output_close(out.transpose(1, 2), expect_out)
    seen = visible(q_len, kv_len)  # blocks hand 0 past their last row's keys
    torch.testing.assert_close(scores[..., seen], expect_scores[..., seen])
    assert probs.shape == (batch, HEADS, q_len, kv_len)


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padding mask"])
@pytest.mark.parametrize("q_len", [6, 3], ids=["prefill", "chunk after 3 cached keys"])
@pytest.mark.parametrize("spec", [s for s in LAYERS.values() if s["align"] == "sparse"], ids=[k for k, s in LAYERS.items() if s["align"] == "sparse"])
def test_feature_attention_equals_reference(spec, q_len, masked):
    """A sparse layer given the previous layer's features: one SDPA call; the features it hands on give its scores."""
    attn = shared_layer(spec)
    batch, kv_len = 2, 6
    x = inputs(attn, batch, q_len, kv_len, seed=3)
    mask = padding_mask(batch, q_len, kv_len) if masked else None
    with torch.no_grad():
        out, (query, key) = attn.feature_attention((x["q_prev"], x["k_prev"]), x["q_lr"], x["k_lr"], x["value"], mask, "features")
    expect_out, expect_scores = reference.shared_attention_reference(
        feature_scores(x["q_prev"], x["k_prev"]), x["q_lr"], x["k_lr"], x["value"], **align_params(attn), mask=mask
    )
    assert_output_close(out.transpose(1, 2), expect_out)
    torch.testing.assert_close(query @ key.transpose(-1, -2), expect_scores)


@pytest.mark.parametrize("spec", LAYERS.values(), ids=LAYERS.keys())
def test_decode_step_equals_reference(spec):
    """One token through `forward` with 6 cached positions: its output and the score row it hands on."""
    attn = shared_layer(spec)
    batch, past = 2, 6
    x = inputs(attn, batch, 1, past + 1, seed=4)
    cache = modeling.DynamicCache(config=attn.config)
    below = torch.zeros(batch, KV_HEADS, past, HEAD_DIM, dtype=torch.float64)
    for idx in range(2):  # the full layers below: layer 2 is the cache's third
        cache.update(below, below, idx)
    cache.update(x["k_lr"][:, :, :past], x["value"][:, :, :past], 2)
    hidden = torch.randn(batch, 1, attn.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    positions = torch.full((batch, 1), past)
    with torch.no_grad():
        out, row = attn(hidden, positions, None, x["prev_scores"], cache=cache, handoff="scores")
        q_lr, k_lr = attn.lowrank_qk(hidden, positions)
        keys, values = cache.layers[2].keys, cache.layers[2].values  # the past and this step's
        expect, expect_row = reference.shared_attention_reference(x["prev_scores"], q_lr, keys, values, **align_params(attn))
        expect_out = attn.o_proj(expect.transpose(1, 2).reshape(batch, 1, -1))
    torch.testing.assert_close(keys[:, :, -1:], k_lr)
    torch.testing.assert_close(row, expect_row)
    assert_output_close(out, expect_out)
