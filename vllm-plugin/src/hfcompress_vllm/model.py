"""hfcompress's converted models as native vLLM models: LISA (sparse Align) shared layers, FASC linears, dropped-attention
layers, for every family of the remote code's family table (`configuration_lisa.FAMILIES`: norms, q/k norms, the
attention scaling and the causal-LM classes come from it). Exact against the remote code (modeling/) up to
floating-point order: tests/vllm/.

The math (modeling/lisa_attention.py): a shared layer l with sparse Align has the scores
    S_l[h] = scale[h] * S_{l-1}[source[h]] + q_lr[h] . k_lr[kh(h)] / sqrt(r),
which is ONE attention over concatenated features (scale 1):
    q = [scale[h] * q_{l-1}[source[h]] | q_lr[h] / sqrt(r)],   k = [k_{l-1}[source[h]] | k_lr[kh(h)]],
where a full layer's features are its rotated query times its attention scaling and its rotated key. A chain of
shared layers concatenates further: the features of the chain's full layer (its "root"), then one low-rank part per
shared layer.

KV cache, by default ("lowrank" layout, lowrank.py): a shared layer caches what the remote code caches, its low-rank
keys and its V in their own widths (SmolLM2: 3 x (20 + 64) = 252 values a token against the original layer's 384), in a
cache vLLM allocates for it like any other, and reads the root's K (and a chain's earlier low-rank keys) where they lie,
in the root's paged cache; its attention is the plugin's own (a C++ kernel reading the caches in place, scoring each
Align source once; torch over the gathered blocks where it cannot build). Whatever the head
matching, the served model caches less than the original. This needs the root's cache in a layout the plugin reads:
vLLM's CPU backend (at the model's dtype or an fp8 KV cache; its vec ISAs' transposed keys and its AMX packing, bf16
on CPUs with AMX tiles), not the GPU backends. There (or with HFCOMPRESS_VLLM_KV=concat) the layouts below, over
concatenated features, serve instead.

Concatenated features. vLLM's attention backends take K and V of one head size (the CPU backend: from a fixed list), so
a shared layer's own cache of [root key | low-rank keys] and V would cost more than the original layer. Instead the
root and its shared layers form a *group* with ONE paged cache, owned by the root's attention and read by the shared layers'
attentions through vLLM's KV sharing (`kv_sharing_target_layer_name`): per KV head and token,
    key   = [K_root | k_lr of shared layer 1 | k_lr of layer 2 | ... | 0 pad]
    value = [V_root | V of shared layer 1    | V of layer 2     | ... | 0 pad]     (both padded to one head size P)
A layer's query is zero outside the parts it uses, and it reads its own V slice of the output. Each layer rewrites
the current tokens' rows with the parts known so far (the root: its own; the later parts 0, then filled by the layers
above), so the rows of past tokens are complete and a chunked prefill or a prefix-cache hit reads what a single pass
would. This needs the heads of one KV group of every shared layer to read one KV head of the root, different groups
different heads ("grouped" head matching, `hfcompress convert --lisa-group-heads`), and low-rank keys per KV group
(`key_heads` = KV, the converter's default): then a shared layer's query heads are only re-ordered so vLLM's GQA
(query head h reads KV head h // group) pairs them with the right cache head. With P = 64 * (group length) (e.g.
SmolLM2: head_dim 64, rank 20: a root and one shared layer, key 84, value 128 -> P = 128), a group costs exactly what
its layers cost in the original: the served model never caches more than the original.
Every layout follows from config.json alone: a shared layer's spec states its `source` (its head matching), so the
cache is planned before any weight is read.
A group that does not meet this (an older conversion with free head matching, or low-rank keys per head) is served
with an own cache per shared layer ([root key | low-rank keys] and V at one padded width; one cache head per KV group
when the group's heads read one key, else one per query head): exact, but more cache than the original
(`LisaModel.kv_layout` says which layout each layer got; vLLM reports the capacity).

A layer with low-rank keys (config `key_ranks`: its keys pass through a key latent z = B k, rebuilt as RoPE(A z)) caches
what the remote code caches, the latent (r values a token, spread over the KV heads) and V ("latent" layout, latent.py:
the keys rebuilt from the paged latent at every step); as the root of shared layers in the lowrank layout it hands them
its rebuilt keys of the step where they would read its cache. As the root of a concatenated-feature group (grouped /
own), with HFCOMPRESS_VLLM_KEYS=full, or off vLLM's CPU platform, it caches its rebuilt keys at full width instead
(exact, without the saving).

A layer with low-rank values (config `value_ranks`: its V, all KV heads side by side, passes through a value latent
z = B v, read as A z) is in the latent layout too, with or without a key latent: its cache holds the value latent (r
values a token, spread over the KV heads) beside the key latent, or beside its rotated keys where it has no key latent;
the attention applies A to the probability-weighted latents (decodes) or to the cached latents (long prefill chunks),
exact either way. As a root of shared layers (lowrank layout) it hands them its rotated keys as a key-latent root does
(the shared layers read no values of the root). Where the latent layout does not apply (the cases above), its values
are rebuilt, A B v, and cached at full width.

A dropped-attention layer (config `dropped_attention_layers`) has no attention and no cache: the MLP part alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import get_act_and_mul_fn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.platforms import current_platform

from .configs import FAMILIES, LisaFamily, UnservableModel
from .lowrank import KeyPart, LowRankCacheAttention, SharedQuery


# head sizes every vLLM attention backend takes (the CPU backend's list; FlashAttention and Triton take these too)
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def supported_head_size(width: int) -> int:
    """The smallest head size >= width the attention backend takes (the CPU backend: its own list, 512 included)."""
    sizes = HEAD_SIZES
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
    for size in sizes:
        if size >= width:
            return size
    raise UnservableModel(
        f"a LISA attention group needs a head size of {width}, more than vLLM's attention backends take ({sizes[-1]}): "
        "convert with a shorter --lisa-max-chain"
    )


def run(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = linear(x)
    return out[0] if isinstance(out, tuple) else out


class FascLinear(nn.Module):
    """y = proj_out(proj_in(x)) (the remote code's FascLinear: A (B x) + b)."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool, prefix: str):
        super().__init__()
        self.proj_in = ReplicatedLinear(in_features, rank, bias=False, prefix=f"{prefix}.proj_in")
        self.proj_out = ReplicatedLinear(rank, out_features, bias=bias, prefix=f"{prefix}.proj_out")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run(self.proj_out, run(self.proj_in, x))


def linear(in_features: int, out_features: int, bias: bool, rank: int | None, prefix: str) -> nn.Module:
    if rank:
        return FascLinear(in_features, out_features, rank, bias, prefix)
    return ReplicatedLinear(in_features, out_features, bias=bias, prefix=prefix)


# ------------------------------------------------------------------------------------------------------------ families
# the family table's norm kinds as vLLM's layers: "rms" w x, "gemma" (1 + w) x
NORMS: dict[str, type[nn.Module]] = {"rms": RMSNorm, "gemma": GemmaRMSNorm}


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_scaling(config) -> float:
    field_name = config.lisa_family.query_scale_field  # Gemma 3: query_pre_attn_scalar
    return (getattr(config, field_name) if field_name else head_dim(config)) ** -0.5


def rope_parameters(config, attention_type: str) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params.get(attention_type), dict):  # Gemma 3: one entry per attention type
        params = params[attention_type]
    params = dict(params)
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def window_of(config, attention_type: str) -> int | None:
    return config.sliding_window if attention_type == "sliding_attention" else None


