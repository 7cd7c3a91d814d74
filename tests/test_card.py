"""The model card by Hub conventions (card.py, cards/model_card.md.j2): licence and its files, base_model and its
relation, a model-index of this model only with dataset ids, `datasets:`, what runs the model, a section per method
that changed something, lm-evaluation-harness results; checked through huggingface_hub's own parsing."""

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard
from huggingface_hub.repocard_data import model_index_to_eval_results
from typer.testing import CliRunner

from hfcompress.evidence.card import (
    BASE_MODEL_RELATION,
    LM_EVAL_NAME,
    LM_EVAL_URL,
    carry_licence,
    declared_licence,
    is_hub_dataset_id,
    licence_files,
    render_card,
    write_card,
)
from hfcompress.cli import app
from tests.test_convert import FAST
from tests.test_distill import models, run_stage  # noqa: F401  (models: the fixture)

REPO = "me/tiny-lisa"
SOURCE_README = """---
license: llama3.2
license_name: llama3.2-community
license_link: LICENSE
language:
- en
- de
library_name: transformers
---

# tiny llama
"""
WIKITEXT = {"id": "Salesforce/wikitext", "config": "wikitext-2-raw-v1", "split": "test",
            "revision": "b08601e04326c79dfdd32d625aee71d232d685c3"}
WIKITEXT_TRAIN = {**WIKITEXT, "split": "train"}


@pytest.fixture(scope="module")
def converted(_tiny_llama_template, tmp_path_factory) -> Path:
    """One fast conversion of a local tiny Llama whose directory carries a model card with a licence and licence
    files (and a directory whose name looks like one, which is not copied)."""
    root = tmp_path_factory.mktemp("card")
    source = root / "tiny-llama"
    shutil.copytree(_tiny_llama_template, source)
    (source / "README.md").write_text(SOURCE_README)
    (source / "LICENSE").write_text("LLAMA 3.2 COMMUNITY LICENSE AGREEMENT (test copy)\n")
    (source / "USE_POLICY.md").write_text("# Llama 3.2 Acceptable Use Policy (test copy)\n")
    (source / "licenses").mkdir()
    (source / "licenses" / "THIRD_PARTY.txt").write_text("not copied: in a directory\n")
    out = root / "out"
    with pytest.MonkeyPatch.context() as monkeypatch:  # the autouse offline fixture is per test: set it here too
        import huggingface_hub.constants as hf_constants

        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
        result = CliRunner().invoke(
            app, ["convert", str(source), "--out", str(out), "--max-ppl-increase", "1000", "--no-speed", "--no-probe",
                  "--share-ratio", "0.25", *FAST],  # every method changes a layer: a section each
            env={"HFCOMPRESS_CACHE": str(root / "cache")},
        )
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def report(converted) -> dict:
    return json.loads((converted / "hfcompress_report.json").read_text())


def header(card: ModelCard) -> dict:
    """The card's YAML as the Hub reads it (plain YAML), after a save/load round trip through huggingface_hub."""
    return yaml.safe_load(str(card).split("---")[1])


def round_trip(card: ModelCard, tmp_path: Path) -> ModelCard:
    card.save(tmp_path / "README.md")
    return ModelCard.load(tmp_path / "README.md")


# ------------------------------------------------------------------------------------------- the real conversion
def test_converted_card_carries_the_source_licence_and_files(converted, report):
    card = ModelCard.load(converted / "README.md")
    data = card.data
    assert (data.license, data.license_name, data.license_link) == ("llama3.2", "llama3.2-community", "LICENSE")
    assert data.language == ["en", "de"]
    assert (converted / "LICENSE").read_text() == "LLAMA 3.2 COMMUNITY LICENSE AGREEMENT (test copy)\n"
    assert (converted / "USE_POLICY.md").is_file() and not (converted / "licenses").exists()
    assert report["licence"]["files"] == ["LICENSE", "USE_POLICY.md"]
    assert report["licence"]["declared_in"] == "the source's model card (README.md)"
    assert "Licence files in this repo: `LICENSE`, `USE_POLICY.md`." in card.text
    assert "`llama3.2` (llama3.2-community)" in card.text


