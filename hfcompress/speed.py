"""Side-by-side speed: prefill and decode tokens/s of two models in one process, same prompt, medians."""

import statistics
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass
class SpeedResult:
    prefill_tokens: int
    prefill_tokens_per_s: float
    decode_tokens: int
    decode_tokens_per_s: float
    peak_memory_mb: float | None  # CUDA only; None on CPU

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


@torch.no_grad()
def _decode_seconds(model: nn.Module, ids: torch.Tensor, new_tokens: int) -> float:
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
    peak = {}
    for _ in range(repeats):
        for name, model in models.items():
            if ids.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(ids.device)
            prefill[name].append(_prefill_seconds(model, ids))
            decode[name].append(_decode_seconds(model, ids, new_tokens))
            if ids.device.type == "cuda":
                peak[name] = torch.cuda.max_memory_allocated(ids.device) / 2**20
    return {
        name: SpeedResult(
            prefill_tokens=ids.shape[1],
            prefill_tokens_per_s=ids.shape[1] / statistics.median(prefill[name]),
            decode_tokens=new_tokens,
            decode_tokens_per_s=new_tokens / statistics.median(decode[name]),
            peak_memory_mb=peak.get(name),
        )
        for name in models
    }
