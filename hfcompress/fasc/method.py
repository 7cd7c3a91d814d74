"""FASC as a pipeline unit (methods.Method)."""

import math
from dataclasses import asdict, replace

import torch

from ..conversion.atomic import save_atomic
from ..conversion.calibrate import LinearStats
from ..conversion.methods import LayerContext, Method, Planner, register
from .factorise import Decomposition, FascLayerResult, decompose, dependence_violation, layer_result, plan_ranks, trusted_layers
from .options import FascOptions
from .weights import replace_linear


@register
class FascMethod(Method):
    """FASC as a pipeline unit: C/G statistics in the backward pass, per-layer factorisations saved as they are
    computed, one global rank budget in plan, the factors swapped in by apply."""

    name = "fasc"
    order = 20
    needs_gradients = True

    def __init__(self, options: FascOptions, seed: int = 0) -> None:
        self.options, self.seed = options, seed
        self.ranks: dict[str, int | None] = {}
        self.results: list[FascLayerResult] = []

    @classmethod
    def from_options(cls, options) -> "FascMethod":
        return cls(replace(options.fasc), options.seed)

    def active(self) -> bool:
        return self.options.budget < 1.0

    def settings(self) -> dict:
        return {**asdict(self.options), "seed": self.seed}

    def calibration_settings(self) -> dict:
        return {k: v for k, v in self.settings().items() if k != "budget"}  # the ranks are planned from the spectra

    def gradient_linears(self, ctx: LayerContext) -> dict[str, torch.nn.Module]:
        return {f"{ctx.index}.{t}": ctx.layer.get_submodule(t) for t in self.options.targets}

    def observe_gradients(self, ctx: LayerContext, stats: dict[str, LinearStats]) -> None:
        """rho of every targeted linear of this layer; for the trusted ones the factorisation, cut at the break-even
        rank (no allocation can give a layer more: it would stay dense), saved in float32."""
        if not ctx.is_main:
            return
        rhos = {name: dependence_violation(stats[name]) for name in stats}
        factors, spectra, shapes = {}, {}, {}
        for name in stats:
            weight = ctx.layer.get_submodule(name.split(".", 1)[1]).weight
            shapes[name] = tuple(weight.shape)
            if name not in trusted_layers(rhos, self.options):
                continue
            dec = decompose(weight, stats[name], self.options.method)
            m, n = weight.shape
            keep = min(len(dec.spectrum), math.ceil(m * n / (m + n)))
            factors[name] = (dec.left[:, :keep].float().cpu(), dec.right[:keep].float().cpu())
            spectra[name] = dec.spectrum.cpu()
        save_atomic(factors, self.store / f"factors-{ctx.index}.pt")
        save_atomic({"rhos": rhos, "shapes": shapes, "spectra": spectra}, self.store / f"fasc-{ctx.index}.pt")

    def plan(self, planner: Planner) -> None:
        """Global ranks from every layer's spectrum (the factors stay on disk) and the per-linear report rows."""
        rhos, shapes, spectra = {}, {}, {}
        for idx in range(planner.num_layers):
            summary = torch.load(self.store / f"fasc-{idx}.pt")
            rhos.update(summary["rhos"])
            shapes.update(summary["shapes"])
            spectra.update(summary["spectra"])
        dropped = set(planner.notes.get("dropped_attention_layers", []))  # LISA's plan ran first (order)
        spectra = {name: s for name, s in spectra.items() if not (int(name.split(".")[0]) in dropped and ".self_attn." in name)}
        empty = torch.empty(0)  # only the spectra drive the allocation
        decompositions = {name: Decomposition(left=empty, right=empty, spectrum=s) for name, s in spectra.items()}
        self.ranks = plan_ranks(decompositions, shapes, self.options)
        self.results = [layer_result(name, shapes[name], self.ranks.get(name), rhos[name], decompositions.get(name)) for name in shapes]

    def _ranked(self, index: int) -> dict[str, int]:
        return {name: r for name, r in self.ranks.items() if r is not None and name.split(".")[0] == str(index)}

    def touches(self, index: int) -> bool:
        return bool(self._ranked(index))

    def apply(self, ctx: LayerContext, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ranked = self._ranked(ctx.index)
        if not ranked:
            return state
        stored = torch.load(self.store / f"factors-{ctx.index}.pt")
        for name, rank in ranked.items():
            state = replace_linear(state, name, *Decomposition(*stored[name], torch.empty(0)).factors(rank))
        return state

    def config_entries(self) -> dict:
        return {"fasc_ranks": {name: r for name, r in self.ranks.items() if r is not None}}

    def report(self) -> dict:
        return {
            "method": self.options.method,
            "budget": self.options.budget,
            "targets": list(self.options.targets),
            "layers": [r.to_dict() for r in self.results],
        }
