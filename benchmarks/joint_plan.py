"""Keep, low-rank keys or drop, per layer, under one KV budget: measured costs against the Fisher surrogate (issue 41).

    python benchmarks/joint_plan.py --budgets 0.75 0.7 0.65 0.6 --out benchmarks/results-joint-plan.md

Costs: every layer's actions alone (its attention dropped; its pre-RoPE keys on the first n Fisher directions, n in
--widths), the mean loss change on the calibration text's selection tokens (no statistic saw them), each a forward of
transformers' own model with hooks (cached in the hfcompress cache). Plans at each budget of cached values a token:
- surrogate keys: the conversion's plan today (`plan_sizes`, floor 8: the Fisher surrogate, every width);
- measured keys: the measured costs, keys only (`hfcompress.keys.joint.plan_layers`, widths of --widths);
- measured joint: the measured costs, keys or drop.
Each plan is scored training-free on the gate's texts (the held-out calibration text and numpy-docs, 4,096 tokens each,
windows of 512), all its actions at once. The Spearman correlation of surrogate and measured cost says whether the
surrogate ranks actions like the loss.
"""

import argparse
import json
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from key_compression import model_and_key_statistics, spearman  # benchmarks/, beside this script

from hfcompress.conversion.calibrate import load_or_compute, tensor_fingerprint
from hfcompress.evidence.validate import perplexity
from hfcompress.keys import KeySubspace, plan_sizes, projected_keys
from hfcompress.keys.joint import Option, plan_layers
from hfcompress.keys.options import MIN_KEY_RANK
from hfcompress.sources.source import BUILTIN_SOURCE


