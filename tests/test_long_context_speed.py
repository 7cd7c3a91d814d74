"""research/long_context.py (benchmarks/long_context.py) on tiny models: rows, cache sizes, the table."""

import pytest
import torch
from test_modeling import lisa_copy, tiny_config
from transformers import LlamaForCausalLM

from research.long_context import long_context_speed, long_context_table


def test_rows_hold_measured_cache_sizes_and_speedups():
    torch.manual_seed(0)
    original = LlamaForCausalLM(tiny_config()).eval()
    converted = lisa_copy(original, lisa_layers={"2": {"rank": 4, "align": "sparse"}})
    seen = []
    rows = long_context_speed(
        {"original": original, "converted": converted}, [("decode", 2, 12), ("prefill", 1, 16)], new_tokens=2,
        repeats=2, progress=seen.append,
    )  # fmt: skip
    decode, prefill = rows
    assert (decode["phase"], decode["batch"], decode["context"], decode["repeats"]) == ("decode", 2, 12, 2)
    # per token and sequence: a full layer caches K and V (2 KV heads x 16 each), the shared one 4 heads x rank 4 + V
    full, shared = 2 * 2 * 16, 4 * 4 + 2 * 16
    assert decode["original"]["cache_mb"] * 2**20 == pytest.approx(4 * 2 * 12 * full * 4)
    assert decode["cache_ratio"] == pytest.approx((3 * full + shared) / (4 * full))
    assert prefill["cache_ratio"] is None and prefill["original"]["cache_mb"] is None
    for row in rows:
        assert row["original"]["tokens_per_s"] > 0 and row["speedup"] > 0
    assert any("decode 2x12" in message for message in seen)
    table = long_context_table(rows)
    assert "| decode 2x12 |" in table and "| prefill 1x16 |" in table and f"{decode['cache_ratio']:.2f}x" in table
