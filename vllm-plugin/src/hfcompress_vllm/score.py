"""Prompt log-probabilities through vLLM, for `hfcompress eval DIR --engine vllm` (hfcompress/evidence/evaluate.py).

Runs in vLLM's environment (HFCOMPRESS_VLLM_PYTHON), called by `hfcompress eval` from hfcompress's own:
    python -m hfcompress_vllm.score MODEL_DIR WINDOWS.json OUT.json
WINDOWS.json: {"windows": [[token ids], ...], "dtype": "float32", "kv_cache_dtype": "auto"} (vLLM's kv_cache_dtype);
OUT.json: {"nll": [[-log p(token t | tokens < t) for t = 1..len-1], ...], "kv_capacity_tokens": N}. Each window is one prompt (max_tokens=1, prompt_logprobs=0: the
log-prob of each actual prompt token), all windows in one `generate` call, prefix caching off (every window scored
from its own tokens, as the transformers path does).
"""

from __future__ import annotations

import json
import os
import sys


def main(model: str, windows_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from . import exit_cleanly

    request = json.loads(open(windows_path).read())
    windows = request["windows"]
    llm = LLM(
        model=model, dtype=request.get("dtype", "float32"), max_model_len=max(len(w) for w in windows) + 1,
        enable_prefix_caching=False, seed=0, kv_cache_dtype=request.get("kv_cache_dtype", "auto"),
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], params, use_tqdm=False)
    nll = []
    for window, output in zip(windows, outputs):
        # prompt_logprobs[0] is None (the first token has no context); entry t holds the actual token's log-prob
        nll.append([-output.prompt_logprobs[t][window[t]].logprob for t in range(1, len(window))])
    config = llm.llm_engine.vllm_config.cache_config
    with open(out_path + ".part", "w") as handle:
        json.dump({"nll": nll, "kv_capacity_tokens": int(config.num_gpu_blocks * config.block_size)}, handle)
    os.replace(out_path + ".part", out_path)
    exit_cleanly(llm)


if __name__ == "__main__":
    main(*sys.argv[1:4])
