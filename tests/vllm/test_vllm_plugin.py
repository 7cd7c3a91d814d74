"""The hfcompress vLLM plugin (vllm-plugin/src/hfcompress_vllm) against the remote code (issue 27). Runs in .venv-vllm only.

- Exact: fp32 greedy tokens equal to the remote code's and max |delta log-prob| <= 1e-4 on 32 prompts of mixed lengths
  (served twice: 40 sequences), with chunked prefill (a 64-token budget: long prompts prefilled in chunks), prefix
  caching (hits counted) and 16 concurrent sequences; on a tiny checkpoint of each family (shared layers, a chain, FASC
  linears, a dropped attention, low-rank keys: `key_ranks`, the root of a shared layer among them) and, in the slow tier, on SmolLM2-135M with 8 shared layers.
- KV cache: a shared layer caches its low-rank keys and V (the "lowrank" layout, reading the root's K from the root's
  cache); a layer with low-rank keys caches its key latent and V (the "latent" layout; as a root it hands the shared
  layers its rebuilt keys), and holds more tokens than with its keys cached at full width; a layer with low-rank values
  (`value_ranks`) caches its value latent beside its key latent or its rotated keys (as a root, it hands the shared
  layers those keys), exact, and holds more tokens than with full-width keys and values; SmolLM2 converted holds more
  tokens than the original in the same VLLM_CPU_KVCACHE_SPACE, as vLLM computes them. The concatenated-feature layouts
  (grouped, own; HFCOMPRESS_VLLM_KV=concat, where the root's cache is not readable) stay exact.
- fp8 KV cache (`kv_cache_dtype` fp8 / fp8_e5m2): the lowrank layout reads the root's fp8 keys where vLLM's CPU backend
  writes them and stores the shared layers' own keys and V in fp8; served with it, a converted model is as close to its
  fp32 reference as the original served by stock vLLM with fp8 is to its own, and caches ~4x the tokens of fp32 (more
  than the original with fp8).
- bf16: served at bf16 (model and KV cache), a converted model is as close to its fp32 reference as the original served
  by stock vLLM's Llama at bf16 is to transformers' fp32 one (the shared layers in the lowrank layout, the root's keys
  read as the CPU backend's bf16 ISA lays them out: "vec" transposed, or packed for AMX tiles).
- Refusals: a dense-Align model, an unknown layer kind, a model whose config.json does not state its shared layers'
  `source` (converted before hfcompress wrote it) and a model another hfcompress version converted are refused while
  vLLM reads config.json, with one sentence naming the file and the option (or the release to install), before any
  KV cache is allocated.
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import pytest
import torch

# a submodule: tests/ is on sys.path (tests/conftest.py), where this folder alone would import as a namespace "vllm"
pytest.importorskip("vllm.entrypoints.llm")

from helpers_vllm import HERE, build_references, serve  # noqa: E402

TINY = ["llama", "llama-own", "mistral", "qwen2", "qwen3", "gemma3"]


def check(models: Path, name: str, env: dict[str, str] | None = None, kv_cache_dtype: str = "auto",
          dtype: str = "float32", eager: bool = True) -> dict:  # fmt: skip
    build_references(models, TINY if name in TINY else [name.removesuffix("-original")])
    variant = f"{''.join('.' + v for v in (env or {}).values())}.{dtype}.{kv_cache_dtype}{'' if eager else '.compiled'}"
    out = models / f"{name}{variant}.result.json"
    options = ["--dtype", dtype, "--kv-cache-dtype", kv_cache_dtype, "--enforce-eager", str(int(eager)),
               str(models / name), str(models / f"{name}.json")]  # fmt: skip
    proc = serve([str(HERE / "serve_check.py"), *options, str(out)], env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@cache
def served(models: Path, name: str) -> dict:
    """`check` (fp32) once a session: the tests that compare with it share one run."""
    return check(models, name)


def capacity(model_dir: Path, kv_cache_dtype: str = "auto", env: dict[str, str] | None = None) -> int:
    """vLLM's KV capacity (tokens) of the model in `model_dir` with serve_check.py's engine (max_model_len 316, or the
    model's own maximum where smaller)."""
    proc = serve([str(HERE / "serve_check.py"), "--kv-cache-dtype", kv_cache_dtype, "--capacity", str(model_dir)], env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return next(json.loads(l) for l in proc.stdout.splitlines() if l.startswith('{"kv_capacity_tokens"'))["kv_capacity_tokens"]


def assert_exact(result: dict) -> None:
    assert result["tokens_equal"] == result["sequences"] == 40, result["mismatches"]
    assert result["max_abs_delta_logprob"] <= 1e-4
    assert result["cached_prompt_tokens"] > 0  # the second call's repeated prompts and shared prefixes hit the cache


def converted_layers(model_dir: Path) -> tuple[list[str], list[str]]:
    """The shared layers and the layers with low-rank keys of a converted model (its config.json)."""
    config = json.loads((model_dir / "config.json").read_text())
    return sorted(config["lisa_layers"]), sorted(config.get("key_ranks") or {})


@pytest.mark.parametrize("name", TINY)
def test_tiny_family_is_exact(vllm_models, name):
    result = check(vllm_models, name)
    assert_exact(result)
    # every shared layer (llama-own's head matching crosses KV groups) caches its low-rank keys and V; every layer with
    # low-rank keys its key latent and V (a root hands the shared layers above its rebuilt keys)
    shared, latent = converted_layers(vllm_models / name)
    layout = result["kv_layout"]
    assert shared and all(layout[i].startswith("lowrank") for i in shared), layout
    assert latent and all(layout[i].startswith("latent") for i in latent), layout


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_compiled_model_is_exact(vllm_models, name):
    """vLLM's default, compiled (the plugin's LisaModel is compiled as vLLM's own Llama is; its attention ops stay
    opaque): as exact against the remote code as eager."""
    assert_exact(check(vllm_models, name, eager=False))


@pytest.mark.parametrize("name, layout", [("llama", "grouped"), ("llama-own", "own")])
def test_concatenated_feature_layouts_are_exact(vllm_models, name, layout):
    """HFCOMPRESS_VLLM_KV=concat (what the plugin serves where the root's cache layout is not readable: GPU backends):
    a group's one cache (grouped head matching) or a shared layer's own wider cache."""
    result = check(vllm_models, name, env={"HFCOMPRESS_VLLM_KV": "concat"})
    assert_exact(result)
    assert layout in json.dumps(result["kv_layout"]), result["kv_layout"]


@pytest.mark.slow
def test_smollm2_is_exact_and_caches_no_more_than_the_original(vllm_models):
    result = check(vllm_models, "smollm2")
    assert_exact(result)
    layout = result["kv_layout"]
    assert layout["23"] == "dropped" and all(layout[str(i)].startswith("lowrank") for i in (5, 6, 12, 13))
    assert result["kv_capacity_tokens"] > capacity(vllm_models / "smollm2-original")


def fp8_supported() -> bool:
    from hfcompress_vllm.lowrank import root_cache_readable

    return root_cache_readable(torch.float32, 32, 64, "fp8")


needs_fp8 = pytest.mark.skipif(not fp8_supported(), reason="vLLM's CPU backend has fp8 KV caches on x86 with AVX-512 only")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", pytest.param("fp8", marks=needs_fp8)])
def test_key_latents_are_cached_and_hold_more_tokens(vllm_models, kv_cache_dtype):
    """A layer with low-rank keys caches its key latent (KV x ceil(r / KV) values a token) and V: vLLM fits more tokens
    than with the rebuilt keys cached at full width (HFCOMPRESS_VLLM_KEYS=full), by the ratio of the per-token cache
    sizes (llama-wide, head_dim 32, unpadded: its root 0 has a latent of rank 48, its shared layers 1-2 cache low-rank
    keys 2 x 8 and V, layer 3 none: 2 x (24 + 32) + 2 x 2 x (8 + 32) = 272 values a token against 2 x 64 + 160 = 288)."""
    build_references(vllm_models, ["llama-wide"])
    model = vllm_models / "llama-wide"
    config = json.loads((model / "config.json").read_text())
    assert config["key_ranks"] == {"0": 48}
    latent = capacity(model, kv_cache_dtype)
    full = capacity(model, kv_cache_dtype, env={"HFCOMPRESS_VLLM_KEYS": "full"})
    assert latent / full == pytest.approx(288 / 272, rel=0.01), (latent, full)


def test_value_latents_are_cached_exactly_and_hold_more_tokens(vllm_models):
    """A tiny Mistral (a window of 6 in every layer, head_dim 24, 2 KV heads) with value latents of rank 25 (2 x 13
    cached, one zero pad): layer 0 with a key latent too, layer 1 alone on the root of shared layer 2 (its V
    FASC-factorised: it hands its rotated keys), layer 3 alone. Served at fp32, exact against the remote code (40/40
    greedy tokens), and so with full-width keys and values (HFCOMPRESS_VLLM_KEYS=full: A B v cached); the latents fit
    more tokens, by the ratio of the per-token cache sizes: 2 x (18 + 13) + 2 x (24 + 13) + 2 x (8 + 24) + 2 x (24 +
    13) = 274 values against 3 x 2 x 2 x 32 (head size 24 padded to the CPU backend's 32) + 64 = 448."""
    result = check(vllm_models, "mistral-values")
    assert_exact(result)
    layout = result["kv_layout"]
    assert layout["0"] == "latent (keys rank 36: 2 x 18, values rank 25: 2 x 13)", layout
    assert layout["1"] == "latent (keys 2 x 24 (handed to the shared layers above), values rank 25: 2 x 13)", layout
    assert layout["2"].startswith("lowrank (root 1") and layout["3"] == "latent (keys 2 x 24, values rank 25: 2 x 13)"
    # the same model with its keys and values rebuilt and cached at full width: exact too, and fewer tokens
    full = check(vllm_models, "mistral-values", env={"HFCOMPRESS_VLLM_KEYS": "full"})
    assert_exact(full)
    assert full["kv_layout"]["1"] == "plain (value latent 25 rebuilt to full-width values)", full["kv_layout"]
    ratio = result["kv_capacity_tokens"] / full["kv_capacity_tokens"]
    assert ratio == pytest.approx(448 / 274, rel=0.01), (result["kv_capacity_tokens"], full["kv_capacity_tokens"])


def written_and_read(isa: str, dtype: torch.dtype, kv_cache_dtype: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """48 random keys (2 KV heads of 64) written by vLLM's CPU backend op with `isa` into two blocks out of order, one
    partly filled, of a `dtype` cache (fp8 bytes where `kv_cache_dtype` says so), and the same keys read back by
    `root_key_blocks` in that ISA's layout + `dequantize`: (keys, read), fp32."""
    import vllm._custom_ops as ops

    from hfcompress_vllm.lowrank import FP8_FORMATS, ROOT_LAYOUTS, dequantize, root_key_blocks

    fp8 = FP8_FORMATS.get(kv_cache_dtype)
    blocks, kv, block, d = 4, 2, 32, 64
    cache = torch.zeros(blocks, kv, block, 2 * d, dtype=dtype if fp8 is None else torch.uint8)
    key_cache, value_cache = cache.view(blocks, kv, 2 * block, d).chunk(2, dim=2)
    torch.manual_seed(0)
    keys = (torch.randn(48, kv, d) * 3).to(dtype)
    slots = torch.cat([torch.arange(3 * block, 4 * block), torch.arange(block, block + 16)])  # block 3, half of block 1
    ops.cpu_attn_reshape_and_cache(keys, torch.randn(48, kv, d).to(dtype), key_cache, value_cache, slots, isa,
                                   k_scale=scale, v_scale=1.0, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    read = dequantize(root_key_blocks(cache, torch.tensor([[3, 1]]), d, ROOT_LAYOUTS[isa]), scale, fp8, torch.float32)
    return keys.float(), read[0].permute(0, 3, 1, 2).reshape(2 * block, kv, d)[:48]  # read: (1, 2, KV, d, block)


def fp8_steps(fp8: torch.dtype) -> tuple[float, float]:
    """The relative spacing of the format's normal values, and its smallest normal (below it, subnormals: an absolute
    step)."""
    return 2.0 ** -(3 if fp8 == torch.float8_e4m3fn else 2), torch.finfo(fp8).smallest_normal


@needs_fp8
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_root_keys_are_read_where_the_cpu_backend_writes_fp8(kv_cache_dtype):
    """Keys written by vLLM's CPU backend op into an fp8 cache (a non-unit scale, two blocks out of order, one partly
    filled) and read back by `root_key_blocks` + `dequantize` are the keys, within the format's rounding step; a shared
    layer's own `quantize` round-trips within half a step and saturates instead of overflowing."""
    from hfcompress_vllm.lowrank import FP8_FORMATS, dequantize, quantize

    fp8 = FP8_FORMATS[kv_cache_dtype]
    step, tiny = fp8_steps(fp8)
    scale = 0.37
    keys, read = written_and_read("vec", torch.float32, kv_cache_dtype, scale)
    assert ((read - keys).abs() <= (keys.abs() * step).clamp_min(tiny * scale)).all()
    assert (read - keys).abs().max() > 0  # stored in fp8, not as the model's dtype

    x = torch.cat([keys.flatten(), torch.tensor([1e9, -1e9])])
    back = dequantize(quantize(x, scale, fp8), scale, fp8, torch.float32)
    assert ((back[:-2] - x[:-2]).abs() <= (x[:-2].abs() * step / 2).clamp_min(tiny * scale / 2)).all()
    assert torch.equal(back[-2:], torch.tensor([1.0, -1.0]) * torch.finfo(fp8).max * scale)


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="vLLM's CPU backend packs keys for AMX only where AMX runs")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_root_keys_are_read_where_the_amx_backend_writes_them(kv_cache_dtype):
    """bf16 on a CPU with AMX tiles: keys written by vLLM's own op with the "amx" ISA (packed in tiles of 16 positions,
    features in pairs; fp8 bytes the same way) into two blocks out of order, one partly filled, are read back by
    `root_key_blocks(..., "amx")` exactly in bf16, within the format's rounding step in fp8."""
    from hfcompress_vllm.lowrank import FP8_FORMATS, root_cache_readable

    assert root_cache_readable(torch.bfloat16, 32, 64, kv_cache_dtype)
    keys, read = written_and_read("amx", torch.bfloat16, kv_cache_dtype, 1.0)
    fp8 = FP8_FORMATS.get(kv_cache_dtype)
    if fp8 is None:
        assert torch.equal(read, keys)
    else:
        step, tiny = fp8_steps(fp8)
        assert ((read - keys).abs() <= (keys.abs() * step).clamp_min(tiny)).all()
        assert (read - keys).abs().max() > 0


# how much further off than the original's the converted model's log-probs may be (mean, max |delta|): measured with
# fp8 0.72x / 1.03x, with fp8_e5m2 1.45x / 1.07x (the root's keys, rebuilt from its fp8 key latent, are read by three
# layers of the converted model; its shared layers' own keys and V add their rounding; before the root had a key
# latent: 0.91x / 1.26x and 1.57x / 1.43x)
FP8_BOUNDS = {"fp8": (1.5, 2.0), "fp8_e5m2": (2.0, 2.0)}


@needs_fp8
@pytest.mark.parametrize("kv_cache_dtype", sorted(FP8_BOUNDS))
def test_fp8_kv_cache_is_as_close_as_the_originals_and_holds_more(vllm_models, kv_cache_dtype):
    """A converted Llama (head_dim 32, a chain of shared layers in the lowrank layout on a root with a key latent, a
    dropped attention) served with an fp8 KV cache against the remote code's fp32 reference, and its original served by
    stock vLLM with the same cache against transformers' fp32 reference: the converted model's log-probs are about as close (FP8_BOUNDS), its greedy
    tokens near as often equal (tiny random models have near-tied logits: 32 vs 28 of 40 with fp8, 22 vs 19 with
    e5m2), and vLLM fits more of its tokens in the same cache space than the original's, 4x its own fp32 capacity
    (served exact in fp32)."""
    converted = check(vllm_models, "llama-wide", kv_cache_dtype=kv_cache_dtype)
    original = check(vllm_models, "llama-wide-original", kv_cache_dtype=kv_cache_dtype)
    fp32 = served(vllm_models, "llama-wide")
    assert_exact(fp32)
    layout = converted["kv_layout"]
    assert all(layout[i].startswith("lowrank") for i in ("1", "2")) and layout["0"].startswith("latent"), layout
    mean_bound, max_bound = FP8_BOUNDS[kv_cache_dtype]
    assert converted["mean_abs_delta_logprob"] <= mean_bound * original["mean_abs_delta_logprob"]
    assert converted["max_abs_delta_logprob"] <= max_bound * original["max_abs_delta_logprob"]
    assert converted["tokens_equal"] >= original["tokens_equal"] - 8
    assert converted["cached_prompt_tokens"] > 0
    assert converted["kv_capacity_tokens"] > original["kv_capacity_tokens"]
    assert converted["kv_capacity_tokens"] / fp32["kv_capacity_tokens"] == pytest.approx(4, rel=0.02)


def test_bf16_is_as_close_as_the_originals(vllm_models):
    """bf16 (the model's dtype and its KV cache): a converted Llama (head_dim 32, a chain of two shared layers, a dropped
    attention) served with the plugin against the remote code's fp32 reference, and its original served by stock
    vLLM's Llama at bf16 against transformers' fp32 reference, on the same prompts: the converted model's log-probs are
    about as close (mean |delta| <= 1.5x the original's, max <= 2x; measured 1.05x / 1.22x: 0.0020 / 0.0076 vs
    0.0019 / 0.0062, the root with a key latent), its greedy tokens near as often equal (tiny random models have
    near-tied logits: 34 vs 34 of 40). Where vLLM's CPU backend picks a bf16 ISA whose cache lowrank.py reads ("vec", or "amx" on CPUs with AMX
    tiles) the shared layers serve in the lowrank layout (elsewhere the concatenated-feature one, grouped here), and
    the converted model fits
    more tokens in the same cache space than the original (1.88x: 272 vs 512 cached features a token)."""
    from hfcompress_vllm.lowrank import root_cache_readable

    converted = check(vllm_models, "llama-wide", dtype="bfloat16")
    original = check(vllm_models, "llama-wide-original", dtype="bfloat16")
    layout = "lowrank" if root_cache_readable(torch.bfloat16, 32, 32) else "grouped"
    shared = [converted["kv_layout"][str(i)] for i in (1, 2)]  # llama-wide's shared layers (the grouped layout names
    # its root's too)
    assert all(v.startswith(layout) for v in shared), converted["kv_layout"]
    assert converted["mean_abs_delta_logprob"] <= 1.5 * original["mean_abs_delta_logprob"]
    assert converted["max_abs_delta_logprob"] <= 2.0 * original["max_abs_delta_logprob"]
    assert converted["tokens_equal"] >= original["tokens_equal"] - 8
    assert converted["cached_prompt_tokens"] > 0
    assert converted["kv_capacity_tokens"] > original["kv_capacity_tokens"]


def refusal(models: Path, edit, tmp_path: Path) -> str:
    build_references(models, TINY)
    bad = tmp_path / "bad"
    shutil.copytree(models / "llama", bad)
    config = json.loads((bad / "config.json").read_text())
    edit(config)
    (bad / "config.json").write_text(json.dumps(config))
    proc = serve([str(HERE / "serve_check.py"), "--capacity", str(bad)], timeout=300)
    assert proc.returncode != 0
    assert "KV cache size" not in proc.stderr + proc.stdout  # refused before the engine allocates its cache
    return proc.stderr


def test_dense_align_is_refused_at_load(vllm_models, tmp_path):
    def dense(config):
        config["lisa_layers"]["1"]["align"] = "dense"

    err = refusal(vllm_models, dense, tmp_path)
    assert "config.json: lisa_layers [1] use dense Align" in err and "--lisa-align sparse" in err


def test_unknown_layer_kind_is_refused_at_load(vllm_models, tmp_path):
    def future(config):
        config["lisa_layers"]["2"]["mixer"] = "ssm"

    err = refusal(vllm_models, future, tmp_path)
    assert "config.json: lisa_layers {'2': ['mixer']}" in err and "does not know" in err


def test_a_model_without_its_cache_layout_in_config_json_is_refused_at_load(vllm_models, tmp_path):
    def older(config):
        for spec in config["lisa_layers"].values():
            del spec["source"]

    err = refusal(vllm_models, older, tmp_path)
    assert "config.json: lisa_layers [1, 2] state no `source`" in err and "convert it again" in err


def test_eval_through_vllm_gives_the_transformers_perplexity(vllm_models, tmp_path):
    """`hfcompress eval DIR --engine vllm` (the served model's prompt log-probs, from this environment) gives the held-out
    perplexity of the transformers path, on both texts, within 0.5% (measured: 4e-7 relative on SmolLM2)."""
    import subprocess
    import sys

    from helpers_vllm import child_env, main_python

    build_references(vllm_models, TINY)
    results = {}
    for engine in ("transformers", "vllm"):
        out = tmp_path / f"{engine}.json"
        proc = subprocess.run(
            [main_python(), "-m", "hfcompress.cli", "eval", str(vllm_models / "qwen3"), "--trust-remote-code", "--no-speed",
             "--no-probe", "--eval-text", "builtin", "--ood-text", "news", "--eval-tokens", "2048", "--context", "128",
             "--engine", engine, "--json", str(out)],
            capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
            env=dict(child_env(), HFCOMPRESS_VLLM_PYTHON=sys.executable, HFCOMPRESS_CACHE=str(tmp_path / "cache")),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        results[engine] = json.loads(out.read_text())["models"]["model"]
    assert results["vllm"]["engine"] == "vllm"
    for key in ("perplexity", "other_domain_perplexity"):
        served, reference = results["vllm"][key], results["transformers"][key]
        assert served["tokens"] == reference["tokens"] > 1000
        assert abs(served["perplexity"] / reference["perplexity"] - 1) <= 0.005


def test_a_model_of_another_hfcompress_version_is_refused_at_load(vllm_models, tmp_path):
    """vLLM reads config.json through the plugin's config class (from_dict): a model that another hfcompress version
    converted is refused there, naming the plugin release to install, before the engine allocates anything."""

    def other_version(config):
        config["hfcompress_version"] = "0.0.9"

    err = refusal(vllm_models, other_version, tmp_path)
    assert "config.json: the model was converted by hfcompress 0.0.9" in err and "pip install 'hfcompress-vllm==0.0.9'" in err
