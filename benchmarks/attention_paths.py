"""One attention layer's cost at prefill, per path the modeling can take, on SmolLM2's shapes (9 heads of 64, 3 KV
heads, LISA rank 6), interleaved in one process, medians.

    python benchmarks/attention_paths.py [--tokens 512] [--threads 1]

- original (SDPA, causal): a full Llama layer's attention
- eager scores: materialised Q K^T, softmax, x V (a layer that hands its scores to a dense-Align layer)
- dense Align: the previous scores through the head mix and the 9 -> 16 -> 9 FFN at every (query, key), + softmax x V
- sparse Align, SDPA, V unpadded: q/k of width 64 + 6, v of 64 (SDPA falls back to its math kernel)
- sparse Align, SDPA, V padded (what the modeling does): all widths 70, SDPA's flash kernel
"""

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from hfcompress.remote import import_remote


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modeling = import_remote("lisa_attention")
    heads, kv_heads, dim, rank, tokens = 9, 3, 64, 6, args.tokens
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q, k, v = randn(1, heads, tokens, dim), randn(1, kv_heads, tokens, dim), randn(1, kv_heads, tokens, dim)
    q_cat, k_cat = randn(1, heads, tokens, dim + rank), randn(1, heads, tokens, dim + rank)
    mask = modeling.causal_block_mask(0, tokens, tokens, 0, torch.float32, torch.device("cpu"))[None, None]
    align = modeling.LisaHeadAlign(heads, 16)
    prev_scores = randn(1, heads, tokens, tokens)
    k_rep, v_rep = modeling.repeat_kv(k, heads // kv_heads), modeling.repeat_kv(v, heads // kv_heads)
    v_padded = F.pad(v_rep, (0, rank))
    paths = {
        "original (SDPA, causal)": lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True),
        "eager scores": lambda: modeling.softmax_attention(q @ k_rep.transpose(2, 3) * dim**-0.5, mask, v, heads // kv_heads),
        "dense Align": lambda: modeling.softmax_attention(align(prev_scores), mask, v, heads // kv_heads),
        "sparse Align, SDPA, V unpadded": lambda: F.scaled_dot_product_attention(q_cat, k_cat, v_rep, attn_mask=mask, scale=1.0),
        "sparse Align, SDPA, V padded": lambda: F.scaled_dot_product_attention(q_cat, k_cat, v_padded, attn_mask=mask, scale=1.0),
    }
    times = {name: [] for name in paths}
    with torch.no_grad():
        for name, run in paths.items():
            run()  # warm-up
        for _ in range(args.repeats):
            for name, run in paths.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    print(f"{tokens} tokens, {args.threads} thread(s), medians of {args.repeats}")
    print("| path | ms per layer |\n|---|---|")
    for name, values in times.items():
        print(f"| {name} | {1000 * statistics.median(values):.1f} |")


if __name__ == "__main__":
    main()
