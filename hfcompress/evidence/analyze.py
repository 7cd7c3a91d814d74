"""`hfcompress analyze`: per-layer attention similarity (and optionally FASC rho) without converting.

It opens the conversion's own run (run.Run.open) and runs its calibration step (passes.calibrate) with the same
cache, so a later `convert` of the same model and text resumes from them.
"""

import json
from contextlib import nullcontext
from pathlib import Path

import torch
from rich.table import Table

from ..conversion.config import ConvertOptions
from ..fasc import FascMethod
from ..lisa import LisaMethod
from ..conversion.methods import Planner
from ..conversion.passes import calibrate
from .plots import similarity_heatmap
from ..progress import console
from ..conversion.run import Run
from ..sources.source import is_local_source
from ..sources.text import local_source_texts


def analyze(options: ConvertOptions, plot: Path, json_path: Path | None) -> dict:
    lisa = LisaMethod.from_options(options)
    methods = [lisa] + ([FascMethod.from_options(options)] if options.fasc.budget < 1.0 else [])
    with local_source_texts() if is_local_source(options.source) else nullcontext():  # a local source stays offline
        run = Run.open(options, methods)
    calibrate(run, methods)
    lisa.plan(Planner(run.stream.config, run.stream.num_layers))
    similarity, chosen = lisa.similarity, lisa.chosen
    rho = {}
    if len(methods) > 1:
        for idx in range(run.stream.num_layers):
            rho.update(torch.load(methods[1].store / f"fasc-{idx}.pt")["rhos"])

    table = Table(title=f"{run.source.name}: attention similarity to the previous layer (JS, nats)")
    columns = (
        "layer", "JS same head", "JS best match", "aligned output error", "attention energy", "matching (head <- prev head)",
        "shared",
    )  # fmt: skip
    for column in columns:
        table.add_column(column)
    if rho:
        table.add_column("mean rho")
    for row in similarity:
        cells = [
            str(row.layer),
            f"{row.js_same_head:.3f}",
            f"{row.js_best_match:.3f}",
            f"{row.aligned_output_error:.3f}",
            f"{row.attention_energy:.4f}",  # what dropping its attention changes (layer_plan.py)
            " ".join(map(str, row.matching)),
            "yes" if row.layer in chosen else "",
        ]
        if rho:
            layer_rho = [v for k, v in rho.items() if k.split(".")[0] == str(row.layer)]
            cells.append(f"{sum(layer_rho) / len(layer_rho):.3f}")
        table.add_row(*cells)
    console.print(table)
    plot.parent.mkdir(parents=True, exist_ok=True)
    similarity_heatmap([s.to_dict() for s in similarity], chosen, plot)
    console.print(f"heatmap: {plot}")
    result = {
        "source": run.source.to_dict(),
        "similarity": [s.to_dict() for s in similarity],
        "selected_at_share_ratio": {"share_ratio": options.lisa.ratio, "layers": chosen},
        "rho": rho,
        "cache": str(run.calib_dir),
    }
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
    return result
