"""Attention primitives the LISA fit and similarity share: RoPE per layer, the causal (sliding) mask, a module's
pre-softmax scores and its output for given scores."""

import torch
from torch import nn

from ..remote import import_remote


def rotary(model: nn.Module, x: torch.Tensor, layer_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (cos, sin) of positions 0..T-1 for layer `layer_idx`: of its attention type in a model of the converted
    classes (Gemma 3's bases differ per type), the one rotary of a transformers model without `attention_types`."""
    positions = torch.arange(x.shape[1]).unsqueeze(0)
    types = getattr(model.config, "attention_types", None)
    if types is None:
        return model.model.rotary_emb(x, position_ids=positions)
    kind = types[layer_idx]
    return import_remote("lisa_attention").rotary_embeddings(model.model.rotary_emb, x, positions, [kind])[kind]


def causal_mask(
    seq_len: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", window: int | None = None
) -> torch.Tensor:  # fmt: skip
    """Additive (1, 1, T, T) causal mask; with a sliding `window`, each query sees only the last `window` positions
    (itself included), as transformers' sliding-window mask."""
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if window is not None:
        allowed = allowed.triu(1 - window)
    return torch.zeros(1, 1, seq_len, seq_len, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def full_attention_scores(attn: nn.Module, x: torch.Tensor, cos_sin) -> torch.Tensor:
    """Pre-softmax scores (B, H, T, T) of a converted model's full attention module (its biases and q/k norms
    included), GQA expanded."""
    q, k = attn.query_key(x, cos_sin)
    k = import_remote("lisa_attention").repeat_kv(k, attn.num_key_value_groups)
    return torch.matmul(q, k.transpose(2, 3)) * attn.scaling


def attention_output(attn: nn.Module, x: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """o_proj(softmax(scores + mask) V) for the module's own V and O projections."""
    value = attn.v_proj(x).view(*x.shape[:-1], -1, attn.head_dim).transpose(1, 2)
    out = import_remote("lisa_attention").softmax_attention(scores, mask, value, attn.num_key_value_groups)
    return attn.o_proj(out.reshape(*x.shape[:-1], -1))



def relative_error(output: torch.Tensor, target: torch.Tensor) -> float:
    return ((output - target).pow(2).mean() / target.pow(2).mean()).item()
