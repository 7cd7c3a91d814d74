"""Research code: what the benchmarks (benchmarks/) and the tests of research code use, and the product does not.
Not in the wheel (pyproject's wheel target packages only hfcompress); importable from a checkout as `research`.

- `inmemory`: the in-memory driver (every method on a model loaded whole) and the LISA ablations the CLI does not offer;
- `long_context`: long-context speed of an original against its conversion (benchmarks/long_context.py);
- `lisa_prefill_triton.py`: the Triton prefill and low-rank-linear kernels and the backend-dispatching wrappers
  (benchmarks/kernel_speed.py). It imports its siblings flat, as remote code does, so it loads as one package with
  kernels/ and modeling/ (`load_kernels` in benchmarks/kernel_speed.py), not as `research.lisa_prefill_triton`.
"""