def lowrank_rope(positions: torch.Tensor, x: torch.Tensor, rank: int, theta: float) -> torch.Tensor:
    """Plain (neox) RoPE at the low-rank width r with the layer type's base, whatever scaling the model's own RoPE has
    (lisa_attention.lowrank_rotary). In torch: vLLM's CPU rotary op crashed in bf16 at widths 20, 24 and 40."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rank, 2, device=x.device, dtype=torch.float) / rank)
    freqs = positions.float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    half = rank // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# ------------------------------------------------------------------------------------------------ the cache plan
@dataclass
class LayerPlan:
    """How layer `idx` attends: kind "full" (own cache, or a group's root), "shared" or "dropped"."""

    idx: int
    kind: str
    attention_type: str = "full_attention"
    rank: int = 0
    key_heads: int = 0
    source: list[int] = field(default_factory=list)
    root: int | None = None  # a group's root layer (grouped layout)
    layout: str = "plain"  # plain (a full layer's own d-wide cache), latent, lowrank, grouped, own
    key_rank: int = 0  # a full layer's key latent width r (config `key_ranks`), 0: none
    value_rank: int = 0  # a full layer's value latent width r (config `value_ranks`), 0: none
    value_size: int = 0  # latent layout: the cache's value head size (the value latent's share per KV head, or d)
    # grouped: the group's layers in order, the head size P, this layer's key / value slot offsets
    members: list[int] = field(default_factory=list)
    head_size: int = 0
    key_offset: int = 0
    value_offset: int = 0
    order: list[int] = field(default_factory=list)  # query head at each position (vLLM pairs position p with KV p // g)
    kv_of_group: list[int] = field(default_factory=list)  # this layer's KV group written at each cache head
    # own: cache heads and, per cache head, which (root KV head, low-rank key per earlier part) it holds
    cache_heads: int = 0
    width: int = 0  # logical feature width: d + sum of the chain's ranks
    hands_off: bool = False  # a shared layer follows
    above: str = ""  # the layout of the shared layer above (what this layer hands it)
    # lowrank: per part of the logical key (the root's K, then each shared layer's low-rank keys up to this one),
    # (layer index, per query head the head of that part it reads, its width, its low-rank key heads)
    parts: list[tuple[int, list[int], int, int]] = field(default_factory=list)


def plan_layers(config, lowrank: bool = False, latent: bool = False) -> list[LayerPlan]:
    """The cache plan of every layer, from config.json alone (a shared layer's spec states its `source`: configs.py
    refuses one that does not); `lowrank`: the shared layers cache their low-rank keys and V and read the root's K from
    its cache (lowrank.py; where the root's cache layout is readable), else the concatenated-feature layouts;
    `latent`: a layer with low-rank keys or values caches its key latent (else its rotated keys) and its value latent
    (else V) (latent.py), unless it is the root of shared layers in a concatenated-feature layout (those put its keys
    and V in the group's cache: full-width keys and values there)."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d, g = head_dim(config), config.num_attention_heads // config.num_key_value_heads
    types = config.attention_types
    dropped = set(config.dropped_attention_layers)
    key_ranks = {int(k): int(v) for k, v in (getattr(config, "key_ranks", None) or {}).items()}
    value_ranks = {int(k): int(v) for k, v in (getattr(config, "value_ranks", None) or {}).items()}
    plans = []
    for idx in range(config.num_hidden_layers):
        spec = config.lisa_layers.get(str(idx))
        if idx in dropped:
            plans.append(LayerPlan(idx, "dropped", types[idx]))
        elif spec is None:
            plans.append(LayerPlan(idx, "full", types[idx], width=d, key_rank=key_ranks.get(idx, 0),
                                   value_rank=value_ranks.get(idx, 0)))
        else:
            rank, kh = int(spec["rank"]), int(spec.get("key_heads", heads))
            plans.append(LayerPlan(idx, "shared", types[idx], rank, kh, [int(h) for h in spec["source"]]))
    for plan in plans[:-1]:
        plan.hands_off = plans[plan.idx + 1].kind == "shared"
    # chains: a full root and the shared layers above it
    idx = 0
    while idx < len(plans):
        if not plans[idx].hands_off or plans[idx].kind != "full":
            idx += 1
            continue
        chain = [plans[idx]]
        while chain[-1].idx + 1 < len(plans) and plans[chain[-1].idx + 1].kind == "shared":
            chain.append(plans[chain[-1].idx + 1])
        plan_chain(chain, heads, kv, d, g, lowrank)
        idx = chain[-1].idx + 1
    for plan in plans:
        if latent and (plan.key_rank or plan.value_rank) and plan.layout == "plain" and plan.above in ("", "lowrank"):
            # each latent spread over the KV heads (the cache spec's key / value head size), zero-padded; without a
            # latent, the rotated keys / V of d per KV head
            plan.layout, plan.cache_heads = "latent", kv
            plan.head_size = -(-plan.key_rank // kv) if plan.key_rank else d
            plan.value_size = -(-plan.value_rank // kv) if plan.value_rank else d
    return plans


def plan_chain(chain: list[LayerPlan], heads: int, kv: int, d: int, g: int, lowrank: bool = False) -> None:
    """Trace, for every shared layer's head, which root KV head and which low-rank key of each earlier layer its
    features read; `lowrank`: every shared layer caches its own low-rank keys and V and reads the other parts where
    they lie; else choose the grouped layout when every layer's KV groups map one-to-one onto the root's KV heads."""
    root = chain[0]
    reads = [[(h // g,) for h in range(heads)]]  # per layer, per head: (root KV head, low-rank key head per part...)
    width = d
    for plan in chain[1:]:
        per_key = heads // plan.key_heads
        reads.append([reads[-1][plan.source[h]] + (h // per_key,) for h in range(heads)])
        width += plan.rank
        plan.width = width
    root.members = [p.idx for p in chain]
    if lowrank:
        for below, plan, layer_reads in zip(chain, chain[1:], reads[1:]):
            plan.layout, plan.root, plan.members = "lowrank", root.idx, root.members
            plan.cache_heads, plan.head_size = kv, d
            plan.parts = [
                (p.idx, [read[n] for read in layer_reads], p.rank if n else d, p.key_heads)
                for n, p in enumerate(chain[: len(layer_reads[0])])
            ]
            below.above = "lowrank"
        return
    grouped = True
    orders, groups = [], []
    for plan, layer_reads in zip(chain[1:], reads[1:]):
        if plan.key_heads != kv:
            grouped = False
            break
        order, kv_of_group = [0] * heads, [0] * kv
        for group in range(kv):
            first = layer_reads[group * g]
            # one root KV head (and one low-rank key of each earlier layer) for the whole group, and V of this group
            if any(layer_reads[h] != first for h in range(group * g, group * g + g)) or first[-1] != group:
                grouped = False
                break
            cache_head = first[0]
            # the earlier low-rank keys read must be those the earlier layers wrote at that cache head
            for part, earlier in enumerate(groups):
                if earlier[cache_head] != first[1 + part]:
                    grouped = False
            kv_of_group[cache_head] = group
            order[cache_head * g : cache_head * g + g] = range(group * g, group * g + g)
        if not grouped or sorted(kv_of_group) != list(range(kv)) or len(set(first[0] for first in layer_reads[::g])) != kv:
            grouped = False
            break
        orders.append(order)
        groups.append(kv_of_group)
    if grouped:
        key_width = d + sum(p.rank for p in chain[1:])
        value_width = d * len(chain)
        size = supported_head_size(max(key_width, value_width))
        root.layout, root.head_size, root.root = "grouped", size, root.idx
        root.order, root.kv_of_group = list(range(heads)), list(range(kv))
        offset = d
        for n, (plan, order, kv_of_group) in enumerate(zip(chain[1:], orders, groups), start=1):
            plan.layout, plan.root, plan.members, plan.head_size = "grouped", root.idx, root.members, size
            plan.key_offset, plan.value_offset = offset, d * n
            plan.order, plan.kv_of_group = order, kv_of_group
            offset += plan.rank
        return
    for below, plan, layer_reads in zip(chain, chain[1:], reads[1:]):
        consistent = all(layer_reads[h] == layer_reads[(h // g) * g] for h in range(heads))
        below.above = "own"
        plan.layout, plan.root, plan.members = "own", root.idx, root.members
        plan.cache_heads = kv if consistent else heads
        plan.head_size = supported_head_size(max(plan.width, d))


def describe(plans: list[LayerPlan]) -> dict[int, str]:
    """Layer -> how its attention is cached: plain, latent (a layer with low-rank keys or values: its latents, and its
    rotated keys / V where it has no latent for them), lowrank
    (a shared layer's low-rank keys and V), grouped (root L: one cache for a root and its shared layers), own (a
    shared layer's own, wider cache), dropped (none)."""
    out = {}
    for plan in plans:
        if plan.kind == "dropped":
            out[plan.idx] = "dropped"
        elif plan.layout == "grouped":
            out[plan.idx] = f"grouped (root {plan.root}, head size {plan.head_size})"
        elif plan.layout == "own":
            out[plan.idx] = f"own ({plan.cache_heads} heads x {plan.head_size})"
        elif plan.layout == "lowrank":
            out[plan.idx] = f"lowrank (root {plan.root}, keys {plan.key_heads} x {plan.rank}, values {plan.cache_heads} x {plan.head_size})"
        elif plan.layout == "latent":
            keys = f"{plan.cache_heads} x {plan.head_size}"
            keys = f"rank {plan.key_rank}: {keys}" if plan.key_rank else keys
            handed = " (handed to the shared layers above)" if plan.hands_off else ""
            values = f"{plan.cache_heads} x {plan.value_size}"
            values = f"rank {plan.value_rank}: {values}" if plan.value_rank else values
            out[plan.idx] = f"latent (keys {keys}{handed}, values {values})"
        elif plan.key_rank or plan.value_rank:
            rebuilt = [f"key latent {plan.key_rank} rebuilt to full-width keys"] if plan.key_rank else []
            rebuilt += [f"value latent {plan.value_rank} rebuilt to full-width values"] if plan.value_rank else []
            out[plan.idx] = f"plain ({', '.join(rebuilt)})"
        else:
            out[plan.idx] = "plain"
    return out


def lowrank_layout(config, dtype: torch.dtype, block_size: int | None, kv_cache_dtype: str = "auto") -> bool:
    """Whether the shared layers get the low-rank layout (their own keys and V; the root's K read from its cache):
    wherever the full layers' cache layout is one lowrank.py reads (vLLM's CPU backend, its vec or AMX ISA; fp32/bf16
    or fp8 at `kv_cache_dtype`), unless HFCOMPRESS_VLLM_KV=concat asks for the concatenated-feature layouts (grouped /
    own)."""
    from .lowrank import root_cache_readable

    choice = os.environ.get("HFCOMPRESS_VLLM_KV", "lowrank")
    if choice not in ("lowrank", "concat"):
        raise UnservableModel(f"HFCOMPRESS_VLLM_KV={choice!r}: use lowrank (the default) or concat.")
    head_size = supported_head_size(head_dim(config))
    return choice == "lowrank" and root_cache_readable(dtype, block_size, head_size, kv_cache_dtype)


def latent_layout() -> bool:
    """Whether layers with low-rank keys or values cache their latents (latent.py): on vLLM's CPU platform (where it is
    tested; elsewhere they cache their rebuilt keys and values at full width), unless HFCOMPRESS_VLLM_KEYS=full asks
    for the full-width keys and values (the comparison of what the latents save)."""
    choice = os.environ.get("HFCOMPRESS_VLLM_KEYS", "latent")
    if choice not in ("latent", "full"):
        raise UnservableModel(f"HFCOMPRESS_VLLM_KEYS={choice!r}: use latent (the default) or full.")
    return choice == "latent" and current_platform.is_cpu()


def served_plans(vllm_config: VllmConfig) -> list[LayerPlan]:
    """Each layer's plan as the engine of `vllm_config` serves it: the cache layout its model dtype, block size and KV
    cache dtype allow."""
    config, model, cache = vllm_config.model_config.hf_config, vllm_config.model_config, vllm_config.cache_config
    return plan_layers(config, lowrank_layout(config, model.dtype, cache.block_size, cache.cache_dtype), latent_layout())


def kv_layout(vllm_config: VllmConfig) -> dict[int, str]:
    """The cache layout the plugin gives each layer of the converted model the engine of `vllm_config` serves (its
    processes other than the model's read it here: the model itself lives in the engine core)."""
    return describe(served_plans(vllm_config))


# ---------------------------------------------------------------------------------------------------------- modules
class MLP(nn.Module):
    def __init__(self, config, fasc: dict[str, int], prefix: str):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        self.merged = not ({"mlp.gate_proj", "mlp.up_proj"} & fasc.keys())
        if self.merged:
            self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=bias, prefix=f"{prefix}.gate_up_proj")
        else:
            self.gate_proj = linear(hidden, inter, bias, fasc.get("mlp.gate_proj"), f"{prefix}.gate_proj")
            self.up_proj = linear(hidden, inter, bias, fasc.get("mlp.up_proj"), f"{prefix}.up_proj")
        self.down_proj = linear(inter, hidden, bias, fasc.get("mlp.down_proj"), f"{prefix}.down_proj")
        self.act_fn = get_act_and_mul_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            gate_up = run(self.gate_up_proj, x)
        else:
            gate_up = torch.cat([run(self.gate_proj, x), run(self.up_proj, x)], dim=-1)
        return run(self.down_proj, self.act_fn(gate_up))


@dataclass
class Handoff:
    """What a layer hands to the shared layer above it: per head (H) its logical query features, the logical key
    features (own layout: per head; else None), and, for a grouped layout, the group's key / value rows of the
    current tokens so far (tokens, KV, P)."""

    query: torch.Tensor
    key: torch.Tensor | None
    key_rows: torch.Tensor | None
    value_rows: torch.Tensor | None


class FullAttention(nn.Module):
    def __init__(self, config, family: LisaFamily, plan: LayerPlan, fasc: dict[str, int], cache_config, prefix: str):
        super().__init__()
        self.plan = plan
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, head_dim(config)
        hidden, d, biases = config.hidden_size, self.head_dim, config.projection_biases
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.scaling = attention_scaling(config)
        self.merged = not ({"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"} & fasc.keys())
        if self.merged:
            if len({biases["q_proj"], biases["k_proj"], biases["v_proj"]}) != 1:
                raise UnservableModel("config.json: q/k/v projections with different biases are not served")
            self.qkv_proj = QKVParallelLinear(hidden, d, self.num_heads, self.num_kv_heads, bias=biases["q_proj"], prefix=f"{prefix}.qkv_proj")
        else:
            self.q_proj = linear(hidden, self.q_size, biases["q_proj"], fasc.get("self_attn.q_proj"), f"{prefix}.q_proj")
            self.k_proj = linear(hidden, self.kv_size, biases["k_proj"], fasc.get("self_attn.k_proj"), f"{prefix}.k_proj")
            self.v_proj = linear(hidden, self.kv_size, biases["v_proj"], fasc.get("self_attn.v_proj"), f"{prefix}.v_proj")
        self.o_proj = linear(self.q_size, hidden, biases["o_proj"], fasc.get("self_attn.o_proj"), f"{prefix}.o_proj")
        if family.qk_norm:
            self.q_norm = NORMS[family.norm](d, eps=config.rms_norm_eps)
            self.k_norm = NORMS[family.norm](d, eps=config.rms_norm_eps)
        self.qk_norm = family.qk_norm
        # low-rank keys (`key_ranks`): keys through the latent, A (B k), before RoPE, as the remote code rebuilds them.
        # The latent layout caches z = B k and V and rebuilds the keys at every step (latent.py); elsewhere (the root
        # of a concatenated-feature group, HFCOMPRESS_VLLM_KEYS=full, GPU platforms) the cache holds the rebuilt keys
        rank = plan.key_rank
        self.key_latent = FascLinear(self.kv_size, self.kv_size, rank, False, f"{prefix}.key_latent") if rank else None
        # low-rank values (`value_ranks`): V through the latent, A (B v). The latent layout caches z = B v and applies A
        # in the attention (latent.py); elsewhere the cache holds the rebuilt values
        value_rank = plan.value_rank
        self.value_latent = (
            FascLinear(self.kv_size, self.kv_size, value_rank, False, f"{prefix}.value_latent") if value_rank else None
        )
        self.rotary_emb = get_rope(d, max_position=config.max_position_embeddings,
                                   rope_parameters=rope_parameters(config, plan.attention_type), is_neox_style=True)
        window = window_of(config, plan.attention_type)
        if plan.layout == "latent":
            from .latent import LatentCacheAttention

            self.attn = LatentCacheAttention(
                num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=d, scale=self.scaling,
                rotary=self.rotary_emb, cache_config=cache_config, sliding_window=window, prefix=f"{prefix}.attn",
                key_rank=rank, key_up=self.key_latent.proj_out if rank else None, value_rank=value_rank,
                value_up=self.value_latent.proj_out if value_rank else None, hands_keys=plan.hands_off,
            )  # fmt: skip
        elif plan.layout == "grouped":  # the group's cache: head size P, pre-scaled queries
            self.attn = Attention(self.num_heads, plan.head_size, 1.0, num_kv_heads=self.num_kv_heads, cache_config=cache_config,
                                  per_layer_sliding_window=window, prefix=f"{prefix}.attn")
        else:  # a head size the backend takes (the CPU backend has no 16 or 24: tiny test models are padded)
            self.padded = supported_head_size(d)
            self.attn = Attention(self.num_heads, self.padded, self.scaling, num_kv_heads=self.num_kv_heads,
                                  cache_config=cache_config, per_layer_sliding_window=window, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, prev: Handoff | None) -> tuple[torch.Tensor, Handoff | None]:
        if self.merged:
            q, k, v = run(self.qkv_proj, x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            q, k, v = run(self.q_proj, x), run(self.k_proj, x), run(self.v_proj, x)
        t, d = x.shape[0], self.head_dim
        if self.qk_norm:
            q = self.q_norm(q.reshape(t, self.num_heads, d)).reshape(t, -1)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, d)).reshape(t, -1)
        if self.plan.layout == "latent":
            if self.key_latent is not None:  # the key latent z = B k (the keys are rebuilt and rotated as read)
                q, _ = self.rotary_emb(positions, q, None)
                k = run(self.key_latent.proj_in, k)
            else:  # the keys cached rotated, as a plain layer's
                q, k = self.rotary_emb(positions, q, k)
            if self.value_latent is not None:  # the value latent z = B v
                v = run(self.value_latent.proj_in, v)
            out = self.attn.attend(q, k, v, self.rotary_emb.cos_sin_cache)
            # the shared layers above (lowrank layout) read the keys this layer hands them (latent.HandedKeys)
            handoff = Handoff(q.reshape(t, self.num_heads, d) * self.scaling, None, None, None) if self.plan.hands_off else None
            return run(self.o_proj, out), handoff
        if self.key_latent is not None:
            k = run(self.key_latent, k)
        if self.value_latent is not None:
            v = run(self.value_latent, v)
        q, k = self.rotary_emb(positions, q, k)
        if self.plan.layout != "grouped":
            if self.padded == d:
                out = self.attn(q, k, v)
            else:
                pad = (0, self.padded - d)
                out = self.attn(*(nn.functional.pad(x.reshape(t, -1, d), pad).reshape(t, -1) for x in (q, k, v)))
                out = out.view(t, self.num_heads, self.padded)[..., :d].reshape(t, -1)
            handoff = None
            if self.plan.hands_off:  # the scaled query per head (own layout above: the keys per head too)
                qs = q.reshape(t, self.num_heads, d) * self.scaling
                keys = None
                if self.plan.above == "own":
                    keys = k.reshape(t, self.num_kv_heads, d).repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
                handoff = Handoff(qs, keys, None, None)
            return run(self.o_proj, out), handoff
        size = self.plan.head_size
        qs = q.reshape(t, self.num_heads, d) * self.scaling
        key_rows = nn.functional.pad(k.reshape(t, self.num_kv_heads, d), (0, size - d))
        value_rows = nn.functional.pad(v.reshape(t, self.num_kv_heads, d), (0, size - d))
        out = self.attn(nn.functional.pad(qs, (0, size - d)).reshape(t, -1), key_rows.reshape(t, -1), value_rows.reshape(t, -1))
        out = out.view(t, self.num_heads, size)[..., :d].reshape(t, -1)
        return run(self.o_proj, out), Handoff(qs, None, key_rows, value_rows)