def test_converted_card_metadata_and_sections(converted, report):
    card = ModelCard.load(converted / "README.md")
    meta = header(card)
    # a local directory has no Hub id: no base_model, so no relation; builtin and news texts: no model-index
    assert "base_model" not in meta and "base_model_relation" not in meta
    assert "model-index" not in meta and "model_name" not in meta and "datasets" not in meta
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"hfcompress", "lisa", "fasc", "low-rank-keys", "custom_code"} <= set(meta["tags"]) and "distillation" not in meta["tags"]
    text = card.text
    assert "## What runs this model" in text and "trust_remote_code=True" in text
    assert f"lm_eval --model hf --model_args pretrained={converted.name},trust_remote_code=True" in text
    assert "**TGI, llama.cpp**: not yet" in text and "vllm serve" in text and "--engine vllm" in text  # sparse Align: served
    assert "### LISA attention sharing" in text and "### FASC low-rank linears" in text and "### Low-rank keys" in text
    assert "### Distillation" not in text and "## lm-evaluation-harness" not in text
    assert "None of these texts is a Hub dataset" in text
    for row in report["validation"]["texts"]:  # the texts table keeps both models
        assert row["dataset"] is None
        assert f"| {row['eval_text']} | {row['converted']['tokens']:,} | {row['original']['perplexity']:.3f} | " \
               f"{row['converted']['perplexity']:.3f} |" in text
    assert report["calibration"]["dataset"] is None
    assert "\n\n\n" not in str(card)


def test_rerender_of_an_existing_output_directory(converted, report, tmp_path):
    """The lead re-renders the card of an output directory from its (updated) report: same card, same files."""
    directory = tmp_path / "again"
    directory.mkdir()
    write_card(report, converted.name, directory)
    assert (directory / "README.md").read_text() == (converted / "README.md").read_text()


# ------------------------------------------------------------------------------------- render_card on variations
def test_hub_dataset_texts_model_index_of_this_model_only(report, tmp_path):
    report = copy.deepcopy(report)
    report["source"].update(kind="hub", name="meta-llama/Llama-3.2-1B", repo_id="meta-llama/Llama-3.2-1B",
                            base_model="meta-llama/Llama-3.2-1B", commit_sha="a" * 40)
    wikitext_row = report["validation"]["texts"][0]
    wikitext_row.update(eval_text=f"Salesforce/wikitext wikitext-2-raw-v1, test split @{WIKITEXT['revision'][:8]}",
                        dataset=WIKITEXT)
    report["calibration"]["dataset"] = WIKITEXT_TRAIN
    card = round_trip(render_card(report, REPO), tmp_path)
    meta = header(card)
    assert meta["base_model"] == "meta-llama/Llama-3.2-1B" and meta["base_model_relation"] == BASE_MODEL_RELATION == "finetune"
    assert meta["datasets"] == ["Salesforce/wikitext"]
    name, results = model_index_to_eval_results(meta["model-index"])
    assert name == REPO and len(results) == 1  # the converted model on the one Hub text; not the original, not news
    result = results[0]
    assert (result.dataset_type, result.dataset_config, result.dataset_split, result.dataset_revision) == (
        WIKITEXT["id"], WIKITEXT["config"], WIKITEXT["split"], WIKITEXT["revision"])
    assert result.task_type == "text-generation" and result.metric_type == "perplexity"
    assert result.metric_value == round(wikitext_row["converted"]["perplexity"], 4)
    assert result.metric_args["context"] == wikitext_row["converted"]["context"]
    assert card.data.eval_results[0].dataset_revision == WIKITEXT["revision"]
    original = f"{wikitext_row['original']['perplexity']:.4f}"
    assert original not in card.content.split("---")[1]  # the original's figure is in the tables only
    text = card.text
    assert f"| [{wikitext_row['eval_text']}](https://huggingface.co/datasets/Salesforce/wikitext) |" in text
    assert f"{wikitext_row['original']['perplexity']:.3f}" in text
    news = report["validation"]["texts"][1]["eval_text"]
    assert f"| {news} |" in text and "are in this table only" in text
    assert "Calibration text: [" in text


