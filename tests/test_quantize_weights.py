"""torchao int8 weight-only on a converted model (quantize.py, `convert --quantize-weights`): every decoder linear,
FASC factors included, and a written output that loads quantized with plain from_pretrained."""

import importlib.util
import json

import pytest
import torch
from typer.testing import CliRunner

from hfcompress.cli import app
from hfcompress.serving.quantize import TORCHAO_PIN, quantize_written, reloaded_logits
from test_quantized_cache import save_remote, tiny_pair

FASC = {"1.mlp.down_proj": 48, "1.self_attn.o_proj": 40, "3.mlp.up_proj": 32}


def test_int8_weights_quantize_every_decoder_linear_and_reload_with_plain_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    _, model = tiny_pair(fasc_ranks=FASC)
    save_remote(model, tmp_path)
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        before = model(ids).logits
    size_before = (tmp_path / "model.safetensors").stat().st_size
    quantize_written(tmp_path, "int8")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "torchao" and config["lisa_layers"] and config["fasc_ranks"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    kinds = {name: type(p).__name__ for name, p in loaded.named_parameters() if name.endswith("weight")}
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name.startswith("model.layers")}
    assert {f"model.layers.1.mlp.down_proj.{part}" for part in ("proj_in", "proj_out")} <= linears  # FASC factors
    assert "model.layers.2.self_attn.k_lowrank" in linears
    dense_align = {name for name in linears if ".align." in name}  # read as matrices, not called: kept float
    assert dense_align == {"model.layers.3.self_attn.align.ffn_in", "model.layers.3.self_attn.align.ffn_out"}
    assert all(kinds[f"{name}.weight"] == ("Parameter" if name in dense_align else "Int8Tensor") for name in linears)
    assert kinds["model.embed_tokens.weight"] == "Parameter"  # transformers leaves the embedding and the head
    with torch.no_grad():
        after = loaded(ids).logits
    assert (after - before).norm() < 0.05 * before.norm()  # one scale per row: a small rounding error
    assert torch.equal(reloaded_logits(tmp_path, ids), after)
    assert (tmp_path / "model.safetensors").stat().st_size < 0.45 * size_before


runner = CliRunner()


@pytest.mark.parametrize("scheme,message", [
    ("int4", "int4 needs torchao's CUDA-only int4 kernels"),
    ("int3", "Unknown --quantize-weights 'int3': choose one of none, int8, int4"),
])  # fmt: skip
def test_convert_refuses_a_weight_scheme_it_cannot_serve_before_any_work(tmp_path, scheme, message):
    result = runner.invoke(app, ["convert", "smollm2-135m-instruct", "--out", str(tmp_path / "out"), "--quantize-weights", scheme])
    assert result.exit_code == 2 and message in result.output and not (tmp_path / "out").exists()


def test_convert_names_torchao_when_it_is_missing(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    result = runner.invoke(app, ["convert", "smollm2-135m-instruct", "--out", str(tmp_path / "out"), "--quantize-weights", "int8"])
    assert result.exit_code == 2 and f"pip install {TORCHAO_PIN}" in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()
