"""LisaLlama: Llama with LISA cross-layer attention sharing and FASC low-rank linears.

Remote code shipped by `hfcompress convert` (flat next to config.json); imports only torch, transformers
and its sibling files. Math, per decoder layer l:

- full layer:   S_l = Q_l K_l^T / sqrt(d_head)                         (ordinary Llama attention)
- LISA layer:   S_l = Align(S_{l-1}) + (x W_Q^lr)(x W_K^lr)^T / sqrt(r)  (no q_proj / k_proj)
    dense Align:  Align(S)[h] = sum_g mix[h, g] S[g] + bias[h] + FFN(S[:, i, j])[h]  (mix across heads)
    sparse Align: Align(S)[h] = scale[h] S[source[h]]                             (one head, scaled)
- both:         out = softmax(S_l + causal/padding mask) V_l, then o_proj.

S are pre-softmax logits ("logits-space" mixing keeps rows normalised after the softmax).
- Dense Align needs S_{l-1} materialised: the layer below hands over its scores.
- Sparse Align is linear in one head's Q K^T, so S_l is one attention over concatenated features,
  [scale Q_{l-1}[source] | Q^lr / sqrt(r)] . [K_{l-1}[source] | K^lr]^T. The layer below hands over its (query, key)
  features, nothing T x T is materialised, and SDPA does the softmax and V product.
- A full layer uses the configured attention backend (SDPA) unless the next layer needs its scores.
At decode the previous layer hands over its score row for the new token (for sparse Align too: one row is
cheap), so a LISA layer caches only its low-rank K (r per head) and its V.
A FASC linear is `y = proj_out(proj_in(x))` (`A (B x)`).
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
    repeat_kv,
)

from .configuration_lisa_llama import LisaLlamaConfig

try:  # optional fused GPU kernels; the torch path below is the reference and the CPU path
    from .lisa_kernels import fused_lisa_decode, triton_available
except ImportError:  # kernels file not shipped, or triton missing
    fused_lisa_decode = None

    def triton_available(tensor: torch.Tensor) -> bool:
        return False


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
        scores = torch.einsum("hg,bgij->bhij", self.mix.to(prev_scores.dtype), prev_scores)
        scores = scores + self.bias.to(prev_scores.dtype)[None, :, None, None]
        if self.ffn_in is not None:
            per_position = prev_scores.permute(0, 2, 3, 1)  # the FFN runs across heads at every (i, j)
            correction = self.ffn_out(nn.functional.gelu(self.ffn_in(per_position), approximate="tanh"))
            scores = scores + correction.permute(0, 3, 1, 2)
        return scores


class LisaSparseAlign(nn.Module):
    """Each head reads one head of the previous layer, scaled: Align(S)[h] = scale[h] * S[source[h]]."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.register_buffer("source", torch.arange(num_heads))  # saved: the head matching found at conversion
        self.scale = nn.Parameter(torch.ones(num_heads))

    def forward(self, prev_scores: torch.Tensor) -> torch.Tensor:
        return prev_scores[:, self.source] * self.scale.to(prev_scores.dtype)[None, :, None, None]

    def features(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous layer's (B, H, T, D) query/key features re-ordered to this layer's heads, query scaled."""
        return query[:, self.source] * self.scale.to(query.dtype)[None, :, None, None], key[:, self.source]


def additive_attention_mask(
    attention_mask: torch.Tensor | None, batch: int, q_len: int, past_len: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """(B, 1, q_len, past_len + q_len) additive mask: causal plus padding from a 2D (B, kv_len) 0/1 mask."""
    if attention_mask is not None and attention_mask.dim() == 4:
        if attention_mask.dtype == torch.bool:
            return torch.zeros(attention_mask.shape, dtype=dtype, device=device).masked_fill(
                ~attention_mask, torch.finfo(dtype).min
            )
        return attention_mask.to(dtype)
    kv_len = past_len + q_len
    query_pos = torch.arange(past_len, kv_len, device=device)[:, None]
    allowed = (torch.arange(kv_len, device=device)[None, :] <= query_pos)[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, -kv_len:].bool()
    allowed = allowed.expand(batch, 1, q_len, kv_len)
    # finfo.min, not -inf: a fully padded row gives a uniform softmax instead of NaN
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def softmax_attention(scores: torch.Tensor, mask: torch.Tensor, value: torch.Tensor, groups: int) -> torch.Tensor:
    """softmax(scores + mask) @ V with GQA; returns (B, T, H, D)."""
    probs = nn.functional.softmax(scores + mask, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, repeat_kv(value, groups)).transpose(1, 2)


class LisaLlamaAttention(nn.Module):
    """Ordinary Llama attention that can also hand its pre-softmax scores to a following LISA layer."""

    def __init__(self, config: LisaLlamaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        hidden, heads, kv_heads, bias = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.attention_bias,
        )
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        additive_mask: torch.Tensor | None,
        cache: Cache | None = None,
        handoff: str | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | tuple | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)

        if handoff == "scores":  # the next layer has a dense Align: materialise the logits it builds on
            passed = torch.matmul(query, repeat_kv(key, self.num_key_value_groups).transpose(2, 3)) * self.scaling
            attn_output = softmax_attention(passed, additive_mask, value, self.num_key_value_groups)
        else:
            # a sparse-Align next layer only needs this layer's (scaled query, per-head key) features
            passed = (query * self.scaling, repeat_kv(key, self.num_key_value_groups)) if handoff == "features" else None
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
                **kwargs,
            )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), passed


class LisaSharedAttention(nn.Module):
    """LISA layer: scores from the previous layer's scores (aligned) plus a low-rank Q/K correction."""

    def __init__(self, config: LisaLlamaConfig, layer_idx: int, rank: int, align_hidden: int, align: str = "dense"):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.rank = rank
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_lowrank = nn.Linear(hidden, self.num_heads * rank, bias=False)
        self.k_lowrank = nn.Linear(hidden, self.num_heads * rank, bias=False)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.sparse = align == "sparse"
        self.align = LisaSparseAlign(self.num_heads) if self.sparse else LisaHeadAlign(self.num_heads, align_hidden)

    def lowrank_rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE at the low-rank width r (same base as the model), so the correction term is position-aware."""
        theta = float((self.config.rope_parameters or {}).get("rope_theta", 10000.0))
        inv_freq = 1.0 / theta ** (torch.arange(0, self.rank, 2, device=position_ids.device, dtype=torch.float) / self.rank)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def lowrank_qk(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated low-rank queries and keys, each (B, H, T, r)."""
        shape = (*hidden_states.shape[:-1], self.num_heads, self.rank)
        q_lr = self.q_lowrank(hidden_states).view(shape).transpose(1, 2)
        k_lr = self.k_lowrank(hidden_states).view(shape).transpose(1, 2)
        cos, sin = self.lowrank_rotary(position_ids, hidden_states.dtype)
        return apply_rotary_pos_emb(q_lr, k_lr, cos, sin)

    def scores(self, prev_scores: torch.Tensor, q_lr: torch.Tensor, k_lr: torch.Tensor) -> torch.Tensor:
        """Pre-softmax scores S_l = Align(S_{l-1}) + q_lr k_lr^T / sqrt(r) (just the aligned scores at rank 0)."""
        aligned = self.align(prev_scores)
        if self.rank == 0:
            return aligned
        return aligned + torch.matmul(q_lr, k_lr.transpose(2, 3)) * self.rank**-0.5

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        additive_mask: torch.Tensor,
        prev: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        cache: Cache | None = None,
        handoff: str | None = "scores",
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | tuple | None]:
        """`prev` is the previous layer's scores, or its (query, key) features when this layer's Align is sparse."""
        input_shape = hidden_states.shape[:-1]
        q_lr, k_lr = self.lowrank_qk(hidden_states, position_ids)
        value = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        if cache is not None:  # a LISA layer caches only its low-rank K and its V
            k_lr, value = cache.update(k_lr, value, self.layer_idx)

        if isinstance(prev, tuple):  # sparse Align: one attention over concatenated features, no T x T tensor
            q_prev, k_prev = self.align.features(*prev)
            query = torch.cat([q_prev, q_lr * self.rank**-0.5], dim=-1) if self.rank else q_prev
            key = torch.cat([k_prev, k_lr], dim=-1) if self.rank else k_prev
            # V padded to the query/key width: SDPA's fused (flash) kernels need one head width for q, k and v
            value = nn.functional.pad(repeat_kv(value, self.num_key_value_groups), (0, query.shape[-1] - self.head_dim))
            attn_output = nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=additive_mask, scale=1.0
            )[..., : self.head_dim].transpose(1, 2)
            passed = (query, key) if handoff == "features" else None
            if handoff == "scores":
                passed = torch.matmul(query, key.transpose(2, 3))
        elif fused_lisa_decode is not None and not self.sparse and q_lr.shape[2] == 1 and triton_available(q_lr):
            attn_output, passed = fused_lisa_decode(self, prev, q_lr, k_lr, value, additive_mask)
        else:
            passed = self.scores(prev, q_lr, k_lr)
            attn_output = softmax_attention(passed, additive_mask, value, self.num_key_value_groups)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), passed


