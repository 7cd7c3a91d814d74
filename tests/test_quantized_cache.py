"""A converted model with transformers' quantized KV cache (generate(cache_implementation="quantized")): the remote
code's LisaQuantizedCache (modeling/lisa_attention.py) on tiny models with head_dim 64 (the quantizers' group), and
once on a real SmolLM2-135M conversion (slow)."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM, QuantizedCache
from transformers.cache_utils import DummyLayer, HQQQuantizedLayer, QuantoQuantizedLayer

from hfcompress.families import FAMILIES
from hfcompress.serving.quantize import check_kv_backend, kv_cache_bytes
from hfcompress.errors import HfcompressError
from hfcompress.remote import import_remote, remote_code_files
from test_modeling import lisa_copy, tiny_config

lisa = import_remote("lisa_attention")
GROUP = 64
# layer 2: sparse Align, one low-rank key of width 20 per KV group (20 is no multiple of the group); layer 3: dense
# Align, width 10 per head
SPEC = {"2": {"rank": 20, "align": "sparse", "key_heads": 2}, "3": {"rank": 10, "align": "dense", "align_hidden": 4}}
LAYERS = {"quanto": (QuantoQuantizedLayer, "LisaQuantoLayer"), "hqq": (HQQQuantizedLayer, "LisaHQQLayer")}


def tiny_pair(**spec) -> tuple[LlamaForCausalLM, torch.nn.Module]:
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)).eval()
    return reference, lisa_copy(reference, **{"lisa_layers": SPEC, **spec})


def teacher_forced_nll(model, ids: torch.Tensor, prefill: int, cache) -> torch.Tensor:
    """Per-token NLL of ids[prefill:] decoded one token at a time through `cache` after a prefill."""
    nll = []
    with torch.no_grad():
        logits = model(ids[:, :prefill], cache=cache, use_cache=True).logits[:, -1]
        for t in range(prefill, ids.shape[1]):
            nll.append(torch.nn.functional.cross_entropy(logits, ids[:, t], reduction="none"))
            logits = model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1]
    return torch.stack(nll, dim=1)


@pytest.mark.parametrize("backend,nbits", [("quanto", 4), ("quanto", 2), ("hqq", 4), ("hqq", 2)])
def test_generate_builds_the_lisa_quantized_cache(backend, nbits):
    """generate(cache_implementation="quantized"): transformers' quantized layers for full attention, the LISA variant
    for the shared layers; the residual window stays under its length; teacher-forced NLL close to the dynamic cache."""
    _, model = tiny_pair()
    ids = torch.randint(0, 128, (1, 120))
    config = {"backend": backend, "nbits": nbits, "residual_length": 16}
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, return_dict_in_generate=True,
            cache_implementation="quantized", cache_config=config,
        )  # fmt: skip
    cache = out.cache
    full, lisa_name = LAYERS[backend]
    assert [type(layer).__name__ for layer in cache.layers] == [full.__name__] * 2 + [lisa_name] * 2
    assert cache.get_seq_length() == 143  # the last generated token is not fed back
    for layer in cache.layers[2:]:
        assert layer.cumulative_length == 143 and layer.keys.shape[-2] < 16 + GROUP
        assert len(layer.chunks) >= 2  # the prefill's whole groups, then at least one flush of the window
    dynamic = teacher_forced_nll(model, ids, 100, DynamicCache(config=model.config))
    quantized = teacher_forced_nll(model, ids, 100, lisa.LisaQuantizedCache(backend, model.config, nbits=nbits, residual_length=16))
    gap = (quantized.mean() - dynamic.mean()).abs().item() / dynamic.mean().item()
    assert gap < {4: 0.01, 2: 0.05}[nbits], gap


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_lisa_keys_are_grouped_along_tokens_and_quantized_once(backend):
    """Low-rank keys of width 20 (no multiple of the group): one scale per channel and 64 tokens, so every error is
    within half a step of its group; the positions past the last whole group stay exact; a flush quantizes only the
    new whole groups (the earlier chunks are kept as they were)."""
    layer = getattr(lisa, LAYERS[backend][1])(nbits=4, residual_length=96)
    torch.manual_seed(0)
    keys, values = torch.randn(2, 3, 150, 20), torch.randn(2, 2, 150, 64)
    assert layer.update(keys, values)[0] is keys  # the prefill attends to itself unrounded
    assert len(layer.chunks) == 1 and layer.keys.shape[-2] == 150 - 128
    first = layer.chunks[0]
    new_k, new_v = torch.randn(2, 3, 1, 20), torch.randn(2, 2, 1, 64)
    out_k, out_v = layer.update(new_k, new_v)
    all_k, all_v = torch.cat([keys, new_k], dim=-2), torch.cat([values, new_v], dim=-2)
    assert out_k.shape == all_k.shape and out_v.shape == all_v.shape
    assert torch.equal(out_k[..., 128:, :], all_k[..., 128:, :])  # the residual window is full precision
    groups = all_k[..., :128, :].reshape(2, 3, 2, GROUP, 20)  # (batch, head, token group, token, channel)
    half_step = (groups.amax(dim=3, keepdim=True) - groups.amin(dim=3, keepdim=True)) / 15 / 2
    err = (out_k[..., :128, :].reshape(groups.shape) - groups).abs()
    assert (err <= half_step * 1.01 + 1e-6).all()
    assert (out_v[..., :128, :] - all_v[..., :128, :]).abs().mean() < 0.15 * all_v.abs().mean()
    for _ in range(100):  # 23 + 100 tokens: the window reaches 96 once, and its 64 oldest are quantized
        layer.update(torch.randn(2, 3, 1, 20), torch.randn(2, 2, 1, 64))
    assert len(layer.chunks) == 2 and layer.chunks[0] is first and layer.keys.shape[-2] == 123 - 64
    assert layer.get_seq_length() == 251


def test_hqq_8_bits_generates_the_dynamic_cache_tokens_with_beams():
    """At 8 bits the quantized cache is close enough that greedy and beam search (whose reordering the quantized
    chunks apply on dequantization) pick the dynamic cache's tokens."""
    _, model = tiny_pair()
    ids = torch.randint(0, 128, (1, 120))
    for beams in (1, 2):
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, num_beams=beams)
        with torch.no_grad():
            dynamic = model.generate(ids, **kwargs)
            quantized = model.generate(ids, **kwargs, cache_implementation="quantized",
                                       cache_config={"backend": "hqq", "nbits": 8, "residual_length": 16})
        assert torch.equal(dynamic, quantized), beams


