"""Torch reference implementations of the LISA shared-attention ops (CPU/GPU, any dtype).

These are the numerical ground truth for the Triton kernels (the decode kernel in
kernels/lisa_attention_triton.py, the prefill and low-rank kernels in benchmarks/lisa_prefill_triton.py) and the
fallback of the dispatching wrappers in benchmarks/lisa_prefill_triton.py when Triton or a CUDA device is
unavailable. Everything is computed in fp32 and cast back to the input dtype at the end. The model does not
use them (it has its own torch path), so they are not shipped with converted models.

Math (one shared layer, previous layer's pre-softmax scores S_prev, scaled, unmasked):

    S[b,h,i,j] = sum_g mix[h,g] S_prev[b,g,i,j] + bias[h]
                 + FFN(S_prev[b,:,i,j])[h] + <qlr[b,h,i,:], klr[b,h,j,:]> / sqrt(r)   (r = 0: no such term)
    FFN(s)     = w2 @ gelu_tanh(w1 @ s + b1)         (w1: (F,H), b1: (F,), w2: (H,F); F = 0 -> none)
    P          = softmax_j(S + causal + attn_mask)   (query i sits at absolute position Tk - Tq + i)
    out[b,h,i] = sum_j P[b,h,i,j] V[b, h // (H / Hkv), j]

Shapes: s_prev (B,H,Tq,Tk), mix (H,H), bias (H,), qlr (B,H,Tq,r), klr (B,H,Tk,r), v (B,Hkv,Tk,D),
attn_mask: additive float or boolean (True = keep), broadcastable to (B,1,Tq,Tk) (also (B,Tk) 0/1 keep-mask).

Imports torch and, for the mask convention it shares with the decode kernel, `normalize_attn_mask` from the
sibling kernels/lisa_attention_triton.py: load it as one package spanning kernels/ and benchmarks/ (flat relative
imports, as on the Hub; see `load_kernels` in benchmarks/kernel_speed.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .lisa_attention_triton import normalize_attn_mask

__all__ = [
    "lisa_prev_scores_reference",
    "lisa_scores_reference",
    "lisa_attention_reference",
    "lisa_prefill_reference",
    "lisa_decode_reference",
    "lowrank_linear_reference",
    "normalize_attn_mask",
]


def _has_ffn(w1: torch.Tensor | None) -> bool:
    return w1 is not None and w1.numel() > 0


def lisa_prev_scores_reference(q_prev: torch.Tensor, k_prev: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """S_prev = scale * q_prev @ k_prev^T with GQA. q_prev (B,H,Tq,D), k_prev (B,Hkv,Tk,D) -> (B,H,Tq,Tk)."""
    heads, kv_heads, head_dim = q_prev.shape[1], k_prev.shape[1], q_prev.shape[-1]
    scale = head_dim**-0.5 if scale is None else scale
    k = k_prev.float().repeat_interleave(heads // kv_heads, dim=1)
    return (torch.matmul(q_prev.float(), k.transpose(-1, -2)) * scale).to(q_prev.dtype)


def lisa_scores_reference(
    s_prev: torch.Tensor,
    mix: torch.Tensor,
    bias: torch.Tensor | None = None,
    w1: torch.Tensor | None = None,
    b1: torch.Tensor | None = None,
    w2: torch.Tensor | None = None,
    qlr: torch.Tensor | None = None,
    klr: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Aligned + low-rank pre-softmax scores S (B,H,Tq,Tk), unmasked. See module docstring."""
    s = s_prev.float()
    out = torch.einsum("hg,bgij->bhij", mix.float(), s)
    if bias is not None:
        out = out + bias.float()[None, :, None, None]
    if _has_ffn(w1):
        hidden = torch.matmul(s.permute(0, 2, 3, 1), w1.float().t())
        if b1 is not None:
            hidden = hidden + b1.float()
        corr = torch.matmul(F.gelu(hidden, approximate="tanh"), w2.float().t())
        out = out + corr.permute(0, 3, 1, 2)
    if qlr is not None and qlr.shape[-1] > 0:  # rank 0: the aligned scores only
        rank = qlr.shape[-1]
        out = out + torch.matmul(qlr.float(), klr.float().transpose(-1, -2)) / math.sqrt(rank)
    return out.to(out_dtype or s_prev.dtype)


def lisa_attention_reference(
    scores: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(S + causal + mask) @ V with GQA.

    scores (B,H,Tq,Tk), v (B,Hkv,Tk,D) -> (out (B,H,Tq,D) in v.dtype, probs (B,H,Tq,Tk) fp32).
    Rows with no visible key (all -inf) give probs 0 and out 0 (instead of NaN).
    """
    batch, heads, q_len, kv_len = scores.shape
    s = scores.float()
    if causal:
        rows = torch.arange(q_len, device=s.device)[:, None] + (kv_len - q_len)
        cols = torch.arange(kv_len, device=s.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    mask = normalize_attn_mask(attn_mask, batch, q_len, kv_len)
    if mask is not None:
        s = s + mask.float()[:, None]
    probs = torch.softmax(s, dim=-1).nan_to_num(nan=0.0)
    vv = v.float().repeat_interleave(heads // v.shape[1], dim=1)
    return torch.matmul(probs, vv).to(v.dtype), probs


def lisa_prefill_reference(
    s_prev: torch.Tensor | None,
    mix: torch.Tensor,
    bias: torch.Tensor | None,
    w1: torch.Tensor | None,
    b1: torch.Tensor | None,
    w2: torch.Tensor | None,
    qlr: torch.Tensor | None,
    klr: torch.Tensor | None,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    q_prev: torch.Tensor | None = None,
    k_prev: torch.Tensor | None = None,
    prev_scale: float | None = None,
    return_scores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Whole shared layer (prefill): (out (B,H,Tq,D), S (B,H,Tq,Tk) or None)."""
    if s_prev is None:
        s_prev = lisa_prev_scores_reference(q_prev, k_prev, prev_scale)
    scores = lisa_scores_reference(s_prev, mix, bias, w1, b1, w2, qlr, klr)
    out, _ = lisa_attention_reference(scores, v, attn_mask, causal=True)
    return out, (scores if return_scores else None)


def lisa_decode_reference(
    s_prev: torch.Tensor,
    mix: torch.Tensor,
    bias: torch.Tensor | None,
    w1: torch.Tensor | None,
    b1: torch.Tensor | None,
    w2: torch.Tensor | None,
    qlr: torch.Tensor | None,
    klr: torch.Tensor | None,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step (Tq = 1, the query sees every cached key).

    s_prev (B,H,Tk), qlr (B,H,r), klr (B,H,Tk,r), v (B,Hkv,Tk,D), attn_mask broadcastable to (B,1,1,Tk)
    or a (B,Tk) keep-mask -> (out (B,H,D), S (B,H,Tk)).
    """
    scores = lisa_scores_reference(
        s_prev[:, :, None, :], mix, bias, w1, b1, w2, None if qlr is None else qlr[:, :, None, :], klr
    )
    out, _ = lisa_attention_reference(scores, v, attn_mask, causal=True)
    return out[:, :, 0], scores[:, :, 0]


def lowrank_linear_reference(
    x: torch.Tensor, b_w: torch.Tensor, a_w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = (x @ b_w^T) @ a_w^T + bias. b_w (k, in), a_w (out, k): two GEMMs (the torch baseline)."""
    return F.linear(F.linear(x, b_w), a_w, bias)
