"""The fast LISA attention paths (feature SDPA, block-wise scores, decode score rows without K/V copies) against an
explicit eager computation of the same model: materialised scores for every layer, repeat_kv, one softmax; the shared
layers by the shipped reference (modeling/lisa_reference.py)."""

import math

import pytest
import torch
from test_lisa_reference import align_params
from test_modeling import lisa_copy, random_lisa_model, tiny_config
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import repeat_kv

from hfcompress.remote import import_remote

modeling = import_remote("lisa_attention")
reference = import_remote("lisa_reference")

SPECS = {
    "sparse after full": {"2": {"rank": 4, "align": "sparse"}},
    "sparse chain": {"2": {"rank": 4, "align": "sparse"}, "3": {"rank": 4, "align": "sparse"}},
    "dense after full": {"2": {"rank": 4, "align": "dense", "align_hidden": 8}},
    "dense chain, then sparse": {
        "2": {"rank": 4, "align": "dense", "align_hidden": 8}, "3": {"rank": 2, "align": "dense", "align_hidden": 0}, "4": {"rank": 4, "align": "sparse"},
    },
    "sparse, then dense": {"2": {"rank": 4, "align": "sparse"}, "3": {"rank": 4, "align": "dense", "align_hidden": 4}},
    "sparse at rank 0": {"3": {"rank": 0, "align": "sparse"}},
    # one low-rank key per KV group (2 groups of 2 heads): the feature path, a chain, and dense Align
    "sparse chain, grouped keys": {"2": {"rank": 4, "align": "sparse", "key_heads": 2}, "3": {"rank": 6, "align": "sparse", "key_heads": 2}},
    "dense then sparse, grouped keys": {"2": {"rank": 4, "align": "dense", "align_hidden": 8, "key_heads": 2}, "3": {"rank": 4, "align": "sparse", "key_heads": 2}},
}  # fmt: skip


def shared_model(spec: dict) -> torch.nn.Module:
    """A 6-layer LisaLlama with random LISA modules: sparse layers read permuted source heads with random scales."""
    return random_lisa_model(tiny_config(num_hidden_layers=6), lisa_layers=spec)


@torch.no_grad()
def eager_logits(model, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The model's math written out: every layer materialises its (B, H, T, T) scores, K and V are repeated to H heads."""
    inner = model.model
    batch, length = ids.shape
    positions = torch.arange(length)[None].expand(batch, -1)
    allowed = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :].bool()
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    hidden = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(hidden, position_ids=positions)
    prev = None
    for layer in inner.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        value = attn.v_proj(x).view(batch, length, -1, attn.head_dim).transpose(1, 2)
        groups = attn.num_key_value_groups
        if layer.is_lisa:
            q_lr, k_lr = attn.lowrank_qk(x, positions)
            attended, scores = reference.shared_attention_reference(prev, q_lr, k_lr, value, **align_params(attn), mask=mask)
        else:
            query = attn.q_proj(x).view(batch, length, -1, attn.head_dim).transpose(1, 2)
            key = attn.k_proj(x).view(batch, length, -1, attn.head_dim).transpose(1, 2)
            query, key = modeling.apply_rotary_pos_emb(query, key, cos, sin)
            scores = query @ repeat_kv(key, groups).transpose(2, 3) / math.sqrt(attn.head_dim)
            attended = torch.softmax(scores + mask, dim=-1) @ repeat_kv(value, groups)
        out = attended.transpose(1, 2).reshape(batch, length, -1)
        hidden = hidden + attn.o_proj(out)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        prev = scores
    return model.lm_head(inner.norm(hidden))


def left_padded(lengths: list[int], total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) of prompts of `lengths` real tokens, left-padded to `total`."""
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (len(lengths), total), generator=generator)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, total - length :] = 1
        ids[row, : total - length] = 0
    return ids, mask


def assert_real_positions_close(actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor) -> None:
    """Logits agree where the query is a real token (a padded query's row is undefined in both)."""
    real = mask.bool()
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual[real], expected[real], atol=2e-4, rtol=1e-4)


def test_the_reference_depends_on_the_shared_layers():
    """The comparisons below can fail: the eager reference reacts to the LISA modules (source heads, scales)."""
    model = shared_model(SPECS["sparse chain"])
    ids = torch.randint(0, 128, (1, 12))
    before = eager_logits(model, ids)
    source = model.model.layers[3].self_attn.align.source
    source.copy_(source.flip(0))
    assert (eager_logits(model, ids) - before).abs().max() > 1e-3