class SharedAttention(nn.Module):
    """A LISA layer with sparse Align: q_lowrank, k_lowrank, align (source, scale), v_proj, o_proj."""

    def __init__(self, config, plan: LayerPlan, fasc: dict[str, int], cache_config, prefix: str, root_prefix: str):
        super().__init__()
        self.plan = plan
        h, kv, d, r = config.num_attention_heads, config.num_key_value_heads, head_dim(config), plan.rank
        self.num_heads, self.num_kv_heads, self.head_dim, self.rank, self.key_heads = h, kv, d, r, plan.key_heads
        hidden, biases = config.hidden_size, config.projection_biases
        # q_lowrank, k_lowrank and (unless factorised or with a bias) v_proj as one matmul: three skinny ones cost the
        # time their smaller weights save
        self.merged_v = not (biases["v_proj"] or "self_attn.v_proj" in fasc)
        self.sizes = [h * r, plan.key_heads * r] + ([kv * d] if self.merged_v else [])
        # named by what it holds: the checkpoint's names map onto it (STACKED)
        if r and self.merged_v:
            self.qkv_lowrank = MergedColumnParallelLinear(hidden, self.sizes, bias=False, prefix=f"{prefix}.qkv_lowrank")
        elif r:
            self.qk_lowrank = MergedColumnParallelLinear(hidden, self.sizes, bias=False, prefix=f"{prefix}.qk_lowrank")
        else:  # no low-rank term (rank 0): V alone
            self.merged_v = False
        if not self.merged_v:
            self.v_proj = linear(hidden, kv * d, biases["v_proj"], fasc.get("self_attn.v_proj"), f"{prefix}.v_proj")
        self.o_proj = linear(h * d, hidden, biases["o_proj"], fasc.get("self_attn.o_proj"), f"{prefix}.o_proj")
        self.align = nn.Module()
        self.align.register_buffer("source", torch.tensor(plan.source, dtype=torch.long))
        self.align.scale = nn.Parameter(torch.ones(h), requires_grad=False)
        self.theta = float(rope_parameters(config, plan.attention_type)["rope_theta"])
        window = window_of(config, plan.attention_type)
        self.root_attn_name = f"{root_prefix}.attn"
        if plan.layout == "lowrank":
            layers = prefix.rsplit(".", 2)[0]  # "model.layers"
            parts = [
                KeyPart(f"{layers}.{idx}.self_attn.attn", "lowrank" if n else "root", part_heads, width, key_heads)
                for n, (idx, part_heads, width, key_heads) in enumerate(plan.parts)
            ]
            self.attn = LowRankCacheAttention(
                num_heads=h, num_kv_heads=kv, key_width=plan.key_heads * r // kv, head_dim=d, parts=parts,
                cache_config=cache_config, sliding_window=window, prefix=f"{prefix}.attn",
            )  # fmt: skip
        elif plan.layout == "grouped":
            self.register_buffer("order", torch.tensor(plan.order), persistent=False)
            self.register_buffer("unorder", torch.argsort(torch.tensor(plan.order)), persistent=False)
            self.register_buffer("kv_of_group", torch.tensor(plan.kv_of_group), persistent=False)
            self.attn = Attention(h, plan.head_size, 1.0, num_kv_heads=kv, cache_config=cache_config, per_layer_sliding_window=window,
                                  prefix=f"{prefix}.attn", kv_sharing_target_layer_name=self.root_attn_name)
        else:
            self.attn = Attention(h, plan.head_size, 1.0, num_kv_heads=plan.cache_heads, cache_config=cache_config,
                                  per_layer_sliding_window=window, prefix=f"{prefix}.attn")

    def features(self, positions: torch.Tensor, x: torch.Tensor, prev: Handoff) -> tuple[SharedQuery, torch.Tensor, torch.Tensor]:
        """The query features (factored: the layer below's, source, scale, this layer's low-rank part), this layer's
        rotated low-rank keys (t, key_heads, r) and its V (t, KV * d)."""
        t, h, r = x.shape[0], self.num_heads, self.rank
        if not r:
            empty = prev.query.new_empty(t, h, 0)
            query = SharedQuery(prev.query, self.align.source, self.align.scale, empty)
            return query, empty[:, : self.key_heads], run(self.v_proj, x)
        q_lr, k_lr, *v = run(self.qkv_lowrank if self.merged_v else self.qk_lowrank, x).split(self.sizes, dim=-1)
        q_lr = lowrank_rope(positions, q_lr.view(t, h, r), r, self.theta) * r**-0.5
        k_lr = lowrank_rope(positions, k_lr.view(t, self.key_heads, r), r, self.theta)
        v = v[0] if self.merged_v else run(self.v_proj, x)
        return SharedQuery(prev.query, self.align.source, self.align.scale, q_lr), k_lr, v

    def forward(self, positions: torch.Tensor, x: torch.Tensor, prev: Handoff) -> tuple[torch.Tensor, Handoff | None]:
        t, h, d, r, plan = x.shape[0], self.num_heads, self.head_dim, self.rank, self.plan
        query, k_lr, v = self.features(positions, x, prev)
        v = v.view(t, self.num_kv_heads, d)
        size = plan.head_size
        if plan.layout == "lowrank":
            out = self.attn.attend(query, k_lr.reshape(t, self.num_kv_heads, -1), v)
            handoff = Handoff(query.concatenated(), None, None, None) if plan.hands_off else None
            return run(self.o_proj, out.reshape(t, -1)), handoff
        q = query.concatenated()
        if plan.layout == "grouped":
            from vllm.model_executor.layers.attention.attention import unified_kv_cache_update

            key_rows, value_rows = prev.key_rows.clone(), prev.value_rows.clone()
            key_rows[..., plan.key_offset : plan.key_offset + r] = k_lr.index_select(1, self.kv_of_group)
            value_rows[..., plan.value_offset : plan.value_offset + d] = v.index_select(1, self.kv_of_group)
            # the current tokens' rows of the group's cache, with this layer's parts (vLLM writes a sharing layer's
            # K/V nowhere itself)
            unified_kv_cache_update(key_rows, value_rows, self.root_attn_name)
            query = nn.functional.pad(q.index_select(1, self.order), (0, size - q.shape[-1]))
            out = self.attn(query.reshape(t, -1), key_rows.reshape(t, -1), value_rows.reshape(t, -1))
            out = out.view(t, h, size)[..., plan.value_offset : plan.value_offset + d].index_select(1, self.unorder)
            handoff = Handoff(q, None, key_rows, value_rows) if plan.hands_off else None
            return run(self.o_proj, out.reshape(t, -1)), handoff
        # own layout: [previous key features of the source head | own low-rank key], V at this width
        keys = torch.cat([prev.key.index_select(1, self.align.source), k_lr.repeat_interleave(h // self.key_heads, dim=1)], dim=-1)
        heads = plan.cache_heads
        groups = h // heads
        cache_keys = keys[:, ::groups]
        values = v.repeat_interleave(heads // self.num_kv_heads, dim=1) if heads != self.num_kv_heads else v
        out = self.attn(
            nn.functional.pad(q, (0, size - q.shape[-1])).reshape(t, -1),
            nn.functional.pad(cache_keys, (0, size - cache_keys.shape[-1])).reshape(t, -1),
            nn.functional.pad(values, (0, size - d)).reshape(t, -1),
        )
        out = out.view(t, h, size)[..., :d].reshape(t, -1)
        handoff = Handoff(q, keys, None, None) if plan.hands_off else None
        return run(self.o_proj, out), handoff


class DecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, family: LisaFamily, plan: LayerPlan, prefix: str):
        super().__init__()
        config = vllm_config.model_config.hf_config
        cache_config = vllm_config.cache_config
        idx = plan.idx
        fasc = {path[len(f"{idx}.") :]: int(rank) for path, rank in config.fasc_ranks.items() if path.startswith(f"{idx}.")}
        self.family, self.plan = family, plan
        norm = NORMS[family.norm]
        hidden, eps = config.hidden_size, config.rms_norm_eps
        if plan.kind == "full":
            self.self_attn = FullAttention(config, family, plan, fasc, cache_config, f"{prefix}.self_attn")
        elif plan.kind == "shared":
            root_prefix = prefix.rsplit(".", 1)[0] + f".{plan.root}.self_attn"
            self.self_attn = SharedAttention(config, plan, fasc, cache_config, f"{prefix}.self_attn", root_prefix)
        else:
            self.self_attn = None
        if self.self_attn is not None:
            self.input_layernorm = norm(hidden, eps=eps)
        if self.self_attn is not None or not family.sandwich_norms:  # Gemma 3 stores no post-attention norm for a dropped attention
            self.post_attention_layernorm = norm(hidden, eps=eps)
        if family.sandwich_norms:
            self.pre_feedforward_layernorm = norm(hidden, eps=eps)
            self.post_feedforward_layernorm = norm(hidden, eps=eps)
        self.mlp = MLP(config, fasc, f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, prev: Handoff | None) -> tuple[torch.Tensor, Handoff | None]:
        handoff = None
        if self.self_attn is not None:
            attn_out, handoff = self.self_attn(positions, self.input_layernorm(hidden), prev)
            hidden = hidden + (self.post_attention_layernorm(attn_out) if self.family.sandwich_norms else attn_out)
        if self.family.sandwich_norms:
            return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden))), handoff
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), handoff


