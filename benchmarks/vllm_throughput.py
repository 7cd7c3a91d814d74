"""Original vs converted models served by vLLM (hfcompress's plugin), same engine settings: output tokens/s at 16
concurrent sequences for prompts of 512 and 2,048 tokens, and the KV capacity vLLM computes (tokens that fit in the same
VLLM_CPU_KVCACHE_SPACE). Runs in .venv-vllm (scripts/install_vllm.sh):

    OMP_NUM_THREADS=2 .venv-vllm/bin/python benchmarks/vllm_throughput.py --model original=DIR --model converted=DIR2 \
        [--model other=DIR3 ...] [--prompt-lens 512,2048] [--concurrency 16] [--new-tokens 64] [--repeats 3] \
        [--dtype float32] [--kv-cache-dtype auto] [--kv-space 2] [--max-num-batched-tokens 2048] [--enforce-eager] \
        [--gpu-memory-utilization 0.9] [--out benchmarks/results-vllm.md]

Each model gets one engine in its own process, started once (alive side by side); the timed rounds are interleaved
(original, converted, ..., the order rotating each repeat) and the medians reported. A round is one `generate` of
`--concurrency` prompts of exactly the prompt length (real text: the CPython docs, tokenized by the first model's
tokenizer, a different slice per round), greedy, `--new-tokens` tokens each, EOS ignored; prefix caching off, chunked
prefill on (vLLM's defaults otherwise: torch.compile, which vLLM's own Llama and the plugin's LISA models both support;
`--enforce-eager` runs every model eager). Output tok/s = generated tokens / wall time of the round (its prefill included).
The results file is regenerated whole, the command that made it at its top.
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

WORKER = "--worker"


def worker(model: str, dtype: str, max_len: int, concurrency: int, batched_tokens: int, kv_cache_dtype: str,
           enforce_eager: bool, gpu_memory_utilization: float) -> None:  # fmt: skip
    """One engine; reads `PROMPT_LEN NEW_TOKENS SEED` lines, answers one JSON line each."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hfcompress_vllm import exit_cleanly

    llm = LLM(
        model=model, dtype=dtype, max_model_len=max_len, max_num_seqs=concurrency, enable_prefix_caching=False, seed=0,
        max_num_batched_tokens=batched_tokens, kv_cache_dtype=kv_cache_dtype, enforce_eager=enforce_eager,
        gpu_memory_utilization=gpu_memory_utilization,
    )  # fmt: skip
    config = llm.llm_engine.vllm_config.cache_config
    capacity = int(config.num_gpu_blocks * config.block_size)
    layout = {}
    hf_config = llm.llm_engine.vllm_config.model_config.hf_config
    if hasattr(hf_config, "lisa_layers"):
        from hfcompress_vllm.model import kv_layout

        layout = {str(k): v for k, v in kv_layout(llm.llm_engine.vllm_config).items() if v != "plain"}
    text_ids = real_text_ids(llm.get_tokenizer())
    print(json.dumps({"ready": True, "kv_capacity_tokens": capacity, "kv_layout": layout}), flush=True)
    for line in sys.stdin:
        length, new_tokens, seed = (int(v) for v in line.split())
        prompts = [
            TokensPrompt(prompt_token_ids=text_ids[(seed * concurrency + i) * 997 % (len(text_ids) - length) :][:length])
            for i in range(concurrency)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(json.dumps({"seconds": elapsed, "generated": generated}), flush=True)
    exit_cleanly(llm)


def real_text_ids(tokenizer) -> list[int]:
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    return tokenizer(text, add_special_tokens=False).input_ids


def answer(proc: subprocess.Popen) -> dict:
    """The next JSON line an engine worker (started as [python, script, WORKER, model directory, ...]) prints."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine process {proc.args[3]} exited (rc {proc.poll()}): see its stderr above")
        if line.startswith("{"):
            return json.loads(line)


def results_header(title: str) -> list[str]:
    """A results file's first lines: its title and the command that regenerates it (this process's)."""
    command = "OMP_NUM_THREADS={} .venv-vllm/bin/python benchmarks/{} {}".format(
        os.environ.get("OMP_NUM_THREADS", "unset"), Path(sys.argv[0]).name, " ".join(sys.argv[1:])
    )
    return [f"# {title}", "", "Regenerate with:", "", f"    {command}", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="NAME=DIR (first: the baseline)")
    parser.add_argument("--prompt-lens", default="512,2048")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype: auto (model dtype), fp8, fp8_e5m2")
    parser.add_argument("--kv-space", default="2", help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="chunked-prefill token budget per step")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile for any model")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="on a GPU, each engine's share of its memory (the engines run side by side: below 1 / models)")
    parser.add_argument("--out", default="benchmarks/results-vllm.md")
    args = parser.parse_args()
    models = dict(spec.split("=", 1) for spec in args.model)
    for name, directory in models.items():
        if not Path(directory, "config.json").is_file():
            parser.error(f"--model {name}={directory}: {directory}/config.json is missing (not a model directory)")
    lengths = [int(v) for v in args.prompt_lens.split(",")]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=args.kv_space)
    procs, info = {}, {}
    for name, directory in models.items():  # started one after the other: their start-up is not timed
        procs[name] = subprocess.Popen(
            [sys.executable, __file__, WORKER, directory, args.dtype, str(max(lengths) + args.new_tokens + 16), str(args.concurrency),
             str(args.max_num_batched_tokens), args.kv_cache_dtype, str(int(args.enforce_eager)), str(args.gpu_memory_utilization)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        info[name] = answer(procs[name])
        print(f"{name}: ready, KV capacity {info[name]['kv_capacity_tokens']:,} tokens", flush=True)
    rates: dict[tuple[str, int], list[float]] = {(n, l): [] for n in models for l in lengths}
    loads: dict[tuple[str, int], list[float]] = {(n, l): [] for n in models for l in lengths}  # 1-minute, after a round
    names = list(models)
    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for length in lengths:
            for name in order:
                procs[name].stdin.write(f"{length} {args.new_tokens} {rep}\n")
                procs[name].stdin.flush()
                result = answer(procs[name])
                rates[(name, length)].append(result["generated"] / result["seconds"])
                loads[(name, length)].append(os.getloadavg()[0])
                print(f"repeat {rep} prompt {length} {name}: {rates[(name, length)][-1]:.1f} tok/s (load average "
                      f"{loads[(name, length)][-1]:.1f})", flush=True)  # fmt: skip
    for proc in procs.values():
        proc.stdin.close()
        proc.wait(timeout=120)
    write_results(args, models, info, rates, lengths, loads)


def write_results(args, models: dict, info: dict, rates: dict, lengths: list[int], loads: dict) -> None:
    base = next(iter(models))
    import vllm

    lines = [
        *results_header("vLLM throughput and KV capacity: original vs converted"),
        f"vLLM {vllm.__version__}, dtype {args.dtype}, KV cache dtype {args.kv_cache_dtype}, "
        f"VLLM_CPU_KVCACHE_SPACE={args.kv_space} GiB, {args.concurrency} concurrent "
        f"sequences, {args.new_tokens} new tokens each, {args.repeats} interleaved repeats (medians), prefix caching off, "
        f"chunked prefill at {args.max_num_batched_tokens} tokens a step, "
        f"{'eager (enforce_eager)' if args.enforce_eager else 'vLLM default compilation'}; "
        f"{os.cpu_count()} CPUs (shared with other work: absolute figures vary, ratios are of interleaved runs).",
        "",
        "| model | KV capacity (tokens) | vs " + base + " | " + " | ".join(f"output tok/s, prompt {l}" for l in lengths) + " | "
        + " | ".join(f"vs {base}, prompt {l}" for l in lengths) + " |",
        "|---|---|---|" + "---|" * (2 * len(lengths)),
    ]
    for name in models:
        cap = info[name]["kv_capacity_tokens"]
        medians = [statistics.median(rates[(name, l)]) for l in lengths]
        base_medians = [statistics.median(rates[(base, l)]) for l in lengths]
        lines.append(
            f"| {name} | {cap:,} | {cap / info[base]['kv_capacity_tokens']:.3f}x | "
            + " | ".join(f"{m:.1f}" for m in medians) + " | "
            + " | ".join(f"{m / b:.3f}x" for m, b in zip(medians, base_medians)) + " |"
        )
    lines += ["", "Cache layout of the converted layers (hfcompress_vllm.model.kv_layout; unlisted layers: plain):", ""]
    for name in models:
        if info[name]["kv_layout"]:
            lines.append(f"- {name} ({models[name]}): " + "; ".join(f"{k}: {v}" for k, v in info[name]["kv_layout"].items()))
    lines += ["", "Every round (tok/s, and the machine's 1-minute load average after it):", ""]
    for (name, length), values in rates.items():
        rounds = zip(values, loads[(name, length)])
        lines.append(f"- {name}, prompt {length}: " + ", ".join(f"{v:.1f} (load {load:.1f})" for v, load in rounds))
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER:
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7], sys.argv[8] == "1",
               float(sys.argv[9]))
    else:
        main()
