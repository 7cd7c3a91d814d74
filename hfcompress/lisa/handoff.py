"""The hand-off: what a (converted) layer gives the shared layer above it on the calibration sequences, as the
modeling hands it at prefill (the fit of the layer above reads it)."""

import torch
from torch import nn

from ..remote import import_remote
from .attention import causal_mask, full_attention_scores
from .options import LisaOptions


# What a shared layer reads from the (converted) layer below, for every calibration sequence. A sparse Align's scores
# are linear in the layer below's (scaled query, key) features, so those are kept: N x H x T x (D + r) numbers instead
# of the N x H x T x T scores (7x less at T = 512, 29x at 2,048: 0.7 instead of 2.4 GB at 256 x 512). A dense Align
# is non-linear in the scores, so it reads them.
Below = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def hands_features(options: LisaOptions) -> bool:
    return options.align != "dense"


def rows(below: Below, index: torch.Tensor | slice) -> Below:
    """The calibration sequences `index` of what the layer below hands over."""
    return tuple(t[index] for t in below) if isinstance(below, tuple) else below[index]


def scores_of(below: Below) -> torch.Tensor:
    """Pre-softmax scores (B, H, T, T) of what the layer below hands over (features: query @ key^T by KV group)."""
    if isinstance(below, tuple):
        return import_remote("lisa_attention").grouped_scores(*below)
    return below


@torch.no_grad()
def handed_over(module: nn.Module, x: torch.Tensor, below: Below | None, cos_sin, options: LisaOptions) -> Below:
    """What a (converted) layer hands the shared layer above it, for all calibration sequences, as the modeling hands
    it at prefill: (scaled query, key) features when the Align is sparse, else pre-softmax scores. `below` is what
    this layer read itself (None: an original layer)."""
    seq_len = x.shape[1]
    positions = torch.arange(seq_len, device=x.device).unsqueeze(0)
    mask = causal_mask(seq_len, device=x.device, window=module.sliding_window)
    handoff = "features" if hands_features(options) else "scores"
    parts = []
    for i in range(0, len(x), options.batch_size):
        xb = x[i : i + options.batch_size]
        if below is None:
            q, k = module.query_key(xb, cos_sin)
            parts.append((q * module.scaling, k) if handoff == "features" else full_attention_scores(module, xb, cos_sin))
        else:
            parts.append(module(xb, positions.expand(len(xb), -1), mask, rows(below, slice(i, i + len(xb))), handoff=handoff)[1])
    return tuple(torch.cat(t) for t in zip(*parts)) if isinstance(parts[0], tuple) else torch.cat(parts)
