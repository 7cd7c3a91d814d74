"""Step 3, lisa: measure cross-layer attention similarity, choose the shared layers, fit their modules.

For layer l and the previous layer l-1, on calibration sequences:
- JS divergence between the attention rows of every head pair (h of l, g of l-1) -> an H x H matrix; the
  "same head" score is its diagonal, the "best match" score is its row minimum (the matching pi(h)).
- A shared layer gets Align (initialised to mix[h, pi(h)] = least-squares scale of S_{l-1}[pi(h)] onto S_l[h];
  "dense": a full head mix + FFN trained from there, "sparse": only that scale trained, "identity": no alignment
  at all, the same head copied) and low-rank Q/K (none with lowrank=False), trained by distillation: the layer's attention output (after o_proj) must match the
  original layer's on the same input, with the anchor scores coming from the already converted layers below
  (so errors of a chain of shared layers are seen while fitting).
"""

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from .calibrate import cache_key, load_or_compute
from .errors import HfcompressError
from .layer_plan import LayerPlan, chain_length, kv_values, largest_within, plan_sequence, ranked_actions
from .methods import LayerContext, Method, Planner, register
from .progress import console, progress_bar
from .remote import import_remote

DEFAULT_SHARE_RATIO = 0.2
# Input RMS at which --lisa-lr is the low-rank Q/K weights' own Adam rate (SmolLM2's deep layers, where the defaults
# were measured). Adam's step has a fixed size in weight space, so its effect on the low-rank scores grows with the
# input's scale: the weights' rate and initial scale are multiplied by LOWRANK_INPUT_RMS / RMS(input). Gemma 3's
# inputs are 4-10x SmolLM2's; at the unscaled rate its fits diverged (benchmarks/results-gemma3-lisa-run.log).
LOWRANK_INPUT_RMS = 0.35


@dataclass
class LisaOptions:
    share_ratio: float | None = None  # fraction of layers shared, best aligned first (None: DEFAULT_SHARE_RATIO)
    layers: list[int] | None = None  # explicit choice instead of share_ratio
    ppl_budget: float | None = None  # percent: share as many layers as keep perplexity within it (searched)
    protect_first: int = 2  # shallow layers are never shared
    # at most this many consecutive shared layers (None: no cap): in a chain each layer approximates the layer below's
    # approximation, and a sparse chain's prefill attention widens by r per layer (benchmarks/results-long-context.md)
    max_chain: int | None = None
    # shared Q/K parameters >= this many times smaller than W_Q + W_K. The paper's 6 gave SmolLM2 rank 6 per head; 3 with
    # keys per KV group gives rank 20 at about the same K cache (3 x 20 against 9 x 6 values a token): benchmarks/scaling.py
    qk_compression: float = 3.0
    align: str = "sparse"  # sparse (one scaled head: SDPA fast path, the default) | dense (head mix + FFN) | identity (none)
    align_hidden: int = 16  # dense Align: FFN width across heads; 0 = linear head mix only
    lowrank: bool = True  # low-rank Q/K correction (False: aligned previous scores only, an ablation)
    lowrank_keys: str = "group"  # one low-rank key per KV "group" (GQA: a smaller cache, a higher rank), or per "head"
    # sparse Align: the query heads of one KV group read one KV head of the layer below, different groups different
    # ones, so a shared layer and its anchor fit in one vLLM paged cache of no more values a token than the
    # original layers (hfcompress.vllm_plugin; docs/serving-vllm.md); False: each head its best match anywhere
    group_heads: bool = False
    # the fit was short of steps: 600 steps of one sequence beat 100 of four on held-out sequences, for about twice the
    # time (benchmarks/lisa_fit_budget.py)
    steps: int = 600
    batch_size: int = 1
    lr: float = 1e-2
    seed: int = 0
    # what --share-ratio and --lisa-ppl-budget may do to a layer: share it (LISA), drop its attention, or either, per
    # layer, by estimated cost per KV value saved (layer_plan.py)
    plan: str = "share"
    drop_layers: list[int] | None = None  # attention dropped in these layers, besides what the plan chooses

    @property
    def ratio(self) -> float:
        return DEFAULT_SHARE_RATIO if self.share_ratio is None else self.share_ratio


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


def relative_error(output: torch.Tensor, target: torch.Tensor) -> float:
    return ((output - target).pow(2).mean() / target.pow(2).mean()).item()


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


