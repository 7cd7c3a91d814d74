"""A factorised linear in a layer's state dict: the names of its two factors and how they replace its weight."""

import torch


FACTOR_MARKERS = (".proj_in.", ".proj_out.")  # names of a FascLinear's two factors (trainable in distillation)


def is_fasc_parameter(name: str) -> bool:
    return any(marker in name for marker in FACTOR_MARKERS)


def replace_linear(state: dict[str, torch.Tensor], name: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """`state` (full names) with linear `name` ("layer.path") replaced by its factors: proj_in = B, proj_out = A."""
    state, prefix = dict(state), f"model.layers.{name}."
    state.pop(prefix + "weight")
    state[prefix + "proj_in.weight"] = b
    state[prefix + "proj_out.weight"] = a
    if prefix + "bias" in state:
        state[prefix + "proj_out.bias"] = state.pop(prefix + "bias")
    return state
