"""LisaQwen3: Qwen3 with LISA cross-layer attention sharing and FASC low-rank linears.

Remote code shipped by `hfcompress convert` (flat next to config.json); imports only torch, transformers and its
sibling files. The LISA math, the score handoff, the masks and the caches are family-neutral and live in
`lisa_attention.py`; this file puts them together with Qwen3's own MLP, RMSNorm and rotary embedding. What is Qwen3's:
a per-head RMSNorm on the query and the key before RoPE (`q_norm`, `k_norm`), which the layer below a shared one
applies to the features and scores it hands on; a shared layer has no q/k, so it has no q/k norms either. Its
`head_dim` is explicit, biases follow `attention_bias`, and `layer_types` sets each layer's window as in Qwen2.
"""

from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from .configuration_lisa_qwen3 import LisaQwen3Config
from .lisa_attention import (
    FascLinear,
    LisaAttentionWeights,
    LisaDecoderLayer,
    LisaForCausalLM,
    LisaModel,
    LisaPreTrainedModel,
    LisaQkNormAttention,
)


class LisaQwen3Attention(LisaQkNormAttention):
    """Qwen3 attention: q_norm and k_norm over each head's features, between the projection and RoPE."""

    qk_norm_class = Qwen3RMSNorm


class LisaQwen3DecoderLayer(LisaDecoderLayer):
    attention_class = LisaQwen3Attention
    mlp_class = Qwen3MLP
    norm_class = Qwen3RMSNorm


class LisaQwen3PreTrainedModel(LisaPreTrainedModel):
    config_class = LisaQwen3Config
    config: LisaQwen3Config
    _no_split_modules = ["LisaQwen3DecoderLayer"]
    _can_record_outputs = {"hidden_states": LisaQwen3DecoderLayer, "attentions": LisaAttentionWeights}


class LisaQwen3Model(LisaModel, LisaQwen3PreTrainedModel):
    decoder_layer_class = LisaQwen3DecoderLayer
    norm_class = Qwen3RMSNorm
    rotary_class = Qwen3RotaryEmbedding


class LisaQwen3ForCausalLM(LisaForCausalLM, LisaQwen3PreTrainedModel):
    model_class = LisaQwen3Model


__all__ = ["LisaQwen3ForCausalLM", "LisaQwen3Model", "LisaQwen3PreTrainedModel", "FascLinear"]
