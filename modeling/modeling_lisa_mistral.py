"""LisaMistral: Mistral with LISA cross-layer attention sharing and FASC low-rank linears.

Remote code shipped by `hfcompress convert` (flat next to config.json); imports only torch, transformers and its
sibling files. The LISA math, the score handoff, the masks and the caches are family-neutral and live in
`lisa_attention.py`; this file puts them together with Mistral's own MLP, RMSNorm and rotary embedding. What is
Mistral's: no biases, an explicit `head_dim` (which may differ from hidden_size / heads), and `sliding_window` (None:
full attention), which every layer applies to its masks and its cache, a LISA layer too.
"""

from transformers.models.mistral.modeling_mistral import MistralMLP, MistralRMSNorm, MistralRotaryEmbedding

from .configuration_lisa_mistral import LisaMistralConfig
from .lisa_attention import (
    FascLinear,
    LisaAttention,
    LisaAttentionWeights,
    LisaDecoderLayer,
    LisaForCausalLM,
    LisaModel,
    LisaPreTrainedModel,
)


class LisaMistralDecoderLayer(LisaDecoderLayer):
    attention_class = LisaAttention
    mlp_class = MistralMLP
    norm_class = MistralRMSNorm


class LisaMistralPreTrainedModel(LisaPreTrainedModel):
    config_class = LisaMistralConfig
    config: LisaMistralConfig
    _no_split_modules = ["LisaMistralDecoderLayer"]
    _can_record_outputs = {"hidden_states": LisaMistralDecoderLayer, "attentions": LisaAttentionWeights}


class LisaMistralModel(LisaModel, LisaMistralPreTrainedModel):
    decoder_layer_class = LisaMistralDecoderLayer
    norm_class = MistralRMSNorm
    rotary_class = MistralRotaryEmbedding


class LisaMistralForCausalLM(LisaForCausalLM, LisaMistralPreTrainedModel):
    model_class = LisaMistralModel


__all__ = ["LisaMistralForCausalLM", "LisaMistralModel", "LisaMistralPreTrainedModel", "FascLinear"]
