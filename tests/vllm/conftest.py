"""The vLLM plugin tests run only in .venv-vllm (scripts/install_vllm.sh): without vllm installed, this folder is skipped
(each module calls pytest.importorskip("vllm.entrypoints.llm")), so the main suite in .venv is unaffected.

Their references come from the main environment (.venv, hfcompress's transformers and the remote code):
`reference.py` runs there in a subprocess. HFCOMPRESS_MAIN_PYTHON overrides its interpreter.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory) -> Path:
    """Folder of converted models and their references (built on demand by `helpers_vllm.build_references`)."""
    return tmp_path_factory.mktemp("vllm_models")
