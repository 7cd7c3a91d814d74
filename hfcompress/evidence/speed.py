"""Side-by-side speed: prefill and decode tokens/s of two models in one process, same prompt, medians.

A ratio is only as good as the machine was quiet while it was measured: the runs use a fixed number of torch threads
(one, unless HFCOMPRESS_SPEED_THREADS says otherwise), alternate the models round by round, and every measurement
comes with a noise verdict (`noise_verdict`: the load average, the share of a core the timed thread had,
the spread of the per-round ratios). Figures that fail it are measured again (at most SPEED_ATTEMPTS times) and
otherwise kept in the report marked untrusted, with the reason; the card and the console then state no ratio.
"""

import os
import platform
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..conversion.build import cast_parameters
from ..errors import HfcompressError
from ..progress import activity, console, heartbeat

# One torch thread by default: a ratio of two models should not depend on how well OpenMP scales each one, and on a
# shared machine one free core is far more likely than all of them (two threads on a busy 2-core machine read 0.38x
# for a model that is 1.0x on one thread). HFCOMPRESS_SPEED_THREADS=N measures with N threads instead.
SPEED_THREADS_ENV = "HFCOMPRESS_SPEED_THREADS"
DEFAULT_SPEED_THREADS = 1
# The 1-minute load average per core above which other work competes for the cores (1.0 is every core busy; the
# conversion's own threads still count in it for a while after distillation, hence the margin of a quarter core).
MAX_LOAD_PER_CORE = 1.25
# The least share of a core the timed thread must get (its CPU seconds over the wall seconds): below 90%, other
# processes took more time than the few-to-tens of percent that the ratios resolve. One thread only: with several,
# OpenMP's idle threads lower it without any contention.
MIN_CPU_SHARE = 0.9
# The largest max/min of a model's per-round ratio to the first model (each round times every model back to back): a
# ratio that moves by more than 15% between rounds measured the machine, not the models.
MAX_RATIO_SPREAD = 1.15
SPEED_ATTEMPTS = 2  # measurements at most: the first, and one more when it was not trusted for a passing reason


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


def speed_threads() -> int:
    """The torch threads speed is measured with: HFCOMPRESS_SPEED_THREADS, else DEFAULT_SPEED_THREADS."""
    value = os.environ.get(SPEED_THREADS_ENV, "").strip()
    if not value:
        return DEFAULT_SPEED_THREADS
    if not value.isdigit() or int(value) < 1:
        raise HfcompressError(
            f"{SPEED_THREADS_ENV} must be a torch thread count of at least 1, got {value!r}: unset it to measure on one thread."
        )
    return int(value)


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to `count` for the block, and set back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class NoiseReading:
    """How quiet the machine was during one speed measurement."""

    load_average: float | None  # os.getloadavg()'s 1-minute figure, the higher of before and after; None: unknown
    cpu_count: int
    threads: int  # torch threads the timed runs used
    cpu_share: float | None  # the process's CPU seconds / (wall seconds x threads) over the timed rounds; None: CUDA
    ratio_spreads: dict[str, float] = field(default_factory=dict)  # "decode converted" -> max/min over the rounds


@dataclass(frozen=True)
class NoiseVerdict:
    trusted: bool
    reasons: list[str]
    transient: bool  # only reasons another measurement right away may not have (not the 1-minute load average)


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None


def noise_verdict(reading: NoiseReading) -> NoiseVerdict:
    """Whether figures measured under `reading` can be presented as results, and if not, why (see the constants)."""
    reasons, busy = [], False
    if reading.load_average is not None and reading.load_average > MAX_LOAD_PER_CORE * reading.cpu_count:
        busy = True
        reasons.append(f"the machine was busy (load average {reading.load_average:.1f} on {reading.cpu_count} cores)")
    if reading.threads == 1 and reading.cpu_share is not None and reading.cpu_share < MIN_CPU_SHARE:
        share = f"{100 * reading.cpu_share:.0f}%"
        reasons.append(f"the timed thread had a core {share} of the time (other processes took the rest)")
    if reading.ratio_spreads:
        name, spread = max(reading.ratio_spreads.items(), key=lambda item: item[1])
        if spread > MAX_RATIO_SPREAD:
            reasons.append(f"the {name} ratio varied {spread:.2f}x between rounds")
    return NoiseVerdict(not reasons, reasons, bool(reasons) and not busy)