def test_fp8_backend_is_per_tensor_for_every_layer():
    """fp8 (transformers' Fp8QuantizedLayer, one scale per tensor) takes any key width; group options are refused."""
    _, model = tiny_pair()
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                             cache_implementation="quantized", cache_config={"backend": "fp8"})
    assert [type(layer).__name__ for layer in out.cache.layers] == ["Fp8QuantizedLayer"] * 4
    assert out.cache.layers[2]._quantized_keys[0].dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="per tensor"):
        lisa.LisaQuantizedCache("fp8", model.config, nbits=4)


def test_dropped_attention_layers_store_nothing():
    _, model = tiny_pair(lisa_layers={"3": SPEC["3"]}, dropped_attention_layers=[1])
    ids = torch.randint(0, 128, (1, 70))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                             cache_implementation="quantized", cache_config={"backend": "quanto", "nbits": 4})
    assert isinstance(out.cache.layers[1], DummyLayer) and type(out.cache.layers[3]).__name__ == "LisaQuantoLayer"
    assert kv_cache_bytes(out.cache) > 0 and out.cache.layers[1].keys is None


def test_kv_bytes_of_converted_and_4_bit_below_original_and_4_bit():
    """Bytes read from the cache tensors after a 256-token prefill (nothing left in a residual window)."""
    reference, model = tiny_pair()
    ids = torch.randint(0, 128, (1, 256))
    sizes = {}
    with torch.no_grad():
        for name, net, cache in [
            ("original", reference, DynamicCache(config=reference.config)),
            ("original 4-bit", reference, QuantizedCache(backend="quanto", config=reference.config, nbits=4)),
            ("converted", model, DynamicCache(config=model.config)),
            ("converted 4-bit", model, lisa.LisaQuantizedCache("quanto", model.config, nbits=4)),
        ]:
            net(ids, cache=cache, use_cache=True)
            sizes[name] = kv_cache_bytes(cache) / 256
    assert sizes["original"] == 4 * 2 * 2 * 64 * 4  # 4 layers x K, V x 2 KV heads x 64 x fp32
    # 64 four-bit codes share a 4-byte scale and a 4-byte zero: 40 bytes per 64 values
    assert sizes["original 4-bit"] == sizes["original"] / 4 * 40 / 256 * 4
    assert sizes["converted 4-bit"] < sizes["original 4-bit"] and sizes["converted 4-bit"] < sizes["converted"] / 5


def save_remote(model, directory) -> None:
    """`model` written as a converted repo: weights, config with the family's auto_map, the remote code beside them."""
    model.config.auto_map = FAMILIES["llama"].auto_map
    model.save_pretrained(directory)
    for path in remote_code_files(FAMILIES["llama"].auto_map):
        shutil.copy(path, directory / path.name)


