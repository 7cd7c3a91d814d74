"""Side-by-side speed: prefill and decode tokens/s of two models in one process, same prompt, medians."""

import os
import platform
import statistics
import time
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
) -> dict:
    """Original vs converted in this process on `device` (default: the best here); the record `convert` keeps and
    the card shows. On CUDA both run in `gpu_dtype` (the saved dtype); on CPU in float32, the fast CPU path."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = gpu_dtype if device.type == "cuda" else torch.float32
    models = {"original": original, "converted": converted}
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
    }