def ratio_spreads(times: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    """Per phase and model after the first: max/min over the rounds of its time over the first model's time in the
    same round. With one model, the max/min of its own times."""
    spreads = {}
    for phase, per_model in times.items():
        names = list(per_model)
        first = per_model[names[0]]
        for name in names[1:] or names:
            ratios = [t / f for t, f in zip(per_model[name], first)] if name != names[0] else first
            spreads[f"{phase} {name}"] = max(ratios) / min(ratios)
    return spreads


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


def hardware_description(device: torch.device | None = None, threads: int | None = None) -> str:
    """What ran the conversion or produced the speed figures (the CUDA device when there is one), in words; `threads`:
    the torch threads the figures used (default: torch's current count)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA)"
    model_name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        model_name = names[0] if names else model_name
    threads = threads or torch.get_num_threads()
    return f"CPU ({model_name}, {os.cpu_count()} cores, torch {threads} thread{'s' if threads > 1 else ''})"


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


def _timed_rounds(
    models: dict[str, nn.Module], ids: torch.Tensor, new_tokens: int, repeats: int, label: str
) -> tuple[dict[str, dict[str, list[float]]], dict, dict, float | None]:  # fmt: skip
    """`repeats` rounds, each timing every model back to back (A, B, A, B, ...): ({"prefill"|"decode": {name:
    seconds per round}}, peak CUDA MB, KV cache MB, the process's share of a core per thread over the rounds)."""
    times = {"prefill": {name: [] for name in models}, "decode": {name: [] for name in models}}
    peak, sizes = {}, {name: {} for name in models}
    cpu, wall = time.process_time(), time.perf_counter()
    for rep in range(repeats):
        for name, model in models.items():
            activity(f"{label}round {rep + 1}/{repeats}, {name}")
            if ids.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(ids.device)
            times["prefill"][name].append(_prefill_seconds(model, ids))
            times["decode"][name].append(_decode_seconds(model, ids, new_tokens, sizes[name]))
            if ids.device.type == "cuda":
                peak[name] = torch.cuda.max_memory_allocated(ids.device) / 2**20
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    share = None if ids.device.type == "cuda" else cpu / (wall * torch.get_num_threads())
    return times, peak, sizes, share


def compare_speed(
    models: dict[str, nn.Module], ids: torch.Tensor, new_tokens: int = 32, repeats: int = 5,
    threads: int | None = None, attempts: int = SPEED_ATTEMPTS,
) -> tuple[dict[str, SpeedResult], dict]:  # fmt: skip
    """Interleaved measurements (A, B, A, B, ...) after one warm-up each, so machine noise hits both alike, on
    `threads` torch threads (default speed_threads()). Returns (per model, the noise record: trusted, reasons, the
    reading, attempts); an untrusted measurement is repeated while its reasons may pass, `attempts` times at most."""
    threads = threads or speed_threads()
    with torch_threads(threads), heartbeat("speed"):
        for model in models.values():
            _prefill_seconds(model, ids)
            _decode_seconds(model, ids[:, :8], 2)
        for attempt in range(1, attempts + 1):
            load_before = load_average()
            label = f"attempt {attempt}/{attempts}, " if attempt > 1 else ""
            times, peak, sizes, share = _timed_rounds(models, ids, new_tokens, repeats, label)
            loads = [x for x in (load_before, load_average()) if x is not None]
            reading = NoiseReading(max(loads) if loads else None, os.cpu_count() or 1, threads, share, ratio_spreads(times))
            verdict = noise_verdict(reading)
            if verdict.trusted or not verdict.transient or attempt == attempts:
                break
            console.log(f"speed: not trusted ({'; '.join(verdict.reasons)}): measuring again", highlight=False)
    noise = {"trusted": verdict.trusted, "reasons": verdict.reasons, "attempts": attempt, **asdict(reading)}
    if not verdict.trusted:
        console.log(f"[yellow]speed: the figures are not trusted: {'; '.join(verdict.reasons)}[/]", highlight=False)
    results = {
        name: SpeedResult(
            prefill_tokens=ids.shape[1],
            prefill_tokens_per_s=ids.shape[1] / statistics.median(times["prefill"][name]),
            decode_tokens=new_tokens,
            decode_tokens_per_s=new_tokens / statistics.median(times["decode"][name]),
            peak_memory_mb=peak.get(name),
            weights_mb=_megabytes([*model.parameters(), *model.buffers()]),
            cache_mb=sizes[name]["cache_mb"],
        )
        for name, model in models.items()
    }
    return results, noise


def measure_speed(
    original: nn.Module, converted: nn.Module, ids: torch.Tensor, prompt_tokens: int = 512, new_tokens: int = 32,
    repeats: int = 3, gpu_dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None,
    peers: dict[str, nn.Module] | None = None,
) -> dict:  # fmt: skip
    """Original vs converted in this process on `device` (default: the best here); the record `convert` keeps and
    the card shows. On CUDA both run in `gpu_dtype` (the saved dtype); on CPU in float32, the fast CPU path. `peers`
    (name -> model, peers.speed_peers) are timed in the same interleaved loop, each against the same original.
    `trusted` is the noise verdict of compare_speed: when False the ratios are kept for the record, never shown as a
    result (`noise.reasons` says why)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = gpu_dtype if device.type == "cuda" else torch.float32
    peers = peers or {}
    models = {"original": original, "converted": converted, **peers}
    working_dtypes = {name: next(model.parameters()).dtype for name, model in models.items()}
    prompt = ids[:prompt_tokens].unsqueeze(0).to(device)
    try:
        on_device = {name: cast_parameters(model.to(device), dtype) for name, model in models.items()}
        measured, noise = compare_speed(on_device, prompt, new_tokens, repeats)
    finally:  # each model back on the CPU in its own working dtype
        for name, model in models.items():
            cast_parameters(model.to("cpu"), working_dtypes[name])
    orig, conv = measured["original"], measured["converted"]
    prefill_ratio = conv.prefill_tokens_per_s / orig.prefill_tokens_per_s
    decode_ratio = conv.decode_tokens_per_s / orig.decode_tokens_per_s
    if noise["trusted"]:
        console.log(
            f"speed: converted/original prefill {prefill_ratio:.2f}x, decode {decode_ratio:.2f}x ({noise['threads']} "
            f"torch thread(s), medians of {repeats} interleaved rounds)", highlight=False,
        )  # fmt: skip
    return {
        "hardware": hardware_description(device, noise["threads"]),
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "repeats": repeats,
        "threads": noise["threads"],
        "trusted": noise["trusted"],
        "noise": noise,
        "original": orig.to_dict(),
        "converted": conv.to_dict(),
        "prefill_speedup": prefill_ratio,
        "decode_speedup": decode_ratio,
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