def _without_lisa(report: dict) -> dict:
    report["lisa"].update(layers=[], fitted=[], rank=None, qk_compression_measured=None)
    report["peers"] = None  # they were computed at the shared layers' KV saving
    return report


def _without_keys(report: dict) -> dict:
    report["keys"] = None
    return report


def _without_fasc(report: dict) -> dict:
    for row in report["fasc"]["layers"]:
        row["rank"] = None
    report["fasc"]["budget"] = 1.0
    return report


def test_fasc_only(report):
    card = render_card(_without_lisa(copy.deepcopy(report)), REPO)
    text, meta = card.text, header(card)
    assert "### FASC low-rank linears" in text and "### LISA attention sharing" not in text
    assert "fasc" in meta["tags"] and "lisa" not in meta["tags"]
    assert "with LISA" not in text and "FASC Fisher-aligned low-rank compression" in text
    assert "does not know this architecture, nor load linears stored as two low-rank factors" in text


def test_lisa_only(report):
    card = render_card(_without_fasc(copy.deepcopy(report)), REPO)
    text, meta = card.text, header(card)
    assert "### LISA attention sharing" in text and "### FASC" not in text and "FASC Fisher" not in text
    assert "lisa" in meta["tags"] and "fasc" not in meta["tags"]
    assert "cannot hand a layer's attention scores to the next layer" in text and "low-rank factors" not in text


def test_nothing_changed_and_distillation(report):
    plain = _without_keys(_without_fasc(_without_lisa(copy.deepcopy(report))))
    text = render_card(plain, REPO).text
    assert "with no layer changed" in text and "Nothing: no layer was shared or factorised" in text
    assert "###" not in text
    distilled = copy.deepcopy(report)
    distilled["finishers"]["distillation"] = {
        "trainable_parameters": 1234, "lora_rank": 2, "steps": 6, "seq_len": 32, "batch_size": 1, "lr": 1e-4,
        "seconds": 3.0, "curve_tokens": 512,
        "perplexity": [{"tokens": 0, **{row["eval_text"]: 10.0 for row in report["validation"]["texts"]}}],
    }
    card = render_card(distilled, REPO)
    assert "### Distillation" in card.text and "then distilled from the original" in card.text
    assert "distillation" in header(card)["tags"] and "192 tokens of calibration text" in card.text
    scored = " / ".join(str(row["converted"]["tokens"]) for row in report["validation"]["texts"])
    assert f"on the first\n512 tokens of each text (the gate above scores {scored})" in card.text
    distilled["finishers"]["distillation"]["data"] = "generated"
    assert "192 tokens of text the original model wrote itself" in render_card(distilled, REPO).text


def test_unknown_licence_is_said_not_invented(report, tmp_path):
    unknown = copy.deepcopy(report)
    unknown["licence"] = carry_licence({"path": str(tmp_path), "gguf_file": None}, tmp_path)  # no card, no files
    card = render_card(unknown, REPO)
    assert "license" not in header(card) and "language" not in header(card)
    assert "The licence is unknown: the source has no model card (README.md), and hfcompress does not invent one" in card.text
    assert "The source came with no licence files" in card.text
    old = copy.deepcopy(report)
    del old["licence"]  # a report from before the licence was recorded
    assert "the conversion record does not say" in render_card(old, REPO).text


