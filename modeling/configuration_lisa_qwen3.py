"""Configuration of LisaQwen3: a Qwen3 model with LISA-shared attention layers and FASC low-rank linears.

Shipped to the Hub as remote code next to `modeling_lisa_qwen3.py`; imports only transformers and its sibling
`configuration_lisa.py` (the conversion specs every family shares).
"""

from huggingface_hub.dataclasses import strict
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from .configuration_lisa import ATTENTION_TYPES, LisaConfigMixin


@strict
class LisaQwen3Config(LisaConfigMixin, Qwen3Config):
    r"""
    A `Qwen3Config` plus `lisa_layers`, `fasc_ranks` and `dropped_attention_layers` (see `LisaConfigMixin`).

    layer_types (`list[str]`): per layer, the type of its cache layer: the attention type Qwen3 gives it (from
        `use_sliding_window` and `max_window_layers`, or the source's own list), "lisa_"-prefixed for a LISA layer.
    """

    model_type = "lisa_qwen3"

    lisa_layers: dict | None = None
    fasc_ranks: dict | None = None
    dropped_attention_layers: list | None = None

    def __post_init__(self, **kwargs):
        self.normalise_specs()
        super().__post_init__(**kwargs)  # Qwen3's own layer_types, when the source has none
        self.layer_types = self.cache_layer_types()

    @property
    def attention_types(self) -> list[str]:
        return [ATTENTION_TYPES.get(t, t) for t in self.layer_types]

    @property
    def projection_biases(self) -> dict[str, bool]:
        return dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), self.attention_bias)


__all__ = ["LisaQwen3Config"]
