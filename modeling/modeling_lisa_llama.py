"""LisaLlama: Llama with LISA cross-layer attention sharing and FASC low-rank linears.

Remote code shipped by `hfcompress convert` (flat next to config.json); imports only torch, transformers and its
sibling files. The LISA math, the score handoff, the masks and the caches are family-neutral and live in
`lisa_attention.py`; this file puts them together with Llama's own MLP, RMSNorm and rotary embedding. Every layer has
full attention; the biases of all four projections follow `attention_bias`.
"""

from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from .configuration_lisa_llama import LisaLlamaConfig
from .lisa_attention import (
    FascLinear,
    LisaAttention,
    LisaAttentionWeights,
    LisaDecoderLayer,
    LisaForCausalLM,
    LisaModel,
    LisaPreTrainedModel,
)


class LisaLlamaDecoderLayer(LisaDecoderLayer):
    attention_class = LisaAttention
    mlp_class = LlamaMLP
    norm_class = LlamaRMSNorm


class LisaLlamaPreTrainedModel(LisaPreTrainedModel):
    config_class = LisaLlamaConfig
    config: LisaLlamaConfig
    _no_split_modules = ["LisaLlamaDecoderLayer"]
    _can_record_outputs = {"hidden_states": LisaLlamaDecoderLayer, "attentions": LisaAttentionWeights}


class LisaLlamaModel(LisaModel, LisaLlamaPreTrainedModel):
    decoder_layer_class = LisaLlamaDecoderLayer
    norm_class = LlamaRMSNorm
    rotary_class = LlamaRotaryEmbedding


class LisaLlamaForCausalLM(LisaForCausalLM, LisaLlamaPreTrainedModel):
    model_class = LisaLlamaModel


__all__ = ["LisaLlamaForCausalLM", "LisaLlamaModel", "LisaLlamaPreTrainedModel", "FascLinear"]