# ------------------------------------------------------------------------------------------------- licence files
def test_licence_files_and_links(tmp_path):
    source, out = tmp_path / "source", tmp_path / "out"
    source.mkdir()
    out.mkdir()
    (source / "README.md").write_text("---\nlicense: other\nlicense_name: custom\nlicense_link: LICENSE.txt\n---\n")
    for name in ("license.md", "Notice", "use_policy.md", "LICENCE-DATA", "config.json"):
        (source / name).write_text(name)
    (source / "NOTICES").mkdir()
    blob = tmp_path / "blob"
    blob.write_text("linked licence")
    os.symlink(blob, source / "LICENSE-linked")  # a Hub snapshot's files are links into the cache
    assert [p.name for p in licence_files(source)] == ["LICENCE-DATA", "LICENSE-linked", "Notice", "license.md", "use_policy.md"]

    hub = {"kind": "hub", "path": str(source), "gguf_file": None, "repo_id": "org/model", "commit_sha": "c" * 40}
    record = carry_licence(hub, out)
    assert record["files"] == ["LICENCE-DATA", "LICENSE-linked", "Notice", "license.md", "use_policy.md"]
    assert (out / "LICENSE-linked").read_text() == "linked licence" and not (out / "LICENSE-linked").is_symlink()
    assert not (out / "NOTICES").exists() and not (out / "config.json").exists()
    # the link named a file of the source repo that was not copied: it points there, at the converted commit
    assert record["license_link"] == f"https://huggingface.co/org/model/blob/{'c' * 40}/LICENSE.txt"
    local = carry_licence({**hub, "kind": "local", "repo_id": None, "commit_sha": None}, tmp_path / "out")
    assert local["license_link"] is None  # a relative link the output cannot resolve is dropped, not left broken
    (source / "README.md").write_text("---\nlicense: [apache-2.0\n---\n")  # YAML that does not parse
    fields, where, why = declared_licence(hub)
    assert fields["license"] is None and where is None and "could not be parsed" in why