@contextmanager
def dropped_attention(model, layers: list[int]):
    """Inside, the attention blocks of `layers` add nothing to the residual stream (what a dropped attention does)."""

    def zero(module, inputs, output):
        return (torch.zeros_like(output[0]), *output[1:])

    handles = [model.model.layers[l].self_attn.register_forward_hook(zero) for l in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def selection_windows(ids: torch.Tensor, prefix, context: int, count: int) -> torch.Tensor:
    """(count, context) windows of the selection tokens, each `prefix` then text, as the perplexity scores them."""
    body = context - len(prefix)
    if len(ids) < count * body:
        raise SystemExit(f"--windows {count} needs {count * body} selection tokens, the text has {len(ids)}")
    return torch.stack([torch.tensor([*prefix, *ids[i * body : (i + 1) * body].tolist()]) for i in range(count)])


def head_loss(model, hidden: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of the windows from the last layer's output."""
    logits = model.lm_head(model.model.norm(hidden))[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def layer_inputs_and_gradients(model, windows: torch.Tensor):
    """Every decoder layer's input (and the last one's output) on the windows, the loss gradient at each layer's output,
    and the RoPE (cos, sin) the layers take."""
    hidden = model.model.embed_tokens(windows)
    cos_sin = model.model.rotary_emb(hidden, torch.arange(windows.shape[1]).unsqueeze(0))
    states = [hidden.detach().requires_grad_(True)]
    for layer in model.model.layers:
        states.append(layer(states[-1], position_embeddings=cos_sin))
        states[-1].retain_grad()
    head_loss(model, states[-1], windows).backward()
    grads = [s.grad.detach() for s in states[1:]]
    model.zero_grad(set_to_none=True)
    return [s.detach() for s in states], grads, tuple(t.detach() for t in cos_sin)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=BUILTIN_SOURCE)
    parser.add_argument("--widths", type=int, nargs="+", default=[96, 48, 16])
    parser.add_argument("--windows", type=int, default=2, help="selection windows of 512 tokens the costs are measured on")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.75, 0.7, 0.65, 0.6])
    parser.add_argument("--calib-sequences", type=int, default=32)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    options, model, streams, stats, cache = model_and_key_statistics(args.source, args.calib_sequences)
    config, layers = model.config, model.model.layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = layers[0].self_attn.k_proj.out_features
    count = len(layers)
    subspaces = [KeySubspace(stats[i], layers[i].self_attn.k_proj.weight.detach(), "fisher", "pre", head_dim) for i in range(count)]

    windows = selection_windows(streams.selection_ids, streams.prefix, options.eval_context, args.windows)

    def measure() -> dict:
        """Per layer and action: the measured loss change (the layers from this one up, on the stored input) and the
        proxies from this layer's output change Δ and the loss gradient g there: first order Σ g.Δ, and with the
        Gauss-Newton term of the per-token empirical Fisher, Σ g.Δ + N/2 Σ_t (g_t.Δ_t)^2."""
        start = time.perf_counter()
        inputs, grads, cos_sin = layer_inputs_and_gradients(model, windows)
        base = float(head_loss(model, inputs[-1], windows))
        tokens = windows[:, 1:].numel()
        costs = {}
        for l in range(count):
            actions = {"drop": dropped_attention(model, [l])}
            actions.update({str(n): projected_keys(model, {l: subspaces[l].projector(n)}) for n in args.widths})
            row = {}
            for name, context in actions.items():
                with context, torch.no_grad():
                    delta = layers[l](inputs[l], position_embeddings=cos_sin) - inputs[l + 1]
                    h = inputs[l + 1] + delta
                    for i in range(l + 1, count):
                        h = layers[i](h, position_embeddings=cos_sin)
                    measured = float(head_loss(model, h, windows)) - base
                dot = (grads[l] * delta).sum(-1)  # per token g.Δ
                first = float(dot.sum())
                row[name] = {"measured": measured, "first": first, "fisher": first + tokens / 2 * float(dot.pow(2).sum())}
            costs[l] = row
            print(f"layer {l}: " + ", ".join(f"{k} {v['measured']:+.4f} ({v['first']:+.4f}, {v['fisher']:+.4f})" for k, v in row.items())
                  + f" ({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
        return {"base": base, "costs": costs}

    widths_key = "-".join(map(str, args.widths))
    measured = load_or_compute(cache / f"joint-costs-{widths_key}-{args.windows}-{tensor_fingerprint(streams.selection_ids)}.pt", measure)
    costs = {int(l): row for l, row in measured["costs"].items()}
    actions = ["drop", *map(str, args.widths)]

    def menu(l: int, drop: bool, kind: str) -> list[Option]:
        options_ = [Option("keep", 2 * width, 0.0)]
        options_ += [Option("keys", width + n, costs[l][str(n)][kind], n) for n in args.widths]
        return options_ + ([Option("drop", 0, costs[l]["drop"][kind])] if drop else [])

    def score(projections: dict[int, int], drops: list[int]) -> list[float]:
        with ExitStack() as stack, torch.no_grad():
            stack.enter_context(projected_keys(model, {l: subspaces[l].projector(n) for l, n in projections.items()}))
            stack.enter_context(dropped_attention(model, drops))
            return [perplexity(model, ids, options.eval_context, max_tokens=args.eval_tokens, prefix=streams.prefix).perplexity
                    for ids in streams.evaluations.values()]  # fmt: skip

    lines = [f"Costs of one action at a time on {windows.numel():,} selection tokens of {streams.calib_name} (original "
             f"{measured['base']:.4f} nats): measured loss change / first-order proxy / Fisher proxy.", "",
             "| layer | " + " | ".join(f"{'drop' if a == 'drop' else 'keys ' + a}" for a in actions) + " |", "|---|" + "---|" * len(actions)]  # fmt: skip
    lines += [f"| {l} | " + " | ".join(f"{costs[l][a]['measured']:+.4f} / {costs[l][a]['first']:+.4f} / {costs[l][a]['fisher']:+.4f}"
                                      for a in actions) + " |" for l in range(count)]  # fmt: skip
    real = [costs[l][a]["measured"] for l in range(count) for a in actions]
    keys_real = [costs[l][str(n)]["measured"] for l in range(count) for n in args.widths]
    drop_real = [costs[l]["drop"]["measured"] for l in range(count)]
    lines += ["", "Spearman rank correlation with the measured loss change:", "",
              "| proxy | every action | keys | drop |", "|---|---|---|---|"]  # fmt: skip
    lines.append(f"| Fisher surrogate of the keys, tr(G (I-P) C (I-P)^T) | - | "
                 f"{spearman([subspaces[l].cost(n) for l in range(count) for n in args.widths], keys_real):.3f} | - |")
    for kind in ("first", "fisher"):
        lines.append(f"| {kind} | {spearman([costs[l][a][kind] for l in range(count) for a in actions], real):.3f} | "
                     f"{spearman([costs[l][str(n)][kind] for l in range(count) for n in args.widths], keys_real):.3f} | "
                     f"{spearman([costs[l]['drop'][kind] for l in range(count)], drop_real):.3f} |")  # fmt: skip
    print("\n".join(lines), flush=True)

    base = score({}, [])
    names = [name.split(" (")[0] for name in streams.evaluations]
    table = ["", "| budget | plan | KV | dropped | key widths | " + " | ".join(names) + " |",
             "|---|---|---|---|---|" + "---|" * len(names),
             "| - | original | 1.000x | - | - | " + " | ".join(f"{p:.3f}" for p in base) + " |"]  # fmt: skip
    print("\n".join(table), flush=True)
    original_values = 2 * width * count
    for budget in args.budgets:
        values = budget * original_values
        plans = {}
        sizes = plan_sizes(subspaces, int(values - width * count), floor=MIN_KEY_RANK)
        plans["surrogate keys"] = ({l: n for l, n in enumerate(sizes) if n < width}, [])
        for name, drop, kind in (("measured keys", False, "measured"), ("measured joint", True, "measured"),
                                 ("Fisher-proxy joint", True, "fisher")):  # fmt: skip
            chosen = plan_layers({l: menu(l, drop, kind) for l in range(count)}, values)
            plans[name] = ({l: o.width for l, o in chosen.items() if o.action == "keys"}, [l for l, o in chosen.items() if o.action == "drop"])
        for name, (projections, drops) in plans.items():
            cached = sum(0 if l in drops else width + projections.get(l, width) for l in range(count))
            ppl = score(projections, drops)
            shown = ",".join(str(projections.get(l, width)) if l not in drops else "-" for l in range(count))
            row = (f"| {budget} | {name} | {cached / original_values:.3f}x | {drops or '-'} | {shown} | "
                   + " | ".join(f"{p:.3f} ({p / b:.3f}x)" for p, b in zip(ppl, base)) + " |")  # fmt: skip
            table.append(row)
            print(row, flush=True)
    if args.out:
        args.out.write_text(f"`python {' '.join(sys.argv)}`\n\n" + "\n".join(lines + table) + "\n")
        (args.out.with_suffix(".json")).write_text(json.dumps({"base": measured["base"], "costs": costs}, indent=1))


if __name__ == "__main__":
    main()
