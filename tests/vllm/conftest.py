"""The vLLM plugin tests run only in .venv-vllm (scripts/install_vllm.sh): without vllm installed, this folder is skipped
(each module calls pytest.importorskip("vllm")), so the main suite in .venv is unaffected.

Their references come from the main environment (.venv, hfcompress's transformers and the remote code):
`reference.py` runs there in a subprocess. HFCOMPRESS_MAIN_PYTHON overrides its interpreter.
"""

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
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")


def build_references(root: Path, names: list[str], timeout: int = 1500) -> None:
    todo = [n for n in names if not (root / f"{n}.json").is_file()]
    if not todo:
        return
    proc = subprocess.run(
        [main_python(), str(HERE / "reference.py"), str(root), *todo], capture_output=True, text=True,
        env=child_env(), timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]


def serve(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    """Run tests/vllm/serve_check.py (or another script of this folder) in a fresh process of this interpreter."""
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=child_env(), timeout=timeout, stdin=subprocess.DEVNULL
    )


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory) -> Path:
    """Folder of converted models and their references (built on demand by `build_references`)."""
    return tmp_path_factory.mktemp("vllm_models")
