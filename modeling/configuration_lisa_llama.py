"""Configuration of LisaLlama: a Llama model with LISA-shared attention layers and FASC low-rank linears.

Shipped to the Hub as remote code next to `modeling_lisa_llama.py`; imports only transformers and its sibling
`configuration_lisa.py` (the conversion specs every family shares).
"""

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig

from .configuration_lisa import LisaConfigMixin


@strict
class LisaLlamaConfig(LisaConfigMixin, LlamaConfig):
    r"""
    A `LlamaConfig` plus `lisa_layers`, `fasc_ranks` and `dropped_attention_layers` (see `LisaConfigMixin`). Every
    layer has full attention.
    """

    model_type = "lisa_llama"

    lisa_layers: dict | None = None
    fasc_ranks: dict | None = None
    dropped_attention_layers: list | None = None

    def __post_init__(self, **kwargs):
        self.normalise_specs()
        super().__post_init__(**kwargs)

    @property
    def attention_types(self) -> list[str]:
        return ["full_attention"] * self.num_hidden_layers

    @property
    def projection_biases(self) -> dict[str, bool]:
        return dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), self.attention_bias)

    @property
    def layer_types(self) -> list[str]:
        """Per layer, its cache layer type ("lisa_attention" for a LISA layer): transformers' caches
        (`DynamicCache(config=...)`, `StaticCache`) build their layers from it."""
        return self.cache_layer_types()


__all__ = ["LisaLlamaConfig"]
