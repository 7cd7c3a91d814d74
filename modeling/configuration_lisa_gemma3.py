"""Configuration of LisaGemma3: a Gemma 3 (text) model with LISA-shared attention layers and FASC low-rank linears.

Shipped to the Hub as remote code next to `modeling_lisa_gemma3.py`; imports only transformers and its sibling
`configuration_lisa.py` (the family table and the conversion specs every family shares).
"""

from huggingface_hub.dataclasses import strict
from transformers.models.gemma3.configuration_gemma3 import Gemma3TextConfig

from .configuration_lisa import FAMILIES, LISA_CACHE_TYPES, LisaConfigMixin


@strict
class LisaGemma3Config(LisaConfigMixin, Gemma3TextConfig):
    r"""
    A `Gemma3TextConfig` plus the conversion specs of `LisaConfigMixin`.

    layer_types (`list[str]`): per layer, the type of its cache layer: the attention type Gemma 3 gives it (its own
        list, or every `sliding_window_pattern`-th layer full), "lisa_"-prefixed for a LISA layer.
    rope_parameters (`dict`): nested by attention type ("full_attention", "sliding_attention"), as Gemma 3's.
    """

    model_type = FAMILIES["gemma3"].converted_model_type
    # the RoPE entries are named by attention type, not by the cache layer types of `layer_types`
    _rope_type_labels = tuple(LISA_CACHE_TYPES)

    lisa_layers: dict | None = None
    fasc_ranks: dict | None = None
    key_ranks: dict | None = None
    value_ranks: dict | None = None
    dropped_attention_layers: list | None = None

    def __post_init__(self, **kwargs):
        self.normalise_specs()
        super().__post_init__(**kwargs)  # Gemma 3's own layer_types, when the source has none
        self.layer_types = self.cache_layer_types()

    def validate_architecture(self):
        super().validate_architecture()
        # what this modeling does not implement (no released Gemma 3 text model sets them)
        unsupported = {
            "attn_logit_softcapping": self.attn_logit_softcapping,
            "final_logit_softcapping": self.final_logit_softcapping,
            "use_bidirectional_attention": self.use_bidirectional_attention or None,
        }
        given = [f"{key}={value}" for key, value in unsupported.items() if value is not None]
        if given:
            raise ValueError(f"LisaGemma3 does not implement {', '.join(given)}.")


__all__ = ["LisaGemma3Config"]
