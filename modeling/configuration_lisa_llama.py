"""Configuration of LisaLlama: a Llama model with LISA-shared attention layers and FASC low-rank linears.

Shipped to the Hub as remote code next to `modeling_lisa_llama.py`; imports only transformers.
"""

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig


@strict
class LisaLlamaConfig(LlamaConfig):
    r"""
    A `LlamaConfig` plus two conversion specs written by `hfcompress convert`.

    lisa_layers (`dict[str, dict]`, *optional*):
        Layer index (as a string) -> LISA spec of that layer. A listed layer has no `q_proj`/`k_proj`: its
        pre-softmax scores are `Align(S_{l-1}) + (x W_Q^lr)(x W_K^lr)^T / sqrt(rank)`, where `S_{l-1}` are the
        previous layer's scores. Spec keys: `rank` (per-head rank of the low-rank Q/K, even),
        `align_hidden` (hidden width of the FFN across heads, 0 = linear head mix only), `align` ("dense",
        the default: mix across heads + FFN; or "sparse": one scaled source head per head, SDPA-friendly).
    fasc_ranks (`dict[str, int]`, *optional*):
        Module path inside a decoder layer, e.g. `"3.mlp.down_proj"` -> rank k. That linear becomes
        `y = A (B x)` with `B: k x in` (`proj_in`) and `A: out x k` (`proj_out`).
    """

    model_type = "lisa_llama"

    lisa_layers: dict | None = None
    fasc_ranks: dict | None = None

    def __post_init__(self, **kwargs):
        self.lisa_layers = {str(k): dict(v) for k, v in (self.lisa_layers or {}).items()}
        self.fasc_ranks = {str(k): int(v) for k, v in (self.fasc_ranks or {}).items()}
        super().__post_init__(**kwargs)

    @property
    def layer_types(self) -> list[str]:
        """Per layer, its cache layer type: "lisa_attention" for a LISA layer (its keys are H low-rank heads, its
        values the KV heads: it needs the cache layers `modeling_lisa_llama.py` registers under that name), else
        "full_attention". transformers' caches (`DynamicCache(config=...)`, `StaticCache`) build layers from it."""
        layers = range(self.num_hidden_layers)
        return ["lisa_attention" if str(i) in self.lisa_layers else "full_attention" for i in layers]

    def validate_layer_type(self):
        """Nothing to check: `layer_types` follows from `lisa_layers`, and the library's list of layer types does not
        hold this model's own "lisa_attention"."""

    def validate_architecture(self):
        super().validate_architecture()
        for key, spec in self.lisa_layers.items():
            idx = int(key)
            if not 0 < idx < self.num_hidden_layers:
                raise ValueError(f"LISA layer {idx} must be in 1..{self.num_hidden_layers - 1} (layer 0 has no anchor).")
            if int(spec["rank"]) < 0 or int(spec["rank"]) % 2:
                raise ValueError(f"LISA layer {idx}: rank must be an even number >= 0, got {spec['rank']}.")
            if spec.get("align", "dense") not in ("dense", "sparse"):
                raise ValueError(f"LISA layer {idx}: align must be 'dense' or 'sparse', got {spec['align']!r}.")


__all__ = ["LisaLlamaConfig"]
