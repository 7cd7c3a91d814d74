"""PNG plots that go into the converted repo and its card (matplotlib, no display needed)."""

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .peers import perplexities_on  # noqa: E402


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
    ax.set_title("Attention JS divergence to the best-matched head of the previous layer", fontsize=9)
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
    top.set_title("FASC: parameters kept per linear (1 = dense) and dependence-violation score rho", fontsize=9)
    bottom.bar(range(len(names)), rho, color="tab:orange")
    bottom.set_ylabel("rho")
    bottom.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _short(text: str, width: int = 28) -> str:
    """A text's name for a tick label: without its description in brackets, wrapped to `width` characters."""
    return "\n".join(textwrap.wrap(text.split(" (")[0], width)) or text


def perplexity_bars(rows: list[dict], limit: float | None, path: Path) -> Path:
    """Original and converted perplexity on every gated text, side by side, each pair labelled with its text and the
    change (the gate applies to each)."""
    fig, ax = plt.subplots(figsize=(max(4.5, 2.6 * len(rows) + 1.2), 3.6))
    width = 0.38
    for i, row in enumerate(rows):
        values = (row["original"]["perplexity"], row["converted"]["perplexity"])
        for offset, value, colour, label in ((-width / 2, values[0], "tab:gray", "original"), (width / 2, values[1], "tab:green", "converted")):
            ax.bar(i + offset, value, width, color=colour, label=label if i == 0 else None)
            ax.annotate(f"{value:.2f}", (i + offset, value), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 2), textcoords="offset points")
        ax.annotate(f"{row['perplexity_increase_pct']:+.2f}%", (i, max(values)), ha="center", va="bottom", fontsize=9,
                    xytext=(0, 14), textcoords="offset points", weight="bold")
    ax.set_xticks(range(len(rows)), [_short(row["eval_text"]) for row in rows], fontsize=8)
    ax.set_ylabel("perplexity (held-out tokens)")
    ax.set_ylim(0, max(max(r["original"]["perplexity"], r["converted"]["perplexity"]) for r in rows) * 1.3)
    gate = f" (gate: at most +{limit:g}% on each)" if limit is not None else ""
    ax.set_title(f"Perplexity on every gated text{gate}", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def speed_bars(speed: dict, path: Path) -> Path:
    """Prefill and decode tokens/s of original and converted, measured side by side (see speed.py); figures the noise
    check did not trust are titled so, with no ratio."""
    untrusted = speed.get("trusted") is False
    fig, axes = plt.subplots(1, 2, figsize=(6.5, 3.4 if untrusted else 3))
    for ax, phase, label in ((axes[0], "prefill", f"prefill ({speed['original']['prefill_tokens']} tokens)"), (axes[1], "decode", "decode")):
        values = [speed[name][f"{phase}_tokens_per_s"] for name in ("original", "converted")]
        ax.bar(["original", "converted"], values, color=["tab:gray", "tab:green"])
        for x, value in enumerate(values):
            ax.text(x, value, f"{value:.1f}", ha="center", va="bottom")
        ax.set_title(f"{label}: not trusted" if untrusted else f"{label}: {speed[phase + '_speedup']:.2f}x")
        ax.set_ylabel("tokens/s (median)")
    reasons = "\n".join(textwrap.wrap("NOT TRUSTED: " + "; ".join(speed["noise"]["reasons"]), 110)) + "\n" if untrusted else ""
    fig.suptitle(reasons + speed["hardware"], fontsize=7, color="tab:red" if untrusted else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def learning_curve(record: dict, path: Path) -> Path:
    """Distillation: KL per token against tokens trained, and perplexity on every evaluation text at the curve points."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    kl = record["kl"]
    # markers: a short run has one KL point, which a line alone does not draw
    left.plot([row["tokens"] for row in kl], [row["kl"] for row in kl], color="tab:blue", marker="o", markersize=4)
    left.set_xlim(0, max(row["tokens"] for row in kl) * 1.08)  # the same origin as the perplexity panel
    left.set_xlabel("tokens trained")
    left.set_ylabel("KL(original || converted)\nper token")
    if all(row["kl"] > 0 for row in kl):
        left.set_yscale("log")
    left.set_title("training loss", fontsize=8)
    points = record["perplexity"]
    for text in [k for k in points[0] if k != "tokens"]:
        right.plot([p["tokens"] for p in points], [p[text] for p in points], marker="o", label=_short(text, 40))
    right.set_xlabel("tokens trained")
    right.set_ylabel(f"perplexity\n({record['curve_tokens']} tokens per text)")
    right.set_title("held-out perplexity", fontsize=8)
    right.legend(fontsize=7)
    fig.suptitle("Distillation learning curve", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tradeoff(report: dict, path: Path) -> Path:
    """Perplexity against KV cache a token, and, where the speed run timed the peers, against decode speed (both
    relative to the original), one panel per gated text: the original, this conversion, the frontier of its plan at
    other budgets (training-free) and the training-free peers (peers.py)."""
    peers, texts = report["peers"], report["validation"]["texts"]
    values = peers["kv_values_per_token"]
    speed = report.get("speed") or {}
    timed = (speed.get("peers") or {}) if speed.get("trusted") is not False else {}  # untrusted speed is no axis
    axes_of = [("KV cache a token (original = 1, left is better)", "kv")]
    if timed:
        axes_of.append(("decode tokens/s, batch 1 (original = 1, right is better)", "decode"))
    styles = {"attention-drop": ("o", "tab:orange"), "layer-drop": ("s", "tab:red"), "kv-quantized": ("^", "tab:purple"), "key-pca": ("P", "tab:brown")}
    fig, axes = plt.subplots(len(axes_of), len(texts), figsize=(4.6 * len(texts), 3.6 * len(axes_of)), squeeze=False)
    for row, (label, measure) in enumerate(axes_of):
        for i, (ax, text) in enumerate(zip(axes[row], texts)):
            own = values["converted"] / values["original"] if measure == "kv" else speed["decode_speedup"]
            ax.scatter([1.0], [text["original"]["perplexity"]], marker="D", color="tab:gray", label="original", zorder=3)
            ax.scatter([own], [text["converted"]["perplexity"]], marker="*", s=160, color="tab:green", label="this conversion", zorder=4)
            tried = [a for a in report.get("back_off") or [] if a.get("kv_ratio") is not None and not a["gate_passed"]]
            if measure == "kv" and tried:  # the plans --back-off tried before this one, each on its own KV cache
                ax.scatter([a["kv_ratio"] for a in tried], [text["original"]["perplexity"] * (1 + a["texts"][i]["perplexity_increase_pct"] / 100) for a in tried],
                           marker="x", color="tab:green", label="gate failed (back-off)", zorder=3)  # fmt: skip
            frontier = sorted(peers.get("frontier") or [], key=lambda point: point["kv_ratio"])
            if measure == "kv" and frontier:  # this conversion's plan at other budgets, training-free (peers.py)
                ax.plot([p["kv_ratio"] for p in frontier], [perplexities_on(p, texts)[i] for p in frontier], marker=".",
                        linestyle="--", color="tab:green", alpha=0.7, label="this plan, training-free", zorder=2)  # fmt: skip
            for kind, (marker, color) in styles.items():
                rows = [p for p in peers["peers"] if p["kind"] == kind and (measure == "kv" or p["name"] in timed)]
                if rows:
                    x = [p["kv_ratio"] if measure == "kv" else timed[p["name"]]["decode_speedup"] for p in rows]
                    ax.scatter(x, [perplexities_on(p, texts)[i] for p in rows], marker=marker, color=color, label=kind, zorder=3)
            ax.set_xlabel(label, fontsize=8)
            ax.set_ylabel("perplexity")
            ax.set_title(text["eval_text"].split(" (")[0], fontsize=9)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Against training-free peers at this KV saving, and this plan at other budgets (lower is better)", fontsize=9)
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
    rows = validation.get("texts") or [{
        "eval_text": validation.get("eval_text") or "held-out text", "original": validation["original"],
        "converted": validation["converted"], "perplexity_increase_pct": validation["perplexity_increase_pct"],
    }]
    perplexity_bars(rows, validation.get("max_ppl_increase_pct"), directory / "perplexity.png")
    plots["perplexity"] = "plots/perplexity.png"
    distill = (report.get("finishers") or {}).get("distillation")
    if distill and distill["kl"]:
        learning_curve(distill, directory / "distillation.png")
        plots["distillation"] = "plots/distillation.png"
    if report.get("speed"):
        speed_bars(report["speed"], directory / "speed.png")
        plots["speed"] = "plots/speed.png"
    peers = report.get("peers")
    if peers and peers["kv_values_per_token"]["converted"] < peers["kv_values_per_token"]["original"]:
        tradeoff(report, directory / "tradeoff.png")
        plots["tradeoff"] = "plots/tradeoff.png"
    return plots
