"""FASC's covariance statistics: float32 products per batch (the library) against float64 products (the reference),
on SmolLM2's real activations and gradients.

    python benchmarks/fasc_statistics.py [--layers 0,15,29] [--sequences 16] [--threads 1]

Speed: the Gram x^T x of one batch (4 sequences of 512 tokens, the pipeline's batch) of each targeted linear, both
ways, interleaved, median of 7. Precision: C and G of the library's hooks against float64 moments of the same inputs
and output gradients, and the FASC ranks (fisher, budget 0.9 over the chosen layers' linears) from each.
"""

import argparse
import statistics
import time
from dataclasses import replace

import torch
from common import prepare_smollm2_wiki

from hfcompress.conversion.calibrate import collect_linear_stats
from hfcompress.fasc import DEFAULT_TARGETS, FascOptions
from research.inmemory import compress_linears

BATCH = 4


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="0,15,29")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    prepared = prepare_smollm2_wiki(args.sequences, 512, args.threads)
    model, sequences = prepared.model, prepared.sequences
    names = [f"{i}.{t}" for i in map(int, args.layers.split(",")) for t in DEFAULT_TARGETS]
    linears = {name: model.model.layers.get_submodule(name) for name in names}
    inputs, grads = {name: [] for name in names}, {name: [] for name in names}  # the reference's float64 copies

    def keep(name):
        def hook(module, args, out):
            inputs[name].append(args[0].detach().reshape(-1, module.in_features).double())
            out.register_hook(lambda g: grads[name].append(g.detach().reshape(-1, module.out_features).double()))
        return hook

    handles = [linears[n].register_forward_hook(keep(n)) for n in names]
    stats = collect_linear_stats(model, sequences, names, batch_size=BATCH)  # the library's own pass, hooks and all
    for handle in handles:
        handle.remove()

    print(f"SmolLM2-135M, {len(sequences)} x 512 tokens of `wiki`, {torch.get_num_threads()} threads\n")
    print("| linear | Gram of one batch: float64 ms | float32 ms | float64 / float32 | C rel. error | G rel. error |")
    print("|---|---|---|---|---|---|")
    reference = {}
    for name in names:
        x, g = torch.cat(inputs[name]), torch.cat(grads[name])
        reference[name] = replace(stats[name], xx=x.T @ x, gg=g.T @ g)
        batch = x[: BATCH * 512].float()
        f64, f32 = [], []
        for _ in range(7):
            f64.append(timed(lambda: (lambda b: b.T @ b)(batch.double())))  # one conversion, as the old hook did
            f32.append(timed(lambda: (batch.T @ batch).double()))
        c_error = ((stats[name].xx - reference[name].xx).norm() / reference[name].xx.norm()).item()
        g_error = ((stats[name].gg - reference[name].gg).norm() / reference[name].gg.norm()).item()
        t64, t32 = statistics.median(f64) * 1e3, statistics.median(f32) * 1e3
        print(f"| {name} | {t64:.1f} | {t32:.1f} | {t64 / t32:.2f} | {c_error:.1e} | {g_error:.1e} |")
    fasc = FascOptions(method="fisher", budget=0.9)
    ranks = {tag: [r.rank for r in compress_linears(linears, s, fasc)[1]] for tag, s in (("float32", stats), ("float64", reference))}
    print(f"\nFASC ranks at budget 0.9 over these {len(names)} linears, float32 products: {ranks['float32']}")
    print(f"the same from float64 products: {ranks['float64']} ({'identical' if ranks['float32'] == ranks['float64'] else 'DIFFERENT'})")


if __name__ == "__main__":
    main()
