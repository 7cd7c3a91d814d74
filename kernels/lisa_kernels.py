"""Adapter between the LisaLlama remote modeling code and the LISA Triton kernels.

`modeling_lisa_llama.py` does `from .lisa_kernels import fused_lisa_decode, triton_available` inside a
try/except; this file provides exactly that (plus a prefill counterpart) on top of
`lisa_attention_triton.py`. Shipped flat next to the modeling file; imports only torch and siblings.

`module` is a `LisaSharedAttention`: uses `module.align.{mix, bias, ffn_in, ffn_out}` and `module.rank`
(the kernels take r from the last dim of q_lr).
"""

from __future__ import annotations

import torch

from .lisa_attention_triton import lisa_decode, lisa_prefill, triton_available

__all__ = ["triton_available", "fused_lisa_decode", "fused_lisa_prefill"]


def _align_weights(module):
    align = module.align
    if align.ffn_in is not None:
        return align.mix, align.bias, align.ffn_in.weight, align.ffn_in.bias, align.ffn_out.weight
    return align.mix, align.bias, None, None, None


def fused_lisa_decode(
    module, prev_scores: torch.Tensor, q_lr: torch.Tensor, k_lr: torch.Tensor, value: torch.Tensor,
    additive_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One decode step. prev_scores (B,H,1,Tk), q_lr (B,H,1,r), k_lr (B,H,Tk,r), value (B,Hkv,Tk,D),
    additive_mask (B,1,1,Tk) | None -> (attn_output (B,1,H,D), scores (B,H,1,Tk)) like the torch path."""
    out, scores = lisa_decode(prev_scores, *_align_weights(module), q_lr, k_lr, value, additive_mask)
    return out[:, None], scores[:, :, None]


def fused_lisa_prefill(
    module, prev_scores: torch.Tensor, q_lr: torch.Tensor, k_lr: torch.Tensor, value: torch.Tensor,
    additive_mask: torch.Tensor | None, return_scores: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Prefill from materialised previous scores (B,H,Tq,Tk) -> (attn_output (B,Tq,H,D), scores or None).
    Scores above the causal diagonal come back as 0 (never attended to)."""
    out, scores = lisa_prefill(
        prev_scores, *_align_weights(module), q_lr, k_lr, value, additive_mask, return_scores=return_scores
    )
    return out.transpose(1, 2), scores
