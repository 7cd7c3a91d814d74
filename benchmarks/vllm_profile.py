"""Where a served model's time goes: torch profiler over one vLLM `generate` (the engine in this process), the
ops by self CPU time. Runs in .venv-vllm:

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/vllm_profile.py DIR \
        [--prompt-len 512] [--concurrency 16] [--new-tokens 16] [--rows 25] [--compiled]

The same engine settings as benchmarks/vllm_throughput.py (fp32, chunked prefill at 2,048 tokens, prefix caching off,
VLLM_CPU_KVCACHE_SPACE 1 GiB); eager by default, so that each op is seen, or with --compiled as vLLM serves by default
(Inductor fuses the elementwise ops into CompiledFxGraph rows); prompts of real text (the CPython docs), greedy, EOS
ignored.
"""

from __future__ import annotations

import argparse
import os
import time

from vllm_throughput import real_text_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--compiled", action="store_true", help="vLLM's default compilation (Inductor) instead of eager")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hfcompress_vllm import exit_cleanly

    llm = LLM(model=args.model, dtype="float32", enforce_eager=not args.compiled, max_model_len=args.prompt_len + args.new_tokens + 16,
              max_num_seqs=args.concurrency, enable_prefix_caching=False, max_num_batched_tokens=2048, seed=0,
              distributed_executor_backend="uni")  # fmt: skip
    ids = real_text_ids(llm.get_tokenizer())
    prompts = [TokensPrompt(prompt_token_ids=ids[i * 997 : i * 997 + args.prompt_len]) for i in range(args.concurrency)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up (and, compiled, the compilation)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    print(f"{args.model}: {args.concurrency} x {args.prompt_len} prompt tokens, {args.new_tokens} new each: {elapsed:.2f} s "
          f"(profiled)")  # fmt: skip
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    exit_cleanly(llm)


if __name__ == "__main__":
    main()