class LisaLlamaDecoderLayer(nn.Module):
    def __init__(self, config: LisaLlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        lisa = config.lisa_layers.get(str(layer_idx))
        self.is_lisa = lisa is not None
        if self.is_lisa:
            self.self_attn = LisaSharedAttention(
                config, layer_idx, int(lisa["rank"]), int(lisa.get("align_hidden", 0)), lisa.get("align", "dense")
            )
        else:
            self.self_attn = LisaLlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        prefix = f"{layer_idx}."
        for path, rank in config.fasc_ranks.items():
            if path.startswith(prefix):
                parent_name, _, child = path[len(prefix) :].rpartition(".")
                parent = self.get_submodule(parent_name)
                dense = getattr(parent, child)
                setattr(parent, child, FascLinear(dense.in_features, dense.out_features, rank, dense.bias is not None))

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
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | tuple | None]:
        residual = hidden_states
        normed = self.input_layernorm(hidden_states)
        if self.is_lisa:
            attn_out, passed = self.self_attn(normed, position_ids, additive_mask, prev, cache=cache, handoff=handoff)
        else:
            attn_out, passed = self.self_attn(
                normed, position_embeddings, attention_mask, additive_mask, cache=cache, handoff=handoff, **kwargs
            )
        hidden_states = residual + attn_out
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, passed


