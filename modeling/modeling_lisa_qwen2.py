"""LisaQwen2: Qwen2 / Qwen2.5 with LISA cross-layer attention sharing and FASC low-rank linears.

Remote code shipped by `hfcompress convert` (flat next to config.json); imports only torch, transformers and its
sibling files. The LISA math, the score handoff, the masks and the caches are family-neutral and live in
`lisa_attention.py`; this file puts them together with Qwen2's own MLP, RMSNorm and rotary embedding. What is Qwen2's:
q/k/v have biases and o has none (`LisaQwen2Config.projection_biases`; a shared layer drops q/k with their biases and
keeps v's), and a layer's attention type (`layer_types`: full, or a sliding window of `sliding_window` positions) sets
its masks and its cache; a LISA layer has the type of the layer below.
"""

from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm, Qwen2RotaryEmbedding

from .configuration_lisa_qwen2 import LisaQwen2Config
from .lisa_attention import (
    FascLinear,
    LisaAttention,
    LisaAttentionWeights,
    LisaDecoderLayer,
    LisaForCausalLM,
    LisaModel,
    LisaPreTrainedModel,
)


class LisaQwen2DecoderLayer(LisaDecoderLayer):
    attention_class = LisaAttention
    mlp_class = Qwen2MLP
    norm_class = Qwen2RMSNorm


class LisaQwen2PreTrainedModel(LisaPreTrainedModel):
    config_class = LisaQwen2Config
    config: LisaQwen2Config
    _no_split_modules = ["LisaQwen2DecoderLayer"]
    _can_record_outputs = {"hidden_states": LisaQwen2DecoderLayer, "attentions": LisaAttentionWeights}


class LisaQwen2Model(LisaModel, LisaQwen2PreTrainedModel):
    decoder_layer_class = LisaQwen2DecoderLayer
    norm_class = Qwen2RMSNorm
    rotary_class = Qwen2RotaryEmbedding


class LisaQwen2ForCausalLM(LisaForCausalLM, LisaQwen2PreTrainedModel):
    model_class = LisaQwen2Model


__all__ = ["LisaQwen2ForCausalLM", "LisaQwen2Model", "LisaQwen2PreTrainedModel", "FascLinear"]
