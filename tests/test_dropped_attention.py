"""Layers whose attention is dropped (config `dropped_attention_layers`): the MLP part on the residual stream alone.

Every family's converted classes with dropped layers compute what transformers' own model computes when those layers'
attention outputs are zeroed (prefill, left-padded batches, cached generation, static cache); a dropped layer has no
attention weights and caches nothing; the config refuses plans the modeling cannot run.
"""

from __future__ import annotations

import pytest
import torch
from test_families import CASES, assert_same_generation, greedy, ids_and_mask, tiny_model

from hfcompress.conversion.build import converted_config
from hfcompress.families import family_of


def zeroed_attention(model: torch.nn.Module, layers: list[int]) -> list:
    """Forward hooks making transformers' `model` skip the attention of `layers` (its output becomes zeros)."""

    def zero(module, args, output):
        return (torch.zeros_like(output[0]), *output[1:])

    return [model.model.layers[i].self_attn.register_forward_hook(zero) for i in layers]


def dropped_model(original: torch.nn.Module, dropped: list[int], lisa: dict | None = None) -> torch.nn.Module:
    """The converted classes of `original`'s family with `dropped` layers and the original's remaining weights."""
    entries = {"dropped_attention_layers": dropped, **({"lisa_layers": lisa} if lisa else {})}
    config = converted_config(original.config, entries)
    _, cls = family_of(config).remote_classes()
    model = cls(config).eval()
    own = model.state_dict()
    result = model.load_state_dict({k: v for k, v in original.state_dict().items() if k in own}, strict=False)
    assert not [k for k in result.missing_keys if "lowrank" not in k and "align" not in k], result.missing_keys
    return model


@pytest.mark.parametrize("name", CASES)
def test_dropped_attention_equals_zeroed_attention(name):
    original = tiny_model(name)
    model = dropped_model(original, [1, 3])
    zeroed_attention(original, [1, 3])
    ids, mask = ids_and_mask(padded=True)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, original(ids, attention_mask=mask).logits, atol=1e-4, rtol=1e-4)
    assert_same_generation(greedy(model, ids, mask), greedy(original, ids, mask))
    assert_same_generation(greedy(model, ids, mask, cache_implementation="static"), greedy(original, ids, mask))


@pytest.mark.parametrize("name", CASES)
def test_a_dropped_layer_has_no_attention_weights_and_caches_nothing(name):
    model = dropped_model(tiny_model(name), [2])
    names = [k for k in model.state_dict() if k.startswith("model.layers.2.")]
    assert names and not [k for k in names if "self_attn" in k or "input_layernorm" in k]
    if name == "gemma3":  # Gemma 3's norm of the attention output goes with the attention
        assert not [k for k in names if "post_attention_layernorm" in k]
    ids, mask = ids_and_mask(padded=False)
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).cache
    assert cache.layers[2].keys is None and cache.layers[2].values is None
    assert cache.layers[1].keys is not None and cache.get_seq_length() == ids.shape[1]


def test_a_lisa_layer_above_a_kept_layer_beside_dropped_ones():
    """A plan mixing the three choices (keep 0, 1; share 2; drop 3) generates the same with and without the cache."""
    model = dropped_model(tiny_model("qwen3"), [3], lisa={"2": {"rank": 4, "align": "sparse"}})
    ids, mask = ids_and_mask(padded=True)
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        uncached = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(generated, uncached)


@pytest.mark.parametrize(
    "entries, message",
    [
        ({"dropped_attention_layers": [0]}, "must be in 1..3"),
        ({"dropped_attention_layers": [4]}, "must be in 1..3"),
        ({"dropped_attention_layers": [2], "lisa_layers": {"2": {"rank": 4}}}, "can be only one"),
        ({"dropped_attention_layers": [1], "lisa_layers": {"2": {"rank": 4}}}, "that layer's is dropped"),
    ],
)
def test_config_refuses_plans_the_modeling_cannot_run(entries, message):
    with pytest.raises(Exception, match=message):  # huggingface_hub wraps the ValueError of a strict validator
        converted_config(tiny_model("mistral").config, entries)


def test_config_round_trip_keeps_the_dropped_layers(tmp_path):
    config = converted_config(tiny_model("gemma3").config, {"dropped_attention_layers": [3, 1]})
    config.save_pretrained(tmp_path)
    loaded = type(config).from_pretrained(tmp_path)
    assert loaded.dropped_attention_layers == [1, 3]
    assert loaded.attention_types == config.attention_types == ["sliding_attention", "sliding_attention", "full_attention", "full_attention"]
    assert loaded.layer_types[1] == "dropped_sliding_attention" and loaded.layer_types[3] == "dropped_attention"
