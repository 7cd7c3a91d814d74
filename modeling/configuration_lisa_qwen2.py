"""Configuration of LisaQwen2: a Qwen2 / Qwen2.5 model with LISA-shared attention layers and FASC low-rank linears.

Shipped to the Hub as remote code next to `modeling_lisa_qwen2.py`; imports only transformers and its sibling
`configuration_lisa.py` (the family table and the conversion specs every family shares).
"""

from huggingface_hub.dataclasses import strict
from transformers.models.qwen2.configuration_qwen2 import Qwen2Config

from .configuration_lisa import FAMILIES, LisaConfigMixin


@strict
class LisaQwen2Config(LisaConfigMixin, Qwen2Config):
    r"""
    A `Qwen2Config` plus the conversion specs of `LisaConfigMixin`.

    layer_types (`list[str]`): per layer, the type of its cache layer: the attention type Qwen2 gives it (from
        `use_sliding_window` and `max_window_layers`, or the source's own list), "lisa_"-prefixed for a LISA layer.
    head_dim (`int`, *optional*): `hidden_size // num_attention_heads` unless given (Qwen2's own default).
    """

    model_type = FAMILIES["qwen2"].converted_model_type

    lisa_layers: dict | None = None
    fasc_ranks: dict | None = None
    key_ranks: dict | None = None
    value_ranks: dict | None = None
    dropped_attention_layers: list | None = None
    head_dim: int | None = None

    def __post_init__(self, **kwargs):
        self.normalise_specs()
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        super().__post_init__(**kwargs)  # Qwen2's own layer_types, when the source has none
        self.layer_types = self.cache_layer_types()


__all__ = ["LisaQwen2Config"]
