"""The hfcompress vLLM plugin (hfcompress/vllm_plugin) against the remote code (issue 27). Runs in .venv-vllm only.

- Exact: fp32 greedy tokens equal to the remote code's and max |delta log-prob| <= 1e-4 on 32 prompts of mixed lengths
  (served twice: 40 sequences), with chunked prefill (a 64-token budget: long prompts prefilled in chunks), prefix
  caching (hits counted) and 16 concurrent sequences; on a tiny checkpoint of each family (shared layers, a chain, FASC
  linears, a dropped attention) and, in the slow tier, on SmolLM2-135M with 8 shared layers.
- KV cache: SmolLM2 converted (grouped layout) holds at least as many tokens as the original in the same
  VLLM_CPU_KVCACHE_SPACE, as vLLM computes them.
- Refusals: a dense-Align model and an unknown layer kind are refused while vLLM reads config.json, with one sentence
  naming the file and the option, before any KV cache is allocated.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from helpers_vllm import HERE, build_references, serve  # noqa: E402

TINY = ["llama", "llama-own", "mistral", "qwen2", "qwen3", "gemma3"]


def check(models: Path, name: str) -> dict:
    build_references(models, TINY if name in TINY else [name])
    out = models / f"{name}.result.json"
    proc = serve([str(HERE / "serve_check.py"), str(models / name), str(models / f"{name}.json"), str(out)])
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
    # llama-own's head matching crosses KV groups: a shared layer's own cache; the others one cache per group
    assert ("own" in json.dumps(result["kv_layout"])) == (name == "llama-own"), result["kv_layout"]


@pytest.mark.slow
def test_smollm2_is_exact_and_caches_no_more_than_the_original(vllm_models):
    result = check(vllm_models, "smollm2")
    assert_exact(result)
    layout = result["kv_layout"]
    assert layout["23"] == "dropped" and all("grouped" in layout[str(i)] for i in (4, 5, 6, 11, 12, 13))
    original = serve([str(HERE / "serve_check.py"), "--capacity", str(vllm_models / "smollm2-original")])
    assert original.returncode == 0, original.stderr[-4000:]
    capacity = json.loads(original.stdout.strip().splitlines()[-1])["kv_capacity_tokens"]
    assert result["kv_capacity_tokens"] >= capacity


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
