"""Configuration of LisaQwen3: a Qwen3 model with LISA-shared attention layers and FASC low-rank linears.

Shipped to the Hub as remote code next to `modeling_lisa_qwen3.py`; imports only transformers and its sibling
`configuration_lisa.py` (the family table and the conversion specs every family shares).
"""

from huggingface_hub.dataclasses import strict
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from .configuration_lisa import FAMILIES, LisaConfigMixin


@strict
class LisaQwen3Config(LisaConfigMixin, Qwen3Config):
    r"""
    A `Qwen3Config` plus the conversion specs of `LisaConfigMixin`.

    layer_types (`list[str]`): per layer, the type of its cache layer: the attention type Qwen3 gives it (from
        `use_sliding_window` and `max_window_layers`, or the source's own list), "lisa_"-prefixed for a LISA layer.
    """

    model_type = FAMILIES["qwen3"].converted_model_type

    lisa_layers: dict | None = None
    fasc_ranks: dict | None = None
    key_ranks: dict | None = None
    value_ranks: dict | None = None
    dropped_attention_layers: list | None = None

    def __post_init__(self, **kwargs):
        self.normalise_specs()
        super().__post_init__(**kwargs)  # Qwen3's own layer_types, when the source has none
        self.layer_types = self.cache_layer_types()


__all__ = ["LisaQwen3Config"]
