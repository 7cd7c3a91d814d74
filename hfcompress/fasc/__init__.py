"""FASC: Fisher-aligned low-rank factorisation of linear layers under one global parameter budget.

    options.py    FascOptions: every option's default, help and range checks
    factorise.py  the arithmetic: rho, the factorisations (fisher, whiten, svd, pca), the global rank budget
    weights.py    a factorised linear in a layer's state dict
    method.py     FascMethod, the pipeline unit

The in-memory driver of the research scripts (compress_linears) is research/inmemory.py, outside the package.
"""

from .factorise import (
    DAMPING, Decomposition, FascLayerResult, allocate_ranks, decompose, dependence_violation, layer_result, plan_ranks,
    trusted_layers,
)  # fmt: skip
from .method import FascMethod
from .options import DEFAULT_TARGETS, METHODS, TARGETABLE, FascOptions
from .weights import FACTOR_MARKERS, is_fasc_parameter, replace_linear

__all__ = [
    "DAMPING", "DEFAULT_TARGETS", "FACTOR_MARKERS", "METHODS", "TARGETABLE", "Decomposition", "FascLayerResult",
    "FascMethod", "FascOptions", "allocate_ranks", "decompose", "dependence_violation", "is_fasc_parameter",
    "layer_result", "plan_ranks", "replace_linear", "trusted_layers",
]  # fmt: skip
