"""`hfcompress convert` end to end on a tiny random Llama, through a real local Hub server."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from typer.testing import CliRunner

from hfcompress.cli import app
from hfcompress.sources.text import numpy_docs_name
from tests.conftest import HUB_USER

FAST = [
    "--no-peers",  # the peers have their own tests (test_layer_plan.py)
    "--distill-tokens", "0",  # the distillation stage has its own tests (test_distill.py, and one below)
    "--calib-sequences", "6", "--seq-len", "64", "--eval-tokens", "512", "--lisa-steps", "10",
    "--protect-first", "1", "--fasc-budget", "0.8",
]
# for conversions that assert nothing about the texts: the 465 kB built-in text alone, no other-domain text
# (tokenising the 4.3 MB offline mixture costs more than the tiny model's conversion; test_text_sources.py tests it)
BUILTIN_TEXTS = ["--calib-text", "builtin", "--eval-text", "builtin", "--ood-text", "none"]
runner = CliRunner()

LOAD_AND_SCORE = r"""
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()
ids = torch.arange(3, 40).unsqueeze(0)
with torch.no_grad():
    torch.save(model(ids).logits, sys.argv[2])
print(type(model).__name__)
"""


def load_and_score(name_or_dir: str, out: Path, env: dict) -> torch.Tensor:
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_SCORE, name_or_dir, str(out)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "LisaLlamaForCausalLM"
    return torch.load(out)


def no_partial_dirs(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".partial-" in p.name]


@pytest.mark.slow  # a convert + push + two fresh-process loads: ~50 s on 2 cores
def test_hub_round_trip(tiny_llama_dir, hub_api, hub_env, local_hub, tmp_path):
    source_repo, target_repo = f"{HUB_USER}/tiny", f"{HUB_USER}/tiny-lisa"
    hub_api.create_repo(source_repo)
    source_commit = hub_api.upload_folder(folder_path=str(tiny_llama_dir), repo_id=source_repo).oid
    out = tmp_path / "out"
    env = {**hub_env, "HFCOMPRESS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "hfcompress.cli", "convert", source_repo, "--out", str(out), "--push-to", target_repo,
         "--max-ppl-increase", "1000", "--share-ratio", "0.25", *FAST],
        env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    report = json.loads((out / "hfcompress_report.json").read_text())
    assert report["source"]["commit_sha"] == source_commit
    assert report["lisa"]["layers"] and report["validation"]["gate_passed"]
    assert report["validation"]["reload"]["max_abs_logit_diff"] <= 1e-4
    assert any(layer["rank"] for layer in report["fasc"]["layers"])
    assert "hf_dummy_test_token" not in (out / "hfcompress_report.json").read_text()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "lisa_llama" and config["auto_map"]["AutoModelForCausalLM"]
    card = (out / "README.md").read_text()
    for needle in ("hfcompress", "custom_code", "perplexity", "trust_remote_code=True", target_repo,
                   f"base_model: {source_repo}", "base_model_relation: finetune"):
        assert needle in card
    assert not ModelCard(card).data.eval_results  # the built-in and news texts are not Hub datasets (tests/test_card.py)

    remote_files = set(local_hub.files(target_repo, "main"))
    assert {"config.json", "model.safetensors", "modeling_lisa_llama.py", "README.md", "tokenizer.json"} <= remote_files
    pushed = [c for c in local_hub.commits(target_repo) if "hfcompress" in str(c)]
    assert len(pushed) == 1  # one upload commit

    fresh_env = {**env, "HF_HOME": str(tmp_path / "fresh_home")}
    from_hub = load_and_score(target_repo, tmp_path / "hub.pt", fresh_env)
    from_dir = load_and_score(str(out), tmp_path / "dir.pt", fresh_env)
    assert (from_hub - from_dir).abs().max() <= 1e-5


@pytest.mark.slow  # two subprocess conversions and a local Hub: 40-60 s on 2 busy cores
def test_gate_failure_writes_marked_output_and_never_pushes(tiny_llama_dir, hub_env, local_hub, tmp_path):
    out = tmp_path / "out"
    env = {**hub_env, "HFCOMPRESS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "hfcompress.cli", "convert", str(tiny_llama_dir), "--out", str(out),
         "--push-to", f"{HUB_USER}/never", "--max-ppl-increase", "0", "--no-back-off", *FAST],
        env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "Not pushing" in proc.stderr and "--force" in proc.stderr
    assert f"{HUB_USER}/never" not in local_hub.repo_ids()
    assert json.loads((out / "hfcompress_report.json").read_text())["validation"]["gate_passed"] is False
    assert "failed the hfcompress quality gate" in (out / "README.md").read_text()


def run_cli(*args: str):
    return runner.invoke(app, ["convert", *args])


def test_unknown_repo(hub_inprocess, tmp_path):
    result = run_cli(f"{HUB_USER}/does-not-exist", "--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert "was not found" in result.output
    assert not (tmp_path / "o").exists() and no_partial_dirs(tmp_path)


def test_unknown_path(tmp_path):
    result = run_cli("./no/such/model", "--out", str(tmp_path / "o"))
    assert result.exit_code == 2 and "neither an existing path nor a Hub id" in result.output


def test_non_llama_architecture(tiny_llama_dir, tmp_path):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tiny_llama_dir / "config.json").write_text(json.dumps(config))
    result = run_cli(str(tiny_llama_dir), "--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert "'gpt2'" in result.output and "supports only: llama (LlamaForCausalLM)" in result.output
    assert not (tmp_path / "o").exists()


def test_push_without_token_fails_before_work(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(c, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-stored-tokens"))
    result = run_cli(str(tiny_llama_dir), "--out", str(tmp_path / "o"), "--push-to", "me/x")
    assert result.exit_code == 2 and "needs a Hub token" in result.output
    assert not (tmp_path / "o").exists()


def test_existing_output_dir_refused(tiny_llama_dir, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_cli(str(tiny_llama_dir), "--out", str(out))
    assert result.exit_code == 2 and "already exists" in result.output and "--overwrite" in result.output
    assert (out / "keep.txt").read_text() == "mine"


def test_bad_fasc_method(tiny_llama_dir, tmp_path):
    result = run_cli(str(tiny_llama_dir), "--out", str(tmp_path / "o"), "--fasc-method", "magic")
    assert result.exit_code == 2 and "fisher, whiten, svd, pca" in result.output
    result = run_cli(str(tiny_llama_dir), "--out", str(tmp_path / "o"), "--lisa-align", "magic")
    assert result.exit_code == 2 and "dense, sparse" in result.output
    for removed in ("--no-lowrank", "--layer-by-layer"):  # a research ablation, a flag that did nothing
        result = run_cli(str(tiny_llama_dir), "--out", str(tmp_path / "o"), removed)
        assert result.exit_code == 2 and "No such option" in result.output
    assert not (tmp_path / "o").exists()


def test_interrupted_write_leaves_nothing(tmp_path):
    from hfcompress.conversion.atomic import atomic_directory
    from hfcompress.conversion.output import user_entries

    def crash(directory: Path) -> None:
        (directory / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_directory(tmp_path / "o", crash, user_entries)
    assert not (tmp_path / "o").exists() and no_partial_dirs(tmp_path)


@pytest.mark.slow  # convert, eval and analyze of the tiny model: ~70 s on 2 cores
def test_eval_and_analyze_commands(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    converted = run_cli(
        str(tiny_llama_dir), "--out", str(out), "--max-ppl-increase", "1000", "--no-probe", *FAST, "--distill-tokens", "192",
        "--distill-seq-len", "32", "--distill-lora-rank", "2"
    )
    assert converted.exit_code == 0, converted.output
    result_path = tmp_path / "eval.json"
    result = runner.invoke(
        app, ["eval", str(out), "--baseline", str(tiny_llama_dir), "--eval-tokens", "512", "--json", str(result_path)]
    )
    assert result.exit_code == 0, result.output
    measured = json.loads(result_path.read_text())
    report = json.loads((out / "hfcompress_report.json").read_text())
    distill = report["finishers"]["distillation"]  # LoRA merged: the reload check inside convert passed
    assert distill["steps"] == 6 and [p["tokens"] for p in distill["perplexity"]] == [0, 192]
    assert (out / "plots" / "distillation.png").is_file() and "Distillation" in (out / "README.md").read_text()
    # same tokens, same windows: eval reproduces the perplexities convert recorded
    assert measured["models"]["baseline"]["perplexity"]["perplexity"] == pytest.approx(
        report["validation"]["original"]["perplexity"], rel=1e-4
    )
    assert measured["models"]["model"]["perplexity"]["perplexity"] == pytest.approx(
        report["validation"]["converted"]["perplexity"], rel=1e-4
    )
    # the other-domain text (the third domain, in no calibration text): gated in convert, reproduced by eval
    assert [row["eval_text"] for row in report["validation"]["texts"]][1] == measured["other_domain_text"] == numpy_docs_name()
    assert measured["models"]["model"]["other_domain_perplexity"]["perplexity"] == pytest.approx(
        report["validation"]["texts"][1]["converted"]["perplexity"], rel=1e-4
    )
    for entry in measured["models"].values():
        assert entry["speed"]["decode_tokens_per_s"] > 0 and entry["probe"]["total"] >= 50

    from transformers import AutoModelForCausalLM, pipeline

    generator = pipeline("text-generation", model=str(out), trust_remote_code=True)
    text = generator("The language reference", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("The language reference") and len(text) > len("The language reference")
    ids = torch.arange(3, 30).unsqueeze(0)
    with torch.no_grad():
        fp32 = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)(ids).logits
        bf16 = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.bfloat16)(ids).logits
    assert bf16.dtype == torch.bfloat16 and (bf16.float() - fp32).abs().max() < 0.1 * fp32.abs().max()

    plot = tmp_path / "sim.png"
    analysis = runner.invoke(
        app, ["analyze", str(tiny_llama_dir), "--plot", str(plot), "--calib-sequences", "6", "--seq-len", "64",
              "--protect-first", "1", "--json", str(tmp_path / "a.json")]
    )
    assert analysis.exit_code == 0, analysis.output
    assert plot.stat().st_size > 1000
    rows = json.loads((tmp_path / "a.json").read_text())["similarity"]
    assert [r["layer"] for r in rows] == [1, 2, 3] and all(0 <= r["js_best_match"] <= r["js_same_head"] + 1e-6 for r in rows)


def test_eval_refuses_foreign_code_without_flag(tmp_path):
    result = runner.invoke(app, ["eval", "someone/model"])
    assert result.exit_code == 2 and "--trust-remote-code" in result.output


def test_output_dir_has_ordinary_permissions(tmp_path):
    import os

    from hfcompress.conversion.atomic import atomic_directory
    from hfcompress.conversion.output import user_entries

    out = atomic_directory(tmp_path / "o", lambda d: (d / "x").write_text("1"), user_entries)
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


def test_push_refuses_incomplete_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    result = runner.invoke(app, ["push", str(tmp_path), "me/x"])
    assert result.exit_code == 2 and "not a finished hfcompress output" in result.output
    assert "it lacks hfcompress_report.json, README.md, *.safetensors weights" in " ".join(result.output.split())


@pytest.mark.slow  # a bfloat16 convert with speed: ~40 s on 2 cores
def test_saved_dtype_speed_record_and_card(tiny_llama_dir, tmp_path):
    """--dtype bfloat16 saves bf16 weights whose reload matches the validated (rounded) model; the speed record
    and its plot reach the report and the card."""
    from safetensors import safe_open

    out = tmp_path / "out"
    result = runner.invoke(
        app, ["convert", str(tiny_llama_dir), "--out", str(out), "--max-ppl-increase", "1000", "--dtype", "bfloat16", *FAST],
        env={"HFCOMPRESS_CACHE": str(tmp_path / "cache")},
    )
    assert result.exit_code == 0, result.output
    with safe_open(out / "model.safetensors", "pt") as weights:
        dtypes = {k: weights.get_tensor(k).dtype for k in weights.keys()}
    assert {d for d in dtypes.values() if d.is_floating_point} == {torch.bfloat16}
    assert {k for k, d in dtypes.items() if not d.is_floating_point} == {k for k in dtypes if k.endswith("align.source")}
    report = json.loads((out / "hfcompress_report.json").read_text())
    assert report["dtype"] == "bfloat16"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert report["validation"]["reload"]["max_abs_logit_diff"] <= 1e-4
    speed = report["speed"]
    assert speed["original"]["prefill_tokens_per_s"] > 0 and speed["converted"]["decode_tokens_per_s"] > 0
    assert speed["decode_speedup"] == pytest.approx(
        speed["converted"]["decode_tokens_per_s"] / speed["original"]["decode_tokens_per_s"]
    )
    assert speed["converted"]["cache_mb"] < speed["original"]["cache_mb"]  # shared layers cache low-rank K
    card = (out / "README.md").read_text()
    assert speed["hardware"] in card and "plots/speed.png" in card and (out / "plots" / "speed.png").is_file()


def test_bad_dtype_refused_before_work(tiny_llama_dir, tmp_path):
    result = runner.invoke(app, ["convert", str(tiny_llama_dir), "--out", str(tmp_path / "out"), "--dtype", "int8"])
    assert result.exit_code == 2 and "Unknown --dtype 'int8'" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags", [["--lisa-align", "sparse"], ["--lisa-lowrank-keys", "group"]]
)
def test_alignment_variants_convert_and_reload(tiny_llama_dir, tmp_path, flags):
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["convert", str(tiny_llama_dir), "--out", str(out), "--max-ppl-increase", "1000", "--no-speed", "--no-probe",
              "--fasc-budget", "1.0", "--share-ratio", "0.5", *FAST[:-2], *BUILTIN_TEXTS, *flags],
        env={"HFCOMPRESS_CACHE": str(tmp_path / "cache")},
    )
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["lisa_layers"] and all(spec["align"] == "sparse" for spec in config["lisa_layers"].values())
    report = json.loads((out / "hfcompress_report.json").read_text())
    assert report["validation"]["reload"]["max_abs_logit_diff"] <= 1e-4
    if "group" in flags:  # one low-rank key per KV group, written into the config the Hub loads
        kv_heads = config["num_key_value_heads"]
        assert all(spec["key_heads"] == kv_heads for spec in config["lisa_layers"].values())
        assert all(f["key_heads"] == kv_heads for f in report["lisa"]["fitted"])
        assert "one low-rank key per KV group" in (out / "README.md").read_text()
    assert all(f["loss_final"] < f["loss_initial"] for f in report["lisa"]["fitted"])


@pytest.mark.slow  # a conversion scoring several candidate plans: 40-60 s on 2 busy cores
def test_lisa_perplexity_budget_search(tiny_llama_dir, tmp_path):
    """A generous budget shares every unprotected layer after about log2(L) searched fits; the search is recorded."""
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["convert", str(tiny_llama_dir), "--out", str(out), "--max-ppl-increase", "1000", "--no-speed", "--no-probe",
              "--fasc-budget", "1.0", "--lisa-ppl-budget", "1000", *FAST[:-2]],
        env={"HFCOMPRESS_CACHE": str(tmp_path / "cache")},
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "hfcompress_report.json").read_text())
    search = report["lisa"]["perplexity_search"]
    candidates = list(range(1, report["num_layers"]))  # --protect-first 1
    assert report["lisa"]["layers"] == candidates
    assert 1 <= len(search["probes"]) <= len(candidates).bit_length()
    assert all(p["perplexity"] <= search["limit"] for p in search["probes"])


def test_cast_parameters_leaves_rope_buffers_alone(tiny_llama_dir):
    """Rounding the weights for a bf16 save must not round the RoPE frequencies: transformers recomputes those in
    float32 at load, so a rounded copy would no longer compute what the saved model computes."""
    from transformers import LlamaForCausalLM

    from hfcompress.conversion.build import cast_parameters

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    weight = model.lm_head.weight.detach().clone()
    cast_parameters(cast_parameters(model, torch.bfloat16), torch.float32)
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)
    assert model.lm_head.weight.dtype == torch.float32
    assert torch.equal(model.lm_head.weight, weight.to(torch.bfloat16).float())