def handoff_to_next_layer(config: LisaLlamaConfig, idx: int) -> str | None:
    """What layer idx hands to layer idx + 1: nothing (next is a full layer), its (query, key) "features" (next
    has a sparse Align and this layer can give features) or its pre-softmax "scores"."""
    following = config.lisa_layers.get(str(idx + 1))
    if following is None:
        return None
    this = config.lisa_layers.get(str(idx))
    gives_features = this is None or this.get("align", "dense") == "sparse"
    return "features" if following.get("align", "dense") == "sparse" and gives_features else "scores"


class LisaLlamaPreTrainedModel(PreTrainedModel):
    config_class = LisaLlamaConfig
    config: LisaLlamaConfig
    base_model_prefix = "model"
    _no_split_modules = ["LisaLlamaDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False  # LISA anchors need materialised logits; full layers still use the backend
    _supports_attention_backend = True

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


class LisaLlamaModel(LisaLlamaPreTrainedModel):
    def __init__(self, config: LisaLlamaConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([LisaLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.handoffs = [handoff_to_next_layer(config, i) for i in range(config.num_hidden_layers)]
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past_len = cache.get_seq_length() if cache is not None else 0
        batch, q_len = inputs_embeds.shape[:2]
        if position_ids is None:
            position_ids = (torch.arange(q_len, device=inputs_embeds.device) + past_len).unsqueeze(0)
        position_ids = position_ids.expand(batch, q_len)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        additive_mask = None
        if self.config.lisa_layers:
            additive_mask = additive_attention_mask(
                attention_mask, batch, q_len, past_len, inputs_embeds.dtype, inputs_embeds.device
            )

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        # one query row (decode): a score row is as cheap as features and skips re-gathering the whole key cache
        handoffs = self.handoffs if q_len > 1 else [handoff and "scores" for handoff in self.handoffs]
        passed = None
        for layer, handoff in zip(self.layers, handoffs):
            hidden_states, passed = layer(
                hidden_states,
                attention_mask=causal_mask,
                additive_mask=additive_mask,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                cache=cache,
                prev=passed,
                handoff=handoff,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class LisaLlamaForCausalLM(LisaLlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LisaLlamaConfig):
        super().__init__(config)
        self.model = LisaLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

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
        past_key_values: Cache | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)


__all__ = ["LisaLlamaForCausalLM", "LisaLlamaModel", "LisaLlamaPreTrainedModel", "FascLinear"]
