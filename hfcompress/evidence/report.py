"""The typed record of one conversion: what the card, the push, `hfcompress eval` and the benchmarks read, and how a
conversion builds it (`build_report`).

Saved as `hfcompress_report.json` in the output. Method sections (`lisa`, `fasc`, ...) come from the methods
themselves and appear as top-level keys of the JSON, next to the driver's sections.

It is pushed with the model, so it holds no absolute local path (`public_path`): a local source is its directory
name, the calibration cache its entry's name, the command line has every absolute path reduced to its last part.
"""

import json
import re
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import huggingface_hub
import torch
import transformers

from .. import __version__
from .gate import quality_gate
from ..conversion.methods import Method
from .peers import log_verdict
from ..sources.source import BUILTIN_SOURCE, ResolvedSource
from .speed import hardware_description
from ..sources.text import hub_dataset, hub_datasets
from .validate import PerplexityResult
from ..conversion.wholemodel import WholeModelResults, WholeModelSteps

REPORT_FILE = "hfcompress_report.json"

# an absolute path (or ~/...) inside free text: starts a word, so "tokens/s", "1/4" and URLs are not one
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~-])~?/[^\s'\"`,;()\[\]{}<>|*]+")


def public_path(path: str) -> str:
    """`path` as the output may show it: an absolute one (or ~/...) reduced to its last part, a relative one as given."""
    return (Path(path).name or path) if path.startswith(("/", "~")) else path


def without_local_paths(value: object) -> object:
    """`value` (a report or any part of it) with every absolute path in its strings reduced to its last part."""
    if isinstance(value, str):
        return _ABSOLUTE_PATH.sub(lambda match: public_path(match.group()), value)
    if isinstance(value, dict):
        return {key: without_local_paths(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_local_paths(item) for item in value]
    return value


def public_command(argv: list[str]) -> str:
    """The command line for the report and card: each absolute path argument (also in --option=PATH) reduced to its
    last part, so a pushed card never shows the local directories."""
    def public(arg: str) -> str:
        option, equals, value = arg.partition("=")
        return f"{option}={public_path(value)}" if equals and option.startswith("--") else public_path(arg)

    return shlex.join(["hfcompress", *map(public, argv)])


def public_source(source: ResolvedSource) -> dict:
    """The report's record of a resolved source (source.ResolvedSource) without local paths: a Hub or the built-in
    source by its name (its files' local copy is not recorded), a local directory or GGUF by its directory name."""
    record = source.to_dict()
    if source.kind == "hub" or source.name == BUILTIN_SOURCE:
        record["path"] = None
    else:  # resolved: "." names its directory too
        directory = Path(source.path).resolve().name
        record["name"], record["path"] = Path(source.name).resolve().name if source.gguf_file else directory, directory
    return record


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
    # what this run wrote into the output (paths relative to it): what a later --overwrite replaces (output.py)
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The report as saved and as the card reads it; a text or file option's absolute path is reduced to its name
        here, wherever a section quotes it."""
        data = asdict(self)
        methods = data.pop("methods")
        return without_local_paths({**data, **methods})

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
        versions=versions(), command=run.command, source=public_source(run.source), num_layers=run.stream.num_layers,
        hardware=hardware_description(run.device), device=str(run.device), processes=run.processes.count,
        calibration={"text": streams.calib_name, "sequences": len(sequences), "seq_len": int(sequences.shape[1]),
                     "tokens": int(sequences.numel()), "text_tokens": len(streams.calib_ids), "cache_dir": run.calib_dir.name,
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
