"""LisaGemma3: Gemma 3 (text) with LISA cross-layer attention sharing and FASC low-rank linears.

Remote code shipped by `hfcompress convert` (flat next to config.json); imports only torch, transformers and its
sibling files. The LISA math, the score handoff, the masks and the caches are family-neutral and live in
`lisa_attention.py`; this file puts them together with Gemma 3's own MLP (GeGLU), RMSNorm ((1 + w)) and rotary
embedding. What is Gemma 3's: the input embeddings are scaled by sqrt(hidden); a layer normalises the attention output
before the residual (`post_attention_layernorm`) and the MLP's input and output (`pre_feedforward_layernorm`,
`post_feedforward_layernorm`); per-head q/k norms before RoPE (a shared layer has none, as Qwen3's); attention scaled by
`query_pre_attn_scalar`**-0.5; and sliding-window layers interleaved with full ones, each attention type with its own
RoPE base (`rope_parameters` nested by type; a LISA layer's low-rank RoPE uses its type's base too).
"""

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP, Gemma3RMSNorm, Gemma3RotaryEmbedding

from .configuration_lisa_gemma3 import LisaGemma3Config
from .lisa_attention import (
    FascLinear,
    LisaAttentionWeights,
    LisaDecoderLayer,
    LisaForCausalLM,
    LisaModel,
    LisaPreTrainedModel,
    LisaQkNormAttention,
)


class LisaGemma3ScaledEmbedding(nn.Embedding):
    """Gemma 3's scaled embedding (Gemma3TextScaledWordEmbedding): the scale rounded to the weight's dtype, as Gemma
    does (sqrt(640) is 25.25 in bfloat16), and kept as a number, not a buffer: nothing to compute after a meta-device
    build."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None, embed_scale: float):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.embed_scale = embed_scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * torch.tensor(self.embed_scale).to(self.weight.dtype)


class LisaGemma3RotaryEmbedding(Gemma3RotaryEmbedding):
    """Gemma 3's rotary embedding, one (cos, sin) per attention type: built from the attention types (`layer_types` of a
    converted config also names the LISA cache types)."""

    per_attention_type = True  # called as rotary(x, position_ids, attention_type) (lisa_attention.rotary_embeddings)

    def __init__(self, config: LisaGemma3Config, device=None):
        nn.Module.__init__(self)
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.layer_types = sorted(set(config.attention_types))
        self.rope_type = {}
        for layer_type in self.layer_types:
            inv_freq, scaling = self.inverse_frequencies(layer_type, device)
            setattr(self, f"{layer_type}_inv_freq", nn.Buffer(inv_freq, persistent=False))
            setattr(self, f"{layer_type}_original_inv_freq", nn.Buffer(inv_freq.clone(), persistent=False))
            setattr(self, f"{layer_type}_attention_scaling", scaling)

    def inverse_frequencies(self, layer_type: str, device=None) -> tuple[torch.Tensor, float]:
        self.rope_type[layer_type] = self.config.rope_parameters[layer_type]["rope_type"]
        rope_init_fn = self.compute_default_rope_parameters
        if self.rope_type[layer_type] != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type[layer_type]]
        return rope_init_fn(self.config, device, layer_type=layer_type)


class LisaGemma3Attention(LisaQkNormAttention):
    """Gemma 3 attention: q_norm and k_norm over each head's features before RoPE, scores scaled by
    query_pre_attn_scalar**-0.5."""

    qk_norm_class = Gemma3RMSNorm

    def __init__(self, config: LisaGemma3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.scaling = config.query_pre_attn_scalar**-0.5


class LisaGemma3DecoderLayer(LisaDecoderLayer):
    """Gemma 3's layer: residual + norm(attention), then residual + norm(MLP(norm(x)))."""

    attention_class = LisaGemma3Attention
    mlp_class = Gemma3MLP
    norm_class = Gemma3RMSNorm
    attention_parts = ("self_attn", "input_layernorm", "post_attention_layernorm")  # the norm of its output too

    def __init__(self, config: LisaGemma3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def after_attention(self, residual: torch.Tensor, attn_out: torch.Tensor | None) -> torch.Tensor:
        hidden_states = residual if attn_out is None else residual + self.post_attention_layernorm(attn_out)
        return hidden_states + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden_states)))


class LisaGemma3PreTrainedModel(LisaPreTrainedModel):
    config_class = LisaGemma3Config
    config: LisaGemma3Config
    _no_split_modules = ["LisaGemma3DecoderLayer"]
    _can_record_outputs = {"hidden_states": LisaGemma3DecoderLayer, "attentions": LisaAttentionWeights}

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, Gemma3RMSNorm):  # (1 + w): zero is the identity
            init.zeros_(module.weight)
        elif isinstance(module, LisaGemma3RotaryEmbedding):  # non-persistent buffers: computed, never loaded
            for layer_type in module.layer_types:
                inv_freq, _ = module.inverse_frequencies(layer_type)
                init.copy_(getattr(module, f"{layer_type}_inv_freq"), inv_freq)
                init.copy_(getattr(module, f"{layer_type}_original_inv_freq"), inv_freq)


class LisaGemma3Model(LisaModel, LisaGemma3PreTrainedModel):
    decoder_layer_class = LisaGemma3DecoderLayer
    norm_class = Gemma3RMSNorm
    rotary_class = LisaGemma3RotaryEmbedding

    def embedding(self, config: LisaGemma3Config) -> nn.Module:
        return LisaGemma3ScaledEmbedding(
            config.vocab_size, config.hidden_size, self.padding_idx, embed_scale=config.embedding_scale
        )


class LisaGemma3ForCausalLM(LisaForCausalLM, LisaGemma3PreTrainedModel):
    model_class = LisaGemma3Model


__all__ = ["LisaGemma3ForCausalLM", "LisaGemma3Model", "LisaGemma3PreTrainedModel", "FascLinear"]
