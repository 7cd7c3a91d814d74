"""The family-neutral LISA machinery every LisaXxx model shares: cache layers, masks, score handoff, the shared
(LISA) attention, the full attention that hands scores on, and the decoder-layer / model / causal-LM bases.

Remote code shipped by `hfcompress convert` (flat next to config.json); imports only torch, transformers and its
sibling files. A family's `modeling_lisa_<family>.py` subclasses the bases below with its own MLP, norms, rotary
embedding and, where it differs, its attention (e.g. Qwen3's q/k norms). Math, per decoder layer l:

- full layer:   S_l = Q_l K_l^T / sqrt(d_head)                         (the family's ordinary attention)
- LISA layer:   S_l = Align(S_{l-1}) + (x W_Q^lr)(x W_K^lr)^T / sqrt(r)  (no q_proj / k_proj, nor q/k norms)
    low-rank keys: one per head, or one per KV group (GQA: the heads of a group read one low-rank key)
    dense Align:  Align(S)[h] = sum_g mix[h, g] S[g] + bias[h] + FFN(S[:, i, j])[h]  (mix across heads)
    sparse Align: Align(S)[h] = scale[h] S[source[h]]                             (one head, scaled)
- both:         out = softmax(S_l + causal/padding/window mask) V_l, then o_proj.

S are pre-softmax logits ("logits-space" mixing keeps rows normalised after the softmax).
What a layer hands to a following LISA layer:
- Prefill, from a full layer (or a sparse layer that got features): its (scaled query, key) features, the key with its
  KV heads only. The full layer itself stays on the attention backend (SDPA).
  - Sparse Align is linear in one head's Q K^T, so S_l is one attention over concatenated features,
    [scale Q_{l-1}[source] | Q^lr / sqrt(r)] . [K_{l-1}[source // groups] | K^lr]^T: one SDPA call, nothing T x T.
  - Dense Align recomputes S_{l-1} from the features a block of query rows at a time, so no T x T x H tensor exists.
- Prefill, from a dense layer: its scores S_l (B, H, T, T), written block by block: the next layer's Align needs them
  at every (query, key) and recomputing a chain of non-linear layers would cost O(chain length^2).
- Decode (one query row): every layer hands its score row for the new token, which it computes anyway for its own
  softmax; GQA runs by reshaping the query to the KV heads, so the K and V caches are never copied to H heads.
A LISA layer caches only its low-rank K (r per head, or per KV group) and its V (cache layers of type "lisa_attention" and
"lisa_sliding_attention", below). A FASC linear is `y = proj_out(proj_in(x))` (`A (B x)`).

Attention types: a layer has full attention or a sliding window (Mistral, Qwen2's `layer_types`); a LISA layer has the
type of its anchor (the layer below: `LisaConfigMixin.validate_architecture`), and its cache layer keeps what the
anchor's keeps, so the handed scores and the shared layer's own keys are the same positions.

Masks, per attention type: the full layers' attention backend gets transformers' causal (or sliding-window causal)
mask. The layers that materialise scores (LISA layers, the score rows handed to them, `output_attentions`) get its
additive form wherever transformers materialises it or the cache has a fixed size (a static cache returns all its
slots, those after the current position unwritten); otherwise (no padding, keys = past + current tokens, fewer keys
than the window) they run plain causal attention: SDPA's is_causal, or causal blocks that skip the keys after their
last row.
Outputs as transformers' models: `output_hidden_states` records every decoder layer (the last state after the final
norm); `output_attentions` takes every layer's probabilities from a materialising path (a full layer leaves the
backend, a sparse layer the feature SDPA call for it).
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    STATIC_LAYER_TYPE_MAPPING,
    Cache,
    DummyLayer,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward, repeat_kv, rotate_half
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_lisa import DEFAULT_ALIGN, lisa_spec, uses_fused_decode

# the fused GPU decode kernel (kernels/), for dense-Align layers with one low-rank key per head; the torch path below is
# the CPU path (both are tested against lisa_reference.py). A converted repo ships it only if one of its layers uses
# it: the copy of this file in any other repo raises ImportError in place of this import (hfcompress/remote.py)
try:
    from .lisa_kernels import fused_lisa_decode, triton_available
except ImportError:  # kernels not shipped, or triton missing
    fused_lisa_decode = None

    def triton_available(tensor: torch.Tensor) -> bool:
        return False


# transformers' mask of each attention type (the backend's, and the source of the additive score masks)
MASK_FUNCTIONS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def allocate_lisa_static(layer: StaticLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """A static LISA cache layer's tensors: StaticLayer would allocate the values with the keys' head count (H low-rank
    heads), here they keep their own (KV)."""
    layer.device = key_states.device
    layer.batch_size, layer.num_heads = key_states.shape[:2]
    layer.k_head_dim, layer.v_head_dim = key_states.shape[-1], value_states.shape[-1]
    layer.keys = key_states.new_zeros(layer.batch_size, layer.num_heads, layer.max_cache_len, layer.k_head_dim)
    kv_heads = value_states.shape[1]
    layer.values = value_states.new_zeros(layer.batch_size, kv_heads, layer.max_cache_len, layer.v_head_dim)
    layer.cumulative_length = layer.cumulative_length.to(layer.device)
    if not torch.compiler.is_compiling():  # fixed addresses for compiled decode steps and CUDA graphs
        for tensor in (layer.keys, layer.values, layer.cumulative_length):
            torch._dynamo.mark_static_address(tensor)
    layer.is_initialized = True


class LisaDynamicLayer(DynamicLayer):
    """Dynamic cache of a full-attention LISA layer (cache layer type "lisa_attention"): low-rank keys (B, H or KV, T, r) and
    values (B, KV, T, head_dim), concatenated like any layer's."""

    _layer_type = "lisa_attention"  # registers the class for DynamicCache(config=...)


class LisaStaticLayer(StaticLayer):
    """Static cache of a full-attention LISA layer: its keys and values at their own head counts."""

    _layer_type = "lisa_attention"  # registers the class for StaticCache (generate's cache_implementation="static")
    # early_initialization gives every layer one (heads, head_dim): this layer allocates at its first update instead
    supports_early_init = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        allocate_lisa_static(self, key_states, value_states)


# transformers hands the window only to its own sliding cache types, so a "lisa_sliding_attention" layer is built
# without one: the model binds it (`bind_sliding_windows`) before the layer's first update.