def in_converted_classes(model: nn.Module) -> nn.Module:
    """The original model in its family's converted classes, converting nothing (sharing the original's tensors)."""
    from .build import build_converted_model

    return build_converted_model(model, [], {})


@torch.no_grad()
def measure_similarity(
    model: nn.Module, attn_inputs: list[torch.Tensor], max_sequences: int = SIMILARITY_SEQUENCES
) -> list[LayerSimilarity]:
    """Attention similarity of every layer to the previous one on calibration inputs (`model`: the original in
    transformers' classes)."""
    model = in_converted_classes(model)
    layers = model.model.layers
    previous, result = None, []
    for idx in progress_bar(range(len(layers)), "analyze: attention similarity"):
        cos_sin = rotary(model, attn_inputs[0][:1], idx)
        similarity, previous = layer_similarity(idx, layers[idx].self_attn, attn_inputs[idx][:max_sequences], cos_sin, previous)
        if similarity is not None:
            result.append(similarity)
    return result


def select_layers(similarity: list[LayerSimilarity], num_layers: int, options: LisaOptions) -> list[int]:
    """Explicit layers, or the share_ratio * L layers outside the protected shallow ones whose attention output
    is best reproduced by the head-aligned previous layer (what LISA keeps before any training)."""
    if options.layers is not None:
        bad = [l for l in options.layers if not 0 < l < num_layers]
        if bad:
            raise HfcompressError(f"--lisa-layers {bad} are out of range: layers 1..{num_layers - 1} can be shared.")
        check_attention_types(options.layers, {s.layer: s.shareable for s in similarity})
        return sorted(set(options.layers))
    if not 0.0 <= options.ratio < 1.0:
        raise HfcompressError(f"--share-ratio must be in [0, 1), got {options.ratio}.")
    count = round(options.ratio * num_layers)
    candidates = ranked_candidates(similarity, options)
    if count > len(candidates):
        raise HfcompressError(too_few_candidates(options, count, len(candidates)))
    return sorted(candidates[:count])


def search_notes(planner: Planner) -> dict:
    """What the report keeps of the planner's notes about a perplexity search: the selection text's size."""
    return {k: planner.notes[k] for k in ("tokens", "context")}


def check_drop_layers(layers: list[int], num_layers: int) -> None:
    """Refuse --drop-attention-layers the modeling cannot run: layer 0 keeps its attention (the cache counts tokens by it)."""
    bad = [layer for layer in layers if not 0 < layer < num_layers]
    if bad:
        raise HfcompressError(f"--drop-attention-layers {bad} are out of range: give layers 1..{num_layers - 1}.")


def without_attention(state: dict[str, torch.Tensor], layer: nn.Module) -> dict[str, torch.Tensor]:
    """Decoder layer `layer`'s tensors `state` (`model.layers.N.*`) without what a dropped attention takes with it (the
    family's `attention_parts`: the attention, its input norm, Gemma 3's norm of its output)."""
    prefixes = tuple(f"model.layers.{layer.layer_idx}.{part}." for part in type(layer).attention_parts)
    return {k: v for k, v in state.items() if not k.startswith(prefixes)}


def too_few_candidates(options: LisaOptions, count: int, candidates: int) -> str:
    """The refusal of a share ratio asking for `count` layers when only `candidates` can be shared."""
    return (
        f"--share-ratio {options.ratio} asks for {count} shared layers but only {candidates} are outside the "
        f"{options.protect_first} protected shallow layers and have the attention type of the layer below"
        + (f", with at most {options.max_chain} in a row: raise --lisa-max-chain." if options.max_chain else ".")
    )


# Sharing across attention types: a shared layer reads the scores of the layer below over the keys that layer sees and
# caches what that layer's cache keeps; a sliding-window layer and a full-attention one see (and keep) different keys.
# So a layer is shared only when the layer below has its attention type; the ratio and the perplexity search skip the
# others, and --lisa-layers naming one is refused.


def shareable_layers(attention_types: list[str]) -> dict[int, bool]:
    """Layer (1..L-1) -> whether it has the attention type of the layer below."""
    return {i: attention_types[i] == attention_types[i - 1] for i in range(1, len(attention_types))}


