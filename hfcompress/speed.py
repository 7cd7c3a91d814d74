"""Side-by-side speed: prefill and decode tokens/s of two models in one process, same prompt, medians."""

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .build import cast_parameters


@dataclass
class SpeedResult:
    prefill_tokens: int
    prefill_tokens_per_s: float
    decode_tokens: int
    decode_tokens_per_s: float
    peak_memory_mb: float | None  # CUDA only; None on CPU
    weights_mb: float  # parameters and buffers, tied weights once
    cache_mb: float  # KV cache after the prompt and the decoded tokens

    def to_dict(self) -> dict:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _prefill_seconds(model: nn.Module, ids: torch.Tensor) -> float:
    device = ids.device
    _sync(device)
    start = time.perf_counter()
    model(ids, use_cache=False, logits_to_keep=1)
    _sync(device)
    return time.perf_counter() - start


def hardware_description(device: torch.device | None = None) -> str:
    """What ran the conversion or produced the speed figures (the CUDA device when there is one), in words."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA)"
    model_name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        model_name = names[0] if names else model_name
    return f"CPU ({model_name}, {os.cpu_count()} cores, torch {torch.get_num_threads()} threads)"


def _megabytes(tensors) -> float:
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is not None and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total / 2**20


def _cache_megabytes(cache) -> float:
    """Bytes held by a transformers Cache (a LISA layer holds low-rank K and V, a full layer K and V)."""
    return _megabytes(t for layer in getattr(cache, "layers", []) for t in (getattr(layer, "keys", None), getattr(layer, "values", None)))


@torch.no_grad()
def _decode_seconds(model: nn.Module, ids: torch.Tensor, new_tokens: int, sizes: dict | None = None) -> float:
    """Time of `new_tokens` cached greedy decode steps after a prefill (the prefill is not timed)."""
    device = ids.device
    out = model(ids, use_cache=True, logits_to_keep=1)
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    _sync(device)
    start = time.perf_counter()
    for _ in range(new_tokens):
        out = model(token, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    _sync(device)
    if sizes is not None:
        sizes["cache_mb"] = _cache_megabytes(cache)
    return time.perf_counter() - start


def compare_speed(
    models: dict[str, nn.Module], ids: torch.Tensor, new_tokens: int = 32, repeats: int = 5
) -> dict[str, SpeedResult]:
    """Interleaved measurements (A, B, A, B, ...) after one warm-up each, so machine noise hits both alike."""
    prefill = {name: [] for name in models}
    decode = {name: [] for name in models}
    for model in models.values():
        _prefill_seconds(model, ids)
        _decode_seconds(model, ids[:, :8], 2)
    peak, sizes = {}, {name: {} for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            if ids.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(ids.device)
            prefill[name].append(_prefill_seconds(model, ids))
            decode[name].append(_decode_seconds(model, ids, new_tokens, sizes[name]))
            if ids.device.type == "cuda":
                peak[name] = torch.cuda.max_memory_allocated(ids.device) / 2**20
    return {
        name: SpeedResult(
            prefill_tokens=ids.shape[1],
            prefill_tokens_per_s=ids.shape[1] / statistics.median(prefill[name]),
            decode_tokens=new_tokens,
            decode_tokens_per_s=new_tokens / statistics.median(decode[name]),
            peak_memory_mb=peak.get(name),
            weights_mb=_megabytes([*model.parameters(), *model.buffers()]),
            cache_mb=sizes[name]["cache_mb"],
        )
        for name, model in models.items()
    }


def measure_speed(
    original: nn.Module, converted: nn.Module, ids: torch.Tensor, prompt_tokens: int = 512, new_tokens: int = 32,
    repeats: int = 3, gpu_dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None,
    peers: dict[str, nn.Module] | None = None,
) -> dict:  # fmt: skip
    """Original vs converted in this process on `device` (default: the best here); the record `convert` keeps and
    the card shows. On CUDA both run in `gpu_dtype` (the saved dtype); on CPU in float32, the fast CPU path. `peers`
    (name -> model, peers.speed_peers) are timed in the same interleaved loop, each against the same original."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = gpu_dtype if device.type == "cuda" else torch.float32
    peers = peers or {}
    models = {"original": original, "converted": converted, **peers}
    working_dtypes = {name: next(model.parameters()).dtype for name, model in models.items()}
    prompt = ids[:prompt_tokens].unsqueeze(0).to(device)
    try:
        on_device = {name: cast_parameters(model.to(device), dtype) for name, model in models.items()}
        measured = compare_speed(on_device, prompt, new_tokens, repeats)
    finally:  # each model back on the CPU in its own working dtype
        for name, model in models.items():
            cast_parameters(model.to("cpu"), working_dtypes[name])
    orig, conv = measured["original"], measured["converted"]
    return {
        "hardware": hardware_description(device),
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "repeats": repeats,
        "original": orig.to_dict(),
        "converted": conv.to_dict(),
        "prefill_speedup": conv.prefill_tokens_per_s / orig.prefill_tokens_per_s,
        "decode_speedup": conv.decode_tokens_per_s / orig.decode_tokens_per_s,
        **({"peers": {
            name: {
                "prefill_tokens_per_s": measured[name].prefill_tokens_per_s,
                "decode_tokens_per_s": measured[name].decode_tokens_per_s,
                "prefill_speedup": measured[name].prefill_tokens_per_s / orig.prefill_tokens_per_s,
                "decode_speedup": measured[name].decode_tokens_per_s / orig.decode_tokens_per_s,
            }
            for name in peers
        }} if peers else {}),
    }  # fmt: skip


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
