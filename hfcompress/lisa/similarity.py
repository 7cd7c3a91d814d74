"""Cross-layer attention similarity (what `analyze` shows and what the layer choice ranks by).

For layer l and the previous layer l-1, on calibration sequences: the JS divergence between the attention rows of every
head pair (h of l, g of l-1) -> an H x H matrix; the "same head" score is its diagonal, the "best match" score is its
row minimum (the matching pi(h)); the aligned output error is the relative MSE of the layer's attention output when its
scores are replaced by the head-aligned previous scores, before any training.
"""

import itertools
from dataclasses import asdict, dataclass

import torch
from torch import nn

from .attention import attention_output, causal_mask, full_attention_scores, relative_error


@dataclass
class LayerSimilarity:
    layer: int
    js_same_head: float
    js_best_match: float
    matching: list[int]  # matching[h] = head of layer-1 that head h resembles most
    head_js_best: list[float]  # per head of this layer, JS to its matched head
    aligned_output_error: float  # relative MSE of the attention output when scores = aligned previous scores
    shareable: bool = True  # it has the attention type of the layer below (see `shareable_layers`)
    attention_energy: float | None = None  # E|a|^2 / E|h + a|^2: attention output a, layer input h (`attention_energy`)

    def to_dict(self) -> dict:
        return asdict(self)

def js_matrix(p_cur: torch.Tensor, p_prev: torch.Tensor) -> torch.Tensor:
    """Mean Jensen-Shannon divergence (nats) between attention rows of every head pair: (H_cur, H_prev)."""
    eps = 1e-12
    heads = p_cur.shape[1]
    out = torch.empty(heads, p_prev.shape[1], device=p_cur.device)
    for h in range(heads):
        p = p_cur[:, h : h + 1]
        m = 0.5 * (p + p_prev)
        log_m = (m + eps).log()
        kl_p = (p * ((p + eps).log() - log_m)).sum(-1)
        kl_q = (p_prev * ((p_prev + eps).log() - log_m)).sum(-1)
        out[h] = (0.5 * (kl_p + kl_q)).mean(dim=(0, 2))
    return out


@torch.no_grad()
def alignment_mix(cur_scores: torch.Tensor, prev_scores: torch.Tensor, matching: list[int]) -> torch.Tensor:
    """H x H mix with mix[h, pi(h)] = least-squares scale of the matched previous head's logits onto head h's.

    Rows are centred over their causal entries first: softmax ignores a per-row offset, so only the shape of
    each score row has to be matched.
    """
    seq_len = cur_scores.shape[-1]
    keep = torch.ones(seq_len, seq_len, dtype=torch.bool, device=cur_scores.device).tril()
    count = keep.sum(-1, keepdim=True)

    def centred(x: torch.Tensor) -> torch.Tensor:
        x = x.masked_fill(~keep, 0.0)
        return (x - x.sum(-1, keepdim=True) / count).masked_fill(~keep, 0.0)

    mix = torch.zeros(cur_scores.shape[1], prev_scores.shape[1], device=cur_scores.device)
    for h, g in enumerate(matching):
        s, p = centred(cur_scores[:, h]), centred(prev_scores[:, g])
        mix[h, g] = (s * p).sum() / (p * p).sum().clamp_min(1e-12)
    return mix



SIMILARITY_SEQUENCES = 8  # calibration sequences the similarity is measured on


@torch.no_grad()
def group_matching(js: torch.Tensor, kv_heads: int) -> list[int]:
    """The head matching (source head below, per head) of least total JS divergence in which the heads of one KV group
    read heads of one KV group below, and different groups different ones: groups are assigned by the permutation of
    least summed divergence (each head's best head inside its group's assigned group), heads inside groups freely."""
    heads = js.shape[0]
    g = heads // kv_heads
    # best[h, c]: head h's least divergence to a head of group c below, and that head
    blocks = js.view(heads, kv_heads, g)
    best, where = blocks.min(dim=2)
    cost = best.view(kv_heads, g, kv_heads).sum(dim=1)  # (this layer's group, group below)
    if kv_heads <= 8:
        perm = min(itertools.permutations(range(kv_heads)), key=lambda p: sum(cost[j, c].item() for j, c in enumerate(p)))
    else:  # greedy: the cheapest free pair first
        perm, free_rows, free_cols = [0] * kv_heads, set(range(kv_heads)), set(range(kv_heads))
        for j, c in sorted(((j, c) for j in range(kv_heads) for c in range(kv_heads)), key=lambda jc: cost[jc].item()):
            if j in free_rows and c in free_cols:
                perm[j] = c
                free_rows.discard(j)
                free_cols.discard(c)
    return [perm[h // g] * g + int(where[h, perm[h // g]]) for h in range(heads)]


def layer_similarity(
    idx: int, attn: nn.Module, x: torch.Tensor, cos_sin, previous: tuple[torch.Tensor, torch.Tensor, int | None] | None
) -> tuple[LayerSimilarity | None, tuple[torch.Tensor, torch.Tensor, int | None]]:
    """Similarity of layer `idx` (attention module, its inputs x) to the previous layer's (scores, probs, sliding
    window), and this layer's for the next call; the first layer has nothing to compare with (None)."""
    mask = causal_mask(x.shape[1], device=x.device, window=attn.sliding_window)
    scores = full_attention_scores(attn, x, cos_sin)
    probs = torch.softmax(scores + mask, dim=-1)
    if previous is None:
        return None, (scores, probs, attn.sliding_window)
    prev_scores, prev_probs, prev_window = previous
    js = js_matrix(probs, prev_probs)
    matching = js.argmin(dim=1).tolist()
    aligned = torch.einsum("hg,bgij->bhij", alignment_mix(scores, prev_scores, matching), prev_scores)
    similarity = LayerSimilarity(
        layer=idx,
        js_same_head=js.diagonal().mean().item(),
        js_best_match=js.min(dim=1).values.mean().item(),
        matching=matching,
        head_js_best=js.min(dim=1).values.tolist(),
        aligned_output_error=relative_error(attention_output(attn, x, aligned, mask), attention_output(attn, x, scores, mask)),
        shareable=attn.sliding_window == prev_window,
    )
    return similarity, (scores, probs, attn.sliding_window)


@torch.no_grad()
def attention_energy(attn: nn.Module, x: torch.Tensor, hidden: torch.Tensor, cos_sin) -> float:
    """E|a|^2 / E|h + a|^2 over tokens: how much of the residual stream after the attention block is the block's output
    a (attention input x = norm(h)); the relative change dropping the block makes (layer_plan.py)."""
    mask = causal_mask(x.shape[1], device=x.device, window=attn.sliding_window)
    out = attention_output(attn, x, full_attention_scores(attn, x, cos_sin), mask).float()
    return (out.pow(2).sum(-1).mean() / (hidden.float() + out).pow(2).sum(-1).mean().clamp_min(1e-30)).item()


