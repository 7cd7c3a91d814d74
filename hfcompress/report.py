"""The typed record of one conversion: what the card, the push, `hfcompress eval` and the benchmarks read.

Saved as `hfcompress_report.json` in the output. Method sections (`lisa`, `fasc`, ...) come from the methods
themselves and appear as top-level keys of the JSON, next to the driver's sections.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

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

    def to_dict(self) -> dict:
        data = asdict(self)
        methods = data.pop("methods")
        return {**data, **methods}

    def save(self, directory: Path) -> None:
        (Path(directory) / REPORT_FILE).write_text(json.dumps(self.to_dict(), indent=2, default=str))
