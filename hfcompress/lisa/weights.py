"""A shared layer's tensors: its fit record, the names of its new parameters, and how it (or a dropped attention)
changes a decoder layer's state dict. The layer below everything else in lisa/: build.py reads it too."""

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class FittedLayer:
    layer: int
    rank: int
    align: str  # as the modeling spells it: dense | sparse
    align_hidden: int
    state: dict  # LisaSharedAttention state dict
    loss_initial: float
    loss_final: float
    seconds: float
    key_heads: int | None = None  # low-rank key heads (None: one per attention head)


PARAMETER_MARKERS = ("q_lowrank", "k_lowrank", ".align.")  # names of a shared layer's new (trainable) parameters
# what a shared layer drops: q/k with their biases, and the per-head q/k norms of the families that have them (Qwen3)
REPLACED = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias", "q_norm.weight", "k_norm.weight")


def is_lisa_parameter(name: str) -> bool:
    return any(marker in name for marker in PARAMETER_MARKERS)


def replace_qk(state: dict[str, torch.Tensor], record: FittedLayer) -> dict[str, torch.Tensor]:
    """`state` (full names) with layer `record.layer`'s q/k projections replaced by its fitted LISA module."""
    prefix = f"model.layers.{record.layer}.self_attn."
    state = {k: v for k, v in state.items() if k.removeprefix(prefix) not in REPLACED}
    state.update({prefix + key: value for key, value in record.state.items()})
    return state


def shared_qk_parameters(record: FittedLayer) -> int:
    return sum(v.numel() for k, v in record.state.items() if is_lisa_parameter("." + k))


def without_attention(state: dict[str, torch.Tensor], layer: nn.Module) -> dict[str, torch.Tensor]:
    """Decoder layer `layer`'s tensors `state` (`model.layers.N.*`) without what a dropped attention takes with it (the
    family's `attention_parts`: the attention, its input norm, Gemma 3's norm of its output)."""
    prefixes = tuple(f"model.layers.{layer.layer_idx}.{part}." for part in type(layer).attention_parts)
    return {k: v for k, v in state.items() if not k.startswith(prefixes)}
