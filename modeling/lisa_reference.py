"""The LISA shared-layer attention written once, plainly: the reference every fast path is tested against.

Remote code shipped with every converted model that has a LISA layer (flat next to config.json); imports only torch.
Nothing in the model calls it: the model's own paths (lisa_attention.py: block-wise scores, the feature SDPA call,
decode, the fused Triton decode kernel) and hfcompress's vLLM plugin (its torch paths and its C++ kernel) must give
what this gives, to their dtype's rounding. It computes in the dtype of its inputs: call it with float64 tensors
for a ground truth.

One shared (LISA) layer l, per batch row b, head h, query row i and key j:

    Align(S)[h]  = scale[h] * S[source[h]]                                     (sparse Align)
    Align(S)[h]  = sum_g mix[h, g] S[g] + bias[h] + FFN(S[:, i, j])[h]         (dense Align)
    FFN(s)       = ffn_out_weight @ gelu_tanh(ffn_in_weight @ s + ffn_in_bias)  (no FFN: ffn_in_weight None)
    S_l          = Align(S_{l-1}) + q_lr[h] k_lr[h // (H / Hk)]^T / sqrt(r)    (r = 0: no low-rank term)
    out[h]       = softmax_j(S_l + mask) @ V[h // (H / KV)]

Shapes: S_{l-1} `prev_scores` (B, H, Tq, Tk), the previous layer's pre-softmax scores; `q_lr` (B, H, Tq, r);
`k_lr` (B, Hk, Tk, r), Hk the low-rank key heads (H: one per head, or KV: one per GQA group); `value` (B, KV, Tk, D).
`mask` is additive, broadcastable to (B, 1, Tq, Tk), and is the whole mask (causal part included); None means plain
causal attention with the Tq queries at the last Tq of the Tk positions (prefill: Tq = Tk; decode: Tq = 1).
"""

import math

import torch
from torch.nn import functional as F


def align_reference(
    prev_scores: torch.Tensor,
    *,
    source: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    mix: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    ffn_in_weight: torch.Tensor | None = None,
    ffn_in_bias: torch.Tensor | None = None,
    ffn_out_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Align(S_{l-1}) (B, H, Tq, Tk): sparse with `source` (H,) and `scale` (H,); dense with `mix` (H, H), `bias` (H,)
    and, optionally, the FFN `ffn_in_weight` (F, H), `ffn_in_bias` (F,), `ffn_out_weight` (H, F)."""
    if source is not None:
        return prev_scores[:, source] * scale[None, :, None, None]
    aligned = torch.einsum("hg,bgij->bhij", mix, prev_scores) + bias[None, :, None, None]
    if ffn_in_weight is not None:
        per_position = prev_scores.permute(0, 2, 3, 1)  # (B, Tq, Tk, H): the FFN reads the H scores at (i, j)
        hidden = F.gelu(per_position @ ffn_in_weight.T + ffn_in_bias, approximate="tanh")
        aligned = aligned + (hidden @ ffn_out_weight.T).permute(0, 3, 1, 2)
    return aligned


def shared_attention_reference(
    prev_scores: torch.Tensor,
    q_lr: torch.Tensor,
    k_lr: torch.Tensor,
    value: torch.Tensor,
    *,
    source: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    mix: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    ffn_in_weight: torch.Tensor | None = None,
    ffn_in_bias: torch.Tensor | None = None,
    ffn_out_weight: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One shared layer's attention (module docstring): (output (B, H, Tq, D), scores S_l (B, H, Tq, Tk), before the
    mask). The Align is sparse when `source` is given, else dense; r is `q_lr`'s last dimension."""
    heads, q_len, kv_len = prev_scores.shape[1], prev_scores.shape[2], prev_scores.shape[3]
    scores = align_reference(
        prev_scores, source=source, scale=scale, mix=mix, bias=bias,
        ffn_in_weight=ffn_in_weight, ffn_in_bias=ffn_in_bias, ffn_out_weight=ffn_out_weight,
    )  # fmt: skip
    rank = q_lr.shape[-1]
    if rank > 0:
        keys = k_lr.repeat_interleave(heads // k_lr.shape[1], dim=1)  # head h reads low-rank key head h // (H / Hk)
        scores = scores + q_lr @ keys.transpose(-2, -1) / math.sqrt(rank)
    if mask is None:
        mask = torch.full((q_len, kv_len), float("-inf"), dtype=scores.dtype, device=scores.device)
        mask = mask.triu(kv_len - q_len + 1)  # query i sits at position kv_len - q_len + i
    probs = torch.softmax(scores + mask, dim=-1)
    values = value.repeat_interleave(heads // value.shape[1], dim=1)  # head h reads KV head h // (H / KV)
    return probs @ values, scores
