"""Low-rank values in the remote code (`value_ranks`, issue 41): a layer caches the value latent z = B v and attends
over A z.

The reference is transformers' own model of each family with its values projected, v -> A B v
(`hfcompress.keys.projected_values`, a hook on v_proj); every path of the converted model (no cache, a left-padded batch,
the dynamic, sliding-window, static and quantized caches, chunked prefill, key latents beside) must compute what it
computes. The tiny models of tests/test_families.py cover the five families and their windows.
"""

from __future__ import annotations

import pytest
import torch
from test_families import (  # noqa: F401 (checkpoints: the fixture)
    CASES, LENGTH, assert_same_generation, checkpoints, chunked_logits, greedy, ids_and_mask, tiny_model,
)
from test_lowrank_keys import latent_factors

from hfcompress.conversion.build import converted_config
from hfcompress.families import family_of
from hfcompress.keys import projected_keys, projected_values

FAMILY_CASES = ["mistral", "qwen2", "qwen3", "gemma3", "mistral, no window"]


def models_with_lowrank_values(name: str, value_ranks: dict[int, int], key_ranks: dict[int, int] | None = None):
    """(transformers' model, the converted model with `value_ranks` (and `key_ranks`), value and key projectors)."""
    original = tiny_model(name)
    key_ranks = key_ranks or {}
    entries = {"value_ranks": {str(k): r for k, r in value_ranks.items()}, "key_ranks": {str(k): r for k, r in key_ranks.items()}}
    config = converted_config(original.config, entries)
    _, cls = family_of(config).remote_classes()
    model = cls(config).eval()
    state = dict(original.state_dict())
    width = config.num_key_value_heads * config.head_dim
    projectors: dict[str, dict[int, torch.Tensor]] = {"values": {}, "keys": {}}
    for kind, ranks, seed in (("values", value_ranks, 100), ("keys", key_ranks, 0)):
        for layer, rank in ranks.items():
            down, up = latent_factors(width, rank, seed=seed + layer)
            prefix = f"model.layers.{layer}.self_attn.{kind[:-1]}_latent."
            state[prefix + "proj_in.weight"], state[prefix + "proj_out.weight"] = down, up
            projectors[kind][layer] = up @ down
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()}, strict=True)
    model.tie_weights()
    return original, model, projectors


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_lowrank_values_equal_transformers_with_projected_values(name):
    """No cache (a left-padded batch), greedy generation with the dynamic and the static cache: the converted model
    computes transformers' model whose values are projected (a layer with a key latent too, one with values only);
    and the projection matters."""
    original, model, projectors = models_with_lowrank_values(name, {1: 10, 2: 7}, key_ranks={2: 9})
    ids, mask = ids_and_mask(padded=True)
    real = mask.bool()
    with torch.no_grad():
        plain = original(ids, attention_mask=mask).logits
        with projected_values(original, projectors["values"]), projected_keys(original, projectors["keys"]):
            want = original(ids, attention_mask=mask).logits
            expected = greedy(original, ids, mask)
        got = model(ids, attention_mask=mask).logits
    assert (plain - want)[real].abs().max() > 1e-3  # the projection changes the model (100x the tolerance below)
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-4)
    assert_same_generation(greedy(model, ids, mask), expected)
    assert_same_generation(greedy(model, ids, mask, cache_implementation="static"), expected)


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_lowrank_values_in_chunks_and_steps_through_a_sliding_window(name):
    """A prompt fed in chunks past the window, then token by token, gives the prefill's logits."""
    _, model, _ = models_with_lowrank_values(name, {0: 12, 1: 10, 3: 7}, key_ranks={1: 8})
    ids, mask = ids_and_mask(padded=True)
    real = mask.bool()
    with torch.no_grad():
        whole = model(ids, attention_mask=mask).logits
    chunked, _ = chunked_logits(model, ids, mask)
    torch.testing.assert_close(chunked[real], whole[real], atol=2e-4, rtol=1e-4)


def test_the_cache_holds_the_value_latent():
    """A low-rank value layer's cache holds (B, 1, T, r) value latents beside its keys; other layers keep V."""
    _, model, _ = models_with_lowrank_values("qwen3", {2: 10}, key_ranks={2: 6})
    ids, mask = ids_and_mask(padded=False)
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).cache
    assert cache.layers[2].keys.shape == (2, 1, LENGTH, 6) and cache.layers[2].values.shape == (2, 1, LENGTH, 10)
    assert cache.layers[1].values.shape == (2, 2, LENGTH, 24)
    assert model.config.cache_layer_types()[2] == "lisa_attention"


