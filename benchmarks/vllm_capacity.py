"""KV capacity and decode speed of an original and its conversion served by vLLM (hfcompress's plugin), side by side in one
script: vLLM's KV capacity in tokens (blocks x block size, as vLLM computes it for the same VLLM_CPU_KVCACHE_SPACE) at
each KV cache dtype (`auto`: the model's dtype; `fp8`), the ratio to the original's, and decode tokens/s at batch 1
and 4. Runs in .venv-vllm (scripts/install_vllm.sh):

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_capacity.py --model original=DIR --model converted=DIR2 \
        [--full-keys converted] [--kv-cache-dtypes auto,fp8] [--batches 1,4] [--prompt-len 512] [--new-tokens 64] \
        [--repeats 3] [--dtype float32] [--kv-space 1] [--out benchmarks/results-vllm-latent.md]

Capacity: one engine per (model, KV cache dtype), started and closed one after the other (never two at once);
`--full-keys NAME` adds NAME served with HFCOMPRESS_VLLM_KEYS=full (its key-latent layers caching their rebuilt keys at
full width: what the plugin cached before the latent layout), to both tables. Speed: one engine per model at the first
KV cache dtype,
alive side by side but used one at a time (an idle vLLM engine sleeps after a second), the rounds interleaved (the
model order rotating each repeat), medians reported. A round at batch B: B prompts of exactly `--prompt-len` tokens
(real text: the CPython docs, a different slice per round), greedy, EOS ignored, prefix caching off; timed once with 1
new token (the prefill) and once with `--new-tokens`: decode tok/s = B x (new tokens - 1) / (the difference). Eager
(enforce_eager) unless --compile. The results file is regenerated whole, the command that made it at its top.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from vllm_throughput import answer, real_text_ids, results_header  # benchmarks/, beside this script

WORKER = "--worker"


def worker(model: str, dtype: str, kv_cache_dtype: str, max_len: int, max_seqs: int, eager: bool) -> None:
    """One engine: prints its capacity and layout, then answers `BATCH PROMPT_LEN NEW_TOKENS SEED` lines with the
    seconds of one `generate` (one JSON line each)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hfcompress_vllm import exit_cleanly

    llm = LLM(
        model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_model_len=max_len, max_num_seqs=max_seqs,
        enable_prefix_caching=False, enforce_eager=eager, seed=0, block_size=32,
    )  # fmt: skip
    config = llm.llm_engine.vllm_config.cache_config
    layout = {}
    if hasattr(llm.llm_engine.vllm_config.model_config.hf_config, "lisa_layers"):
        from hfcompress_vllm.model import kv_layout

        layout = {str(k): v for k, v in kv_layout(llm.llm_engine.vllm_config).items()}
    text_ids = real_text_ids(llm.get_tokenizer())
    print(json.dumps({"kv_capacity_tokens": int(config.num_gpu_blocks * config.block_size), "kv_layout": layout}), flush=True)
    for line in sys.stdin:
        batch, length, new_tokens, seed = (int(v) for v in line.split())
        prompts = [TokensPrompt(prompt_token_ids=text_ids[(seed * 16 + i) * 997 % (len(text_ids) - length) :][:length])
                   for i in range(batch)]  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)
        print(json.dumps({"seconds": elapsed}), flush=True)
    exit_cleanly(llm)


