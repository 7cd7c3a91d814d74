"""The one streamed driver on the tiny random Llama: the same conversion as an in-memory reference computed with the
library's own in-memory functions, resumable per layer, sharded output that loads, two data-parallel gloo processes
equal to one, methods as units, and whole-model steps that are skipped or refused when the model does not fit."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_models import save_tiny_llama

import hfcompress.conversion.pipeline as pipeline
from hfcompress.conversion.checkpoint import Checkpoint
from hfcompress.conversion.config import ConvertOptions, DistillOptions
from hfcompress.errors import HfcompressError
from hfcompress.fasc import FascOptions
from hfcompress.lisa import LisaOptions
from hfcompress.keys import KeyOptions
from hfcompress.conversion.stream import LayerStream
from hfcompress.sources.token_streams import SELECTION_TOKENS

# one small text (the 465 kB built-in one) and no other-domain text: tokenising the 4.3 MB offline mixture cost each
# conversion more than the tiny model's work (test_text_sources.py tests the texts)
TEXTS = dict(calib_text="builtin", eval_text="builtin", ood_text="none")
SETTINGS = dict(
    **TEXTS,
    calib_sequences=8, seq_len=64, eval_tokens=512, probe=False, speed=False, peers=False, max_ppl_increase=1000.0,
    lisa=LisaOptions(share_ratio=0.5, protect_first=1, steps=10), fasc=FascOptions(budget=0.8),
    distill=DistillOptions(tokens=0),  # the distillation stage has its own tests (test_distill.py)
)
CLI_SETTINGS = [
    "--calib-sequences", "8", "--seq-len", "64", "--eval-tokens", "512", "--no-probe", "--no-speed", "--no-peers",
    "--max-ppl-increase", "1000", "--share-ratio", "0.5", "--protect-first", "1", "--lisa-steps", "10",
    "--fasc-budget", "0.8", "--max-shard-size", "200KB", "--distill-tokens", "0",
    *(f"--{key.replace('_', '-')}={value}" for key, value in TEXTS.items()),
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
    return save_tiny_llama(tmp_path_factory.mktemp("pipeline") / "tiny")


@pytest.fixture(scope="module")
def streamed(tiny, tmp_path_factory) -> tuple[Path, dict, Path]:
    """One uninterrupted single-process conversion: (output dir, report, cache dir)."""
    root = tmp_path_factory.mktemp("pipeline-run")
    options = ConvertOptions(source=str(tiny), out=root / "out", cache_dir=root / "cache", max_shard_size="200KB", **SETTINGS)
    return root / "out", pipeline.convert(options, argv=[]).to_dict(), root / "cache"


def in_memory_reference(tiny: Path, report: dict) -> dict:
    """The conversion the old in-memory pipeline computed, from the research area's in-memory driver
    (research/inmemory.py, which the benchmarks use: this keeps it equal to the product): the same layers (chosen from
    its own similarity), the same FASC ranks and the same perplexities."""
    from hfcompress.conversion.calibrate import collect_attention_inputs, collect_linear_stats
    from hfcompress.lisa import select_layers
    from research.inmemory import build_converted_model, compress_linears, fit_lisa, measure_similarity
    from hfcompress.sources.source import load_source, resolve_source
    from hfcompress.sources.text import chunk, text_streams
    from hfcompress.evidence.validate import perplexity

    model, tokenizer = load_source(resolve_source(str(tiny)))
    calib_ids, _, eval_ids, _ = text_streams(tokenizer, TEXTS["calib_text"], TEXTS["eval_text"], 8 * 64 + SELECTION_TOKENS)
    bos = [tokenizer.bos_token_id]  # the tiny tokenizer starts every text with <s>: so does every window
    sequences = torch.cat([torch.tensor(bos).expand(8, 1), chunk(calib_ids, 63, 8)], dim=1)
    inputs = collect_attention_inputs(model, sequences)
    similarity = measure_similarity(model, inputs)
    options = SETTINGS["lisa"]
    chosen = select_layers(similarity, model.config.num_hidden_layers, options)
    fitted = fit_lisa(model, inputs, chosen, similarity, options)
    names = [f"{i}.{t}" for i in range(model.config.num_hidden_layers) for t in SETTINGS["fasc"].targets]
    stats = collect_linear_stats(model, sequences, names)
    factors, results = compress_linears({n: model.model.layers.get_submodule(n) for n in names}, stats, SETTINGS["fasc"])
    converted = build_converted_model(model, fitted, factors)
    return {
        "layers": chosen,
        "ranks": [r.rank for r in results],
        "original": perplexity(model, eval_ids, 512, max_tokens=512, prefix=bos).perplexity,
        "converted": perplexity(converted, eval_ids, 512, max_tokens=512, prefix=bos).perplexity,
    }


def test_streamed_equals_in_memory_reference_and_sharded_output_loads(tiny, streamed):
    out, report, _ = streamed
    reference = in_memory_reference(tiny, report)
    assert report["lisa"]["layers"] == reference["layers"] and report["lisa"]["layers"]
    assert [r["rank"] for r in report["fasc"]["layers"]] == reference["ranks"]
    assert report["validation"]["original"]["perplexity"] == pytest.approx(reference["original"], rel=1e-4)
    # converted: the streamed run validates the weights rounded to their saved dtype (float32 here: none)
    assert report["validation"]["converted"]["perplexity"] == pytest.approx(reference["converted"], rel=1e-3)

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
    assert report["memory"]["peak_rss_mb"] > 0 and report["device"] == "cpu"
    assert not list(out.parent.glob(".out.partial-*"))


@pytest.mark.slow  # an interrupted conversion and its resume: 40-60 s on 2 busy cores
def test_interrupted_run_resumes_at_the_next_layer(tiny, streamed, tmp_path, monkeypatch):
    reference_out, _, _ = streamed
    options = ConvertOptions(source=str(tiny), out=tmp_path / "out", cache_dir=tmp_path / "cache", max_shard_size="200KB", **SETTINGS)
    built = []
    real_build = LayerStream.build

    def crash_at_layer_2_of_the_convert_pass(self, config, idx, state):
        if config.lisa_layers or config.fasc_ranks:  # the convert pass builds converted layers
            built.append(idx)
            if idx == 2:
                raise KeyboardInterrupt
        return real_build(self, config, idx, state)

    monkeypatch.setattr(LayerStream, "build", crash_at_layer_2_of_the_convert_pass)
    with pytest.raises(KeyboardInterrupt):
        pipeline.convert(options, argv=[])
    assert not options.out.exists()

    loaded = []
    real_state = LayerStream.original_state
    monkeypatch.setattr(LayerStream, "build", real_build)
    monkeypatch.setattr(LayerStream, "original_state", lambda self, idx: loaded.append(idx) or real_state(self, idx))
    pipeline.convert(options, argv=[])

    assert loaded == [2, 3]  # calibration and statistics come from the cache; conversion restarts at layer 2
    assert max_difference(weights(options.out), weights(reference_out)) < 1e-6


@pytest.mark.slow  # two processes of torch.distributed: 17 s, the fast tier's longest
def test_two_gloo_processes_equal_one(tiny, streamed, tmp_path):
    reference_out, reference, _ = streamed
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hfcompress.cli",
        "convert", str(tiny), "--out", str(tmp_path / "out"), "--device", "cpu", *CLI_SETTINGS,
    ]
    env = dict(os.environ, HFCOMPRESS_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    report = json.loads((tmp_path / "out" / "hfcompress_report.json").read_text())
    assert report["processes"] == 2
    assert report["lisa"]["layers"] == reference["lisa"]["layers"]
    assert [r["rank"] for r in report["fasc"]["layers"]] == [r["rank"] for r in reference["fasc"]["layers"]]
    assert report["validation"]["converted"]["perplexity"] == pytest.approx(reference["validation"]["converted"]["perplexity"], rel=1e-4)
    assert max_difference(weights(tmp_path / "out"), weights(reference_out)) < 1e-4
    assert sorted(p.name for p in (tmp_path / "cache").rglob("process*-of-2"))  # each process kept its own shard


@pytest.mark.slow  # a conversion scoring several candidate plans: 40-60 s on 2 busy cores
def test_perplexity_budget_search_streams_candidates_and_reuses_fits(tiny, tmp_path, monkeypatch):
    """--lisa-ppl-budget scores each candidate set by streaming it layer by layer; the final conversion reuses the
    fits of the chosen chain instead of fitting again."""
    from hfcompress.lisa import method

    fits = []
    real_fit = method.fit_shared_layer
    monkeypatch.setattr(method, "fit_shared_layer", lambda *a, **k: fits.append(a[3]) or real_fit(*a, **k))
    settings = {**SETTINGS, "lisa": LisaOptions(ppl_budget=1000.0, protect_first=1, steps=5), "fasc": FascOptions()}
    report = pipeline.convert(ConvertOptions(source=str(tiny), out=tmp_path / "out", cache_dir=tmp_path / "cache", **settings), argv=[]).to_dict()
    search = report["lisa"]["perplexity_search"]
    assert report["lisa"]["layers"] == [1, 2, 3]  # a generous budget shares every unprotected layer
    assert 1 <= len(search["probes"]) <= 2 and all(p["within_budget"] for p in search["probes"])
    # every candidate was converted and scored (not the original scored again)
    assert all(p["perplexity"] != pytest.approx(search["original_perplexity"], rel=1e-6) for p in search["probes"])
    # each fit depends on its chain of shared layers below: one fit per chain the search scored, none in the end
    chains = {tuple(layer for layer in p["layers"] if layer <= top) for p in search["probes"] for top in p["layers"]}
    assert len(fits) == len(chains)


def test_whole_model_steps_skip_by_default_and_refuse_when_asked(tiny, tmp_path, monkeypatch):
    """A model that does not fit in memory: default probe/speed/peers are skipped with a note; asked for explicitly, they
    are refused with one sentence before any calibration."""
    from hfcompress.conversion import wholemodel

    monkeypatch.setattr(wholemodel, "available_memory", lambda device: 1000)  # bytes: nothing fits
    calibrated = []
    monkeypatch.setattr(pipeline, "calibrate", lambda *a: calibrated.append(True))
    with pytest.raises(HfcompressError, match="--probe needs the whole model.*pass --no-probe"):
        pipeline.convert(ConvertOptions(source=str(tiny), out=tmp_path / "a", cache_dir=tmp_path / "cache", **{**SETTINGS, "probe": True}), argv=[])
    with pytest.raises(HfcompressError, match="distillation train the whole model"):
        settings = {**SETTINGS, "distill": DistillOptions(tokens=4096, seq_len=128)}  # within the tiny model's context
        pipeline.convert(ConvertOptions(source=str(tiny), out=tmp_path / "b", cache_dir=tmp_path / "cache", **settings), argv=[])
    assert calibrated == []
    monkeypatch.setattr(pipeline, "calibrate", lambda *a: None)
    report_skipped = wholemodel.WholeModelSteps.decide(
        ConvertOptions(source=str(tiny), out=tmp_path / "c"), Checkpoint(tiny, "tiny"), [], torch.device("cpu")
    ).describe()
    assert report_skipped["ran"] == [] and set(report_skipped["skipped"]) == {"probe", "speed", "peers"}


def test_methods_are_registered_units():
    """The driver sees methods only through the registry; LISA and FASC own their names and report sections."""
    from hfcompress.conversion.methods import FINISHERS, METHODS
    from hfcompress.conversion.registry import build_methods

    methods, finishers = build_methods(ConvertOptions(source="x", out=Path("y"), fasc=FascOptions(budget=0.5)))
    assert [m.name for m in methods] == ["lisa", "keys", "fasc"] and set(METHODS) == {"lisa", "keys", "fasc"}
    assert [f.name for f in finishers] == ["distillation"] and set(FINISHERS) == {"distillation"}  # on by default
    assert build_methods(ConvertOptions(source="x", out=Path("y"), distill=DistillOptions(tokens=0)))[1] == []
    nothing = ConvertOptions(source="x", out=Path("y"), keys=KeyOptions(kv_budget=1.0))
    assert build_methods(nothing)[1] == []  # nothing to train
    methods, finishers = build_methods(ConvertOptions(source="x", out=Path("y")))
    assert [f.name for f in finishers] == ["distillation"]  # the default's key latents train
    assert [m.name for m in methods if m.active()] == ["lisa", "keys"]  # LISA shares none by default; FASC is off
    import inspect

    from hfcompress.evidence import gate
    from hfcompress.conversion import output, passes, run
    from hfcompress.sources import token_streams

    for module in (pipeline, passes, run, output, token_streams, gate):  # the driver and its steps
        source = inspect.getsource(module)
        assert "lisa" not in source.lower().replace("lisallama", "") and "fasc" not in source.lower(), module.__name__


@pytest.mark.slow  # two conversions: 40-60 s on 2 busy cores
def test_a_new_plan_in_the_same_cache_converts_afresh(tiny, tmp_path):
    """The convert pass's resume key includes the plan: another layer choice never picks up the layer files of an
    earlier conversion with the same cache and settings."""
    cache = tmp_path / "cache"
    for layers in ([1], [2]):
        settings = {**SETTINGS, "lisa": LisaOptions(layers=layers, steps=5, protect_first=1), "fasc": FascOptions()}
        out = tmp_path / f"out-{layers[0]}"
        pipeline.convert(ConvertOptions(source=str(tiny), out=out, cache_dir=cache, **settings), argv=[])
        assert list(json.loads((out / "config.json").read_text())["lisa_layers"]) == [str(layers[0])]
        names = set(weights(out))
        assert f"model.layers.{layers[0]}.self_attn.q_lowrank.weight" in names
        assert f"model.layers.{3 - layers[0]}.self_attn.q_proj.weight" in names


def test_back_off_is_refused_where_it_has_no_count_to_lower(tiny, tmp_path):
    """--back-off lowers the count --share-ratio asks for or raises --kv-budget: with the keys off and an explicit list
    or a search it is refused before any work, with the flag to drop."""
    no_keys = KeyOptions(kv_budget=1.0)
    for lisa, flag in ((LisaOptions(layers=[2, 3]), "--lisa-layers"), (LisaOptions(ppl_budget=5.0), "--lisa-ppl-budget")):
        with pytest.raises(HfcompressError, match=f"--back-off .*{flag} chooses them instead"):
            pipeline.convert(ConvertOptions(source=str(tiny), out=tmp_path / "out", back_off=True, lisa=lisa, keys=no_keys), argv=[])
        assert not ConvertOptions(source=str(tiny), out=tmp_path / "out", lisa=lisa, keys=no_keys).validate().backs_off  # the default: off
        assert ConvertOptions(source=str(tiny), out=tmp_path / "out", lisa=lisa).validate().backs_off  # the keys' budget can rise
    assert not (tmp_path / "out").exists()
    assert ConvertOptions(source=str(tiny), out=tmp_path / "out").backs_off  # on by default: the key budget
    assert not ConvertOptions(source=str(tiny), out=tmp_path / "out", back_off=False).backs_off
    with pytest.raises(HfcompressError, match="shares none and compresses no keys"):
        ConvertOptions(source=str(tiny), out=tmp_path / "out", back_off=True, keys=no_keys).validate()
    assert ConvertOptions(source=str(tiny), out=tmp_path / "out", lisa=LisaOptions(share_ratio=0.5), keys=no_keys).backs_off


@pytest.mark.slow  # up to five tiny conversions (their calibration shared)
def test_back_off_converts_again_with_fewer_layers_until_the_gate_passes(tmp_path):
    """A failed gate with --back-off converts again with fewer shared layers: it stops at the first count that passes
    (written, exit 0, the attempts in the report and the card), or after one layer, marked failed (exit 3)."""
    from safetensors.torch import load_file, save_file

    # sharp attention (Q and K x8): each layer attends its own way, so sharing costs perplexity (about +0.14% at one
    # layer, +0.38% at three) where the random tiny model's near-uniform attention costs nothing
    tiny = save_tiny_llama(tmp_path / "sharp")
    tensors = load_file(tiny / "model.safetensors")
    save_file({k: v * 8 if ".q_proj." in k or ".k_proj." in k else v for k, v in tensors.items()}, tiny / "model.safetensors", metadata={"format": "pt"})
    cache = tmp_path / "cache"
    base = {**SETTINGS, "fasc": FascOptions(), "lisa": LisaOptions(share_ratio=0.75, protect_first=1, steps=10),
            "keys": KeyOptions(kv_budget=1.0)}  # fmt: skip  (the keys' back-off: test_lowrank_keys.py)

    def increase(ratio: float) -> float:
        settings = {**base, "lisa": replace(base["lisa"], share_ratio=ratio)}
        report = pipeline.convert(ConvertOptions(source=str(tiny), out=tmp_path / f"r{ratio}", cache_dir=cache, **settings), argv=[])
        return report.validation.perplexity_increase_pct

    three, one = increase(0.75), increase(0.25)
    assert one < three  # the tiny model loses more with more shared layers: a limit between them passes at fewer
    limit = (one + three) / 2
    options = ConvertOptions(source=str(tiny), out=tmp_path / "out", cache_dir=cache, back_off=True, **{**base, "max_ppl_increase": limit})
    report = pipeline.convert(options, argv=[]).to_dict()
    attempts = report["back_off"]
    assert len(attempts) >= 2 and len(attempts[0]["changed_layers"]["shared"]) == 3 and not attempts[0]["gate_passed"]
    assert attempts[-1]["gate_passed"] and all(not a["gate_passed"] for a in attempts[:-1])
    assert report["lisa"]["layers"] == attempts[-1]["changed_layers"]["shared"] and len(report["lisa"]["layers"]) < 3
    assert report["validation"]["gate_passed"] and report["validation"]["perplexity_increase_pct"] <= limit
    card = (tmp_path / "out" / "README.md").read_text()
    assert "`--back-off` converted again with fewer" in card and "| 1 | 3 | 0 |" in card

    # a limit no count reaches: every count down to one layer is tried, and the last is written marked failed; the
    # peers are computed for that one only, not for the attempts thrown away
    proc = subprocess.run(
        [sys.executable, "-m", "hfcompress.cli", "convert", str(tiny), "--out", str(tmp_path / "fails"), "--back-off",
         *CLI_SETTINGS, "--fasc-budget", "1.0", "--share-ratio", "0.75", "--kv-budget", "1.0", "--max-ppl-increase", "0",
         "--peers"],
        capture_output=True, text=True, env=dict(os.environ, HFCOMPRESS_CACHE=str(cache)), timeout=900,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "--back-off tried 3, 2, 1 changed layers and none passed" in " ".join(proc.stderr.split())
    failed = json.loads((tmp_path / "fails" / "hfcompress_report.json").read_text())
    assert [len(a["changed_layers"]["shared"]) for a in failed["back_off"]] == [3, 2, 1]
    assert proc.stderr.count("validate: training-free peers") == 1 and failed["peers"]["kv_values_per_token"]