class LisaDynamicSlidingLayer(DynamicSlidingWindowLayer):
    """Dynamic cache of a sliding-window LISA layer: keeps the last window - 1 positions, as its anchor's
    DynamicSlidingWindowLayer does."""

    _layer_type = "lisa_sliding_attention"

    def __init__(self, **kwargs):
        super().__init__(sliding_window=0)
        self.sliding_window = None

    def bind_window(self, sliding_window: int) -> None:
        self.sliding_window = sliding_window
        self._sliding_window_tensor = torch.tensor(sliding_window, dtype=torch.long)


class LisaStaticSlidingLayer(StaticSlidingWindowLayer):
    """Static cache of a sliding-window LISA layer: the anchor's StaticSlidingWindowLayer, at its own head counts."""

    _layer_type = "lisa_sliding_attention"
    supports_early_init = False

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len=max_cache_len, sliding_window=max_cache_len)
        self.requested_len, self.sliding_window = max_cache_len, None

    def bind_window(self, sliding_window: int) -> None:
        self.sliding_window = sliding_window
        self.max_cache_len = min(sliding_window, self.requested_len)
        self._is_croppable = self.requested_len <= sliding_window

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        allocate_lisa_static(self, key_states, value_states)


# A layer whose attention is dropped stores nothing: transformers' DummyLayer under the cache layer types of
# configuration_lisa.DROPPED_CACHE_TYPES (DummyLayer does not register itself by `_layer_type`)
for _dropped_type in ("dropped_attention", "dropped_sliding_attention"):
    DYNAMIC_LAYER_TYPE_MAPPING[_dropped_type] = STATIC_LAYER_TYPE_MAPPING[_dropped_type] = DummyLayer


def bind_sliding_windows(cache: Cache, sliding_window: int) -> None:
    """Give the sliding-window LISA cache layers of `cache` the model's window (once, before their first update)."""
    for layer in cache.layers:
        # by duck type, not isinstance: transformers' layer-type registry holds the classes of whichever copy of this
        # file registered last (hfcompress's own import, or transformers_modules' copy of a loaded repo)
        if hasattr(layer, "bind_window") and layer.sliding_window is None:
            layer.bind_window(sliding_window)


# Quantized cache: generate(cache_implementation="quantized", cache_config={"backend": "quanto" | "hqq" | "fp8", "nbits":
# ...}) builds a LisaQuantizedCache (LisaForCausalLM._prepare_cache_for_generation): transformers' QuantizedCache takes
# full-attention layers only, and its group-wise quantizers group each token's head vector along the last axis, which a
# low-rank key of width r (e.g. 20) does not fill for a group of 64. Full-attention layers keep transformers' quantized
# layers; a LISA layer groups its low-rank keys along the tokens instead (one scale and zero per channel and
# q_group_size tokens, KIVI's key layout: any r fits, nothing is padded) and its values as transformers' layers do (per
# token along head_dim, axis_value); the positions past the last whole group of tokens stay in full precision (the
# residual window), and each flush quantizes only the new whole groups (nothing is quantized twice). fp8 is per tensor:
# transformers' Fp8QuantizedLayer takes any width. A dropped-attention layer stays a DummyLayer (it stores nothing).
from transformers.cache_utils import Fp8QuantizedLayer, HQQQuantizedLayer, QuantoQuantizedLayer  # noqa: E402