@pytest.mark.parametrize("padding", [False, True], ids=["no padding", "left padding"])
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_prefill_equals_eager_reference(spec, padding):
    model = shared_model(spec)
    ids, mask = left_padded([14, 9 if padding else 14], 14)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    assert_real_positions_close(logits, eager_logits(model, ids, mask), mask)


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_decode_with_cache_equals_eager_reference_for_prompts_of_different_lengths(spec):
    """Prefill left-padded prompts of 7, 4 and 1 real tokens, then feed 6 tokens one at a time through the cache."""
    model = shared_model(spec)
    ids, mask = left_padded([13, 10, 7], 13)
    prompt = 7
    with torch.no_grad():
        out = model(ids[:, :prompt], attention_mask=mask[:, :prompt], use_cache=True)
        steps, cache = [out.logits], out.cache
        for t in range(prompt, ids.shape[1]):
            out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.cache
    assert_real_positions_close(torch.cat(steps, dim=1), eager_logits(model, ids, mask), mask)


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_decode_without_mask_and_chunked_prefill_equal_eager_reference(spec):
    """No attention_mask (causal only), and a prompt fed in two chunks (queries that start after a cached past)."""
    model = shared_model(spec)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        first = model(ids[:, :5], use_cache=True)
        second = model(ids[:, 5:9], cache=first.cache, use_cache=True)
        steps, cache = [first.logits, second.logits], second.cache
        for t in range(9, 12):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.cache
    torch.testing.assert_close(torch.cat(steps, dim=1), eager_logits(model, ids), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("spec", [SPECS["dense chain, then sparse"], SPECS["sparse, then dense"]], ids=["dense", "mixed"])
def test_blockwise_scores_equal_eager_reference(spec, monkeypatch):
    """With blocks of 3 query rows (the long-prefill memory bound), handed scores included, nothing changes, and no
    score block holds more than 3 rows."""
    model = shared_model(spec)
    ids, mask = left_padded([11, 8], 11)
    rows_seen = []
    scores = modeling.LisaSharedAttention.scores

    def spy(self, prev_scores, q_lr, k_lr):
        rows_seen.append(prev_scores.shape[2])
        return scores(self, prev_scores, q_lr, k_lr)

    monkeypatch.setattr(modeling, "SCORE_BLOCK_ELEMENTS", 2 * 4 * 11 * 3)  # B x H x keys x 3 rows
    monkeypatch.setattr(modeling.LisaSharedAttention, "scores", spy)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    assert rows_seen and max(rows_seen) == 3
    assert_real_positions_close(logits, eager_logits(model, ids, mask), mask)


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_decode_never_copies_the_caches_to_all_heads(spec, monkeypatch):
    """At decode the score rows and softmax x V run by KV head: repeat_kv (a copy of K or V to H heads) is not called."""
    model = shared_model(spec)
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache

        def refuse(*args):
            raise AssertionError("repeat_kv at decode")

        monkeypatch.setattr(modeling, "repeat_kv", refuse)
        step = model(ids[:, -1:], cache=cache, use_cache=True).logits
    assert torch.isfinite(step).all()


def test_full_layer_decode_row_equals_eager_attention():
    """The layer below a shared one at decode: its handed score row and its output are the eager GQA formula."""
    torch.manual_seed(0)
    model = shared_model(SPECS["sparse after full"])
    attn = model.model.layers[1].self_attn
    x, cos_sin = torch.randn(2, 1, 64), model.model.rotary_emb(torch.zeros(1), position_ids=torch.tensor([[6], [6]]))
    key_cache, value_cache = torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16)
    cache = modeling.DynamicCache(config=model.config)
    for idx in range(2):
        cache.update(key_cache, value_cache, idx)
    mask = torch.zeros(2, 1, 1, 7)
    mask[1, :, :, :2] = torch.finfo(torch.float32).min  # the second row's first two keys are padding
    with torch.no_grad():
        out, row = attn(x, cos_sin, None, mask, cache=cache, handoff="scores")
        query = attn.q_proj(x).view(2, 1, 4, 16).transpose(1, 2)
        key = attn.k_proj(x).view(2, 1, 2, 16).transpose(1, 2)
        query, key = modeling.apply_rotary_pos_emb(query, key, *cos_sin)
        keys = repeat_kv(torch.cat([key_cache, key], 2), 2)
        values = repeat_kv(torch.cat([value_cache, attn.v_proj(x).view(2, 1, 2, 16).transpose(1, 2)], 2), 2)
        expected_row = query @ keys.transpose(2, 3) / 4.0
        expected = torch.softmax(expected_row + mask, -1) @ values
        expected_out = attn.o_proj(expected.transpose(1, 2).reshape(2, 1, 64))
    torch.testing.assert_close(row, expected_row)
    torch.testing.assert_close(out, expected_out)


def test_grouped_low_rank_keys_cache_one_key_per_kv_group():
    """key_heads = KV: the layer's low-rank projection and its cache hold KV (not H) low-rank keys."""
    model = shared_model(SPECS["sparse chain, grouped keys"])
    attn = model.model.layers[3].self_attn
    assert attn.key_heads == 2 and attn.k_lowrank.out_features == 2 * 6 and attn.q_lowrank.out_features == 4 * 6
    with torch.no_grad():
        cache = model(torch.randint(0, 128, (1, 8)), use_cache=True).cache
    assert cache.layers[3].keys.shape == (1, 2, 8, 6) and cache.layers[3].values.shape == (1, 2, 8, 16)
    assert cache.layers[1].keys.shape == (1, 2, 8, 16)  # a full layer: its own K


def test_key_heads_must_be_the_heads_or_the_kv_groups():
    # transformers wraps the ValueError of the config validation in its strict-dataclass error
    with pytest.raises(Exception, match="key_heads must be num_attention_heads \\(4\\) or num_key_value_heads \\(2\\)"):
        lisa_copy(LlamaForCausalLM(tiny_config(num_hidden_layers=6)).eval(), lisa_layers={"2": {"rank": 4, "key_heads": 3}})