def start(directory: str, args, kv_cache_dtype: str, env: dict) -> subprocess.Popen:
    max_len = args.prompt_len + args.new_tokens + 16
    return subprocess.Popen(
        [sys.executable, __file__, WORKER, directory, args.dtype, kv_cache_dtype, str(max_len), str(max(args.batch_list)),
         str(int(not args.compile))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def close(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="NAME=DIR (first: the baseline)")
    parser.add_argument("--full-keys", action="append", default=[], help="NAME: also NAME with HFCOMPRESS_VLLM_KEYS=full")
    parser.add_argument("--kv-cache-dtypes", default="auto,fp8")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-space", default="1", help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    parser.add_argument("--compile", action="store_true", help="vLLM's default compilation (default here: eager)")
    parser.add_argument("--out", default="benchmarks/results-vllm-latent.md")
    args = parser.parse_args()
    args.batch_list = [int(b) for b in args.batches.split(",")]
    models = dict(spec.split("=", 1) for spec in args.model)
    for name, directory in models.items():
        if not Path(directory, "config.json").is_file():
            parser.error(f"--model {name}={directory}: {directory}/config.json is missing (not a model directory)")
    variants = [(name, directory, {}) for name, directory in models.items()]
    variants += [(f"{name} (full-width keys)", models[name], {"HFCOMPRESS_VLLM_KEYS": "full"}) for name in args.full_keys]
    dtypes = args.kv_cache_dtypes.split(",")
    base_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=args.kv_space)

    capacity: dict[tuple[str, str], int] = {}
    layouts: dict[str, dict] = {}
    for kv_cache_dtype in dtypes:
        for name, directory, extra in variants:
            proc = start(directory, args, kv_cache_dtype, dict(base_env, **extra))
            info = answer(proc)
            close(proc)
            capacity[(name, kv_cache_dtype)] = info["kv_capacity_tokens"]
            layouts.setdefault(name, info["kv_layout"])
            print(f"{name}, KV cache {kv_cache_dtype}: {info['kv_capacity_tokens']:,} tokens", flush=True)

    names = [name for name, _, _ in variants]
    rates: dict[tuple[str, int], list[float]] = {(n, b): [] for n in names for b in args.batch_list}
    loads: dict[tuple[str, int], list[float]] = {(n, b): [] for n in names for b in args.batch_list}
    procs = {}
    for name, directory, extra in variants:  # started one after the other: start-up is not timed
        procs[name] = start(directory, args, dtypes[0], dict(base_env, **extra))
        answer(procs[name])

    def timed(name: str, batch: int, new_tokens: int, seed: int) -> float:
        procs[name].stdin.write(f"{batch} {args.prompt_len} {new_tokens} {seed}\n")
        procs[name].stdin.flush()
        return answer(procs[name])["seconds"]

    for name in names:  # one warm-up round each (first-call costs: kernel loading, allocator)
        for batch in args.batch_list:
            timed(name, batch, 2, 99)
    for rep in range(args.repeats):
        for batch in args.batch_list:
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                prefill = timed(name, batch, 1, rep)
                total = timed(name, batch, args.new_tokens, rep)
                rates[(name, batch)].append(batch * (args.new_tokens - 1) / (total - prefill))
                loads[(name, batch)].append(os.getloadavg()[0])
                print(f"repeat {rep} batch {batch} {name}: decode {rates[(name, batch)][-1]:.1f} tok/s "
                      f"(prefill {prefill:.2f} s, load average {loads[(name, batch)][-1]:.1f})", flush=True)  # fmt: skip
    for proc in procs.values():
        close(proc)
    write_results(args, models, variants, dtypes, capacity, layouts, rates, loads)


def write_results(args, models, variants, dtypes, capacity, layouts, rates, loads) -> None:
    import vllm

    base = next(iter(models))
    lines = [
        *results_header("vLLM KV capacity and decode speed: original vs converted (key latents cached)"),
        f"vLLM {vllm.__version__}, model dtype {args.dtype}, VLLM_CPU_KVCACHE_SPACE={args.kv_space} GiB, block size 32, "
        f"{'compiled' if args.compile else 'eager'}; threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'unset (vLLM: auto)')}; "
        f"{os.cpu_count()} CPUs shared with other work (absolute speeds vary; ratios are of interleaved rounds).",
        "",
        "KV capacity (tokens vLLM fits in the cache space, blocks x block size):",
        "",
        "| model | " + " | ".join(f"KV cache {d} | vs {base}" for d in dtypes) + " |",
        "|---|" + "---|---|" * len(dtypes),
    ]
    for name, _, _ in variants:
        cells = []
        for kv_cache_dtype in dtypes:
            cap = capacity[(name, kv_cache_dtype)]
            cells += [f"{cap:,}", f"{cap / capacity[(base, kv_cache_dtype)]:.3f}x"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Decode tokens/s (KV cache {dtypes[0]}; prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens; "
        f"medians of {args.repeats} interleaved rounds; decode = batch x {args.new_tokens - 1} tokens / (time of "
        f"{args.new_tokens} new tokens - time of 1)):",
        "",
        "| model | " + " | ".join(f"batch {b} | vs {base}" for b in args.batch_list) + " |",
        "|---|" + "---|---|" * len(args.batch_list),
    ]
    for name, _, _ in variants:
        cells = []
        for batch in args.batch_list:
            median = statistics.median(rates[(name, batch)])
            cells += [f"{median:.1f}", f"{median / statistics.median(rates[(base, batch)]):.3f}x"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Cache layout per layer (hfcompress_vllm.model.kv_layout):", ""]
    for name, layout in layouts.items():
        if layout:
            lines.append(f"- {name}: " + "; ".join(f"{k}: {v}" for k, v in layout.items()))
    lines += ["", "Every round (decode tok/s, and the machine's 1-minute load average after it):", ""]
    for (name, batch), values in rates.items():
        lines.append(f"- {name}, batch {batch}: " + ", ".join(f"{v:.1f} (load {l:.1f})" for v, l in zip(values, loads[(name, batch)])))
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER:
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), sys.argv[7] == "1")
    else:
        main()