def check_attention_types(layers: list[int], shareable: dict[int, bool]) -> None:
    """Refuse explicit shared layers whose layer below has another attention type (`shareable`: layer -> bool)."""
    bad = sorted({layer for layer in layers if not shareable[layer]})
    if bad:
        raise HfcompressError(
            f"--lisa-layers {bad} cannot be shared: a shared layer reuses the attention of the layer below, and "
            f"{'these layers have' if len(bad) > 1 else 'this layer has'} another attention type (sliding window or "
            "full) than the layer below."
        )


def ranked_candidates(similarity: list[LayerSimilarity], options: LisaOptions) -> list[int]:
    """Layers outside the protected shallow ones that have the attention type of the layer below, best reproduced by
    the aligned previous layer first. With `max_chain`, a layer that would make a run of more consecutive shared
    layers than that with the better ones is left out (greedily, so every prefix is the capped choice of its size)."""
    candidates = [s for s in similarity if s.layer >= max(1, options.protect_first) and s.shareable]
    ranked = [s.layer for s in sorted(candidates, key=lambda s: s.aligned_output_error)]
    if options.max_chain is None:
        return ranked
    taken: list[int] = []
    for layer in ranked:
        if chain_length(set(taken) | {layer}, layer) <= options.max_chain:
            taken.append(layer)
    return taken


