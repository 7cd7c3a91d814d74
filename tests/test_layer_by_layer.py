"""`convert --layer-by-layer` on the tiny random Llama: same result as the in-memory pipeline, resumable per layer,
sharded output that loads, and two data-parallel gloo processes (accelerate launch) equal to one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hfcompress.sequential as sequential
from hfcompress.convert import ConvertOptions, convert
from hfcompress.fasc import FascOptions
from hfcompress.lisa import LisaOptions
from tiny_models import save_tiny_llama

SETTINGS = dict(
    calib_sequences=8, seq_len=64, eval_tokens=512, probe=False, speed=False, max_ppl_increase=1000.0,
    lisa=LisaOptions(share_ratio=0.5, protect_first=1, steps=10), fasc=FascOptions(budget=0.8),
)
CLI_SETTINGS = [
    "--calib-sequences", "8", "--seq-len", "64", "--eval-tokens", "512", "--no-probe", "--no-speed",
    "--max-ppl-increase", "1000", "--share-ratio", "0.5", "--protect-first", "1", "--lisa-steps", "10",
    "--fasc-budget", "0.8", "--max-shard-size", "200KB",
]


def weights(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a converted directory; a FASC pair is compared as its product (the factors' signs are free)."""
    tensors = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            tensors.update({k: handle.get_tensor(k).float() for k in handle.keys()})
    for key in [k for k in tensors if k.endswith("proj_in.weight")]:
        prefix = key.removesuffix("proj_in.weight")
        tensors[prefix + "product"] = tensors.pop(prefix + "proj_out.weight") @ tensors.pop(key)
    return tensors


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("lbl") / "tiny")


@pytest.fixture(scope="module")
def layer_by_layer(tiny, tmp_path_factory) -> tuple[Path, dict, Path]:
    """One uninterrupted single-process layer-by-layer conversion: (output dir, report, cache dir)."""
    root = tmp_path_factory.mktemp("lbl-run")
    options = ConvertOptions(source=str(tiny), out=root / "out", cache_dir=root / "cache", layer_by_layer=True, max_shard_size="200KB", **SETTINGS)
    return root / "out", convert(options, argv=[]), root / "cache"


def test_layer_by_layer_equals_in_memory_and_sharded_output_loads(tiny, layer_by_layer, tmp_path):
    out, report, _ = layer_by_layer
    reference = convert(ConvertOptions(source=str(tiny), out=tmp_path / "in-memory", cache_dir=tmp_path / "cache", **SETTINGS), argv=[])

    assert report["lisa"]["layers"] == reference["lisa"]["layers"] and report["lisa"]["layers"]
    assert [r["rank"] for r in report["fasc"]["layers"]] == [r["rank"] for r in reference["fasc"]["layers"]]
    assert [r["rho"] for r in report["fasc"]["layers"]] == pytest.approx([r["rho"] for r in reference["fasc"]["layers"]], rel=1e-6)
    for model in ("original", "converted"):
        assert report["validation"][model]["perplexity"] == pytest.approx(reference["validation"][model]["perplexity"], rel=1e-4)
    assert max_difference(weights(out), weights(tmp_path / "in-memory")) < 1e-3
    assert report["parameters"] == reference["parameters"]

    index = json.loads((out / "model.safetensors.index.json").read_text())
    groups = {}  # shard -> the layers (or "rest") it holds; a shard over the limit holds a single one
    for key, shard in index["weight_map"].items():
        groups.setdefault(shard, set()).add(key.split(".")[2] if key.startswith("model.layers.") else "rest")
    assert len(groups) > 1
    assert all((out / shard).stat().st_size <= 200_000 or len(held) == 1 for shard, held in groups.items())
    # the pipeline reloaded the sharded directory in a fresh process with AutoModelForCausalLM(trust_remote_code=True)
    assert report["validation"]["reload"]["mode"] == "logits"
    assert report["validation"]["reload"]["class"] == "LisaLlamaForCausalLM"
    assert report["validation"]["reload"]["max_abs_logit_diff"] <= 1e-4
    assert report["memory"]["peak_rss_mb"] > 0
    assert not list(out.parent.glob(".out.partial-*"))


def test_interrupted_run_resumes_at_the_next_layer(tiny, layer_by_layer, tmp_path, monkeypatch):
    reference_out, _, _ = layer_by_layer
    options = ConvertOptions(source=str(tiny), out=tmp_path / "out", cache_dir=tmp_path / "cache", layer_by_layer=True, max_shard_size="200KB", **SETTINGS)
    evaluated = []
    real_evaluate = sequential._evaluate_layer

    def crash_at_layer_2(*args, **kwargs):
        if len(evaluated) == 2:
            raise KeyboardInterrupt
        evaluated.append(True)
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(sequential, "_evaluate_layer", crash_at_layer_2)
    with pytest.raises(KeyboardInterrupt):
        convert(options, argv=[])
    assert not options.out.exists()

    loaded, fitted = [], []
    real_state, real_fit = sequential.Stream.original_state, sequential.fit_shared_layer
    monkeypatch.setattr(sequential, "_evaluate_layer", real_evaluate)
    monkeypatch.setattr(sequential.Stream, "original_state", lambda self, idx: loaded.append(idx) or real_state(self, idx))
    monkeypatch.setattr(sequential, "fit_shared_layer", lambda model, idx, *a: fitted.append(idx) or real_fit(model, idx, *a))
    convert(options, argv=[])

    assert loaded == [2, 3]  # calibration and statistics come from the cache; conversion restarts at layer 2
    assert set(fitted) <= {2, 3}
    assert max_difference(weights(options.out), weights(reference_out)) < 1e-6


def test_two_gloo_processes_equal_one(tiny, layer_by_layer, tmp_path):
    reference_out, reference, _ = layer_by_layer
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hfcompress.cli",
        "convert", str(tiny), "--out", str(tmp_path / "out"), "--layer-by-layer", *CLI_SETTINGS,
    ]
    env = dict(os.environ, HFCOMPRESS_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    report = json.loads((tmp_path / "out" / "hfcompress_report.json").read_text())
    assert report["mode"]["processes"] == 2
    assert report["lisa"]["layers"] == reference["lisa"]["layers"]
    assert [r["rank"] for r in report["fasc"]["layers"]] == [r["rank"] for r in reference["fasc"]["layers"]]
    assert report["validation"]["converted"]["perplexity"] == pytest.approx(reference["validation"]["converted"]["perplexity"], rel=1e-4)
    assert max_difference(weights(tmp_path / "out"), weights(reference_out)) < 1e-4
    assert sorted(p.name for p in (tmp_path / "cache").rglob("process*-of-2"))  # each process kept its own shard


def test_gguf_source_is_refused_with_one_sentence(tmp_path):
    from hfcompress.errors import HfcompressError

    with pytest.raises(HfcompressError, match="GGUF"):
        convert(ConvertOptions(source="smollm2-135m-instruct", out=tmp_path / "out", layer_by_layer=True), argv=[])


def test_multi_process_needs_layer_by_layer(tiny, tmp_path, monkeypatch):
    from hfcompress.errors import HfcompressError

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(HfcompressError, match="--layer-by-layer"):
        convert(ConvertOptions(source=str(tiny), out=tmp_path / "out"), argv=[])
