"""The quality gate: the converted model's perplexity on every evaluation text within `--max-ppl-increase` of the
original's on the same tokens. A NaN/inf perplexity is refused before anything is written."""

import math

from ..errors import HfcompressError
from .validate import PerplexityResult


def refuse_non_finite(results: dict[str, tuple[PerplexityResult, PerplexityResult]]) -> None:
    for text, pair in results.items():
        for name, ppl in zip(("source", "converted"), pair):
            if not math.isfinite(ppl.perplexity):  # NaN would slip through the gate comparison as "failed"
                raise HfcompressError(
                    f"The {name} model's perplexity is {ppl.perplexity} on {text.split(' (')[0]} (NaN/inf logits): its "
                    "weights overflow; nothing was written."
                )


def quality_gate(results: dict[str, tuple[PerplexityResult, PerplexityResult]], limit: float) -> tuple[list[dict], bool, str]:
    """Per text {eval_text, original, converted, perplexity_increase_pct}; passed when every text is within `limit`."""
    rows = [
        {"eval_text": text, "original": original.to_dict(), "converted": converted.to_dict(),
         "perplexity_increase_pct": 100.0 * (converted.perplexity / original.perplexity - 1.0)}
        for text, (original, converted) in results.items()
    ]
    passed = all(row["perplexity_increase_pct"] <= limit for row in rows)
    message = "; ".join(
        f"perplexity on {row['eval_text'].split(' (')[0]} {row['original']['perplexity']:.3f} -> "
        f"{row['converted']['perplexity']:.3f} ({row['perplexity_increase_pct']:+.2f}%)" for row in rows
    )
    return rows, passed, f"{message}; limit +{limit:g}% on each"