def test_remote_code_copy_generates_with_the_quantized_cache(tmp_path):
    """Loaded as a user loads a converted repo (trust_remote_code: transformers_modules' copy of the remote code)."""
    _, model = tiny_pair()
    save_remote(model, tmp_path)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (1, 70))
    with torch.no_grad():
        out = loaded.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                              cache_implementation="quantized", cache_config={"backend": "quanto", "nbits": 4})
    assert type(out.cache).__name__ == "LisaQuantizedCache" and type(out.cache).__module__.startswith("transformers_modules")


def test_sliding_window_layers_are_refused_as_transformers_refuses_them():
    config_cls, _ = FAMILIES["mistral"].remote_classes()
    config = config_cls(**tiny_config().to_dict() | {"sliding_window": 32, "lisa_layers": {"2": {"rank": 4}}})
    with pytest.raises(ValueError, match="layer 0 is 'sliding_attention'"):
        lisa.LisaQuantizedCache("quanto", config, nbits=4)


def test_kv_backend_check_names_the_package_or_the_bits(monkeypatch):
    with pytest.raises(HfcompressError, match="quantizes to 2, 4 bits, not 3"):
        check_kv_backend("quanto", 3)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("optimum") else real(name, *a))
    with pytest.raises(HfcompressError, match=r"pip install optimum-quanto==0\.2\.7"):
        check_kv_backend("quanto", 4)
    check_kv_backend("hqq", 2)


@pytest.mark.slow
def test_smollm2_conversion_stacks_int8_weights_and_a_4_bit_kv_cache(tmp_path):
    """A lean real conversion written with --quantize-weights int8 (its reload check passes on the quantized logits),
    then read with transformers' quantized cache at 4 bits: greedy next tokens mostly those of the dynamic cache,
    perplexity within 5%, and fewer KV bytes per token than the original with the same 4-bit cache."""
    from transformers import AutoModelForCausalLM

    from hfcompress.serving.quantize import cached_logits, kv_bytes_per_token, lisa_quantized_cache, window_perplexity
    from hfcompress.sources.source import BUILTIN_SOURCE, load_source, resolve_source
    from hfcompress.sources.text import news_text

    out = tmp_path / "smollm2-lisa"
    proc = subprocess.run(
        [sys.executable, "-m", "hfcompress.cli", "convert", "--out", str(out), "--lisa-layers", "21,24,27,28",
         "--lisa-steps", "20", "--calib-sequences", "8", "--eval-tokens", "1024", "--ood-text", "none",
         "--max-ppl-increase", "100", "--no-probe", "--no-speed", "--no-peers", "--distill-tokens", "0",
         "--quantize-weights", "int8", "--kv-budget", "1.0"],  # shared layers alone (key latents: test_lowrank_keys.py)
        capture_output=True, text=True, env={**os.environ, "HFCOMPRESS_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reload = json.loads((out / "hfcompress_report.json").read_text())["validation"]["reload"]
    assert reload["mode"] == "logits" and reload["max_abs_logit_diff"] <= 1e-4 and reload["quantized_weights"] == "int8"
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model.model.layers[24].self_attn.k_lowrank.weight).__name__ == "Int8Tensor"

    torch.set_num_threads(1)
    original, tokenizer = load_source(resolve_source(BUILTIN_SOURCE))
    ids = torch.tensor(tokenizer(news_text().text).input_ids[:1024])
    dynamic = lambda: DynamicCache(config=model.config)  # noqa: E731
    four_bit = lambda: lisa_quantized_cache(model, "quanto", nbits=4)  # noqa: E731
    logits_dynamic, logits_quantized = cached_logits(model, ids, dynamic), cached_logits(model, ids, four_bit)
    agree = [(a.argmax(-1) == b.argmax(-1)).float().mean() for a, b in zip(logits_dynamic, logits_quantized)]
    assert sum(agree) / len(agree) >= 0.85  # measured 0.94 (0.96, 0.92 by window)
    ppl_dynamic, ppl_quantized = window_perplexity(ids, logits_dynamic)[0], window_perplexity(ids, logits_quantized)[0]
    assert abs(ppl_quantized / ppl_dynamic - 1) < 0.05, (ppl_dynamic, ppl_quantized)  # measured +2.6%

    converted_kv = kv_bytes_per_token(model, ids[:512], four_bit())
    original_kv = kv_bytes_per_token(original, ids[:512], QuantizedCache(backend="quanto", config=original.config, nbits=4))
    # per token, a shared layer's K: 3 x 20 four-bit codes + a 4-byte scale and zero per channel and 64 tokens (37.5 B)
    # instead of 3 x 64 codes + a scale and zero per head (120 B); V as the original's
    assert converted_kv == pytest.approx(original_kv - 4 * (120 - 37.5)) and original_kv == 30 * 2 * 120
    prompt = ids[:200].unsqueeze(0)
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=8, do_sample=False, cache_implementation="quantized",
                                   cache_config={"backend": "quanto", "nbits": 4})
    assert generated.shape == (1, 208)
