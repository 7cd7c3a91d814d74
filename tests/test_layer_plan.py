"""The per-layer plan (keep, share, drop the attention) and the training-free peers a conversion is measured against."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from test_families import tiny_model
from test_modeling import tiny_config
from transformers import LlamaForCausalLM
from typer.testing import CliRunner

from hfcompress.conversion.build import converted_config
from hfcompress.cli import app
from hfcompress.families import family_of
from hfcompress.keys import projected_keys
from hfcompress.conversion.layer_plan import Action, kv_values, largest_within, plan_sequence, ranked_actions, take
from hfcompress.lisa import LayerSimilarity
from hfcompress.evidence.peers import (
    QuantizedKV,
    attention_free,
    block_influence,
    dominating,
    fewest_layers_saving,
    kv_values_per_token,
    pca_key_projectors,
    pca_key_width,
    quantized_cache_perplexity,
    removed,
    speed_peers,
    without_layers,
)
from hfcompress.evidence.speed import measure_speed
from hfcompress.evidence.validate import perplexity

VALUES = {"keep": 384, "share": 252, "drop": 0}


def similarity(errors: dict[int, float]) -> list[LayerSimilarity]:
    return [LayerSimilarity(layer, 0.0, 0.0, [], [], error, attention_energy=0.1) for layer, error in errors.items()]


def test_actions_are_ranked_by_estimated_cost_per_value_saved():
    sims = similarity({1: 0.5, 2: 10.0, 3: 0.5})
    energy = {1: 0.30, 2: 0.01, 3: 0.20}
    actions = ranked_actions(sims, energy, VALUES, "mixed", protect_first=1)
    assert [a.cost / a.saved for a in actions] == sorted(a.cost / a.saved for a in actions)
    # layer 2's attention adds little but is poorly aligned: dropping it (0.01 / 384 = 2.6e-5 a value) beats sharing it
    # (0.07 * 10 * 0.01 / 132 = 5.3e-5) and sharing layer 3 (0.07 * 0.5 * 0.2 / 132 = 5.3e-5, a larger layer index)
    assert actions[0] == Action(2, "drop", 0.01, 384)
    assert actions[1].kind == "share"
    assert {a.kind for a in ranked_actions(sims, energy, VALUES, "drop", 1)} == {"drop"}
    assert all(a.layer >= 2 for a in ranked_actions(sims, energy, VALUES, "mixed", protect_first=2))


def test_take_keeps_every_shared_layers_anchor_and_caps_chains():
    actions = [Action(3, "drop", 0.0, 384), Action(4, "share", 0.0, 132), Action(2, "share", 0.0, 132),
               Action(5, "share", 0.0, 132), Action(6, "share", 0.0, 132), Action(7, "share", 0.0, 132)]  # fmt: skip
    plan = take(actions)
    assert plan.dropped == [3]
    assert 4 not in plan.shared  # its anchor, layer 3, has no attention
    assert plan.shared == [2, 5, 6, 7]
    capped = take(actions, max_chain=2)
    assert capped.shared == [2, 5, 6]  # 7 would make a run of three
    assert take([Action(4, "share", 0, 132), Action(3, "drop", 0, 384)]).dropped == []  # 3 anchors the shared 4


def test_plans_of_every_size_grow_by_one_action():
    sims = similarity({i: 0.1 * i for i in range(1, 9)})
    energy = {i: 0.05 * (9 - i) for i in range(1, 9)}
    plans = plan_sequence(ranked_actions(sims, energy, VALUES, "mixed", 1), max_chain=3)
    for small, big in zip(plans, plans[1:]):
        assert len(big) == len(small) + 1
        assert set(small.shared) <= set(big.shared) and set(small.dropped) <= set(big.dropped)
    final = plans[-1]
    assert not set(final.shared) & set(final.dropped)
    assert all(layer - 1 not in final.dropped for layer in final.shared)


def test_largest_within_searches_counts_in_log_time():
    calls = []

    def value_of(count):
        calls.append(count)
        return 10.0 + count

    assert largest_within(20, value_of, 15.5)[0] == 5
    assert len(calls) <= 5


def test_kv_values_per_token_is_what_the_cache_holds():
    """The figure the peers are sized by equals the values the converted model's dynamic cache holds a token."""
    original = tiny_model("qwen3")
    spec = {"2": {"rank": 4, "align": "sparse", "key_heads": 2}}
    config = converted_config(original.config, {"lisa_layers": spec, "dropped_attention_layers": [3]})
    _, cls = family_of(config).remote_classes()
    model = cls(config).eval()
    ids = torch.randint(3, 100, (1, 12))
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
    held = sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
    assert held == kv_values_per_token(config) * ids.shape[1]
    values = kv_values(config, 4, 2)
    assert kv_values_per_token(config) == 2 * values["keep"] + values["share"] + values["drop"]


