"""Serve a converted model with vLLM (the hfcompress plugin) and compare with the remote code's reference
(tests/vllm/reference.py). Runs in .venv-vllm: `python tests/vllm/serve_check.py [--dtype bfloat16]
[--kv-cache-dtype fp8] MODEL_DIR REFERENCE.json RESULT.json` (or `--capacity MODEL_DIR`).

Engine: fp32 (unless --dtype, vLLM's model dtype, says e.g. bfloat16; the KV cache at the model's dtype unless
--kv-cache-dtype, vLLM's option, says e.g. fp8), eager (`--enforce-eager 0`: compiled, vLLM's default), chunked prefill with a small
token budget (long prompts are prefilled in several chunks), prefix caching, 16 concurrent sequences. The prompts are
served in two calls: the first 8, then all 32, so the second call's prompts that repeat a prompt or its prefix are
prefix-cache hits (counted from vLLM's num_cached_tokens).
Writes RESULT.json: tokens equal (count), max and mean |delta logprob|, cached prompt tokens, KV layout, vLLM's KV
capacity.
"""

from __future__ import annotations

import json
import os
import sys

from hfcompress_vllm import exit_cleanly


def engine(model_dir: str, max_model_len: int, chunk: int = 64, kv_cache_dtype: str = "auto", dtype: str = "float32",
           eager: bool = True):  # fmt: skip
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    return LLM(
        model=model_dir, dtype=dtype, enforce_eager=eager, enable_chunked_prefill=True, enable_prefix_caching=True,
        max_num_batched_tokens=chunk, max_num_seqs=16, block_size=32, max_model_len=max_model_len, seed=0,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip


def main(model_dir: str, reference_path: str, result_path: str, kv_cache_dtype: str = "auto",
         dtype: str = "float32", eager: bool = True) -> None:  # fmt: skip
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    reference = json.loads(open(reference_path).read())
    prompts, tokens, logprobs = reference["prompts"], reference["tokens"], reference["logprobs"]
    llm = engine(model_dir, max(len(p) for p in prompts) + 16, kv_cache_dtype=kv_cache_dtype, dtype=dtype, eager=eager)
    params = SamplingParams(temperature=0.0, max_tokens=len(tokens[0]), logprobs=1, ignore_eos=True)
    first = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:8]], params, use_tqdm=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    equal, max_delta, cached, deltas = 0, 0.0, 0, []
    mismatches = []
    for i, out in enumerate([*first, *outputs]):
        j = i if i < len(first) else i - len(first)
        completion = out.outputs[0]
        got = list(completion.token_ids)
        if got == tokens[j]:
            equal += 1
        else:
            mismatches.append({"prompt": j, "got": got, "want": tokens[j]})
        for step, (token, want) in enumerate(zip(got, logprobs[j])):
            if token != tokens[j][step]:
                break
            deltas.append(abs(completion.logprobs[step][token].logprob - want))
            max_delta = max(max_delta, deltas[-1])
        cached += out.num_cached_tokens or 0
    result = {
        "sequences": len(first) + len(outputs),
        "tokens_equal": equal,
        "max_abs_delta_logprob": max_delta,
        "mean_abs_delta_logprob": sum(deltas) / max(len(deltas), 1),  # over the tokens compared (up to a mismatch)
        "cached_prompt_tokens": cached,
        "mismatches": mismatches[:3],
        "kv_capacity_tokens": kv_capacity(llm.llm_engine),
        "kv_layout": layout(llm.llm_engine),
        "kv_cache_dtype": kv_cache_dtype,
        "dtype": dtype,
    }
    with open(result_path, "w") as handle:
        json.dump(result, handle)
    exit_cleanly(llm)


def kv_capacity(engine) -> int | None:
    """Tokens the KV cache holds, as vLLM computed it (blocks x block size)."""
    try:
        config = engine.vllm_config.cache_config
        return int(config.num_gpu_blocks * config.block_size)
    except Exception:  # noqa: BLE001 - the engine core runs in another process on some versions
        return None


def layout(llm_engine) -> dict:
    from hfcompress_vllm.model import kv_layout

    if not hasattr(llm_engine.vllm_config.model_config.hf_config, "lisa_layers"):
        return {}
    return {str(k): v for k, v in kv_layout(llm_engine.vllm_config).items()}


if __name__ == "__main__":
    args = sys.argv[1:]
    options = {"--dtype": "float32", "--kv-cache-dtype": "auto", "--enforce-eager": "1"}
    while args[0] in options:
        options[args[0]], args = args[1], args[2:]
    dtype, kv_cache_dtype, eager = options["--dtype"], options["--kv-cache-dtype"], options["--enforce-eager"] == "1"
    if args[0] == "--capacity":  # the same engine, nothing served: {"kv_capacity_tokens": N} on the last line
        # 316 tokens (the prompts' engine), or the model's own maximum where smaller (the tiny models' 256)
        limit = json.loads(open(os.path.join(args[1], "config.json")).read()).get("max_position_embeddings") or 316
        llm = engine(args[1], min(316, limit), kv_cache_dtype=kv_cache_dtype, dtype=dtype)
        print(json.dumps({"kv_capacity_tokens": kv_capacity(llm.llm_engine)}), flush=True)
        exit_cleanly(llm)
    else:
        main(*args[:3], kv_cache_dtype=kv_cache_dtype, dtype=dtype, eager=eager)
