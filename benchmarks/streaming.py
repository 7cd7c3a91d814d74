"""Streaming figures of the one driver, each from one run of this script.

  smollm2        peak resident memory of the README's default `hfcompress convert` (built-in SmolLM2-135M GGUF, no
                 flags, empty cache) in a fresh process, against the float32 model file; layers and perplexities.
  llama7b-shape  a random-weight model with Llama-2-7B's shapes, written shard by shard in bfloat16 (never whole in
                 memory), converted with --dtype bfloat16; prints wall time and peak memory, then deletes the ~13 GB
                 of weights and the output.

  python benchmarks/streaming.py smollm2 --workdir /tmp/lbl-bench
  python benchmarks/streaming.py llama7b-shape --workdir /tmp/lbl-7b
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

LLAMA7B_SETTINGS = [
    "--dtype", "bfloat16", "--calib-sequences", "4", "--seq-len", "128", "--share-ratio", "0.2", "--lisa-steps", "5",
    "--fasc-budget", "1.0", "--eval-tokens", "512", "--max-shard-size", "2GB",
    "--no-probe", "--no-speed", "--max-ppl-increase", "1000",
]
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000)


def convert(source: Path | str, out: Path, extra: list[str], cache: Path) -> tuple[dict, float, int]:
    """One `hfcompress convert` in a fresh process: (its report, wall seconds, its peak RSS in MB by wait4)."""
    command = [sys.executable, "-m", "hfcompress.cli", "convert", str(source), "--out", str(out), "--overwrite", *extra]
    print("$", " ".join(command[1:]), flush=True)
    start = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HFCOMPRESS_CACHE=str(cache)))
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"convert failed, see {out.with_suffix('.log')}")
    return json.loads((out / "hfcompress_report.json").read_text()), seconds, usage.ru_maxrss // 1024


def smollm2(workdir: Path) -> None:
    """The README's default conversion (no flags) of the built-in GGUF with an empty cache, in a fresh process: its peak
    RSS against the float32 model file (the dequantised safetensors the first step writes into the cache)."""
    cache = workdir / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    report, seconds, rss = convert("smollm2-135m-instruct", workdir / "smollm2-lisa", [], cache)
    float32_file = sum(f.stat().st_size for f in cache.glob("gguf-*/*.safetensors"))
    validation = report["validation"]
    print("\n| peak RSS (tool, MB) | peak RSS (wait4, MB) | float32 model file (MB) | ratio | wall s | perplexity | LISA layers |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {report['memory']['peak_rss_mb']:.0f} | {rss} | {float32_file / 2**20:.0f} | {rss * 2**20 / float32_file:.2f}x | "
          f"{seconds:.0f} | {validation['original']['perplexity']:.3f} -> {validation['converted']['perplexity']:.3f} | "
          f"{report['lisa']['layers']} |")
    print(f"running peak after each step (MB): {json.dumps(report['memory']['peak_rss_mb_after_step'])}")
    print(f"whole-model steps: {json.dumps(report['whole_model_steps'])}")


def write_random_llama(directory: Path, shapes: dict, seed: int = 0) -> None:
    """Llama checkpoint with random bfloat16 weights, one shard per 4 layers, written as it is generated."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import build_tiny_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    h, inter, layers, vocab = shapes["hidden_size"], shapes["intermediate_size"], shapes["num_hidden_layers"], shapes["vocab_size"]
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    groups = [range(start, min(start + 4, layers)) for start in range(0, layers, 4)]
    weight_map, total = {}, 0
    for number, group in enumerate([None, *groups], start=1):
        if group is None:
            tensors = {"model.embed_tokens.weight": normal(vocab, h), "lm_head.weight": normal(vocab, h),
                       "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
        else:
            tensors = {}
            for i in group:
                p = f"model.layers.{i}."
                tensors.update({
                    p + "self_attn.q_proj.weight": normal(h, h), p + "self_attn.k_proj.weight": normal(h, h),
                    p + "self_attn.v_proj.weight": normal(h, h), p + "self_attn.o_proj.weight": normal(h, h),
                    p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
                    p + "mlp.down_proj.weight": normal(h, inter),
                    p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                    p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                })
        shard = f"model-{number:05d}-of-{len(groups) + 1:05d}.safetensors"
        save_file(tensors, directory / shard, metadata={"format": "pt"})
        weight_map.update({k: shard for k in tensors})
        total += sum(t.numel() * 2 for t in tensors.values())
        del tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16", **shapes,
        "head_dim": h // shapes["num_attention_heads"], "hidden_act": "silu", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    build_tiny_tokenizer().save_pretrained(directory)  # 512 tokens: every id is inside the 32000-token vocabulary


def llama7b_shape(workdir: Path, keep: bool) -> None:
    source = workdir / "llama2-7b-shape-random"
    start = time.perf_counter()
    if not (source / "config.json").is_file():
        write_random_llama(source, LLAMA2_7B)
    size = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    print(f"random weights: {size / 1e9:.1f} GB in {time.perf_counter() - start:.0f} s")
    cache = workdir / "cache"
    try:
        report, seconds, rss = convert(source, workdir / "llama2-7b-shape-lisa", LLAMA7B_SETTINGS, cache)
        validation = report["validation"]
        print(f"\nwall {seconds:.0f} s, peak RSS {report['memory']['peak_rss_mb']:.0f} MB (tool), {rss} MB (wait4)")
        print(f"timings {json.dumps(report['timings'])}")
        print(f"LISA layers {report['lisa']['layers']}, perplexity {validation['original']['perplexity']:.1f} -> "
              f"{validation['converted']['perplexity']:.1f}, reload check {validation['reload']['mode']}, "
              f"parameters {report['parameters']['original']['total']} -> {report['parameters']['converted']['total']}")
        print("output files:", sorted(p.name for p in (workdir / "llama2-7b-shape-lisa").iterdir()))
    finally:
        if not keep:
            for path in (source, workdir / "llama2-7b-shape-lisa", cache):
                shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figure", choices=["smollm2", "llama7b-shape"])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--keep", action="store_true", help="llama7b-shape: keep the generated weights and the output")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.figure == "smollm2":
        smollm2(args.workdir)
    else:
        llama7b_shape(args.workdir, args.keep)


if __name__ == "__main__":
    main()
