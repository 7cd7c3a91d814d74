"""The in-memory driver of the research scripts (benchmarks/): every method on a model loaded whole, without the
streamed pipeline. Research code, not in the wheel; the product never imports it. Each function does what the
methods' pipeline units do layer by layer (lisa.LisaMethod, fasc.FascMethod, distill.Distillation), with the same
functions underneath. Ablations the CLI does not offer are LisaOptions built here (`ABLATIONS`).
"""

import tempfile
from pathlib import Path

import torch
from torch import nn

from hfcompress.conversion.build import assemble, converted_config, in_converted_classes
from hfcompress.conversion.calibrate import LinearStats
from hfcompress.distill import DistillData, Distillation, DistillOptions
from hfcompress.fasc import FascLayerResult, FascOptions, decompose, dependence_violation, layer_result, plan_ranks, replace_linear, trusted_layers
from hfcompress.lisa import (
    FittedLayer, LayerSimilarity, LisaOptions, SIMILARITY_SEQUENCES, fit_inputs, fit_shared_layer, handed_over,
    layer_similarity, lowrank_rank, replace_qk, rotary,
)  # fmt: skip
from hfcompress.progress import progress_bar

__all__ = ["ABLATIONS", "build_converted_model", "compress_linears", "converted_state", "distill_model", "fit_lisa",
           "in_converted_classes", "measure_similarity"]  # fmt: skip

# Named variants benchmarks/lisa_ablations.py compares (LisaOptions overrides; identity_align and lowrank=False are
# research ablations, not on the CLI)
ABLATIONS = {
    "direct": dict(identity_align=True, lowrank=False),  # previous scores copied head for head, nothing trained
    "align only": dict(align="dense", lowrank=False),
    "dense + low-rank": dict(align="dense"),
    "linear + low-rank": dict(align="dense", align_hidden=0),
    "sparse + low-rank": dict(align="sparse"),  # the default
}


@torch.no_grad()
def measure_similarity(
    model: nn.Module, attn_inputs: list[torch.Tensor], max_sequences: int = SIMILARITY_SEQUENCES
) -> list[LayerSimilarity]:
    """Attention similarity of every layer to the previous one on calibration inputs (`model`: the original in
    transformers' classes)."""
    model = in_converted_classes(model)
    layers = model.model.layers
    previous, result = None, []
    for idx in progress_bar(range(len(layers)), "analyze: attention similarity"):
        cos_sin = rotary(model, attn_inputs[0][:1], idx)
        similarity, previous = layer_similarity(idx, layers[idx].self_attn, attn_inputs[idx][:max_sequences], cos_sin, previous)
        if similarity is not None:
            result.append(similarity)
    return result


def fit_lisa(
    model: nn.Module,
    attn_inputs: list[torch.Tensor],
    chosen: list[int],
    similarity: list[LayerSimilarity],
    options: LisaOptions,
) -> list[FittedLayer]:
    """In memory (research scripts, tests): fit every chosen layer of a loaded model (transformers' classes) in depth
    order, anchoring each on the converted layers below it, as LisaMethod does layer by layer in the pipeline."""
    if not chosen:
        return []
    model = in_converted_classes(model)
    rank = lowrank_rank(model.config, options.qk_compression, options.lowrank_keys) if options.lowrank else 0
    matching = {s.layer: s.matching for s in similarity}
    layers = model.model.layers
    fitted: list[FittedLayer] = []
    converted: dict[int, nn.Module] = {}
    below = None
    for idx in progress_bar(range(chosen[-1] + 1), "lisa: fit shared layers"):
        cos_sin = rotary(model, attn_inputs[0][:1], idx)
        x = fit_inputs(attn_inputs[idx], options)
        if idx in chosen:
            module, record = fit_shared_layer(model.config, layers[idx].self_attn, cos_sin, idx, x, below, matching[idx], rank, options)
            converted[idx] = module
            fitted.append(record)
        if idx + 1 in chosen:  # the next layer anchors on what this (converted) one hands over
            module = converted.get(idx, layers[idx].self_attn)
            below = handed_over(module, x, below if idx in converted else None, cos_sin, options)
        else:
            below = None
    return fitted


def compress_linears(
    linears: dict[str, torch.nn.Linear], stats: dict[str, LinearStats], options: FascOptions
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[FascLayerResult]]:
    """Factor every targeted linear under one budget: ({name: (A, B)} for compressed layers, per-layer results)."""
    rhos = {name: dependence_violation(stats[name]) for name in linears}
    trusted = trusted_layers(rhos, options)
    decompositions = {name: decompose(linears[name].weight, stats[name], options.method) for name in linears if name in trusted}
    ranks = plan_ranks(decompositions, {name: tuple(lin.weight.shape) for name, lin in linears.items()}, options)
    factors, results = {}, []
    for name, linear in linears.items():
        rank = ranks.get(name)
        dec = decompositions.get(name)
        if rank is not None:
            a, b = dec.factors(rank)
            factors[name] = (a.to(linear.weight.dtype), b.to(linear.weight.dtype))
        results.append(layer_result(name, tuple(linear.weight.shape), rank, rhos[name], dec))
    return factors, results


def converted_state(
    state: dict[str, torch.Tensor],
    lisa_layers: list[FittedLayer],
    fasc_factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """`state` with the shared layers' Q/K replaced by their fitted modules and every factorised linear by its
    factors (the same functions the methods apply layer by layer)."""
    for record in lisa_layers:
        state = replace_qk(state, record)
    for name, (a, b) in fasc_factors.items():
        state = replace_linear(state, name, a, b)
    return state


def build_converted_model(
    original: nn.Module,
    lisa_layers: list[FittedLayer],
    fasc_factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> nn.Module:
    """A converted model in memory from a loaded original and fitted modules (the pipeline assembles its output layer
    by layer)."""
    spec = {
        str(f.layer): {"rank": f.rank, "align": f.align, "align_hidden": f.align_hidden}
        | ({"key_heads": f.key_heads} if f.key_heads else {})
        for f in lisa_layers
    }
    ranks = {name: int(b.shape[0]) for name, (a, b) in fasc_factors.items()}
    config = converted_config(original.config, {"lisa_layers": spec, "fasc_ranks": ranks})
    state = converted_state(original.state_dict(), lisa_layers, fasc_factors)
    return assemble(config, state, next(original.parameters()).dtype)


def distill_model(
    student: nn.Module, teacher: nn.Module, train_ids: torch.Tensor, options: DistillOptions,
    evaluations: dict[str, torch.Tensor] | None = None, eval_context: int = 512, seed: int = 0,
) -> tuple[nn.Module, dict]:
    """The distillation stage on an in-memory model, its resumable state in a temporary directory."""
    with tempfile.TemporaryDirectory() as work:
        data = DistillData(train_ids, evaluations or {}, eval_context, Path(work), seed)
        return Distillation(options).finish(student, teacher, data)