def test_a_decode_step_mixes_the_cached_latents_instead_of_rebuilding_the_values():
    """At decode the probabilities mix the cached value latents and A applies once per query head
    (`latent_value_attention`): the same output as attending over the rebuilt values, and proj_out never runs on the
    cache (a prefill rebuilds them, once)."""
    from hfcompress.remote import import_remote

    attention = import_remote("lisa_attention")
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(2, 6, 1, 9, generator=generator), -1)
    latent, up = torch.randn(2, 1, 9, 5, generator=generator), torch.randn(3 * 4, 5, generator=generator)
    values = (latent.squeeze(1) @ up.T).view(2, 9, 3, 4).transpose(1, 2)
    torch.testing.assert_close(attention.latent_value_attention(probs, latent, up, 2), attention.grouped_attention(probs, values, 2))

    _, model, _ = models_with_lowrank_values("mistral", {1: 10})
    ids, mask = ids_and_mask(padded=True)
    calls = []
    model.model.layers[1].self_attn.value_latent.proj_out.register_forward_hook(lambda *args: calls.append(1))
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert len(calls) == 1  # the prefill's


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_the_quantized_cache_quantizes_the_value_latent(backend):
    """generate(cache_implementation="quantized"): a low-rank value layer's cache is the LISA quantized layer (a latent
    the groups do not fill is grouped along the tokens); at 8 bits the generation stays the float cache's."""
    pytest.importorskip("optimum.quanto" if backend == "quanto" else "hqq")
    _, model, _ = models_with_lowrank_values("qwen3", {1: 10, 3: 6}, key_ranks={3: 5})
    ids, mask = ids_and_mask(padded=False)
    nbits = 4 if backend == "quanto" else 8
    config = {"backend": backend, "nbits": nbits, "q_group_size": 4, "residual_length": 4}
    with torch.no_grad():
        tokens, logits = greedy(model, ids, mask, cache_implementation="quantized", cache_config=config)
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
            cache_implementation="quantized", cache_config=config,
        )  # fmt: skip
    kinds = [type(layer).__name__ for layer in out.past_key_values.layers]
    assert kinds[1].startswith("Lisa") and kinds[3].startswith("Lisa") and not kinds[0].startswith("Lisa")
    assert torch.isfinite(logits).all()
    if backend == "hqq":  # 8 bits: the same tokens
        assert torch.equal(tokens, greedy(model, ids, mask)[0])


@pytest.mark.parametrize(
    "entries, message",
    [
        ({"value_ranks": {"9": 4}}, "must be in 0..3"),
        ({"value_ranks": {"1": 49}}, "rank must be in 1..48"),
        ({"value_ranks": {"2": 8}, "lisa_layers": {"2": {"rank": 4}}}, "both a LISA layer and a low-rank value layer"),
        ({"value_ranks": {"2": 8}, "dropped_attention_layers": [2]}, "low-rank values and its attention dropped"),
    ],
)
def test_the_config_refuses_value_ranks_it_cannot_take(entries, message):
    with pytest.raises(Exception, match=message):  # huggingface_hub's strict validation wraps the ValueError
        converted_config(tiny_model("qwen3").config, entries)


assert set(FAMILY_CASES) <= set(CASES)


# ------------------------------------------------------------------------------------------------ the conversion
@pytest.mark.slow
def test_convert_with_the_keys_values_plan_narrows_both_within_the_budget(checkpoints, tmp_path):
    """`convert --kv-plan keys-values --kv-budget 0.45` (below what keys alone reach): latents of keys and of values
    from one budget, the cache within it; the written model reloads in a fresh process with the streamed logits,
    distillation trains both latents, the card tells the values' widths."""
    import json

    from test_families import FAST
    from typer.testing import CliRunner

    from hfcompress.cli import app

    out = tmp_path / "out"
    fast = [arg for arg in FAST if arg not in ("--fasc-budget", "0.8")]
    fast[fast.index("--distill-tokens") + 1] = "1024"
    args = ["convert", str(checkpoints["qwen3"]), "--out", str(out), *fast, "--distill-seq-len", "32", "--share-ratio", "0",
            "--kv-plan", "keys-values", "--kv-budget", "0.45"]  # fmt: skip
    result = CliRunner().invoke(app, args, env={"HFCOMPRESS_CACHE": str(tmp_path / "cache")})
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    report = json.loads((out / "hfcompress_report.json").read_text())
    width = config["num_key_value_heads"] * config["head_dim"]
    assert config["value_ranks"] and all(8 <= rank < width for rank in config["value_ranks"].values())
    keys = report["keys"]
    assert keys["plan"] == "keys-values" and all("value_rank" in row for row in keys["layers"])
    values = keys["kv_values_per_token"]
    assert values["converted"] <= 0.45 * values["original"]
    assert report["validation"]["reload"]["max_abs_logit_diff"] <= 1e-4
    trained = report["finishers"]["distillation"]["trainable_parameters"]
    latents = [*config.get("key_ranks", {}).values(), *config["value_ranks"].values()]
    assert trained >= sum(2 * width * r for r in latents)
    card = (out / "README.md").read_text()
    assert "low-rank values in" in card and "value latent width" in card and "low-rank keys and values hold their latents" in card


def test_a_keys_values_budget_below_eight_of_each_is_refused_before_calibration(checkpoints, tmp_path):
    from test_families import FAST
    from typer.testing import CliRunner

    from hfcompress.cli import app

    args = ["convert", str(checkpoints["qwen2"]), "--out", str(tmp_path / "o"), *FAST, "--kv-plan", "keys-values", "--kv-budget", "0.1"]
    result = CliRunner().invoke(app, args, env={"HFCOMPRESS_CACHE": str(tmp_path / "cache")})
    assert result.exit_code == 2 and "below what --kv-plan keys-values can reach" in result.output, result.output
    assert "calibrate" not in result.output and not (tmp_path / "o").exists()
