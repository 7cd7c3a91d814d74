"""Helpers of the vLLM plugin tests (a module of its own: tests/conftest.py is the other `conftest`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def main_python() -> str:
    python = os.environ.get("HFCOMPRESS_MAIN_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    if not Path(python).is_file():
        pytest.fail(f"{python} is missing: the plugin tests compare with the remote code in the main environment; run scripts/install.sh")
    return python


def child_env() -> dict[str, str]:
    # HFCOMPRESS_VLLM_ATTENTION=kernel: the shared layers attend with the C++ kernel or the engine fails (no silent
    # torch fallback in the end-to-end tests; the torch path is the kernel's reference in test_lisa_kernel.py)
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore",
                HFCOMPRESS_VLLM_ATTENTION=os.environ.get("HFCOMPRESS_VLLM_ATTENTION", "kernel"))


def build_references(root: Path, names: list[str], timeout: int = 1500) -> None:
    todo = [n for n in names if not (root / f"{n}.json").is_file()]
    if not todo:
        return
    proc = subprocess.run(
        [main_python(), str(HERE / "reference.py"), str(root), *todo], capture_output=True, text=True,
        env=child_env(), timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]


def serve(args: list[str], timeout: int = 900, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run tests/vllm/serve_check.py (or another script of this folder) in a fresh process of this interpreter (`env`:
    variables added to its environment)."""
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=dict(child_env(), **(env or {})), timeout=timeout,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
