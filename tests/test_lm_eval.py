"""lm-evaluation-harness runs a converted model: its own `lm_eval --model hf` CLI, and `hfcompress eval --lm-eval`.

Local task files (one `loglikelihood_rolling`, one `generate_until`) over real English text keep it offline. The
harness's numbers are checked against the same quantities computed here directly from the model.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hfcompress.cli import app

pytest.importorskip("lm_eval")

runner = CliRunner()
CONVERT = [
    "--distill-tokens", "0", "--calib-sequences", "6", "--seq-len", "64", "--eval-tokens", "512", "--lisa-steps", "10",
    "--protect-first", "1", "--fasc-budget", "0.8", "--share-ratio", "0.25", "--max-ppl-increase", "1000",
    "--calib-text", "builtin", "--eval-text", "builtin", "--ood-text", "none", "--no-probe", "--no-speed",
]  # fmt: skip
PROMPTS = [  # different lengths, so the harness's batch of 2 is left-padded
    ("The keyword that defines a function in Python is", "def"),
    ("A loop", "for"),
    ("Exceptions are raised with the statement", "raise"),
]


def write_tasks(directory: Path) -> Path:
    """Two lm-eval task YAMLs over JSONL files: rolling log-likelihood of documents, greedy completion of prompts."""
    from pydoc_data.topics import topics

    directory.mkdir()
    docs = [topics[key][:300] for key in ("assert", "break", "continue", "del")]  # under the tiny model's 256 tokens
    (directory / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (directory / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in PROMPTS))
    (directory / "rolling.yaml").write_text(f"""task: hfc_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / "docs.jsonl"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""")
    (directory / "generate.yaml").write_text(f"""task: hfc_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / "prompts.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return directory


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """A tiny model converted with LISA and FASC (both change it), written once for the module."""
    from tests.tiny_models import save_tiny_llama

    root = tmp_path_factory.mktemp("lm_eval")
    source = save_tiny_llama(root / "tiny")
    out = root / "converted"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HFCOMPRESS_CACHE", str(root / "cache"))
        result = runner.invoke(app, ["convert", str(source), "--out", str(out), *CONVERT])
    assert result.exit_code == 0, result.output[-3000:]
    report = json.loads((out / "hfcompress_report.json").read_text())
    assert report["lisa"]["layers"] and any(layer["rank"] for layer in report["fasc"]["layers"])
    return out


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("tasks") / "tasks")


def own_rolling_loglikelihood(model, tokenizer, text: str) -> float:
    """sum log p(token | the ones before) of the text tokenised as the harness does (with the tokenizer's special
    tokens), after one BOS: one lm-eval rolling window."""
    ids = tokenizer(text).input_ids
    sequence = torch.tensor([[tokenizer.bos_token_id, *ids]])
    with torch.no_grad():
        logprobs = model(sequence).logits[0, :-1].log_softmax(-1)
    return float(logprobs.gather(1, sequence[0, 1:, None]).sum())


def own_greedy(model, tokenizer, prompt: str, new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.input_ids.shape[1] :], skip_special_tokens=True).split("\n")[0]


@pytest.mark.slow
def test_lm_eval_cli_runs_the_converted_model(converted, tasks, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(
        [Path(sys.executable).with_name("lm_eval"), "--model", "hf", "--model_args",
         f"pretrained={converted},trust_remote_code=True,dtype=float32", "--tasks", "hfc_rolling,hfc_generate",
         "--include_path", str(tasks), "--device", "cpu", "--batch_size", "2", "--output_path", str(tmp_path / "out"),
         "--log_samples"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = next((tmp_path / "out").iterdir())
    results = json.loads(next(run_dir.glob("results_*.json")).read_text())["results"]
    assert torch.isfinite(torch.tensor(results["hfc_rolling"]["word_perplexity,none"]))

    model = AutoModelForCausalLM.from_pretrained(converted, trust_remote_code=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(converted, trust_remote_code=True)
    samples = [json.loads(line) for line in next(run_dir.glob("samples_hfc_rolling_*.jsonl")).read_text().splitlines()]
    assert len(samples) == 4
    for sample in samples:
        expected = own_rolling_loglikelihood(model, tokenizer, sample["doc"]["text"])
        assert float(sample["resps"][0][0]) == pytest.approx(expected, rel=1e-4)
    samples = [json.loads(line) for line in next(run_dir.glob("samples_hfc_generate_*.jsonl")).read_text().splitlines()]
    assert len(samples) == len(PROMPTS)
    for sample in samples:  # batched, left-padded greedy generation equals one prompt at a time
        assert sample["resps"][0][0].split("\n")[0] == own_greedy(model, tokenizer, sample["doc"]["prompt"], 6)


@pytest.mark.slow
def test_hfcompress_eval_lm_eval_writes_both_models_into_the_card(converted, tasks, tmp_path, monkeypatch):
    args = [
        "eval", str(converted), "--lm-eval", "hfc_rolling,hfc_generate", "--lm-eval-include", str(tasks),
        "--lm-eval-batch-size", "2", "--no-speed", "--no-probe", "--eval-text", "builtin", "--ood-text", "none",
        "--eval-tokens", "256", "--json", str(tmp_path / "eval.json"),
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["hfcompress", *args])  # the command line the card records
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output[-3000:]
    section = json.loads((converted / "hfcompress_report.json").read_text())["lm_eval"]
    assert section == json.loads((tmp_path / "eval.json").read_text())["lm_eval"]
    assert section["settings"]["batch_size"] == 2 and section["lm_eval_version"] == "0.4.13"
    assert section["original"] and "--lm-eval hfc_rolling,hfc_generate" in section["command"]
    rows = {(row["task"], row["metric"]): row for row in section["rows"]}
    assert set(rows) == {("hfc_rolling", "word_perplexity"), ("hfc_rolling", "bits_per_byte"), ("hfc_generate", "exact_match")}
    rolling = rows[("hfc_rolling", "bits_per_byte")]
    assert rolling["original"] is not None and rolling["original"] != rolling["converted"]  # two models, both measured
    assert rolling["higher_is_better"] is False and rows[("hfc_generate", "exact_match")]["higher_is_better"] is True
    card = (converted / "README.md").read_text()
    assert "lm-evaluation-harness" in card and "hfc_rolling" in card and "bits_per_byte" in card


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--lm-eval", "no_such_task_xyz"], "Unknown lm-eval task"),
        (["--lm-eval", "hfc_rolling", "--lm-eval-include", "/nonexistent/tasks"], "is not a directory"),
        (["--lm-eval", "hfc_rolling", "--lm-eval-batch-size", "0"], "--lm-eval-batch-size must be >= 1"),
        (["--lm-eval", " , "], "needs comma-separated"),
    ],
)
def test_bad_lm_eval_options_fail_before_any_model_loads(args, needle, tmp_path, monkeypatch):
    import hfcompress.evidence.evaluate

    def never(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(hfcompress.evidence.evaluate, "load_converted", never)
    result = runner.invoke(app, ["eval", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert needle in " ".join(result.output.split())