class LisaQuantizedLayerMixin:
    """The LISA half of a group-wise quantized cache layer (keys (B, Hk, T, r) grouped along T, values (B, KV, T, d) as
    the backend's layer groups them, a value latent (B, 1, T, r) along T where r is not a multiple of the group);
    `key_group_axis` is the backend's axis whose groups are contiguous in memory."""

    key_group_axis: int

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.chunks = []  # per flush: [quantized keys or None (r = 0), quantized values, pending beam index or None]

    def quantize_chunk(self, keys: torch.Tensor, values: torch.Tensor) -> list:
        # (B, Hk, n, r) -> (B, Hk, r, n), n a multiple of the group: each group is q_group_size tokens of one channel
        q_keys = self._quantize(keys.transpose(-1, -2).contiguous(), axis=self.key_group_axis) if keys.shape[-1] else None
        # a value latent whose width the groups do not fill is grouped along the tokens too
        by_token = values.shape[-1] % self.q_group_size != 0
        if by_token:
            q_values = self._quantize(values.transpose(-1, -2).contiguous(), axis=self.key_group_axis)
        else:
            q_values = self._quantize(values.contiguous(), axis=self.axis_value)
        return [q_keys, q_values, None, keys.shape, by_token]

    def dequantize_chunk(self, chunk: list) -> tuple[torch.Tensor, torch.Tensor]:
        q_keys, q_values, beam_idx, key_shape, by_token = chunk
        keys = self._dequantize(q_keys).transpose(-1, -2) if q_keys is not None else self.keys.new_zeros(key_shape)
        values = self._dequantize(q_values).transpose(-1, -2) if by_token else self._dequantize(q_values)
        if beam_idx is not None:
            keys, values = keys.index_select(0, beam_idx), values.index_select(0, beam_idx)
        return keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.cumulative_length += key_states.shape[-2]
        prefill = not self.is_initialized
        if prefill:
            self.lazy_initialization(key_states, value_states)
        stored = [self.dequantize_chunk(chunk) for chunk in self.chunks]
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        # the prefill is quantized at once (as transformers' layers do), later tokens once the window is full
        flush = keys.shape[-2] // self.q_group_size * self.q_group_size
        if flush and (prefill or keys.shape[-2] >= self.residual_length):
            self.chunks.append(self.quantize_chunk(keys[..., :flush, :], values[..., :flush, :]))
            self.keys, self.values = keys[..., flush:, :].clone(), values[..., flush:, :].clone()
        else:
            self.keys, self.values = keys, values
        if prefill:  # the prefill attends to its own states unrounded (as transformers' layers)
            return key_states, value_states
        return (
            torch.cat([*(k for k, _ in stored), keys], dim=-2),
            torch.cat([*(v for _, v in stored), values], dim=-2),
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: the quantized chunks keep a pending index (applied on dequantization, never re-quantized)."""
        if not self.is_initialized:
            return
        for chunk in self.chunks:
            idx = beam_idx.to(self.device)
            chunk[2] = idx.clone() if chunk[2] is None else chunk[2].index_select(0, idx)
        self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
        self.values = self.values.index_select(0, beam_idx.to(self.values.device))

    def reset(self) -> None:
        super().reset()
        self.chunks = []


class LisaQuantoLayer(LisaQuantizedLayerMixin, QuantoQuantizedLayer):
    """A LISA layer's cache quantized by optimum-quanto (2 or 4 bits)."""

    key_group_axis = 0  # quanto's axis 0 groups q_group_size consecutive elements


class LisaHQQLayer(LisaQuantizedLayerMixin, HQQQuantizedLayer):
    """A LISA layer's cache quantized by HQQ (1, 2, 3, 4 or 8 bits)."""

    key_group_axis = 1  # HQQ's axis 1 groups q_group_size consecutive elements


# backend -> (full-attention layer, LISA layer)
QUANTIZED_LAYERS = {
    "quanto": (QuantoQuantizedLayer, LisaQuantoLayer),
    "hqq": (HQQQuantizedLayer, LisaHQQLayer),
    "fp8": (Fp8QuantizedLayer, Fp8QuantizedLayer),
}


class LisaQuantizedCache(Cache):
    """transformers' QuantizedCache for a LISA model (same arguments): full-attention layers get the backend's own
    quantized layer, LISA layers its LISA variant (above), dropped-attention layers a DummyLayer. Sliding-window layers
    are refused, as transformers' QuantizedCache refuses them."""

    def __init__(
        self, backend: str, config, nbits: int | None = None, axis_key: int | None = None,
        axis_value: int | None = None, q_group_size: int | None = None, residual_length: int | None = None,
    ):  # fmt: skip
        if backend not in QUANTIZED_LAYERS:
            raise ValueError(f"Unknown quantization backend `{backend}`: one of {sorted(QUANTIZED_LAYERS)}.")
        options = dict(
            nbits=nbits, axis_key=axis_key, axis_value=axis_value, q_group_size=q_group_size,
            residual_length=residual_length,
        )  # fmt: skip
        options = {name: value for name, value in options.items() if value is not None}
        if backend == "fp8" and options:
            raise ValueError(f"The `fp8` backend quantizes per tensor and takes none of {sorted(options)}.")
        full, lisa = QUANTIZED_LAYERS[backend]
        layers = []
        for idx, layer_type in enumerate(config.get_text_config(decoder=True).layer_types):
            if layer_type in ("full_attention", "lisa_attention"):
                layers.append((full if layer_type == "full_attention" else lisa)(**options))
            elif DYNAMIC_LAYER_TYPE_MAPPING.get(layer_type) is DummyLayer:
                layers.append(DummyLayer())
            else:
                raise ValueError(
                    f"The quantized cache takes full-attention layers only (as transformers' QuantizedCache); layer "
                    f"{idx} is {layer_type!r}."
                )
        super().__init__(layers=layers)


def prepare_quantized_cache(model, generation_config, model_kwargs: dict) -> bool:
    """generate's cache for cache_implementation="quantized" (cache_config as transformers reads it): a
    LisaQuantizedCache in model_kwargs["cache"]; False (nothing done) for every other case, which transformers handles."""
    if (
        generation_config.cache_implementation != "quantized" or model_kwargs.get("cache") is not None
        or generation_config.use_cache is False
    ):  # fmt: skip
        return False
    cache_config = dict(generation_config.cache_config or {})  # generate may be called again with the same config
    cache_config.setdefault("config", model.config.get_text_config(decoder=True))
    backend = cache_config.pop("backend", "quanto")
    model_kwargs["cache"] = LisaQuantizedCache(backend, **cache_config)
    return True


class FascLinear(nn.Module):
    """Low-rank factorised linear `y = A (B x) + b`: `proj_in` is B (rank x in), `proj_out` is A (out x rank)."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.proj_in = nn.Linear(in_features, rank, bias=False)
        self.proj_out = nn.Linear(rank, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(self.proj_in(x))


class LisaHeadAlign(nn.Module):
    """Maps the previous layer's per-head scores to this layer's heads: linear head mix + optional tiny FFN."""

    def __init__(self, num_heads: int, hidden: int):
        super().__init__()
        self.mix = nn.Parameter(torch.eye(num_heads))
        self.bias = nn.Parameter(torch.zeros(num_heads))
        self.ffn_in = nn.Linear(num_heads, hidden) if hidden else None
        self.ffn_out = nn.Linear(hidden, num_heads, bias=False) if hidden else None

    def forward(self, prev_scores: torch.Tensor) -> torch.Tensor:
        # the mix and the FFN act across heads at every (i, j): batched matmuls over the head axis of a (B, H, i*j)
        # view need no permuted copy of the scores (1.5x faster on CPU than an einsum plus a channels-last FFN)
        batch, dtype = prev_scores.shape[0], prev_scores.dtype
        flat = prev_scores.reshape(batch, prev_scores.shape[1], -1)

        def per_batch(weight: torch.Tensor) -> torch.Tensor:
            return weight.to(dtype).expand(batch, -1, -1)

        scores = torch.baddbmm(self.bias.to(dtype)[:, None], per_batch(self.mix), flat)
        if self.ffn_in is not None:
            hidden = torch.baddbmm(self.ffn_in.bias.to(dtype)[:, None], per_batch(self.ffn_in.weight), flat)
            hidden = nn.functional.gelu(hidden, approximate="tanh")
            scores = torch.baddbmm(scores, per_batch(self.ffn_out.weight), hidden)
        return scores.view(prev_scores.shape)


class LisaSparseAlign(nn.Module):
    """Each head reads one head of the previous layer, scaled: Align(S)[h] = scale[h] * S[source[h]]."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.register_buffer("source", torch.arange(num_heads))  # saved: the head matching found at conversion
        self.scale = nn.Parameter(torch.ones(num_heads))

    def forward(self, prev_scores: torch.Tensor) -> torch.Tensor:
        return prev_scores.index_select(1, self.source) * self.scale.to(prev_scores.dtype).view(1, -1, 1, 1)

    def features(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous layer's query (B, H, T, D) and key (B, KV, T, D) features re-ordered to this layer's heads,
        query scaled; a key is read from the KV head of its source head (no copy of the keys to H heads first)."""
        groups = query.shape[1] // key.shape[1]
        query = query.index_select(1, self.source) * self.scale.to(query.dtype).view(1, -1, 1, 1)
        return query, key.index_select(1, self.source // groups)


def score_mask(
    config, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None, cache: Cache | None,
    position_ids: torch.Tensor, causal_mask: torch.Tensor | None, attention_type: str,
) -> torch.Tensor | None:  # fmt: skip
    """The additive (B, 1, Tq, Tk) mask of the attention of `attention_type` that materialises its scores, from
    transformers' mask of that type `causal_mask`, or None for plain causal attention over exactly the past and the
    current keys (transformers skips a sliding window's mask only where every key is inside the window)."""
    fixed_size = cache is not None and cache.is_compileable
    if causal_mask is None and not fixed_size:
        return None
    if causal_mask is None:  # SDPA's top-left is_causal hides a static cache's unwritten slots, the LISA paths do not
        causal_mask = MASK_FUNCTIONS[attention_type](
            config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
            position_ids=position_ids, allow_is_causal_skip=False,
        )  # fmt: skip
    dtype = inputs_embeds.dtype
    if causal_mask.dtype == torch.bool:
        # finfo.min, not -inf: a fully masked row (a padded query) gives a uniform softmax instead of NaN
        return torch.zeros(causal_mask.shape, dtype=dtype, device=causal_mask.device).masked_fill(
            ~causal_mask, torch.finfo(dtype).min
        )
    return causal_mask.to(dtype)


def causal_block_mask(
    start: int, stop: int, kv_end: int, past_len: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """(stop - start, kv_end) additive causal mask of query rows start..stop (at positions past_len + row), or None
    for a single row that sees every key (decode)."""
    if stop - start == 1 and kv_end == past_len + stop:
        return None
    masked = torch.full((stop - start, kv_end), torch.finfo(dtype).min, dtype=dtype, device=device)
    return masked.triu(past_len + start + 1)


def block_mask(
    additive_mask: torch.Tensor | None, start: int, stop: int, kv_end: int, past_len: int, dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:  # fmt: skip
    """The mask of query rows start..stop over keys ..kv_end: a slice of the model's `score_mask` when there is one,
    else causal only."""
    if additive_mask is not None:
        return additive_mask[:, :, start:stop, :kv_end]
    return causal_block_mask(start, stop, kv_end, past_len, dtype, device)


# The helpers below call bmm on 3D views rather than matmul on 4D tensors: at decode, one layer's attention is a few
# small ops, and matmul's own reshapes and checks cost about as much as the arithmetic.


def grouped_scores(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """query (B, H, Tq, D) . key (B, KV, Tk, D)^T -> (B, H, Tq, Tk) by KV head: the keys are never copied to H heads."""
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1:3]
    grouped = query.reshape(batch * kv_heads, heads // kv_heads * q_len, dim)
    keys = key.reshape(batch * kv_heads, kv_len, dim).transpose(1, 2)
    return torch.bmm(grouped, keys).view(batch, heads, q_len, kv_len)


def attention_probs(scores: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """softmax(scores + mask) over the keys, in float32, returned in `dtype` (as transformers' eager attention)."""
    if mask is not None:
        scores = scores + mask
    return nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)


def grouped_attention(probs: torch.Tensor, value: torch.Tensor, groups: int) -> torch.Tensor:
    """probs @ V with GQA by KV head (no copy of V to H heads): (B, H, Tq, Tk) -> (B, H, Tq, D)."""
    batch, heads, q_len, kv_len = probs.shape
    kv_heads = heads // groups
    values = value.reshape(batch * kv_heads, kv_len, -1)
    out = torch.bmm(probs.reshape(batch * kv_heads, groups * q_len, kv_len), values)
    return out.view(batch, heads, q_len, -1)


def latent_value_attention(probs: torch.Tensor, latent: torch.Tensor, up: torch.Tensor, groups: int) -> torch.Tensor:
    """probs @ V for values V = A z kept as their latents z (B, 1, Tk, r), A = `up` (KV x D, r): the probabilities mix
    the latents, then each query head applies its KV head's rows of A, (B, H, Tq, Tk) -> (B, H, Tq, D). Exact (A is
    linear) and, for few query rows, far cheaper than rebuilding every cached token's values."""
    batch, heads, q_len, kv_len = probs.shape
    mixed = torch.bmm(probs.reshape(batch, heads * q_len, kv_len), latent.reshape(batch, kv_len, -1))
    per_head = up.view(heads // groups, -1, up.shape[-1]).repeat_interleave(groups, dim=0)  # (H, D, r)
    return torch.einsum("bhqr,hdr->bhqd", mixed.view(batch, heads, q_len, -1), per_head)


def softmax_attention(
    scores: torch.Tensor, mask: torch.Tensor | None, value: torch.Tensor, groups: int
) -> torch.Tensor:  # fmt: skip
    """softmax(scores + mask) @ V with GQA; returns (B, T, H, D) (hfcompress fits LISA layers with it)."""
    return grouped_attention(attention_probs(scores, mask, value.dtype), value, groups).transpose(1, 2)


class LisaAttentionWeights(nn.Module):
    """Identity on a layer's attention probabilities (B, H, Tq, Tk), called only for `output_attentions`: transformers'
    output capturing records them with a forward hook on this class."""

    def forward(self, probs: torch.Tensor) -> torch.Tensor:
        return probs


# Block-wise LISA scores: query rows per block (a block's scores stay in the CPU caches: 3-4x faster than whole rows
# at 512-2048 tokens, and causal blocks skip the keys after their last row), at most 64 MB of float32 scores per block
SCORE_BLOCK_ROWS = 64
SCORE_BLOCK_ELEMENTS = 1 << 24


def layer_window(config, layer_idx: int) -> int | None:
    """The sliding window of layer `layer_idx` (None: full attention)."""
    return config.sliding_window if config.attention_types[layer_idx] == "sliding_attention" else None


class LisaAttention(nn.Module):
    """A family's ordinary attention (biases per projection from `config.projection_biases`, the window of its layer's
    attention type), which can also hand its pre-softmax scores or (query, key) features to a following LISA layer."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.sliding_window = layer_window(config, layer_idx)
        hidden, heads, kv_heads, bias = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.projection_biases,
        )
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias["q_proj"])
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias["k_proj"])
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias["v_proj"])
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias["o_proj"])
        # low-rank keys (`config.key_ranks`): the cache holds z = B k (proj_in), the queries read RoPE(A z) (proj_out)
        key_rank = config.key_ranks.get(str(layer_idx))
        width = kv_heads * self.head_dim
        self.key_latent = FascLinear(width, width, key_rank) if key_rank else None
        # low-rank values (`config.value_ranks`): the cache holds z = B v (proj_in), the attention reads A z (proj_out)
        value_rank = config.value_ranks.get(str(layer_idx))
        self.value_latent = FascLinear(width, width, value_rank) if value_rank else None
        self.attention_weights = LisaAttentionWeights()

    def qk_norm(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Query and key (B, T, heads, head_dim) between projection and RoPE: unchanged here; families with per-head
        q/k norms use LisaQkNormAttention."""
        return query, key

    def query_key(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Rotated query (B, H, T, D) and key (B, KV, T, D), unscaled (hfcompress measures and fits LISA from them)."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)
        query, key = self.qk_norm(query, self.k_proj(hidden_states).view(hidden_shape))
        return apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), *position_embeddings)

    def latent_query_key_value(
        self, hidden_states: torch.Tensor, value: torch.Tensor, cache: Cache | None, rotary: "KeyRotary"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Rotated query (B, H, Tq, D), keys (B, KV, Tk, D) and values of a layer with low-rank keys. The cache holds the
        latent z = B k (B, 1, T, r); the keys are A z of every cached token, rotated at their positions in the cache
        (`get_mask_sizes`' offset: a sliding window's first kept token), the query at its own. Scores depend on
        position differences only, so this equals RoPE at `position_ids` wherever they differ from the cache positions
        by a constant per sequence (left padding included)."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key = self.qk_norm(self.q_proj(hidden_states).view(hidden_shape), self.k_proj(hidden_states).view(hidden_shape))
        latent = self.key_latent.proj_in(key.flatten(-2)).unsqueeze(1)
        q_len, offset = query.shape[1], 0
        # rotated before the update: a static cache's length is a tensor that the update increments in place
        query = rotate(query.transpose(1, 2), *rotary(cache.get_seq_length(self.layer_idx) if cache is not None else 0, q_len))
        if cache is not None:
            offset = cache.get_mask_sizes(q_len, self.layer_idx)[1]
            latent, value = cache.update(latent, value, self.layer_idx)
        key = self.key_latent.proj_out(latent.squeeze(1))
        key = key.view(*key.shape[:-1], -1, self.head_dim).transpose(1, 2)
        return query, rotate(key, *rotary(offset, key.shape[2])), value

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        additive_mask: torch.Tensor | None,
        cache: Cache | None = None,
        handoff: str | None = None,
        output_attentions: bool = False,
        key_rotary: "KeyRotary | None" = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | tuple | None]:
        """(output, what it hands to the next layer). `additive_mask` is the mask of materialised scores (`score_mask`),
        `attention_mask` the backend's; both of this layer's attention type. `key_rotary`: RoPE at given positions, for
        a layer with low-rank keys."""
        input_shape = hidden_states.shape[:-1]
        if self.value_latent is not None:  # (B, 1, T, r): what the cache holds
            value = self.value_latent.proj_in(self.v_proj(hidden_states)).unsqueeze(1)
        else:
            value = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        if self.key_latent is not None:
            query, key, value = self.latent_query_key_value(hidden_states, value, cache, key_rotary)
        else:
            query, key = self.query_key(hidden_states, position_embeddings)
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
        q_len, kv_len = query.shape[2], key.shape[2]
        # a decode step with a value latent mixes the cached latents (the model hands it the step's mask)
        mix_latent = self.value_latent is not None and q_len == 1 and additive_mask is not None
        if self.value_latent is not None and not mix_latent:  # every cached token's values, rebuilt: (B, KV, Tk, D)
            value = self.value_latent.proj_out(value.squeeze(1))
            value = value.view(*value.shape[:-1], -1, self.head_dim).transpose(1, 2)

        if handoff == "scores" or (handoff and q_len == 1) or output_attentions or mix_latent:
            # decode (or materialised scores on request, or output_attentions): the score row is computed once, for
            # this layer's own softmax and for the next layer (cheaper than the next layer re-reading the whole key
            # cache); GQA by KV head, so the caches are not copied to H heads
            scores = grouped_scores(query * self.scaling, key)
            mask = block_mask(additive_mask, 0, q_len, kv_len, kv_len - q_len, scores.dtype, scores.device)
            probs = attention_probs(scores, mask, value.dtype)
            if output_attentions:
                self.attention_weights(probs)
            if mix_latent:
                up = self.value_latent.proj_out.weight
                attn_output = latent_value_attention(probs, value, up, self.num_key_value_groups)
            else:
                attn_output = grouped_attention(probs, value, self.num_key_value_groups)
            attn_output = attn_output.transpose(1, 2)
            passed = scores if handoff else None
        else:
            # the next LISA layer recomputes what it needs from this layer's (scaled query, key) features
            passed = (query * self.scaling, key) if handoff else None
            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
            attn_output, _ = attention_interface(
                self,
                query,
                key,
                value,
                attention_mask,
                dropout=0.0 if not self.training else self.attention_dropout,
                scaling=self.scaling,
                sliding_window=self.sliding_window,  # flash attention reads the window from here, SDPA from the mask
                **kwargs,
            )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), passed


class LisaQkNormAttention(LisaAttention):
    """Full attention with a per-head RMSNorm on the query and the key between projection and RoPE (Qwen3, Gemma 3);
    `qk_norm_class` is the family's RMSNorm."""

    qk_norm_class: type[nn.Module]

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.q_norm = self.qk_norm_class(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = self.qk_norm_class(self.head_dim, eps=config.rms_norm_eps)

    def qk_norm(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(query), self.k_norm(key)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x (B, heads, T, D) with (cos, sin) of shape (1 or B, T, D): apply_rotary_pos_emb's formula for one tensor."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class KeyRotary:
    """RoPE (cos, sin) of one attention type at positions start..start + length - 1: what a layer with low-rank keys
    rotates its rebuilt keys and its query with. One per forward and attention type: the layers of one type rotate the
    same positions, computed once (a start held in a tensor, a static cache's, is computed each time: reading it would
    wait for the device)."""

    def __init__(self, rotary: nn.Module, x: torch.Tensor, attention_type: str):
        self.rotary, self.x, self.attention_type = rotary, x, attention_type
        self.memo: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, start: int | torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (start, length) if isinstance(start, int) else None
        if key in self.memo:
            return self.memo[key]
        positions = (torch.arange(length, device=self.x.device) + start).unsqueeze(0)
        cos_sin = rotary_embeddings(self.rotary, self.x, positions, [self.attention_type])[self.attention_type]
        if key is not None:
            self.memo[key] = cos_sin
        return cos_sin


def rope_theta(config, attention_type: str = "full_attention") -> float:
    """The RoPE base of layers of `attention_type`: `rope_parameters` may be nested by attention type (Gemma 3: 1e6 for
    full attention, 1e4 for the sliding window) or one dict for every layer."""
    params = config.rope_parameters or {}
    if isinstance(params.get(attention_type), dict):
        params = params[attention_type]
    return float(params.get("rope_theta", 10000.0))


def rotary_embeddings(
    rotary: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, attention_types: list[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Attention type -> RoPE (cos, sin) of `position_ids`: a rotary embedding with parameters per attention type
    (`per_attention_type`, Gemma 3) is called once per type (`rotary(x, position_ids, attention_type)`), any other once
    for all."""
    if getattr(rotary, "per_attention_type", False):
        return {kind: rotary(x, position_ids, kind) for kind in dict.fromkeys(attention_types)}
    return dict.fromkeys(attention_types, rotary(x, position_ids=position_ids))


def lowrank_rotary(
    config, rank: int, position_ids: torch.Tensor, dtype: torch.dtype, attention_type: str = "full_attention"
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """RoPE (cos, sin) at the low-rank width r (the base of the layer's attention type in the model), so the correction
    term is position-aware."""
    theta = rope_theta(config, attention_type)
    inv_freq = 1.0 / theta ** (torch.arange(0, rank, 2, device=position_ids.device, dtype=torch.float) / rank)
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class LisaSharedAttention(nn.Module):
    """LISA layer: scores from the previous layer's scores (aligned) plus a low-rank Q/K correction."""

    def __init__(
        self, config, layer_idx: int, rank: int, align_hidden: int, align: str = DEFAULT_ALIGN, key_heads: int | None = None
    ):  # fmt: skip
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.rank = rank
        # low-rank key heads: H (one per head) or KV (one per GQA group, read by the group's heads: a smaller cache)
        self.key_heads = key_heads or config.num_attention_heads
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.attention_type = config.attention_types[layer_idx]
        self.sliding_window = layer_window(config, layer_idx)
        hidden, bias = config.hidden_size, config.projection_biases
        self.q_lowrank = nn.Linear(hidden, self.num_heads * rank, bias=False)
        self.k_lowrank = nn.Linear(hidden, self.key_heads * rank, bias=False)
        # q_proj/k_proj go, with their biases and any q/k norms (the low-rank fit absorbs them); V and O stay
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias["v_proj"])
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias["o_proj"])
        self.sparse = align == "sparse"
        self.align = LisaSparseAlign(self.num_heads) if self.sparse else LisaHeadAlign(self.num_heads, align_hidden)
        self.fused_decode = uses_fused_decode({"rank": rank, "align": align, "key_heads": self.key_heads}, self.num_heads)
        self.attention_weights = LisaAttentionWeights()

    def lowrank_qk(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Rotated low-rank queries (B, H, T, r) and keys (B, key_heads, T, r); `rotary` is `lowrank_rotary` of these
        positions."""
        shape = hidden_states.shape[:-1]
        q_lr = self.q_lowrank(hidden_states).view(*shape, self.num_heads, self.rank).transpose(1, 2)
        k_lr = self.k_lowrank(hidden_states).view(*shape, self.key_heads, self.rank).transpose(1, 2)
        if rotary is None:
            rotary = lowrank_rotary(self.config, self.rank, position_ids, hidden_states.dtype, self.attention_type)
        return apply_rotary_pos_emb(q_lr, k_lr, *rotary)

    def scores(self, prev_scores: torch.Tensor, q_lr: torch.Tensor, k_lr: torch.Tensor) -> torch.Tensor:
        """Pre-softmax scores S_l = Align(S_{l-1}) + q_lr k_lr^T / sqrt(r) (just the aligned scores at rank 0)."""
        aligned = self.align(prev_scores)
        if self.rank == 0:
            return aligned
        # by low-rank key head, as grouped_scores: the heads reading one key are adjacent, so these are views
        batch, heads, q_len, kv_len = aligned.shape
        key_heads = k_lr.shape[1]
        flat = aligned.reshape(batch * key_heads, heads // key_heads * q_len, kv_len)
        lowrank = (q_lr.reshape(flat.shape[0], flat.shape[1], -1), k_lr.reshape(flat.shape[0], kv_len, -1).transpose(1, 2))
        return torch.baddbmm(flat, *lowrank, alpha=self.rank**-0.5).view(aligned.shape)

    def feature_attention(
        self, prev: tuple[torch.Tensor, torch.Tensor], q_lr: torch.Tensor, k_lr: torch.Tensor, value: torch.Tensor,
        additive_mask: torch.Tensor | None, handoff: str | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:  # fmt: skip
        """Sparse Align from the previous layer's features: one SDPA call over concatenated (query, key) features."""
        q_prev, k_prev = self.align.features(*prev)
        width = q_prev.shape[-1] + self.rank
        pad = -width % 8  # SDPA's CPU flash kernel is 5-10% faster at a head width that is a multiple of 8 (72, not 70)
        q_lr = q_lr * self.rank**-0.5 if self.rank else q_lr
        k_lr = repeat_kv(k_lr, self.num_heads // self.key_heads)  # the features are per head (q_prev's source heads)
        query = torch.cat([q_prev, nn.functional.pad(q_lr, (0, pad))], dim=-1)
        key = torch.cat([k_prev, nn.functional.pad(k_lr, (0, pad))], dim=-1)
        # V on H heads at the q/k width: the fused (flash) kernels need one width for q, k and v, and as many K as V
        # heads (unpadded, SDPA falls back to its math kernel: 2-5x slower on CPU)
        value = nn.functional.pad(repeat_kv(value, self.num_key_value_groups), (0, width + pad - self.head_dim))
        q_len, kv_len = query.shape[2], key.shape[2]
        mask = additive_mask
        if mask is None and q_len != kv_len:  # is_causal would align the causal diagonal top-left
            mask = causal_block_mask(0, q_len, kv_len, kv_len - q_len, query.dtype, query.device)
        attn_output = nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=mask is None and q_len > 1, scale=1.0
        )[..., : self.head_dim]
        # the scores stay linear in these features, whatever the next layer is
        passed = (query[..., :width], key[..., :width]) if handoff else None
        return attn_output.transpose(1, 2), passed

    def blockwise_attention(
        self, prev: torch.Tensor | tuple[torch.Tensor, torch.Tensor], q_lr: torch.Tensor, k_lr: torch.Tensor,
        value: torch.Tensor, additive_mask: torch.Tensor | None, keep_scores: bool, keep_probs: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """(output, scores or None, probabilities or None): S_l, its softmax and softmax(S_l) V a block of query rows
        at a time. Besides the tensors handed in and out (scores next to a dense layer, probabilities for
        output_attentions), nothing larger than one block (B x H x rows x keys) is alive. A block's rows only see
        keys up to its last row (causal), so the keys past it are skipped; the handed tensors hold 0 there. With a
        mask, kv_len - q_len is at least the number of cached keys (a static cache returns its unwritten slots too):
        the blocks still see every key their rows may attend to, and the mask hides the rest."""
        batch, heads, q_len, _ = q_lr.shape
        kv_len = value.shape[2]
        past_len = kv_len - q_len
        rows = max(1, min(SCORE_BLOCK_ROWS, SCORE_BLOCK_ELEMENTS // (batch * heads * kv_len)))

        def block(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            kv_end = past_len + stop
            if isinstance(prev, tuple):  # recompute the previous layer's scores from its features
                prev_block = grouped_scores(prev[0][:, :, start:stop], prev[1][:, :, :kv_end])
            else:
                prev_block = prev[:, :, start:stop, :kv_end]
            scores = self.scores(prev_block, q_lr[:, :, start:stop], k_lr[:, :, :kv_end])
            mask = block_mask(additive_mask, start, stop, kv_end, past_len, scores.dtype, scores.device)
            probs = attention_probs(scores, mask, value.dtype)
            return scores, probs, grouped_attention(probs, value[:, :, :kv_end], self.num_key_value_groups)

        if rows >= q_len:
            scores, probs, attn_output = block(0, q_len)
            return attn_output.transpose(1, 2), scores if keep_scores else None, probs if keep_probs else None
        attn_output = value.new_empty(batch, q_len, heads, self.head_dim)
        handed = value.new_empty(batch, heads, q_len, kv_len) if keep_scores else None
        weights = value.new_zeros(batch, heads, q_len, kv_len) if keep_probs else None
        for start in range(0, q_len, rows):
            stop = min(start + rows, q_len)
            scores, probs, block_output = block(start, stop)
            attn_output[:, start:stop] = block_output.transpose(1, 2)
            if handed is not None:
                handed[:, :, start:stop, : past_len + stop] = scores
                handed[:, :, start:stop, past_len + stop :] = 0
            if weights is not None:
                weights[:, :, start:stop, : past_len + stop] = probs
        return attn_output, handed, weights

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        additive_mask: torch.Tensor | None,
        prev: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        cache: Cache | None = None,
        handoff: str | None = None,
        lowrank_position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | tuple | None]:
        """`prev` is the previous layer's scores, or its (scaled query, key) features. A layer that gets features and
        has a sparse Align hands features on whatever `handoff` asks (scores with `output_attentions`, which the
        features path never materialises); otherwise it hands its scores (None: nothing)."""
        input_shape = hidden_states.shape[:-1]
        q_lr, k_lr = self.lowrank_qk(hidden_states, position_ids, lowrank_position_embeddings)
        value = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        if cache is not None:  # a LISA layer caches only its low-rank K and its V
            k_lr, value = cache.update(k_lr, value, self.layer_idx)

        if self.sparse and isinstance(prev, tuple) and not output_attentions:
            attn_output, passed = self.feature_attention(prev, q_lr, k_lr, value, additive_mask, handoff)
        # the fused kernel returns no probabilities; torch.compile traces the torch path (the launcher is not made for
        # dynamo)
        elif (
            fused_lisa_decode is not None and self.fused_decode and not isinstance(prev, tuple) and q_lr.shape[2] == 1
            and not output_attentions and not torch.compiler.is_compiling() and triton_available(q_lr)
        ):  # fmt: skip
            attn_output, passed = fused_lisa_decode(self, prev, q_lr, k_lr, value, additive_mask)
        else:
            attn_output, passed, probs = self.blockwise_attention(
                prev, q_lr, k_lr, value, additive_mask, handoff is not None, output_attentions
            )
            if output_attentions:
                self.attention_weights(probs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), passed


def factorise_linears(layer: nn.Module, config, layer_idx: int) -> None:
    """Replace the linears `config.fasc_ranks` lists for this layer by FascLinear modules of their ranks."""
    prefix = f"{layer_idx}."
    for path, rank in config.fasc_ranks.items():
        if path.startswith(prefix):
            parent_name, _, child = path[len(prefix) :].rpartition(".")
            parent = layer.get_submodule(parent_name)
            dense = getattr(parent, child)
            setattr(parent, child, FascLinear(dense.in_features, dense.out_features, rank, dense.bias is not None))


class LisaDecoderLayer(GradientCheckpointingLayer):
    """A pre-norm decoder layer (Llama's layout: norm, attention, residual, norm, MLP, residual) with a family's
    `attention_class`, `mlp_class` and `norm_class`; a LISA layer's attention is LisaSharedAttention instead, and a
    layer in `dropped_attention_layers` has no attention at all (nor its input norm): the MLP part alone."""

    attention_class: type[nn.Module] = LisaAttention
    mlp_class: type[nn.Module]
    norm_class: type[nn.Module]
    # the submodules a dropped attention takes with it (Llama's post_attention_layernorm is the MLP's input norm)
    attention_parts: tuple[str, ...] = ("self_attn", "input_layernorm")

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_type = config.attention_types[layer_idx]
        lisa = config.lisa_layers.get(str(layer_idx))
        self.is_lisa = lisa is not None
        self.attention_free = layer_idx in config.dropped_attention_layers
        if self.is_lisa:
            spec = lisa_spec(lisa, config.num_attention_heads)
            self.self_attn = LisaSharedAttention(
                config, layer_idx, spec["rank"], spec["align_hidden"], spec["align"], spec["key_heads"]
            )
        else:
            self.self_attn = self.attention_class(config, layer_idx)
        self.mlp = self.mlp_class(config)
        self.input_layernorm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        factorise_linears(self, config, layer_idx)
        if self.attention_free:
            for part in self.attention_parts:
                setattr(self, part, None)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        additive_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cache: Cache | None = None,
        prev: torch.Tensor | tuple | None = None,
        handoff: str | None = None,
        lowrank_position_embeddings: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        output_attentions: bool = False,
        key_rotary: KeyRotary | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | tuple | None]:
        """(hidden states, what this layer hands to the next one). The masks, `position_embeddings` and `key_rotary` (a
        layer with low-rank keys rotates with it) are those of this layer's attention type.
        `lowrank_position_embeddings`: (rank, attention type) -> `lowrank_rotary` of `position_ids`, computed once for
        all layers. Under gradient checkpointing `prev` is a keyword argument, so only
        the non-reentrant checkpoint (transformers' default) sees it and its gradient."""
        if self.attention_free:  # no attention: it hands nothing on (the layer above is never a LISA layer)
            return self.after_attention(hidden_states, None), None
        residual = hidden_states
        normed = self.input_layernorm(hidden_states)
        if self.is_lisa:
            lowrank = lowrank_position_embeddings or {}
            attn_out, passed = self.self_attn(
                normed, position_ids, additive_mask, prev, cache=cache, handoff=handoff,
                lowrank_position_embeddings=lowrank.get((self.self_attn.rank, self.attention_type)),
                output_attentions=output_attentions,
            )  # fmt: skip
        else:
            attn_out, passed = self.self_attn(
                normed, position_embeddings, attention_mask, additive_mask, cache=cache, handoff=handoff,
                output_attentions=output_attentions, key_rotary=key_rotary, **kwargs,
            )  # fmt: skip
        return self.after_attention(residual, attn_out), passed

    def after_attention(self, residual: torch.Tensor, attn_out: torch.Tensor | None) -> torch.Tensor:
        """The residual stream after the attention (None: a dropped attention): Llama's residual, norm, MLP, residual
        (Gemma 3 adds norms)."""
        hidden_states = residual if attn_out is None else residual + attn_out
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def handoff_to_next_layer(config, idx: int) -> str | None:
    """What layer idx hands to layer idx + 1 at prefill: nothing (next is a full layer), its (query, key) "features"
    (a full layer, or a sparse layer whose scores are linear in the features it got) or its pre-softmax "scores" (a
    dense layer: its Align is non-linear). At decode (one query row) every layer hands its score row instead."""
    if str(idx + 1) not in config.lisa_layers:
        return None
    this = config.lisa_layers.get(str(idx))
    return "features" if this is None or lisa_spec(this, config.num_attention_heads)["align"] == "sparse" else "scores"


class LisaPreTrainedModel(PreTrainedModel):
    """What every LisaXxx model shares; a family's `LisaXxxPreTrainedModel` adds its config class, `_no_split_modules`
    and `_can_record_outputs` (its decoder layer)."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = False  # LISA anchors need materialised logits; full layers still use the backend
    _can_compile_fullgraph = True
    # a LISA layer needs the previous layer's scores or (query, key) features: an external attention backend (vLLM's
    # or TGI's Transformers backend) can hand neither
    _supports_attention_backend = False

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, **kwargs):
        """Non-reentrant only (transformers' default, also when the kwargs leave it out): a layer gets the scores or
        features of the layer below as a keyword argument, whose gradient a re-entrant checkpoint loses."""
        activation_checkpointing_kwargs = {"use_reentrant": False, **(activation_checkpointing_kwargs or {})}
        if activation_checkpointing_kwargs["use_reentrant"]:
            raise ValueError(
                f"{type(self).__name__} supports only non-reentrant activation checkpointing (use_reentrant=False): re-"
                "entrant checkpointing loses the gradient through the scores a LISA layer reads from the layer below."
            )
        super().activation_checkpointing_enable(activation_checkpointing_kwargs, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, LisaHeadAlign):  # identity mix and a zero FFN: Align starts as "copy the scores"
            init.eye_(module.mix)
            init.zeros_(module.bias)
            if module.ffn_out is not None:
                init.zeros_(module.ffn_out.weight)
        if isinstance(module, LisaSparseAlign):  # same head, scale 1: "copy the scores"
            init.ones_(module.scale)
            init.copy_(module.source, torch.arange(module.source.numel()))


class LisaModel(LisaPreTrainedModel):
    """The decoder stack: a family's subclass names its `decoder_layer_class`, `norm_class` and `rotary_class`."""

    decoder_layer_class: type[LisaDecoderLayer]
    norm_class: type[nn.Module]
    rotary_class: type[nn.Module]

    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = self.embedding(config)
        self.layers = nn.ModuleList([self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers)])
        self.norm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = self.rotary_class(config=config)
        self.handoffs = [handoff_to_next_layer(config, i) for i in range(config.num_hidden_layers)]
        self.lowrank_ranks = sorted({int(spec["rank"]) for spec in config.lisa_layers.values()})
        self.attention_types = config.attention_types
        self.mask_types = list(dict.fromkeys(self.attention_types))  # one mask per attention type
        # the attention types whose layers materialise scores (a LISA layer and its anchor share one)
        self.lisa_types = {self.attention_types[int(idx)] for idx in config.lisa_layers}
        self.key_types = {self.attention_types[int(idx)] for idx in config.key_ranks}  # with low-rank key layers
        self.value_types = {self.attention_types[int(idx)] for idx in config.value_ranks}  # with low-rank value layers
        # with a cache layer of their own layout (a LISA layer, a key or a value latent)
        self.own_layout_types = {
            kind for idx, kind in enumerate(self.attention_types) if config.caches_own_layout(idx)
        }  # fmt: skip
        self.gradient_checkpointing = False
        self.post_init()

    def embedding(self, config) -> nn.Module:
        """The input embedding (Gemma 3's is scaled by sqrt(hidden))."""
        return nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if cache is not None and "sliding_attention" in self.own_layout_types:
            bind_sliding_windows(cache, self.config.sliding_window)
        batch, q_len = inputs_embeds.shape[:2]
        if position_ids is None:
            past_len = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(q_len, device=inputs_embeds.device) + past_len).unsqueeze(0)
        position_ids = position_ids.expand(batch, q_len)

        mask_kwargs = dict(
            config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
            position_ids=position_ids,
        )  # fmt: skip
        if isinstance(attention_mask, dict):  # generate's masks by layer type (a static cache, standard types only)
            causal_masks = {kind: attention_mask[kind] for kind in self.mask_types}
        else:
            causal_masks = {kind: MASK_FUNCTIONS[kind](**mask_kwargs) for kind in self.mask_types}
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        # a decode step's value-latent layers attend with materialised scores too (LisaAttention.forward: mix_latent)
        decode_step = inputs_embeds.shape[1] == 1
        additive_masks = {
            kind: score_mask(**mask_kwargs, causal_mask=mask, attention_type=kind)
            if kind in self.lisa_types or output_attentions or (decode_step and kind in self.value_types) else None
            for kind, mask in causal_masks.items()
        }  # fmt: skip

        hidden_states = inputs_embeds
        position_embeddings = rotary_embeddings(self.rotary_emb, hidden_states, position_ids, self.mask_types)
        lowrank_position_embeddings = {
            (rank, kind): lowrank_rotary(self.config, rank, position_ids, hidden_states.dtype, kind)
            for rank in self.lowrank_ranks for kind in self.lisa_types
        }  # fmt: skip
        key_rotaries = {kind: KeyRotary(self.rotary_emb, hidden_states, kind) for kind in self.key_types}
        passed = None
        for layer, handoff, kind in zip(self.layers, self.handoffs, self.attention_types):
            hidden_states, passed = layer(
                hidden_states,
                attention_mask=causal_masks[kind],
                additive_mask=additive_masks[kind],
                position_ids=position_ids,
                position_embeddings=position_embeddings[kind],
                cache=cache,
                prev=passed,
                handoff=handoff,
                lowrank_position_embeddings=lowrank_position_embeddings,
                output_attentions=output_attentions,
                key_rotary=key_rotaries.get(kind),
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class LisaForCausalLM(LisaPreTrainedModel, GenerationMixin):
    """The causal LM head over a family's `model_class`."""

    model_class: type[LisaModel]
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = self.model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs):
        """cache_implementation="quantized" builds a LisaQuantizedCache (transformers' QuantizedCache refuses the LISA and
        dropped-attention layer types); every other cache is transformers' choice."""
        if not prepare_quantized_cache(self, generation_config, model_kwargs):
            super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )  # fmt: skip
