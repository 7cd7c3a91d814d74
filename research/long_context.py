"""Long-context speed of an original model against its conversion (benchmarks/long_context.py): per cell of a grid,
prefill or decode tokens/s and the KV cache after the prompt, in one process, repetitions interleaved, medians.
Research code, not in the wheel; the conversion's own speed step is hfcompress/evidence/speed.py."""

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from hfcompress.evidence.speed import _cache_megabytes, _prefill_seconds, _sync

# (phase, batch, context): decode = tokens/s of cached greedy steps after a `context`-token prompt (and the KV cache
# that prompt leaves), prefill = tokens/s of the prompt itself
LONG_CONTEXT_GRID = (
    ("decode", 1, 512), ("decode", 4, 2048), ("decode", 1, 8192), ("prefill", 1, 512), ("prefill", 1, 8192),
)  # fmt: skip


def cell_name(phase: str, batch: int, context: int) -> str:
    return f"{phase} {batch}x{context}"


@torch.no_grad()
def _prefilled(model: nn.Module, ids: torch.Tensor) -> tuple[object, torch.Tensor, float]:
    """(cache, next token, cache MB) after an untimed cached prefill of `ids`."""
    out = model(ids, use_cache=True, logits_to_keep=1)
    return out.cache, out.logits[:, -1:].argmax(-1), _cache_megabytes(out.cache)


@torch.no_grad()
def _timed_decode(model: nn.Module, cache, token: torch.Tensor, context: int, new_tokens: int) -> float:
    """Seconds of `new_tokens` greedy steps from the cache cropped back to the prompt (so repetitions start alike)."""
    cache.crop(context - cache.get_seq_length())  # crop takes the number of tokens to remove, negated
    _sync(token.device)
    start = time.perf_counter()
    for _ in range(new_tokens):
        out = model(token, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    _sync(token.device)
    return time.perf_counter() - start


def long_context_speed(
    models: dict[str, nn.Module], grid: Sequence[tuple[str, int, int]] = LONG_CONTEXT_GRID, new_tokens: int = 16,
    repeats: int = 3, long_repeats: int | None = None, long_prefill: int = 8192, vocab_size: int | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> list[dict]:  # fmt: skip
    """Per grid cell, each model's median tokens/s (and KV cache MB after the prompt, for decode cells), measured in
    this process with repetitions interleaved (A, B, A, B, ...) after one warm-up each. Prompts are random token ids:
    speed does not depend on the text. A decode cell prefills once per model (untimed) and crops the cache back to the
    prompt before each repetition. Prefill cells of `long_prefill` tokens or more run `long_repeats` times (default
    `repeats`): one such prefill takes minutes on a CPU. Rows: phase, batch, context, repeats, new_tokens (decode),
    per model {tokens_per_s, cache_mb}, speedup (second model over the first) and cache_ratio (decode)."""
    names = list(models)
    device = next(models[names[0]].parameters()).device
    vocab_size = vocab_size or models[names[0]].config.vocab_size
    generator = torch.Generator().manual_seed(0)
    for model in models.values():  # warm-up: first-call allocations and lazy initialisations
        cache, token, _ = _prefilled(model, torch.randint(vocab_size, (1, 8), generator=generator).to(device))
        _timed_decode(model, cache, token, 8, 2)
    rows = []
    for phase, batch, context in grid:
        ids = torch.randint(vocab_size, (batch, context), generator=generator).to(device)
        cell = cell_name(phase, batch, context)
        times: dict[str, list[float]] = {name: [] for name in names}
        cache_mb: dict[str, float | None] = dict.fromkeys(names)
        if phase == "decode":
            runs, prefilled = repeats, {}
            for name in names:
                progress(f"{cell}: prefill {name}")
                cache, token, cache_mb[name] = _prefilled(models[name], ids)
                prefilled[name] = (cache, token)
            for rep in range(runs):
                for name in names:
                    progress(f"{cell}: decode {name}, repetition {rep + 1}/{runs}")
                    seconds = _timed_decode(models[name], *prefilled[name], context, new_tokens)
                    times[name].append(seconds / (batch * new_tokens))
            del prefilled
        elif phase == "prefill":
            runs = (long_repeats or repeats) if context >= long_prefill else repeats
            for rep in range(runs):
                for name in names:
                    progress(f"{cell}: {name}, repetition {rep + 1}/{runs}")
                    times[name].append(_prefill_seconds(models[name], ids) / (batch * context))
        else:
            raise ValueError(f"unknown phase {phase!r}: decode or prefill")
        per_model = {
            name: {"tokens_per_s": 1 / statistics.median(times[name]), "cache_mb": cache_mb[name]} for name in names
        }
        first, second = (per_model[name] for name in names[:2])
        rows.append({
            "phase": phase, "batch": batch, "context": context, "repeats": runs,
            "new_tokens": new_tokens if phase == "decode" else None, **per_model,
            "speedup": second["tokens_per_s"] / first["tokens_per_s"],
            "cache_ratio": second["cache_mb"] / first["cache_mb"] if phase == "decode" else None,
        })  # fmt: skip
        progress(f"{cell}: {rows[-1]['speedup']:.2f}x")
    return rows


def long_context_table(rows: list[dict], names: tuple[str, str] = ("original", "converted")) -> str:
    """Markdown table of `long_context_speed` rows (tokens/s counts every sequence of the batch)."""
    first, second = names
    lines = [
        f"| cell | {first} tok/s | {second} tok/s | speedup | {first} KV cache | {second} KV cache | cache ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cache = ["–", "–", "–"]
        if row["cache_ratio"] is not None:
            sizes = (row[first]["cache_mb"], row[second]["cache_mb"])
            cache = [f"{sizes[0]:.1f} MB", f"{sizes[1]:.1f} MB", f"{row['cache_ratio']:.2f}x"]
        lines.append(
            f"| {cell_name(row['phase'], row['batch'], row['context'])} | {row[first]['tokens_per_s']:.1f} | "
            f"{row[second]['tokens_per_s']:.1f} | {row['speedup']:.2f}x | {' | '.join(cache)} |"
        )
    return "\n".join(lines)
