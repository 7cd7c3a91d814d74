"""`hfcompress eval --kv-cache-dtype` (vLLM's KV cache dtype, passed to the engine): refused without --engine vllm, with
one sentence, before any model loads. The served perplexity with an fp8 cache is measured in .venv-vllm (docs/serving-vllm.md)."""

from typer.testing import CliRunner

from hfcompress.cli import app
from tests.helpers import one_error


def test_kv_cache_dtype_needs_the_vllm_engine(tmp_path, monkeypatch):
    import hfcompress.evidence.evaluate

    def never(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(hfcompress.evidence.evaluate, "load_converted", never)
    result = CliRunner().invoke(app, ["eval", str(tmp_path), "--kv-cache-dtype", "fp8", "--no-speed", "--no-probe"])
    one_error(result, 2, "--kv-cache-dtype fp8 sets vLLM's KV cache: use it with --engine vllm.")


def test_kv_cache_dtype_reaches_the_engine(tmp_path, monkeypatch):
    """vllm_perplexities hands the KV cache dtype to the scorer in vLLM's environment (here a stand-in interpreter
    that records the request and returns NLLs of 1)."""
    import json
    import math
    import sys

    import torch

    from hfcompress.serving.vllm_engine import vllm_perplexities

    fake = tmp_path / "python"
    fake.write_text(
        f"#!{sys.executable}\nimport json, shutil, sys\n"  # argv: -m hfcompress_vllm.score MODEL WINDOWS OUT
        f"shutil.copy(sys.argv[4], {str(tmp_path / 'request.json')!r})\n"
        "windows = json.load(open(sys.argv[4]))['windows']\n"
        "json.dump({'nll': [[1.0] * (len(w) - 1) for w in windows]}, open(sys.argv[5], 'w'))\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("HFCOMPRESS_VLLM_PYTHON", str(fake))
    result = vllm_perplexities(str(tmp_path), [torch.arange(40)], 16, None, None, [1], kv_cache_dtype="fp8_e5m2")
    assert json.loads((tmp_path / "request.json").read_text())["kv_cache_dtype"] == "fp8_e5m2"
    assert result[0].perplexity == math.e
