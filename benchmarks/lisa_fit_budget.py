"""Held-out error of one shared layer's local fit against its budget: rank, Adam steps, sequences per step, keys.

    python benchmarks/lisa_fit_budget.py [--layers 13,16] [--train 48] [--seq-len 256] [--threads 2]

Calibration on `wiki` (--train sequences to fit on, 16 more held out), in memory. Each layer is fitted on the original
model's inputs, anchored on the original layer below, once per variant; the line printed per fit is its training loss
(relative MSE of the attention output on the first 16 training sequences) and the same error on the held-out
sequences, which is what the converted model meets. The README's "the local fit was short of steps" comes from this
script.
"""

import argparse
import time
from dataclasses import replace

import torch
from common import prepare_smollm2_wiki

from hfcompress.conversion.build import in_converted_classes
from hfcompress.lisa import (
    LisaOptions,
    attention_output,
    causal_mask,
    fit_shared_layer,
    full_attention_scores,
    handed_over,
    lowrank_rank,
    relative_error,
    rotary,
    rows,
)

HELD_OUT = 16
# (label, LisaOptions overrides of the previous defaults, OLD); the rank follows from qk_compression and lowrank_keys as
# in a conversion. The last variant is today's default.
OLD = dict(qk_compression=6.0, lowrank_keys="head", steps=100, batch_size=4)
VARIANTS = [
    ("rank 6 per head, 100 steps x 4 (the previous default)", dict()),
    ("rank 6 per head, 300 steps x 4", dict(steps=300)),
    ("rank 14 per head (qk 3), 100 steps x 4", dict(qk_compression=3.0)),
    ("rank 14 per head (qk 3), 100 steps x 4, lr 0.03", dict(qk_compression=3.0, lr=0.03)),
    ("rank 14 per head (qk 3), 300 steps x 4", dict(qk_compression=3.0, steps=300)),
    ("rank 14 per head (qk 3), 600 steps x 1", dict(qk_compression=3.0, steps=600, batch_size=1)),
    ("rank 14 per head (qk 3), 1200 steps x 1", dict(qk_compression=3.0, steps=1200, batch_size=1)),
    ("rank 20 per KV group (qk 3), 600 steps x 1", dict(qk_compression=3.0, lowrank_keys="group", steps=600, batch_size=1)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="13,16")
    parser.add_argument("--train", type=int, default=48)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    prepared = prepare_smollm2_wiki(args.train + HELD_OUT, args.seq_len, args.threads)
    inputs = prepared.attention_inputs()
    matching = {s.layer: s.matching for s in prepared.similarity(inputs)}
    model = in_converted_classes(prepared.model)
    config, layers = model.config, model.model.layers
    train, test = slice(0, args.train), slice(args.train, args.train + HELD_OUT)
    mask, positions = causal_mask(args.seq_len), torch.arange(args.seq_len).unsqueeze(0)
    print("| layer | variant | rank | fit loss | held-out error | seconds |\n|---|---|---|---|---|---|")
    for idx in (int(v) for v in args.layers.split(",")):
        x, original = inputs[idx], layers[idx].self_attn
        cos_sin = rotary(model, x[:1], idx)
        below = handed_over(layers[idx - 1].self_attn, inputs[idx - 1], None, cos_sin, LisaOptions())
        with torch.no_grad():
            target = attention_output(original, x[test], full_attention_scores(original, x[test], cos_sin), mask)
        for label, overrides in VARIANTS:
            lisa = replace(LisaOptions(), **{**OLD, **overrides})
            rank = lowrank_rank(config, lisa.qk_compression, lisa.lowrank_keys)
            start = time.perf_counter()
            module, record = fit_shared_layer(config, original, cos_sin, idx, x[train], rows(below, train), matching[idx], rank, lisa)
            seconds = time.perf_counter() - start
            with torch.no_grad():
                out, _ = module(x[test], positions.expand(HELD_OUT, -1), mask, rows(below, test))
                error = relative_error(out, target)
            print(f"| {idx} | {label} | {rank} | {record.loss_final:.4f} | {error:.4f} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