def test_attention_drop_peer_equals_the_converted_classes_with_the_layer_dropped():
    """Two implementations of one model: hooks on transformers' Llama, and the remote code's attention-free layer."""
    torch.manual_seed(0)
    original = LlamaForCausalLM(tiny_config(vocab_size=128)).eval()
    dropped = attention_free(original, [2])  # the peer as served: the remote code, the original's tensors
    assert "model.layers.2.self_attn.q_proj.weight" not in dropped.state_dict()
    assert dropped.model.embed_tokens.weight.data_ptr() == original.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad(), removed(original, attention=[2]):
        peer = perplexity(original, ids[0], 16)
    assert math.isclose(peer.perplexity, perplexity(dropped, ids[0], 16).perplexity, rel_tol=1e-5)
    assert not math.isclose(peer.perplexity, perplexity(original, ids[0], 16).perplexity, rel_tol=1e-5)  # hooks gone


def test_layer_drop_peer_skips_the_layer():
    torch.manual_seed(0)
    original = LlamaForCausalLM(tiny_config(vocab_size=128)).eval()
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        with removed(original, layers=[1, 3]):
            skipped = original(ids, use_cache=False).logits
        served = without_layers(original, [1, 3])  # the peer as served: 2 layers, renumbered, the original's tensors
        assert served.config.num_hidden_layers == 2 and original.config.num_hidden_layers == 4
        assert torch.allclose(skipped, served(ids, use_cache=False).logits, atol=1e-5)
        # cached decoding reads the renumbered layers' cache: the same logits as without a cache
        prefix = served(ids[:, :5], use_cache=True)
        step = served(ids[:, 5:6], cache=prefix.cache, use_cache=True).logits[:, -1]
        assert torch.allclose(step, served(ids[:, :6], use_cache=False).logits[:, -1], atol=1e-5)


def test_the_speed_run_times_the_peers_that_could_dominate_beside_the_original():
    torch.manual_seed(0)
    original = LlamaForCausalLM(tiny_config(vocab_size=128)).eval()
    values = kv_values_per_token(original.config)
    section = {
        "kv_values_per_token": {"original": values, "converted": values * 3 // 4},
        "peers": [
            {"name": "drop 1 attention block", "kind": "attention-drop", "kv_ratio": 0.75, "layers": [2]},
            {"name": "drop 1 layer", "kind": "layer-drop", "kv_ratio": 0.75, "layers": [2]},
            {"name": "drop 0 layers", "kind": "layer-drop", "kv_ratio": 1.0, "layers": []},  # saves less: not timed
            {"name": "4-bit KV cache (quanto)", "kind": "kv-quantized", "kv_ratio": 0.2, "layers": []},
        ],
    }  # fmt: skip
    models = speed_peers(original, section)
    assert list(models) == ["drop 1 attention block", "drop 1 layer", "4-bit KV cache (quanto)"]
    assert isinstance(models["4-bit KV cache (quanto)"], QuantizedKV)
    ids = torch.randint(0, 128, (300,))
    speed = measure_speed(original, original, ids, prompt_tokens=200, new_tokens=4, repeats=1, peers=models)
    assert set(speed["peers"]) == set(models)
    for timed in speed["peers"].values():
        assert timed["decode_tokens_per_s"] > 0 and timed["decode_speedup"] > 0
    with torch.no_grad():  # the wrapped original decodes through the 4-bit cache: its keys come back quantized
        prompt = ids[:200].unsqueeze(0)
        cache = models["4-bit KV cache (quanto)"](prompt, use_cache=True).cache
        assert type(cache).__name__ == "QuantizedCache"


def test_block_influence_is_zero_for_a_block_that_adds_nothing():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(vocab_size=128)).eval()
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.zero_()
        model.model.layers[2].mlp.down_proj.weight.zero_()
        model.model.layers[2].self_attn.o_proj.weight.zero_()
    attention, layer = block_influence(model, torch.randint(0, 128, (3, 20)))
    assert attention[1] == pytest.approx(0.0, abs=1e-6) and layer[2] == pytest.approx(0.0, abs=1e-6)
    assert attention[0] > 1e-4 and layer[0] > 1e-4