# compiled as vLLM compiles its own Llama (Inductor fuses the norms, activations and residual adds; the attention ops,
# the plugin's included, stay opaque): eager, the model lost ~14% of its throughput to a compiled original
@support_torch_compile(dynamic_arg_dims={"input_ids": {0: "b"}, "positions": {0: "b"}, "intermediate_tensors": {0: "b"},
                                         "inputs_embeds": {0: "b"}})  # fmt: skip
class LisaModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.family = config.lisa_family
        self.plans = served_plans(vllm_config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            [DecoderLayer(vllm_config, self.family, plan, f"{prefix}.layers.{plan.idx}") for plan in self.plans]
        )
        self.norm = NORMS[self.family.norm](config.hidden_size, eps=config.rms_norm_eps)
        if self.family.scaled_embedding:  # rounded to the model's dtype, as Gemma does
            self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5), persistent=False)

    @property
    def kv_layout(self) -> dict[int, str]:
        return describe(self.plans)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        if self.family.scaled_embedding:
            embeds = embeds * self.normalizer.to(embeds.dtype)
        return embeds

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        handoff = None
        for layer in self.layers:
            hidden, handoff = layer(positions, hidden, handoff)
        return self.norm(hidden)


STACKED = (  # (checkpoint name part, vLLM parameter name part, shard id)
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".q_lowrank.", ".qkv_lowrank.", 0),  # a shared layer's
    (".k_lowrank.", ".qkv_lowrank.", 1),
    (".v_proj.", ".qkv_lowrank.", 2),
    (".q_lowrank.", ".qk_lowrank.", 0),  # a shared layer's whose V has a bias or is factorised
    (".k_lowrank.", ".qk_lowrank.", 1),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


