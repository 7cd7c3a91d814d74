"""Configuration of LisaLlama: a Llama model with LISA-shared attention layers and FASC low-rank linears.

Shipped to the Hub as remote code next to `modeling_lisa_llama.py`; imports only transformers and its sibling
`configuration_lisa.py` (the family table and the conversion specs every family shares).
"""

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig

from .configuration_lisa import FAMILIES, LisaConfigMixin


@strict
class LisaLlamaConfig(LisaConfigMixin, LlamaConfig):
    r"""
    A `LlamaConfig` plus the conversion specs of `LisaConfigMixin`. Every
    layer has full attention.
    """

    model_type = FAMILIES["llama"].converted_model_type

    lisa_layers: dict | None = None
    fasc_ranks: dict | None = None
    key_ranks: dict | None = None
    value_ranks: dict | None = None
    dropped_attention_layers: list | None = None

    def __post_init__(self, **kwargs):
        self.normalise_specs()
        super().__post_init__(**kwargs)

    @property
    def layer_types(self) -> list[str]:
        """Per layer, its cache layer type ("lisa_attention" for a LISA layer): transformers' caches
        (`DynamicCache(config=...)`, `StaticCache`) build their layers from it."""
        return self.cache_layer_types()


__all__ = ["LisaLlamaConfig"]