def test_gguf_licence_from_metadata(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "model.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_license("apache-2.0")
    writer.add_license_link("https://www.apache.org/licenses/LICENSE-2.0")
    writer.add_languages(["en", "fr"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    source = {"kind": "gguf", "path": str(tmp_path), "gguf_file": "model.gguf"}
    fields, where, why = declared_licence(source)
    assert fields == {"license": "apache-2.0", "license_name": None,
                      "license_link": "https://www.apache.org/licenses/LICENSE-2.0", "language": ["en", "fr"]}
    assert where == "the GGUF metadata of model.gguf" and why is None


# ------------------------------------------------------------------------------------------ lm-evaluation-harness
LM_EVAL = {
    "lm_eval_version": "0.4.9",
    "command": "hfcompress eval out --lm-eval hellaswag,arc_easy,mine",
    "settings": {"batch_size": "auto", "num_fewshot": 0, "limit": 0.5, "device": "cuda:0", "dtype": "bfloat16"},
    "original": "meta-llama/Llama-3.2-1B",
    "rows": [
        {"task": "hellaswag", "metric": "acc_norm,none", "original": 0.6, "converted": 0.55, "original_stderr": 0.005,
         "converted_stderr": 0.006, "dataset_path": "Rowan/hellaswag", "dataset_name": None, "split": "validation",
         "higher_is_better": True},
        {"task": "arc_easy", "metric": "acc,none", "original": None, "converted": 0.7, "original_stderr": None,
         "converted_stderr": None, "dataset_path": "allenai/ai2_arc", "dataset_name": "ARC-Easy", "split": "test",
         "higher_is_better": None},
        {"task": "mine", "metric": "acc,none", "original": 0.5, "converted": 0.25, "original_stderr": None,
         "converted_stderr": None, "dataset_path": "json", "dataset_name": None, "split": "train", "higher_is_better": True},
    ],
}


def test_lm_eval_section_and_model_index(report, tmp_path):
    report = copy.deepcopy(report)
    report["lm_eval"] = LM_EVAL
    card = round_trip(render_card(report, REPO), tmp_path)
    text = card.text
    assert "## lm-evaluation-harness" in text and "lm-evaluation-harness 0.4.9" in text
    assert "batch size auto, few-shot: 0, 50% of each task's examples, cuda:0, bfloat16" in text
    assert "| hellaswag | acc_norm,none ↑ | 0.6000 ± 0.0050 | 0.5500 ± 0.0060 | -0.0500 (-8.3%) |" in text
    assert "| arc_easy | acc,none | – | 0.7000 | – |" in text
    assert "| mine | acc,none ↑ | 0.5000 | 0.2500 | -0.2500 (-50.0%) |" in text
    assert LM_EVAL["command"] in text
    name, results = model_index_to_eval_results(header(card)["model-index"])
    assert name == REPO
    lm = [r for r in results if r.source_name == LM_EVAL_NAME]
    assert [(r.dataset_type, r.dataset_config, r.dataset_split, r.metric_type, r.metric_value) for r in lm] == [
        ("Rowan/hellaswag", None, "validation", "acc_norm", 0.55), ("allenai/ai2_arc", "ARC-Easy", "test", "acc", 0.7)]
    assert all(r.source_url == LM_EVAL_URL and r.dataset_args == {"num_few_shot": 0} for r in lm)
    assert len(results) == len(lm)  # the built-in texts are not Hub datasets; "json" is a local loader
    assert "0.6" not in str(header(card)["model-index"])  # the original's scores stay in the table


def test_hub_dataset_ids():
    assert is_hub_dataset_id("Rowan/hellaswag") and is_hub_dataset_id("hellaswag")
    for path in ("json", "text", "parquet", "/data/x", "./x", "~/x", None, "", "a/b/c"):
        assert not is_hub_dataset_id(path)


# ------------------------------------------------------------------------------------------------------ text.py
def test_hub_dataset_text_records_its_split(monkeypatch):
    import datasets

    from hfcompress.sources import text

    class Rows:
        column_names = ("text",)

        def __getitem__(self, key):
            return ["a line", "another"]

    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: calls.append((args, kwargs)) or Rows())
    loaded = text._load_dataset("org/corpus", "cfg", "test", "d" * 40)
    assert loaded.dataset == text.HubDataset("org/corpus", "cfg", "test", "d" * 40)
    assert text.hub_dataset(loaded.name) == {"id": "org/corpus", "config": "cfg", "split": "test", "revision": "d" * 40}
    assert text.hub_dataset(text.BUILTIN_TEXT_NAME) is None


# ------------------------------------------------------------------------------------------ a custom licence: Gemma
GEMMA_NOTICE = "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms"


def test_gemma_licence_notice_terms_and_link(report, tmp_path):
    """A source declaring `license: gemma` (no name, no link, no files, as the Gemma GGUF's metadata): the card names
    the terms and links them, NOTICE carries the line the terms require, and the missing copy of the terms is said;
    with --licence-file naming a copy, it ships and the card says so."""
    source, out = tmp_path / "source", tmp_path / "out"
    source.mkdir()
    out.mkdir()
    (source / "README.md").write_text("---\nlicense: gemma\n---\n")
    record = carry_licence({"path": str(source), "gguf_file": None}, out)
    assert (record["license_name"], record["license_link"]) == ("Gemma Terms of Use", "https://ai.google.dev/gemma/terms")
    assert record["files"] == ["NOTICE"] and (out / "NOTICE").read_text() == GEMMA_NOTICE + "\n"
    assert record["terms_copied"] is False
    card = render_card({**copy.deepcopy(report), "licence": record}, REPO)
    assert header(card)["license"] == "gemma" and header(card)["license_link"] == "https://ai.google.dev/gemma/terms"
    assert GEMMA_NOTICE in card.text and "must accompany this model when it is redistributed" in card.text

    terms = tmp_path / "GEMMA_TERMS.html"
    terms.write_text("<html><h1>Gemma Terms of Use</h1> (test copy)</html>")
    (source / "NOTICE.md").write_text("where the files came from\n")
    (source / "NOTICE").write_text("Copyright the source\n")  # an existing NOTICE gets the line appended
    again = tmp_path / "again"
    again.mkdir()
    record = carry_licence({"path": str(source), "gguf_file": None}, again, [terms])
    assert record["files"] == ["GEMMA_TERMS.html", "NOTICE", "NOTICE.md"] and record["terms_copied"] is True
    assert (again / "NOTICE").read_text() == "Copyright the source\n" + GEMMA_NOTICE + "\n"
    card = render_card({**copy.deepcopy(report), "licence": record}, REPO)
    assert "A copy of the Gemma Terms of Use is in this repo." in card.text and "must accompany" not in card.text
    assert "`GEMMA_TERMS.html`" in card.text
    # a licence that asks for no notice gets none
    (source / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    (tmp_path / "plain").mkdir()
    plain = carry_licence({"path": str(source), "gguf_file": None}, tmp_path / "plain")
    assert plain["notice"] is None and plain["terms_copied"] is None
    assert (tmp_path / "plain" / "NOTICE").read_text() == "Copyright the source\n"


def test_licence_file_option_is_checked_before_any_work(tmp_path):
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "missing"), "--out", str(tmp_path / "o"),
                                      "--licence-file", str(tmp_path / "TERMS.txt")])
    assert result.exit_code != 0 and "--licence-file" in result.output and "is not a file" in result.output
    assert not (tmp_path / "o").exists()


