"""`hfcompress analyze`: per-layer attention similarity (and optionally FASC rho) without converting.

Uses the same calibration cache as `convert`, so a later conversion of the same model and text reuses it.
"""

import json
from pathlib import Path

from rich.table import Table

from .convert import ConvertOptions, prepare
from .fasc import dependence_violation
from .lisa import select_layers
from .plots import similarity_heatmap
from .progress import console


def analyze(options: ConvertOptions, plot: Path, json_path: Path | None, with_rho: bool) -> dict:
    prepared = prepare(options)
    model = prepared.model
    similarity = prepared.similarity(prepared.attention_inputs())
    num_layers = model.config.num_hidden_layers
    chosen = select_layers(similarity, num_layers, options.lisa)
    rho = {}
    if with_rho:
        stats = prepared.linear_stats(options.fasc.targets, options.seed)
        rho = {name: dependence_violation(entry) for name, entry in stats.items()}

    table = Table(title=f"{prepared.source.name}: attention similarity to the previous layer (JS, nats)")
    columns = ("layer", "JS same head", "JS best match", "aligned output error", "matching (head <- prev head)", "shared")
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
        "source": prepared.source.to_dict(),
        "similarity": [s.to_dict() for s in similarity],
        "selected_at_share_ratio": {"share_ratio": options.lisa.share_ratio, "layers": chosen},
        "rho": rho,
        "cache": str(prepared.cache),
    }
    if json_path:
        json_path.write_text(json.dumps(result, indent=2))
    return result
