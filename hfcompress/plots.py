"""PNG plots that go into the converted repo and its card (matplotlib, no display needed)."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def similarity_heatmap(similarity: list[dict], shared: list[int], path: Path) -> Path:
    """Per layer and head: JS divergence to the best-matched head of the previous layer; shared layers marked."""
    layers = [row["layer"] for row in similarity]
    grid = [[row["head_js_best"][h] for row in similarity] for h in range(len(similarity[0]["head_js_best"]))]
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(layers) + 2), 3.2))
    image = ax.imshow(grid, aspect="auto", cmap="viridis_r", extent=(layers[0] - 0.5, layers[-1] + 0.5, len(grid) - 0.5, -0.5))
    for layer in shared:
        ax.axvline(layer, color="red", alpha=0.35, linewidth=3)
    ax.set_xlabel("layer (red: shared with LISA)")
    ax.set_ylabel("head")
    ax.set_title("Attention JS divergence to the best-matched head of the previous layer")
    fig.colorbar(image, ax=ax, label="JS divergence (nats)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fasc_ranks_and_rho(layers: list[dict], path: Path) -> Path:
    """Kept rank fraction and rho per targeted linear."""
    names = [row["name"] for row in layers]
    kept = [1.0 if row["rank"] is None else row["rank"] * sum(row["shape"]) / (row["shape"][0] * row["shape"][1]) for row in layers]
    rho = [row["rho"] for row in layers]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 0.12 * len(names) + 2), 5), sharex=True)
    top.bar(range(len(names)), kept, color="tab:blue")
    top.set_ylabel("params kept")
    top.set_title("FASC: parameters kept per linear (1 = dense) and dependence-violation score rho")
    bottom.bar(range(len(names)), rho, color="tab:orange")
    bottom.set_ylabel("rho")
    bottom.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def perplexity_bars(original: float, converted: float, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar(["original", "converted"], [original, converted], color=["tab:gray", "tab:green"])
    for x, value in enumerate((original, converted)):
        ax.text(x, value, f"{value:.2f}", ha="center", va="bottom")
    ax.set_ylabel("perplexity (held-out)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def speed_bars(speed: dict, path: Path) -> Path:
    """Prefill and decode tokens/s of original and converted, measured side by side (see speed.py)."""
    fig, axes = plt.subplots(1, 2, figsize=(6.5, 3))
    for ax, phase, label in ((axes[0], "prefill", f"prefill ({speed['original']['prefill_tokens']} tokens)"), (axes[1], "decode", "decode")):
        values = [speed[name][f"{phase}_tokens_per_s"] for name in ("original", "converted")]
        ax.bar(["original", "converted"], values, color=["tab:gray", "tab:green"])
        for x, value in enumerate(values):
            ax.text(x, value, f"{value:.1f}", ha="center", va="bottom")
        ax.set_title(f"{label}: {speed[phase + '_speedup']:.2f}x")
        ax.set_ylabel("tokens/s (median)")
    fig.suptitle(speed["hardware"], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def learning_curve(record: dict, path: Path) -> Path:
    """Distillation: KL per token against tokens trained, and perplexity on every evaluation text at the curve points."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    kl = record["kl"]
    left.plot([row["tokens"] for row in kl], [row["kl"] for row in kl], color="tab:blue")
    left.set_xlabel("tokens trained")
    left.set_ylabel("KL(original || converted) per token")
    left.set_yscale("log")
    points = record["perplexity"]
    for text in [k for k in points[0] if k != "tokens"]:
        right.plot([p["tokens"] for p in points], [p[text] for p in points], marker="o", label=text.split(" (")[0])
    right.set_xlabel("tokens trained")
    right.set_ylabel(f"perplexity ({record['curve_tokens']} tokens)")
    right.legend(fontsize=7)
    fig.suptitle("Distillation learning curve", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(report: dict, directory: Path) -> dict[str, str]:
    """The card's PNGs from a report; returns {name: path relative to the repo root}."""
    directory.mkdir(parents=True, exist_ok=True)
    plots = {}
    lisa, fasc = report.get("lisa") or {}, report.get("fasc") or {}
    if lisa.get("similarity"):
        similarity_heatmap(lisa["similarity"], lisa["layers"], directory / "similarity.png")
        plots["similarity"] = "plots/similarity.png"
    if fasc.get("layers"):
        fasc_ranks_and_rho(fasc["layers"], directory / "fasc.png")
        plots["fasc"] = "plots/fasc.png"
    validation = report["validation"]
    perplexity_bars(validation["original"]["perplexity"], validation["converted"]["perplexity"], directory / "perplexity.png")
    plots["perplexity"] = "plots/perplexity.png"
    distill = (report.get("finishers") or {}).get("distillation")
    if distill and distill["kl"]:
        learning_curve(distill, directory / "distillation.png")
        plots["distillation"] = "plots/distillation.png"
    if report.get("speed"):
        speed_bars(report["speed"], directory / "speed.png")
        plots["speed"] = "plots/speed.png"
    return plots
