"""Speed figures a user can trust (speed.py): a fixed thread count, interleaved rounds, and a noise verdict that keeps
figures measured on a busy machine out of the card and the console as results.

The verdict is tested on readings shaped like real measurements; the end-to-end test converts a tiny model while
other processes spin on the one core the conversion may use, and the card must say the speed was not trusted. No test
here asserts a speed ratio."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from hfcompress.evidence import speed
from hfcompress.evidence.card import peers_view
from hfcompress.errors import HfcompressError
from hfcompress.evidence.speed import (
    MAX_LOAD_PER_CORE,
    MAX_RATIO_SPREAD,
    MIN_CPU_SHARE,
    SPEED_ATTEMPTS,
    NoiseReading,
    NoiseVerdict,
    compare_speed,
    noise_verdict,
    ratio_spreads,
    speed_threads,
)
from tests.test_convert import BUILTIN_TEXTS, FAST

# seconds per round of a 512-token prefill and 32 decode steps of SmolLM2-135M on one thread of a quiet 2-core machine
QUIET = {
    "prefill": {"original": [0.512, 0.508, 0.515], "converted": [0.509, 0.511, 0.507]},
    "decode": {"original": [1.21, 1.19, 1.22], "converted": [1.24, 1.23, 1.25]},
}
# the same on two threads while other work ran on both cores: the ratio swings from round to round
BUSY = {
    "prefill": {"original": [0.301, 0.702, 0.288], "converted": [0.795, 0.310, 0.760]},
    "decode": {"original": [0.83, 1.65, 0.90], "converted": [1.25, 1.31, 1.70]},
}


def reading(**changes) -> NoiseReading:
    values = {"load_average": 1.1, "cpu_count": 2, "threads": 1, "cpu_share": 0.98, "ratio_spreads": ratio_spreads(QUIET)}
    return NoiseReading(**{**values, **changes})


def test_a_quiet_measurement_is_trusted():
    assert ratio_spreads(QUIET)["decode converted"] < MAX_RATIO_SPREAD
    assert noise_verdict(reading()) == NoiseVerdict(True, [], False)
    assert noise_verdict(reading(load_average=None, cpu_share=None)).trusted  # unknown load, CUDA: the spread decides


def test_ratios_that_swing_between_rounds_are_not_trusted_and_may_pass():
    spreads = ratio_spreads(BUSY)
    assert spreads["prefill converted"] == pytest.approx((0.795 / 0.301) / (0.310 / 0.702))
    verdict = noise_verdict(reading(threads=2, cpu_share=0.55, ratio_spreads=spreads))  # two threads: no share check
    assert not verdict.trusted and verdict.transient
    assert verdict.reasons == [f"the prefill converted ratio varied {spreads['prefill converted']:.2f}x between rounds"]


def test_a_busy_machine_is_not_trusted_and_not_measured_again():
    load = MAX_LOAD_PER_CORE * 2 + 0.1
    verdict = noise_verdict(reading(load_average=load, cpu_share=0.62))
    assert not verdict.trusted and not verdict.transient  # the 1-minute average will not drop within a re-measurement
    assert verdict.reasons[0] == f"the machine was busy (load average {load:.1f} on 2 cores)"
    assert "had a core 62% of the time" in verdict.reasons[1]
    assert noise_verdict(reading(load_average=MAX_LOAD_PER_CORE * 2)).trusted  # at the limit: still trusted


def test_a_thread_that_waited_for_its_core_is_not_trusted():
    assert not noise_verdict(reading(cpu_share=MIN_CPU_SHARE - 0.01)).trusted
    assert noise_verdict(reading(cpu_share=MIN_CPU_SHARE)).trusted


def test_one_model_alone_is_judged_by_its_own_spread():
    spreads = ratio_spreads({"decode": {"model": [1.0, 1.1, 1.3]}})
    assert spreads == {"decode model": pytest.approx(1.3)}


def test_speed_threads_default_and_override(monkeypatch):
    monkeypatch.delenv("HFCOMPRESS_SPEED_THREADS", raising=False)
    assert speed_threads() == 1
    monkeypatch.setenv("HFCOMPRESS_SPEED_THREADS", "4")
    assert speed_threads() == 4
    monkeypatch.setenv("HFCOMPRESS_SPEED_THREADS", "0")
    with pytest.raises(HfcompressError, match="HFCOMPRESS_SPEED_THREADS must be a torch thread count"):
        speed_threads()


class _Recorder(nn.Module):
    """A stand-in model that records the torch threads each call ran with (the speed loop's interface)."""

    def __init__(self, seen: list[int]) -> None:
        super().__init__()
        self.weight, self.seen = nn.Parameter(torch.zeros(1)), seen

    def forward(self, ids, cache=None, use_cache=False, logits_to_keep=None):
        self.seen.append(torch.get_num_threads())
        return type("Out", (), {"cache": cache, "logits": torch.zeros(ids.shape[0], 1, 4)})()


@pytest.mark.parametrize("transient, attempts", [(True, SPEED_ATTEMPTS), (False, 1)])
def test_untrusted_figures_are_measured_again_a_bounded_number_of_times(monkeypatch, transient, attempts):
    seen: list[int] = []
    verdicts = []
    monkeypatch.setattr(speed, "noise_verdict", lambda r: verdicts.append(r) or NoiseVerdict(False, ["noisy"], transient))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results, noise = compare_speed({"a": _Recorder(seen), "b": _Recorder(seen)}, torch.zeros(1, 4, dtype=torch.long), 2, 3)
        assert torch.get_num_threads() == 2  # set back after the run
    finally:
        torch.set_num_threads(before)
    assert set(seen) == {1}  # every call, warm-up included, on one thread
    assert noise["attempts"] == attempts == len(verdicts) and noise["trusted"] is False and noise["reasons"] == ["noisy"]
    assert noise["threads"] == 1 and set(results) == {"a", "b"}


def test_the_card_leaves_untrusted_peer_speed_out():
    report = {
        "validation": {"texts": [{"eval_text": "t (x)", "original": {"perplexity": 10.0}, "converted": {"perplexity": 11.0}}]},
        "peers": {"kv_values_per_token": {"original": 100, "converted": 80}, "peers": [], "skipped": None},
        "speed": {"trusted": False, "noise": {"reasons": ["the machine was busy"]}, "decode_speedup": 0.66,
                  "peers": {"p": {"decode_speedup": 0.5}}},
    }  # fmt: skip
    view = peers_view(report)
    assert view["untrusted_speed"] == "the machine was busy" and all(row["decode"] is None for row in view["rows"])
    report["speed"]["trusted"] = True
    view = peers_view(report)
    assert view["untrusted_speed"] is None and [row["decode"] for row in view["rows"]] == [1.0, 0.66]


@pytest.mark.slow  # a real conversion or CLI process: the fast tier stays under 5 minutes
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins processes to one core (Linux)")
def test_a_conversion_on_a_busy_core_says_its_speed_was_not_trusted(tiny_llama_dir, tmp_path):
    """Two processes spin on the one core the conversion may use while it runs: the timed thread gets about a third
    of it, so the report marks the speed untrusted with the reason, the card states no ratio and says so, and so does
    the console."""
    core = min(os.sched_getaffinity(0))
    pin = lambda: os.sched_setaffinity(0, {core})  # noqa: E731
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin) for _ in range(2)]
    out = tmp_path / "out"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "hfcompress.cli", "convert", str(tiny_llama_dir), "--out", str(out), "--device", "cpu",
             "--max-ppl-increase", "1000", "--speed", "--no-probe", "--share-ratio", "0.25", *FAST, *BUILTIN_TEXTS],
            env={**os.environ, "HFCOMPRESS_CACHE": str(tmp_path / "cache"), "HFCOMPRESS_SPEED_THREADS": "1"},
            capture_output=True, text=True, timeout=600, preexec_fn=pin,
        )  # fmt: skip
        evaluated = subprocess.run(  # `hfcompress eval --speed` of the output on the same busy core
            [sys.executable, "-m", "hfcompress.cli", "eval", str(out), "--speed", "--no-probe", "--eval-tokens", "256",
             "--eval-text", "builtin", "--ood-text", "none", "--json", str(tmp_path / "eval.json")],
            env={**os.environ, "COLUMNS": "200"}, capture_output=True, text=True, timeout=600, preexec_fn=pin,
        )  # fmt: skip
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "hfcompress_report.json").read_text())
    logged = " ".join(proc.stderr.split())
    # the plan step says what it chose before the layers are converted
    plan_line = f"plan: lisa: lisa_layers {', '.join(map(str, report['lisa']['layers']))} (rank"
    assert plan_line in logged and logged.index(plan_line) < logged.index("convert: layer by layer")
    assert re.search(r"plan: fasc: fasc_ranks (\d+\.\w+\.\w+=\d+, )+", logged)
    record = report["speed"]
    assert record["trusted"] is False and record["threads"] == 1
    assert any("of the time (other processes took the rest)" in reason for reason in record["noise"]["reasons"])
    assert record["noise"]["cpu_share"] < MIN_CPU_SHARE
    card = (out / "README.md").read_text()
    section = card[card.index("Speed, original and converted"):]
    assert "The speed figures are not trusted" in section and record["noise"]["reasons"][0] in " ".join(section.split())
    assert "| model | prefill tok/s" not in card and "x) |" not in section.split("![")[0]  # no table, no ratio
    assert "the figures are not trusted" in logged and "speed: converted/original" not in logged
    assert Path(out / "plots" / "speed.png").is_file()
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    noise = json.loads((tmp_path / "eval.json").read_text())["speed_noise"]
    assert noise["trusted"] is False and noise["threads"] == 1
    assert "The tok/s columns are not trusted:" in " ".join(evaluated.stderr.split())


def test_a_step_that_counts_nothing_still_prints_a_line_every_interval(monkeypatch, capsys):
    """validate: speed printed nothing for minutes: inside a heartbeat a silent console gets a "still running" line
    every PLAIN_INTERVAL seconds (here 0.3 s), naming what the step is doing; a console that speaks needs none."""
    from hfcompress import progress

    monkeypatch.setattr(progress, "PLAIN_INTERVAL", 0.3)
    with progress.heartbeat("validate: speed"):
        progress.activity("round 2/3, converted")
        time.sleep(1.6)
    quiet = [line for line in capsys.readouterr().err.splitlines() if "still running" in line]
    assert len(quiet) >= 3 and all("validate: speed: still running (round 2/3, converted)" in line for line in quiet)
    with progress.heartbeat("chatty"):
        for _ in range(8):
            progress.console.log("a line of its own")
            time.sleep(0.1)
    assert "still running" not in capsys.readouterr().err