def most_with_max_chain(layers: list[int], max_chain: int) -> int:
    """The most of `layers` that can be shared with at most `max_chain` consecutive ones (an upper bound of the greedy
    choice, checked before calibration)."""
    ordered = sorted(layers)
    runs = [1] if ordered else []  # lengths of the runs of consecutive layers
    for below, layer in zip(ordered, ordered[1:]):
        if layer == below + 1:
            runs[-1] += 1
        else:
            runs.append(1)
    return sum(n - n // (max_chain + 1) for n in runs)


def search_layers_by_perplexity(
    ranked: list[int], perplexity_of: Callable[[list[int]], float], limit: float
) -> tuple[list[int], list[dict]]:
    """The most layers, taken in `ranked` order, whose converted model keeps perplexity_of(layers) <= limit.

    Binary search over the count (about log2(len(ranked)) fits), assuming that sharing more layers never lowers
    the perplexity; returns the choice and every probe made, for the report.
    """
    count, probes = largest_within(len(ranked), lambda n: perplexity_of(sorted(ranked[:n])), limit)
    return sorted(ranked[:count]), [{"count": p["count"], "layers": sorted(ranked[: p["count"]]), **p} for p in probes]


LOWRANK_KEYS = ("head", "group")


def lowrank_key_heads(config, lowrank_keys: str) -> int:
    """Low-rank key heads of a shared layer: one per attention head, or one per KV group."""
    return config.num_attention_heads if lowrank_keys == "head" else config.num_key_value_heads


def lowrank_rank(config, qk_compression: float, lowrank_keys: str = "head") -> int:
    """Largest even rank r whose low-rank Q/K (d * (H + key heads) * r) is >= qk_compression x smaller than W_Q+W_K
    (with one key per KV group, the same parameters buy a higher rank)."""
    dense = config.hidden_size * config.head_dim * (config.num_attention_heads + config.num_key_value_heads)
    heads = config.num_attention_heads + lowrank_key_heads(config, lowrank_keys)
    rank = int(dense / qk_compression / (config.hidden_size * heads))
    rank -= rank % 2
    if rank < 2:
        raise HfcompressError(f"--qk-compression {qk_compression} leaves no room for a rank-2 low-rank Q/K.")
    return rank


ALIGN_KINDS = ("dense", "sparse", "identity")
# Named variants benchmarks/lisa_ablations.py compares (LisaOptions overrides; each is also a set of CLI flags)
ABLATIONS = {
    "direct": dict(align="identity", lowrank=False),  # previous scores copied head for head, nothing trained
    "align only": dict(align="dense", lowrank=False),
    "dense + low-rank": dict(align="dense"),
    "linear + low-rank": dict(align="dense", align_hidden=0),
    "sparse + low-rank": dict(align="sparse"),  # the default
}
FIT_REPORT_SEQUENCES = 16  # the fit record's initial and final losses are on the first 16 calibration sequences
# LisaOptions that do not change a fit
SELECTION_ONLY = ("share_ratio", "layers", "protect_first", "ppl_budget", "max_chain", "plan", "drop_layers")


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


def fit_inputs(x: torch.Tensor, options: LisaOptions) -> torch.Tensor:
    """The calibration sequences a local fit draws from: the first `steps x batch_size` (at least the report's
    FIT_REPORT_SEQUENCES). Its draws could reach no more distinct sequences than that, so a larger calibration (for
    FASC's statistics, say) costs LISA neither the memory of its inputs, targets and handed-over features nor their
    time. With fewer calibration sequences than that, as in every run measured so far, the fit reads them all."""
    return x[: max(options.steps * options.batch_size, FIT_REPORT_SEQUENCES)]


def fit_shared_layer(
    config,
    original: nn.Module,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    layer_idx: int,
    x: torch.Tensor,
    below: Below,
    matching: list[int],
    rank: int,
    options: LisaOptions,
) -> tuple[nn.Module, FittedLayer]:
    """Train Align + low-rank Q/K of one shared layer (original attention module `original`, its calibration inputs
    x, what the converted layer below hands over: `Below`) on x's device; returns the module and its fit record."""
    start = time.perf_counter()
    align = "dense" if options.align == "dense" else "sparse"  # identity = a sparse Align that stays the identity
    align_hidden = options.align_hidden if align == "dense" else 0
    key_heads = lowrank_key_heads(config, options.lowrank_keys)
    module = import_remote("lisa_attention").LisaSharedAttention(config, layer_idx, rank, align_hidden, align, key_heads)
    module.v_proj.load_state_dict(original.v_proj.state_dict())
    module.o_proj.load_state_dict(original.o_proj.state_dict())
    module.v_proj.requires_grad_(False)
    module.o_proj.requires_grad_(False)
    generator = torch.Generator().manual_seed(options.seed * 1000 + layer_idx)
    input_scale = LOWRANK_INPUT_RMS / x.float().pow(2).mean().sqrt().clamp_min(1e-6).item()
    with torch.no_grad():
        for lin in (module.q_lowrank, module.k_lowrank):
            std = 0.3 / math.sqrt(config.hidden_size) * input_scale
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=generator) * std)
        if align == "dense":
            if module.align.ffn_in is not None:
                w = module.align.ffn_in.weight
                w.copy_(torch.randn(w.shape, generator=generator) / math.sqrt(w.shape[1]))
                module.align.ffn_in.bias.zero_()
                module.align.ffn_out.weight.zero_()
            module.align.bias.zero_()
    module.to(x.device)

    seq_len = x.shape[1]
    mask = causal_mask(seq_len, device=x.device, window=original.sliding_window)
    positions = torch.arange(seq_len, device=x.device).unsqueeze(0)
    with torch.no_grad():
        target = torch.cat(
            [
                attention_output(original, xb, full_attention_scores(original, xb, cos_sin), mask)
                for xb in x.split(options.batch_size)
            ]
        )
        sample = slice(0, min(len(x), 8))
        if options.align != "identity":
            scores, below_scores = full_attention_scores(original, x[sample], cos_sin), scores_of(rows(below, sample))
            if options.group_heads and align == "sparse":
                probs = [torch.softmax(s + mask, dim=-1) for s in (scores, below_scores)]
                matching = group_matching(js_matrix(*probs), config.num_key_value_heads)
            mix = alignment_mix(scores, below_scores, matching)
            if align == "dense":
                module.align.mix.copy_(mix)
            else:
                module.align.source.copy_(torch.tensor(matching))
                module.align.scale.copy_(mix[torch.arange(len(matching)), matching])
    if options.align == "identity":
        module.align.requires_grad_(False)
    target_power = target.pow(2).mean()

    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and p.numel()]  # none: identity, rank 0
    trainable = [p for _, p in named]
    if trainable:
        groups = [
            {"params": [p for n, p in named if n.startswith(("q_lowrank", "k_lowrank"))], "lr": options.lr * input_scale},
            {"params": [p for n, p in named if not n.startswith(("q_lowrank", "k_lowrank"))], "lr": options.lr},
        ]
        optimizer = torch.optim.Adam([g for g in groups if g["params"]])
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, options.steps))

    def loss_on(idx: torch.Tensor) -> torch.Tensor:
        out, _ = module(x[idx], positions.expand(len(idx), -1), mask, rows(below, idx))
        return (out - target[idx]).pow(2).mean() / target_power

    with torch.no_grad():
        everything = torch.arange(min(len(x), FIT_REPORT_SEQUENCES))
        loss_initial = loss_on(everything).item()
    for _ in range(options.steps if trainable else 0):
        idx = torch.randint(len(x), (options.batch_size,), generator=generator)
        loss = loss_on(idx)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        loss_final = loss_on(everything).item()
    module.requires_grad_(False).eval()
    record = FittedLayer(
        layer=layer_idx,
        rank=rank,
        align=align,
        align_hidden=align_hidden,
        state={k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
        loss_initial=loss_initial,
        loss_final=loss_final,
        seconds=time.perf_counter() - start,
        key_heads=key_heads,
    )
    return module, record


def shared_attention(config, record: FittedLayer, device: torch.device | str = "cpu") -> nn.Module:
    """The LisaSharedAttention module of a fit record (weights from `record.state`), in eval mode."""
    module = import_remote("lisa_attention").LisaSharedAttention(
        config, record.layer, record.rank, record.align_hidden, record.align, record.key_heads
    )
    module.load_state_dict(record.state)
    return module.to(device).requires_grad_(False).eval()


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


def fit_lisa(
    model: nn.Module,
    attn_inputs: list[torch.Tensor],
    chosen: list[int],
    similarity: list[LayerSimilarity],
    options: LisaOptions,
) -> list[FittedLayer]:
    """In memory (research scripts, tests): fit every chosen layer of a loaded model (transformers' classes) in depth
    order, anchoring each on the converted layers below it, as LisaMethod does layer by layer in the pipeline."""
    if not chosen:
        return []
    model = in_converted_classes(model)
    rank = lowrank_rank(model.config, options.qk_compression, options.lowrank_keys) if options.lowrank else 0
    matching = {s.layer: s.matching for s in similarity}
    layers = model.model.layers
    fitted: list[FittedLayer] = []
    converted: dict[int, nn.Module] = {}
    below = None
    for idx in progress_bar(range(chosen[-1] + 1), "lisa: fit shared layers"):
        cos_sin = rotary(model, attn_inputs[0][:1], idx)
        x = fit_inputs(attn_inputs[idx], options)
        if idx in chosen:
            module, record = fit_shared_layer(model.config, layers[idx].self_attn, cos_sin, idx, x, below, matching[idx], rank, options)
            converted[idx] = module
            fitted.append(record)
        if idx + 1 in chosen:  # the next layer anchors on what this (converted) one hands over
            module = converted.get(idx, layers[idx].self_attn)
            below = handed_over(module, x, below if idx in converted else None, cos_sin, options)
        else:
            below = None
    return fitted


# ------------------------------------------------------------------------------------------- the pipeline unit
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


@register
class LisaMethod(Method):
    """LISA as a pipeline unit: similarity (and each attention block's energy) in the forward pass, the per-layer plan
    (keep, share or drop the attention) in plan, the fits and the drops in apply."""

    name = "lisa"
    order = 10

    def __init__(self, options: LisaOptions, layers: list[int] | None = None, dropped: list[int] | None = None) -> None:
        self.options = options
        self.fixed_layers = layers  # a candidate plan scored by the perplexity search
        self.fixed_dropped = dropped
        self.config = None
        self.chosen: list[int] = []
        self.dropped: list[int] = []  # layers whose attention is dropped
        self.rank = 0
        self.search: dict | None = None
        self.records: list[FittedLayer] = []  # fit records of the layers converted so far (weights dropped)
        self.qk_params: list[int] = []
        self.below: Below | None = None  # what the converted layer below hands over, on calibration inputs
        self._previous: tuple[int, tuple[torch.Tensor, torch.Tensor, int | None]] | None = None
        self.similarity: list[LayerSimilarity] = []

    @classmethod
    def from_options(cls, options) -> "LisaMethod":
        return cls(replace(options.lisa, seed=options.seed))

    def settings(self) -> dict:
        return {k: v for k, v in asdict(self.options).items() if k not in SELECTION_ONLY}

    def calibration_settings(self) -> dict:
        return {}  # the similarity depends on the model and the calibration text only; fits are keyed by settings()

    def check_model(self, config) -> None:
        self.config = config

    def observe(self, ctx: LayerContext) -> None:
        """Similarity of this layer's attention to the layer below's (nothing for layer 0)."""
        x = ctx.attention_input()[:SIMILARITY_SEQUENCES]
        previous = None
        if ctx.index > 0:
            if self._previous is None or self._previous[0] != ctx.index - 1:  # resumed: recompute the layer below
                below = ctx.previous()
                x_below = below.attention_input()[:SIMILARITY_SEQUENCES]
                _, scores = layer_similarity(below.index, below.layer.self_attn, x_below, below.cos_sin(x.shape[1]), None)
                self._previous = (below.index, scores)
            previous = self._previous[1]
        similarity, scores = layer_similarity(ctx.index, ctx.layer.self_attn, x, ctx.cos_sin(x.shape[1]), previous)
        self._previous = (ctx.index, scores) if ctx.index + 1 < ctx.num_layers else None
        if similarity is not None:
            hidden = ctx.hidden_input()[:SIMILARITY_SEQUENCES]
            similarity.attention_energy = attention_energy(ctx.layer.self_attn, x, hidden, ctx.cos_sin(x.shape[1]))
        if ctx.is_main and similarity is not None:
            torch.save(similarity, self.store / f"similarity-{ctx.index}.pt")

    def plan(self, planner: Planner) -> None:
        config, options = planner.config, self.options
        if not self.similarity:
            self.similarity = [torch.load(self.store / f"similarity-{i}.pt", weights_only=False) for i in range(1, planner.num_layers)]
        fixed_drops = sorted(set(options.drop_layers or []))
        check_drop_layers(fixed_drops, planner.num_layers)
        # the layers a plan may still change: not dropped by --drop-attention-layers, nor right above such a layer
        similarity = [s for s in self.similarity if s.layer not in fixed_drops and s.layer - 1 not in fixed_drops]
        self.dropped = fixed_drops
        if self.fixed_layers is not None:
            self.chosen, self.dropped = sorted(self.fixed_layers), sorted(self.fixed_dropped or [])
        elif options.layers is not None:
            self.chosen = select_layers(self.similarity, planner.num_layers, options)
            clash = sorted({layer for layer in self.chosen if layer in fixed_drops or layer - 1 in fixed_drops})
            if clash:
                raise HfcompressError(
                    f"--lisa-layers {clash} cannot be shared: the layer or the layer below it is in --drop-attention-"
                    "layers, and a shared layer reads the attention of the layer below."
                )
        elif options.plan != "share":
            plan = self.plan_layers(planner, similarity)
            self.chosen, self.dropped = plan.shared, sorted({*plan.dropped, *fixed_drops})
        elif options.ppl_budget is not None:
            def perplexity_of(layers: list[int]) -> float:
                return self.score(planner, layers, fixed_drops)

            base, limit = self.search_limit(planner)
            self.chosen, probes = search_layers_by_perplexity(ranked_candidates(similarity, options), perplexity_of, limit)
            self.search = {"original_perplexity": base, "limit": limit, "probes": probes, **search_notes(planner)}
            console.log(f"lisa search: {len(self.chosen)} layers within +{options.ppl_budget:g}% ({len(probes)} fits)")
        else:
            self.chosen = select_layers(similarity, planner.num_layers, options)
        self.rank = lowrank_rank(config, options.qk_compression, options.lowrank_keys) if self.chosen and options.lowrank else 0
        self.config = config
        self.records, self.qk_params, self.below = [], [], None
        planner.notes["dropped_attention_layers"] = self.dropped  # FASC leaves a dropped attention's linears alone

    def score(self, planner: Planner, layers: list[int], dropped: list[int]) -> float:
        """Selection perplexity of this method with the candidate plan (`layers` shared, `dropped` dropped)."""
        variant = LisaMethod(self.options, layers, dropped)
        variant.similarity, variant.store = self.similarity, self.store
        variant.plan(planner)
        return planner.selection_perplexity([variant])

    def search_limit(self, planner: Planner) -> tuple[float, float]:
        """(original selection perplexity, the search's limit) for --lisa-ppl-budget."""
        tokens, context = planner.notes["tokens"], planner.notes["context"]
        if tokens < context:
            raise HfcompressError(
                f"--lisa-ppl-budget needs {context} calibration tokens beyond the calibration sequences, the text "
                f"has {tokens}: give a longer --calib-text or fewer --calib-sequences."
            )
        base = planner.selection_perplexity([])
        return base, base * (1 + self.options.ppl_budget / 100)

    def plan_layers(self, planner: Planner, similarity: list[LayerSimilarity]) -> LayerPlan:
        """--layer-plan drop | mixed: actions ranked by estimated cost per KV value saved (layer_plan.py), as many as
        the ratio asks, or the most whose selection perplexity stays within --lisa-ppl-budget."""
        config, options = planner.config, self.options
        rank = lowrank_rank(config, options.qk_compression, options.lowrank_keys) if options.lowrank else 0
        values = kv_values(config, rank, lowrank_key_heads(config, options.lowrank_keys))
        energy = {s.layer: s.attention_energy for s in similarity}
        plans = plan_sequence(ranked_actions(similarity, energy, values, options.plan, options.protect_first), options.max_chain)
        fixed_drops = sorted(set(options.drop_layers or []))
        if options.ppl_budget is None:
            count = round(options.ratio * planner.num_layers)
            if count >= len(plans):
                raise HfcompressError(
                    f"--share-ratio {options.ratio} asks for {count} changed layers but --layer-plan {options.plan} can "
                    f"change only {len(plans) - 1} outside the {options.protect_first} protected shallow layers: lower "
                    "--share-ratio."
                )
            return plans[count]

        def perplexity_of(count: int) -> float:
            return self.score(planner, plans[count].shared, sorted({*plans[count].dropped, *fixed_drops}))

        base, limit = self.search_limit(planner)
        count, probes = largest_within(len(plans) - 1, perplexity_of, limit)
        probes = [{"count": p["count"], "layers": plans[p["count"]].shared, "dropped": plans[p["count"]].dropped, **p} for p in probes]
        self.search = {"original_perplexity": base, "limit": limit, "probes": probes, **search_notes(planner)}
        plan = plans[count]
        console.log(
            f"layer plan: {len(plan.shared)} shared, {len(plan.dropped)} dropped within +{options.ppl_budget:g}% "
            f"({len(probes)} probes)"
        )
        return plan

    def touches(self, index: int) -> bool:
        return index in self.chosen or index + 1 in self.chosen or index in self.dropped

    def apply(self, ctx: LayerContext, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        idx = ctx.index
        if idx in self.dropped:
            self.below = None
            return without_attention(state, ctx.layer)
        if not self.touches(idx):
            self.below = None
            return state
        x = fit_inputs(ctx.attention_input(), self.options)
        cos_sin = ctx.cos_sin(x.shape[1])
        module = ctx.layer.self_attn
        if idx in self.chosen:
            matching = next(s.matching for s in self.similarity if s.layer == idx)
            below = [layer for layer in self.chosen if layer <= idx]  # a fit depends on its anchors: the chain below

            def fit() -> FittedLayer:
                return fit_shared_layer(self.config, module, cos_sin, idx, x, self.below, matching, self.rank, self.options)[1]

            record = load_or_compute(self.store / f"fit-{cache_key(below, self.settings())}.pt", fit)
            module = shared_attention(self.config, record, ctx.device)
            state = replace_qk(state, record)
            self.qk_params.append(shared_qk_parameters(record))
            self.records.append(replace(record, state={}))
        below = self.below if idx in self.chosen else None
        self.below = handed_over(module, x, below, cos_sin, self.options) if idx + 1 in self.chosen else None
        return state

    def config_entries(self) -> dict:
        """The planned shared layers (known once plan has run, before any fit)."""
        align = "dense" if self.options.align == "dense" else "sparse"
        hidden = self.options.align_hidden if align == "dense" else 0
        spec = {"rank": self.rank, "align": align, "align_hidden": hidden}
        if self.options.lowrank_keys != "head":
            spec["key_heads"] = lowrank_key_heads(self.config, self.options.lowrank_keys)
        entries = {"lisa_layers": {str(layer): dict(spec) for layer in self.chosen}}
        if self.dropped:
            entries["dropped_attention_layers"] = list(self.dropped)
        return entries

    def resume_state(self) -> dict:
        return {"records": self.records, "qk_params": self.qk_params, "below": self.below}

    def restore(self, state: dict) -> None:
        self.records, self.qk_params, self.below = state["records"], state["qk_params"], state["below"]

    def report(self) -> dict:
        config = self.config
        dense_qk = config.hidden_size * config.head_dim * (config.num_attention_heads + config.num_key_value_heads)
        return {
            "layers": self.chosen,
            "dropped_attention_layers": self.dropped,
            "layer_plan": self.options.plan,
            "perplexity_search": self.search,
            "rank": self.records[0].rank if self.records else None,
            "options": asdict(self.options),
            "similarity": [s.to_dict() for s in self.similarity],
            "fitted": [{k: v for k, v in asdict(r).items() if k != "state"} for r in self.records],
            "qk_compression_measured": (dense_qk / max(self.qk_params)) if self.qk_params else None,
        }
