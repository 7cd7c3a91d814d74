"""Configuration of LisaMistral: a Mistral model with LISA-shared attention layers and FASC low-rank linears.

Shipped to the Hub as remote code next to `modeling_lisa_mistral.py`; imports only transformers and its sibling
`configuration_lisa.py` (the family table and the conversion specs every family shares).
"""

from huggingface_hub.dataclasses import strict
from transformers.models.mistral.configuration_mistral import MistralConfig

from .configuration_lisa import FAMILIES, LisaConfigMixin


@strict
class LisaMistralConfig(LisaConfigMixin, MistralConfig):
    r"""
    A `MistralConfig` plus the conversion specs of `LisaConfigMixin`.
    Every layer attends within the last `sliding_window` positions, or to all of them when it is None.
    """

    model_type = FAMILIES["mistral"].converted_model_type

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
        """Per layer, its cache layer type (a LISA layer's "lisa_"-prefixed): transformers' caches build their layers
        from it (MistralConfig itself has none: transformers infers "sliding_attention" from the window)."""
        return self.cache_layer_types()


__all__ = ["LisaMistralConfig"]
