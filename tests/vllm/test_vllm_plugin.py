"""The hfcompress vLLM plugin (hfcompress/vllm_plugin) against the remote code (issue 27). Runs in .venv-vllm only.

- Exact: fp32 greedy tokens equal to the remote code's and max |delta log-prob| <= 1e-4 on 32 prompts of mixed lengths
  (served twice: 40 sequences), with chunked prefill (a 64-token budget: long prompts prefilled in chunks), prefix
  caching (hits counted) and 16 concurrent sequences; on a tiny checkpoint of each family (shared layers, a chain, FASC
  linears, a dropped attention) and, in the slow tier, on SmolLM2-135M with 8 shared layers.
- KV cache: a shared layer caches its low-rank keys and V (the "lowrank" layout, reading the root's K from the root's
  cache); SmolLM2 converted holds more tokens than the original in the same VLLM_CPU_KVCACHE_SPACE, as vLLM computes
  them. The concatenated-feature layouts (grouped, own; HFCOMPRESS_VLLM_KV=concat, where the root's cache is not
  readable) stay exact.
- Refusals: a dense-Align model and an unknown layer kind are refused while vLLM reads config.json, with one sentence
  naming the file and the option, before any KV cache is allocated.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

# a submodule: tests/ is on sys.path (tests/conftest.py), where this folder alone would import as a namespace "vllm"
pytest.importorskip("vllm.entrypoints.llm")

from helpers_vllm import HERE, build_references, serve  # noqa: E402

TINY = ["llama", "llama-own", "mistral", "qwen2", "qwen3", "gemma3"]


def check(models: Path, name: str, env: dict[str, str] | None = None) -> dict:
    build_references(models, TINY if name in TINY else [name])
    out = models / f"{name}{''.join('.' + v for v in (env or {}).values())}.result.json"
    proc = serve([str(HERE / "serve_check.py"), str(models / name), str(models / f"{name}.json"), str(out)], env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def assert_exact(result: dict) -> None:
    assert result["tokens_equal"] == result["sequences"] == 40, result["mismatches"]
    assert result["max_abs_delta_logprob"] <= 1e-4
    assert result["cached_prompt_tokens"] > 0  # the second call's repeated prompts and shared prefixes hit the cache


@pytest.mark.parametrize("name", TINY)
def test_tiny_family_is_exact(vllm_models, name):
    result = check(vllm_models, name)
    assert_exact(result)
    # every shared layer (llama-own's head matching crosses KV groups) caches its low-rank keys and V
    shared = [v for v in result["kv_layout"].values() if v not in ("plain", "dropped")]
    assert shared and all(v.startswith("lowrank") for v in shared), result["kv_layout"]


@pytest.mark.parametrize("name, layout", [("llama", "grouped"), ("llama-own", "own")])
def test_concatenated_feature_layouts_are_exact(vllm_models, name, layout):
    """HFCOMPRESS_VLLM_KV=concat (what the plugin serves where the root's cache layout is not readable: GPU backends,
    AMX): a group's one cache (grouped head matching) or a shared layer's own wider cache."""
    result = check(vllm_models, name, env={"HFCOMPRESS_VLLM_KV": "concat"})
    assert_exact(result)
    assert layout in json.dumps(result["kv_layout"]), result["kv_layout"]


@pytest.mark.slow
def test_smollm2_is_exact_and_caches_no_more_than_the_original(vllm_models):
    result = check(vllm_models, "smollm2")
    assert_exact(result)
    layout = result["kv_layout"]
    assert layout["23"] == "dropped" and all(layout[str(i)].startswith("lowrank") for i in (5, 6, 12, 13))
    original = serve([str(HERE / "serve_check.py"), "--capacity", str(vllm_models / "smollm2-original")])
    assert original.returncode == 0, original.stderr[-4000:]
    capacity = next(json.loads(l) for l in original.stdout.splitlines() if l.startswith('{"kv_capacity_tokens"'))["kv_capacity_tokens"]
    assert result["kv_capacity_tokens"] > capacity


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