def test_quantized_kv_cache_perplexity_reads_back_quantized_keys():
    pytest.importorskip("optimum.quanto")
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(vocab_size=128, head_dim=64, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)).eval()
    ids = torch.randint(0, 128, (600,))
    plain = perplexity(model, ids, 300, prefix=[1]).perplexity
    quantized, ratio = quantized_cache_perplexity(model, ids, 300, None, [1])
    assert quantized != plain and abs(quantized / plain - 1) < 0.05
    two_bit, _ = quantized_cache_perplexity(model, ids, 300, None, [1], nbits=2)
    assert abs(two_bit / plain - 1) > abs(quantized / plain - 1)  # fewer bits, further away
    assert 0.1 < ratio < 0.5  # 4 bits and a group's scale and zero point, plus the full-precision last tokens


def test_fewest_layers_bracket_the_saving():
    assert fewest_layers_saving(792, 384) == [2, 3]
    assert fewest_layers_saving(768, 384) == [2]
    assert fewest_layers_saving(100, 384) == [1]
    assert fewest_layers_saving(0, 384) == []


def test_key_pca_peer_is_the_original_with_its_keys_projected():
    """Two implementations of one model: hooks on the keys, and k_proj's weights replaced by P W_K."""
    torch.manual_seed(0)
    original = LlamaForCausalLM(tiny_config(vocab_size=128)).eval()
    config = original.config  # 4 layers, 2 KV heads x 16: keys of 32 values a layer
    full = config.num_key_value_heads * config.head_dim
    assert pca_key_width(config, 4 * 10) == full - 10 and pca_key_width(config, 4 * 10 + 1) == full - 11
    assert pca_key_width(config, 0) is None and pca_key_width(config, 4 * full) is None
    ids = torch.randint(0, 128, (4, 24))
    projectors = pca_key_projectors(original, ids, 8)
    assert all(torch.linalg.matrix_rank(p).item() == 8 for p in projectors.values())
    with torch.no_grad():
        reference = original(ids).logits
        with projected_keys(original, projectors):
            hooked = original(ids).logits
        folded = copy.deepcopy(original)
        for layer, p in zip(folded.model.layers, projectors.values()):
            layer.self_attn.k_proj.weight.copy_(p.float() @ layer.self_attn.k_proj.weight)
        assert torch.allclose(hooked, folded(ids).logits, atol=1e-5)
        assert not torch.allclose(hooked, reference, atol=1e-3)


def test_a_peer_dominates_only_with_at_least_the_saving_and_no_worse_perplexity_on_every_text():
    section = {"kv_values_per_token": {"original": 400, "converted": 300}, "peers": [
        {"name": "a", "kind": "attention-drop", "kv_ratio": 0.5, "perplexity": {"x": 9.0, "y": 9.0}},
        {"name": "b", "kind": "attention-drop", "kv_ratio": 0.9, "perplexity": {"x": 1.0, "y": 1.0}},  # saves less
        {"name": "c", "kind": "layer-drop", "kv_ratio": 0.5, "perplexity": {"x": 9.0, "y": 11.0}},  # worse on y
        {"name": "d", "kind": "kv-quantized", "kv_ratio": 0.2, "perplexity": {"x": 1.0, "y": 1.0}},  # a partner
        {"name": "e", "kind": "key-pca", "kv_ratio": 0.75, "perplexity": {"x": 10.0, "y": 9.5}},
    ]}  # fmt: skip
    assert [p["name"] for p in dominating(section, {"x": 10.0, "y": 10.0})] == ["a", "e"]