def patch_kv_sharing_with_mixed_head_sizes() -> None:
    """vLLM 0.32 adds a KV-sharing layer to its target's cache group by name only; when the group mixes head sizes (a
    UniformTypeKVCacheSpecs: plain layers of head size d next to a LISA group's root of size P) the runner then looks
    the sharing layer's spec up and fails (KeyError). Give the sharing layer its target's spec too (idempotent; only in
    a process that loads a converted model)."""
    import sys

    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    for module_name in ("vllm.v1.worker.utils", "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.attn_utils"):
        module = sys.modules.get(module_name)
        original = getattr(module, "add_kv_sharing_layers_to_kv_cache_groups", None)
        if original is None or getattr(original, "hfcompress_patched", False):
            continue

        def patched(shared_kv_cache_layers, kv_cache_groups, *args, _original=original, **kwargs):
            _original(shared_kv_cache_layers, kv_cache_groups, *args, **kwargs)
            for layer_name, target in shared_kv_cache_layers.items():
                for group in kv_cache_groups:
                    spec = group.kv_cache_spec
                    if isinstance(spec, UniformTypeKVCacheSpecs) and target in spec.kv_cache_specs:
                        spec.kv_cache_specs.setdefault(layer_name, spec.kv_cache_specs[target])

        patched.hfcompress_patched = True
        setattr(module, "add_kv_sharing_layers_to_kv_cache_groups", patched)


class LisaForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        patch_kv_sharing_with_mixed_head_sizes()
        if get_tensor_model_parallel_world_size() != 1:
            raise UnservableModel("the hfcompress vLLM plugin serves with tensor_parallel_size=1 only")
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = LisaModel(vllm_config=vllm_config, prefix="model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size, scale=getattr(config, "logit_scale", 1.0))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.config.tie_word_embeddings and name.startswith("lm_head."):
                continue
            target, shard = name, None
            for part, merged, shard_id in STACKED:
                candidate = name.replace(part, merged)
                if part in name and candidate in params:
                    target, shard = candidate, shard_id
                    break
            if target in params:
                param = params[target]
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor) if shard is None else loader(param, tensor, shard)
            elif target in buffers:
                if target.endswith("align.source") and not torch.equal(buffers[target].cpu(), tensor.cpu().long()):
                    raise UnservableModel(
                        f"checkpoint tensor {name} differs from the `source` config.json states for its layer (the "
                        "cache layout was built from that): the files are from different conversions; convert again."
                    )
                buffers[target].copy_(tensor)
            else:
                raise UnservableModel(
                    f"checkpoint tensor {name} has no place in {type(self).__name__} of the hfcompress vLLM plugin: "
                    "the model was converted by another version of the modeling; convert again with this hfcompress."
                )
            loaded.add(target)
        return loaded


# one class per family of the table, named as config.json's "architectures" names it (register() registers these names)
for _family in FAMILIES.values():
    globals()[_family.causal_lm_class] = type(_family.causal_lm_class, (LisaForCausalLM,), {"__module__": __name__})
del _family