def test_parameters_with_and_without_embeddings(converted, report):
    original, converted_counts = report["parameters"]["original"], report["parameters"]["converted"]
    assert original["embeddings"] > 0 and original["without_embeddings"] == original["total"] - original["embeddings"]
    assert converted_counts["embeddings"] == original["embeddings"]  # no method touches the embeddings
    text = ModelCard.load(converted / "README.md").text
    assert f"without the embeddings, original\n{original['without_embeddings']:,}" in text


def test_a_gguf_original_is_named_as_loaded_beside_base_model(report):
    """The built-in source's original is a dequantised Q4_1 GGUF while base_model names the full-precision repo: the
    card says what was loaded at the top and in the results table, not only in its licence section."""
    gguf = copy.deepcopy(report)
    gguf["source"].update(kind="gguf", name="smollm2-135m-instruct", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                          base_model="HuggingFaceTB/SmolLM2-135M-Instruct")  # fmt: skip
    card = render_card(gguf, REPO)
    text = " ".join(card.text.split())
    assert header(card)["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert ("**The original, as loaded:** the Q4_1 GGUF file `SmolLM2-135M-Instruct.Q4_1.gguf` of "
            "`HuggingFaceTB/SmolLM2-135M-Instruct`, dequantised to float32 by hfcompress.") in text
    assert "not of the full-precision `HuggingFaceTB/SmolLM2-135M-Instruct` that `base_model` names" in text
    assert text.index("The original, as loaded") < text.index("## What runs this model")
    assert "| original (smollm2-135m-instruct, dequantised Q4_1 GGUF) |" in card.text
    assert "as loaded" not in render_card(report, REPO).text  # a safetensors source is what it names


def test_untrusted_speed_states_no_ratio(report):
    """Speed figures the noise check did not trust: the card says so with the reason and prints no table, no ratio."""
    timed = copy.deepcopy(report)
    figures = {"prefill_tokens": 512, "prefill_tokens_per_s": 900.0, "decode_tokens": 32, "decode_tokens_per_s": 40.0,
               "cache_mb": 1.0}  # fmt: skip
    timed["speed"] = {
        "hardware": "CPU (test, 2 cores, torch 1 thread)", "dtype": "float32", "repeats": 3, "threads": 1,
        "original": figures, "converted": {**figures, "decode_tokens_per_s": 26.4}, "prefill_speedup": 0.38,
        "decode_speedup": 0.66, "trusted": True, "noise": {"reasons": []},
    }  # fmt: skip
    assert "(0.66x)" in render_card(timed, REPO).text
    timed["speed"].update(trusted=False, noise={"reasons": ["the machine was busy (load average 3.4 on 2 cores)"]})
    text = " ".join(render_card(timed, REPO).text.split())
    assert ("The speed figures are not trusted, so none is stated here**: the machine was busy (load average 3.4 on "
            "2 cores).") in text
    assert "0.66x" not in text and "0.38x" not in text and "| model | prefill tok/s" not in text
    del timed["speed"]["trusted"]  # a report from before the noise check: as it was
    assert "(0.66x)" in render_card(timed, REPO).text


def test_every_distillation_step_of_a_short_run_is_on_the_loss_curve(models, tmp_path):
    """A short run (8 steps here, 32 by default) has a KL point per step on its curve and plot, not one averaged point."""
    from hfcompress.evidence.plots import learning_curve

    teacher, student, train_ids, eval_ids = models
    _, record = run_stage(student, teacher, train_ids, eval_ids, tmp_path)
    assert [row["tokens"] for row in record["kl"]] == [64 * (step + 1) for step in range(record["steps"])]
    assert learning_curve(record, tmp_path / "distillation.png").stat().st_size > 0
