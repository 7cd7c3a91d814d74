"""The method interface: what a compression method (LISA, FASC, ...) gives the driver, and its registration.

A method is a unit in the spirit of llm-compressor's modifiers. The driver (pipeline.py) streams decoder layers
and calls every registered method at fixed points; it never knows what a method does:

    observe(ctx)              forward calibration pass, every layer in depth order (ctx: LayerContext)
    gradient_linears(...)     backward calibration pass (only if `needs_gradients`): the linears whose
    observe_gradients(...)    activation/gradient statistics it wants, then the finished statistics of a layer
    plan(planner)             after calibration: choose layers, ranks, ... (may score candidate plans)
    apply(ctx, state)         convert pass, every layer in depth order: the layer's converted tensors
    config_entries()          the keys of the converted config.json the modeling code reads
    report()                  its section of hfcompress_report.json and of the card
    frontier()                its plan at other KV budgets, which the peers step scores training-free for the card

Finishers (distillation) run afterwards on the whole converted model, if it fits: `finish(student, teacher,
sequences)`. A new method is a class in its own module, registered with @register and imported by registry.py;
the driver does not change.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class LayerContext:
    """One decoder layer as the driver streams it past the methods."""

    index: int
    num_layers: int
    layer: nn.Module  # the original decoder layer (its family's converted classes, float32, on `device`), frozen
    device: torch.device
    attention_input: Callable[[], torch.Tensor]  # every process's calibration inputs of self_attn, (N, T, d), lazily
    cos_sin: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # RoPE (cos, sin) for a sequence length, on device
    previous: Callable[[], "LayerContext | None"]  # the layer below (rebuilt on demand, e.g. when a pass resumes)
    is_main: bool = True
    hidden_input: Callable[[], torch.Tensor] | None = None  # every process's layer inputs (N, T, d): the residual stream
    # the backward pass only: every process's d(summed calibration loss) / d(layer output), (N, T, d)
    output_gradient: Callable[[], torch.Tensor] | None = None
    run_layer: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None  # a decoder layer's output on inputs


@dataclass
class Planner:
    """What a method's plan step may use: the model's config and a scorer of candidate plans."""

    config: Any  # the original model's config in the converted classes (e.g. a LisaLlamaConfig converting nothing)
    num_layers: int
    # perplexity of the streamed conversion by `methods` alone, on calibration text the fits never saw
    selection_perplexity: Callable[[list["Method"]], float] | None = None
    notes: dict = field(default_factory=dict)


@dataclass
class FrontierPoint:
    """A method's plan at another KV budget, as the peers step scores it on the original model, training-free: its keys
    and values projected on the latents' subspaces (layer -> (width, width) projector; a cached latent gives exactly
    these scores) and its dropped attentions."""

    name: str
    budget: float  # the --kv-budget it was planned for
    kv_ratio: float  # KV values a token it caches, relative to the original's
    key_projectors: dict[int, torch.Tensor] = field(default_factory=dict)
    value_projectors: dict[int, torch.Tensor] = field(default_factory=dict)
    dropped_attention: list[int] = field(default_factory=list)


class Method(ABC):
    name: str  # the key of its report section and its cache directory
    order: int  # methods apply in this order, lowest first
    needs_gradients: bool = False
    store: Path | None = None  # its own directory in the calibration cache, set by the driver before any pass

    @classmethod
    @abstractmethod
    def from_options(cls, options) -> "Method":
        """The method configured by ConvertOptions (its own section of them)."""

    @abstractmethod
    def settings(self) -> dict:
        """Everything that changes what this method computes (the convert pass's cache key)."""

    def calibration_settings(self) -> dict:
        """What changes its calibration results (the key of its directory in the cache)."""
        return self.settings()

    def active(self) -> bool:
        """False when the options turn the method off: then the driver skips it entirely."""
        return True

    def check_model(self, config) -> None:
        """Refuse options this model cannot take (raise HfcompressError); runs before calibration."""

    def observe(self, ctx: LayerContext) -> None:
        """Forward calibration pass."""

    def gradient_linears(self, ctx: LayerContext) -> dict[str, nn.Module]:
        """Linears of this layer whose input/output-gradient statistics the method needs (needs_gradients)."""
        return {}

    def observe_gradients(self, ctx: LayerContext, stats: dict) -> None:
        """The finished statistics of `gradient_linears` (summed over processes)."""

    def plan(self, planner: Planner) -> None:
        """Choose what to convert."""

    @abstractmethod
    def apply(self, ctx: LayerContext, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This layer's converted tensors (full names, `model.layers.N.`) from `state`."""

    def touches(self, index: int) -> bool:
        """Whether apply changes layer `index` (the driver needs the calibration inputs only then)."""
        return True

    def config_entries(self) -> dict:
        """Its keys of the converted config.json (known once plan has run)."""
        return {}

    def resume_state(self) -> dict:
        """What the convert pass must keep to resume after layer N (the driver saves it after each layer)."""
        return {}

    def restore(self, state: dict) -> None:
        """Inverse of resume_state."""

    def report(self) -> dict:
        return {}

    def frontier(self) -> list[FrontierPoint]:
        """Its plan at other budgets, for the card's frontier (known once plan has run); empty for a method without a KV
        budget."""
        return []

    def changed_layers(self) -> dict[str, list[int]]:
        """The layers its plan changed, by kind of change (known once plan has run): what --back-off lowers. Empty for
        a method whose changes --back-off leaves alone."""
        return {}

    def with_fewer_changes(self, options, count: int) -> "tuple[object, str] | None":
        """`options` (ConvertOptions) with this method's plan changing `count` of its changed layers (or as much less as
        that), and the change in words for the log; None when it cannot."""
        return None


def merged_config_entries(methods: list[Method]) -> dict:
    """Every method's config.json entries; a list two methods give (the dropped attentions of LISA's plan and of the
    KV plan) is their union."""
    entries: dict = {}
    for method in methods:
        for key, value in method.config_entries().items():
            if isinstance(value, list) and isinstance(entries.get(key), list):
                value = sorted({*entries[key], *value})
            entries[key] = value
    return entries


class Finisher(ABC):
    """A step on the whole converted model after the streamed conversion (distillation from the original)."""

    name: str
    # whether the options ask for it explicitly: one asked for that cannot run (the whole model does not fit) is refused,
    # one that runs by default is skipped with a notice
    asked: bool = True

    @classmethod
    @abstractmethod
    def from_options(cls, options) -> "Finisher | None":
        """The finisher configured by ConvertOptions, or None when the options turn it off."""

    def settings(self) -> dict:
        """What changes its result (the key of its files in the work directory)."""
        return {}

    @abstractmethod
    def finish(self, student: nn.Module, teacher: nn.Module, data) -> tuple[nn.Module, dict]:
        """Train `student` (on its device) on `data` (distill.DistillData: training tokens, evaluation texts, the
        work directory for resumable state); returns it (or its replacement) and the record for the report."""


METHODS: dict[str, type[Method]] = {}
FINISHERS: dict[str, type[Finisher]] = {}


def register(cls):
    """Class decorator: makes a Method or Finisher known to the driver under its `name`."""
    (METHODS if issubclass(cls, Method) else FINISHERS)[cls.name] = cls
    return cls
