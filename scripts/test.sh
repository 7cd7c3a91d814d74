#!/usr/bin/env bash
# The whole test suite, in two tiers, each test once: the fast tier first (a broken tree fails within minutes), then
# the slow tier (the real SmolLM2-135M, tiny conversions end to end). Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -m "not slow" -p no:cacheprovider "$@"
.venv/bin/python -m pytest -m slow -p no:cacheprovider "$@"
