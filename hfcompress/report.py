"""The typed record of one conversion: what the card, the push, `hfcompress eval` and the benchmarks read, and how a
conversion builds it (`build_report`).

Saved as `hfcompress_report.json` in the output. Method sections (`lisa`, `fasc`, ...) come from the methods
themselves and appear as top-level keys of the JSON, next to the driver's sections.
"""

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import huggingface_hub
import torch
import transformers

from . import __version__
from .gate import quality_gate
from .methods import Method
from .peers import log_verdict
from .speed import hardware_description
from .text import hub_dataset, hub_datasets
from .validate import PerplexityResult
from .wholemodel import WholeModelResults, WholeModelSteps

REPORT_FILE = "hfcompress_report.json"


@dataclass
class Validation:
    """The gate covers every evaluation text (`texts`); the top-level figures are the calibration domain's."""

    eval_text: str
    original: dict  # PerplexityResult.to_dict()
    converted: dict
    perplexity_increase_pct: float
    max_ppl_increase_pct: float
    gate_passed: bool
    gate_message: str
    probe: dict = field(default_factory=dict)  # {"original"|"converted": {correct, total, accuracy}}
    reload: dict | None = None  # fresh-process reload check (logits or layout)
    texts: list[dict] = field(default_factory=list)  # per evaluation text: eval_text, original, converted, increase


@dataclass
class Report:
    versions: dict
    command: str
    source: dict
    num_layers: int
    hardware: str
    device: str
    processes: int
    calibration: dict
    methods: dict[str, dict]  # method name -> its report section
    finishers: dict[str, dict]  # finisher name -> its training record
    validation: Validation
    parameters: dict = field(default_factory=dict)
    speed: dict | None = None
    peers: dict | None = None  # what a user could do instead at this KV saving (peers.py)
    dtype: str = "float32"
    max_shard_size: str = "2GB"
    whole_model_steps: dict = field(default_factory=dict)  # which whole-model steps ran, and why others did not
    timings: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    plots: dict = field(default_factory=dict)
    licence: dict = field(default_factory=dict)  # the source's licence, where it was declared, the files copied (card.py)
    wall_seconds: float | None = None
    push: dict | None = None
    back_off: list[dict] | None = None  # --back-off's attempts in order, the last the written one (pipeline.py)

    def to_dict(self) -> dict:
        data = asdict(self)
        methods = data.pop("methods")
        return {**data, **methods}

    def save(self, directory: Path) -> None:
        (Path(directory) / REPORT_FILE).write_text(json.dumps(self.to_dict(), indent=2, default=str))


def versions() -> dict:
    return {
        "hfcompress": __version__,
        "transformers": transformers.__version__,
        "huggingface_hub": huggingface_hub.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


def build_report(
    run, methods: list[Method], whole: WholeModelSteps, results: WholeModelResults,
    perplexities: dict[str, tuple[PerplexityResult, PerplexityResult]],
) -> Report:
    """The report of a conversion (`run`: run.Run, not imported here: run.py reads preflight.py, which reads this
    module) before writing: the gate over every text's (original, converted) perplexities, whether a training-free
    peer dominates the result, every method's section and the whole-model steps' results. Written by output.py,
    which adds the parameters, the reload check, plots, memory and the licence."""
    options, streams = run.options, run.streams
    gate_rows, gate_passed, gate_message = quality_gate(perplexities, options.max_ppl_increase)
    for row in gate_rows:  # the Hub dataset split a text is (id, config, split, revision), for the card's model-index
        row["dataset"] = hub_dataset(row["eval_text"])
    main_row = gate_rows[0]
    if results.peers is not None:
        converted_ppl = {text: pair[1].perplexity for text, pair in perplexities.items()}
        results.peers["dominated_by"] = [peer["name"] for peer in log_verdict(results.peers, converted_ppl)]
    sequences = streams.sequences
    return Report(
        versions=versions(), command=run.command, source=run.source.to_dict(), num_layers=run.stream.num_layers,
        hardware=hardware_description(run.device), device=str(run.device), processes=run.processes.count,
        calibration={"text": streams.calib_name, "sequences": len(sequences), "seq_len": int(sequences.shape[1]),
                     "tokens": int(sequences.numel()), "text_tokens": len(streams.calib_ids), "cache_dir": str(run.calib_dir),
                     "dataset": hub_dataset(streams.calib_name), "datasets": hub_datasets(streams.calib_name)},
        methods={m.name: m.report() for m in methods}, finishers=results.finished,
        validation=Validation(
            eval_text=main_row["eval_text"], original=main_row["original"], converted=main_row["converted"],
            perplexity_increase_pct=main_row["perplexity_increase_pct"], max_ppl_increase_pct=options.max_ppl_increase,
            gate_passed=gate_passed, gate_message=gate_message, probe=results.probe, texts=gate_rows,
        ),
        speed=results.speed, peers=results.peers, dtype=str(run.saved_dtype).removeprefix("torch."),
        max_shard_size=options.max_shard_size, whole_model_steps=whole.describe(), timings=run.steps.timings,
    )
