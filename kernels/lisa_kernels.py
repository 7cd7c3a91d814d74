"""Adapter between the LISA remote modeling code and the LISA decode kernel.

`lisa_attention.py` (the family-neutral part of every `modeling_lisa_<family>.py`) does `from .lisa_kernels import fused_lisa_decode, triton_available` inside a
try/except and calls `fused_lisa_decode` for a dense-Align shared layer at decode only when
`triton_available(q_lr)` (Triton importable, q_lr on CUDA in fp32/fp16/bf16); this file provides exactly
that on top of `lisa_attention_triton.py`. Shipped flat next to the modeling file; imports only torch and
its sibling.

`module` is a `LisaSharedAttention`: uses `module.align.{mix, bias, ffn_in, ffn_out}` (the kernel takes r from
the last dim of q_lr; r = 0 means no low-rank term).
"""

from __future__ import annotations

import torch

from .lisa_attention_triton import lisa_decode_triton, triton_available

__all__ = ["triton_available", "fused_lisa_decode"]


def _module_align_weights(module):
    """(mix, bias, w1, b1, w2) of a shared layer's dense Align; the FFN entries are None without one."""
    align = module.align
    if align.ffn_in is not None:
        return align.mix, align.bias, align.ffn_in.weight, align.ffn_in.bias, align.ffn_out.weight
    return align.mix, align.bias, None, None, None


def fused_lisa_decode(
    module, prev_scores: torch.Tensor, q_lr: torch.Tensor, k_lr: torch.Tensor, value: torch.Tensor,
    additive_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One decode step. prev_scores (B,H,1,Tk), q_lr (B,H,1,r), k_lr (B,H,Tk,r), value (B,Hkv,Tk,D),
    additive_mask (B,1,1,Tk) | None -> (attn_output (B,1,H,D), scores (B,H,1,Tk)) like the torch path.
    Call only where `triton_available(q_lr)` (or under TRITON_INTERPRET=1): there is no torch fallback."""
    out, scores = lisa_decode_triton(prev_scores, *_module_align_weights(module), q_lr, k_lr, value, additive_mask)
    return out[:, None], scores[:, :, None]