runner = CliRunner()


@pytest.mark.slow  # a tiny conversion with the peers and a fresh-process reload: ~40 s on 2 busy cores
def test_convert_drops_shares_and_reports_its_peers(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    result = runner.invoke(app, [
        "convert", str(tiny_llama_dir), "--out", str(out), "--distill-tokens", "0", "--calib-sequences", "4",
        "--seq-len", "64", "--eval-tokens", "256", "--lisa-steps", "5", "--no-probe",
        "--max-ppl-increase", "1000", "--calib-text", "builtin", "--ood-text", "news",
        "--drop-attention-layers", "1", "--lisa-layers", "3",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["dropped_attention_layers"] == [1] and list(config["lisa_layers"]) == ["3"]
    report = json.loads((out / "hfcompress_report.json").read_text())
    peers = report["peers"]
    assert peers["kv_values_per_token"]["converted"] < peers["kv_values_per_token"]["original"]
    kinds = {p["kind"] for p in peers["peers"]}
    assert {"attention-drop", "layer-drop", "key-pca"} <= kinds
    for peer in peers["peers"]:
        assert set(peer["perplexity"]) == {t["eval_text"] for t in report["validation"]["texts"]}
    # the speed run timed the dropping peers that save at least as much KV cache, beside the original
    timed = report["speed"]["peers"]
    could_dominate = [p["name"] for p in peers["peers"] if p["kind"] in ("attention-drop", "layer-drop")
                      and p["kv_ratio"] <= peers["kv_values_per_token"]["converted"] / peers["kv_values_per_token"]["original"] + 1e-9]
    assert could_dominate and set(could_dominate) <= set(timed)
    card = (out / "README.md").read_text()
    assert "Against what you could do instead" in card and "Dropped attention" in card and "decode, batch 1" in card
    assert (out / "plots" / "tradeoff.png").is_file()


def test_drop_and_share_options_are_checked_before_any_work(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(tmp_path / "cache"))
    cases = [
        (["--layer-plan", "everything"], "Unknown --layer-plan"),
        (["--layer-plan", "mixed", "--lisa-layers", "2"], "--drop-attention-layers"),
        (["--drop-attention-layers", "0"], "layer 0 keeps its attention"),
        (["--drop-attention-layers", "9"], "out of range"),
        (["--drop-attention-layers", "x"], "comma-separated"),
    ]
    for flags, message in cases:
        result = runner.invoke(app, ["convert", str(tiny_llama_dir), "--out", str(tmp_path / "o"), *flags])
        assert result.exit_code == 2, (flags, result.output)
        assert message in result.output, (flags, result.output)
        assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_a_plan_that_only_drops_creates_nothing_to_distil(tmp_path):
    from hfcompress.conversion.config import ConvertOptions
    from hfcompress.lisa import LisaOptions

    from hfcompress.keys import KeyOptions

    no_keys = KeyOptions(kv_budget=1.0)
    assert not ConvertOptions(source="x", out=tmp_path, lisa=LisaOptions(plan="drop"), keys=no_keys).changes_layers
    assert ConvertOptions(source="x", out=tmp_path, lisa=LisaOptions(plan="mixed", share_ratio=0.2), keys=no_keys).changes_layers
    assert ConvertOptions(source="x", out=tmp_path, lisa=LisaOptions(plan="drop")).changes_layers  # the default's keys
    result = runner.invoke(app, ["convert", "x", "--out", str(tmp_path / "o"), "--layer-plan", "drop", "--kv-budget", "1.0",
                                 "--distill-tokens", "4096"])  # fmt: skip
    assert result.exit_code == 2 and "shares no layer, factorises none and compresses no keys" in result.output
