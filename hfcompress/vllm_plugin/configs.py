"""The converted configs as vLLM reads them (transformers of vLLM's environment, no remote code imported).

Each is the family's transformers config plus the conversion specs (`lisa_layers`, `fasc_ranks`,
`dropped_attention_layers`). `layer_types` of a converted config names cache layer types ("lisa_attention",
"dropped_sliding_attention", ...); here it is turned back into attention types, which vLLM and the family config
understand, and the conversion's own view is kept in `lisa_cache_types`.

What the plugin cannot serve is refused here, while vLLM parses config.json (before it builds the model or allocates
any memory), with one sentence that names config.json, the layers, and the conversion option to use instead.
"""

from huggingface_hub.dataclasses import strict
from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

# the spec keys of a LISA layer this plugin implements (modeling/configuration_lisa.py of this hfcompress)
LISA_SPEC_KEYS = {"rank", "align", "align_hidden", "key_heads"}
# cache layer type of a converted config -> attention type
CACHE_TYPES = {
    "full_attention": "full_attention",
    "sliding_attention": "sliding_attention",
    "lisa_attention": "full_attention",
    "lisa_sliding_attention": "sliding_attention",
    "dropped_attention": "full_attention",
    "dropped_sliding_attention": "sliding_attention",
}


class UnservableModel(ValueError):
    """A converted model (or a config field) this plugin cannot serve; the message is one sentence for the user."""


class LisaSpecsMixin:
    """Normalises and checks the conversion specs (a family config calls `lisa_setup()` first in __post_init__)."""

    def lisa_setup(self) -> None:
        self.lisa_layers = {str(k): dict(v) for k, v in (self.lisa_layers or {}).items()}
        self.fasc_ranks = {str(k): int(v) for k, v in (self.fasc_ranks or {}).items()}
        self.dropped_attention_layers = sorted({int(i) for i in self.dropped_attention_layers or []})
        types = getattr(self, "layer_types", None)
        if types is not None:
            unknown = sorted(set(types) - set(CACHE_TYPES))
            if unknown:
                raise UnservableModel(
                    f"config.json: layer_types {unknown} are layer kinds this hfcompress vLLM plugin does not serve; "
                    "upgrade hfcompress (pip install -U 'hfcompress[vllm]') to the version that converted the model."
                )
            self.lisa_cache_types = list(types)
            self.layer_types = [CACHE_TYPES[t] for t in types]
        self.check_servable()

    def check_servable(self) -> None:
        n = self.num_hidden_layers
        dense, unknown = [], {}
        for key, spec in self.lisa_layers.items():
            extra = set(spec) - LISA_SPEC_KEYS
            if extra:
                unknown[key] = sorted(extra)
            if spec.get("align", "dense") == "dense":
                dense.append(int(key))
            elif spec.get("align") != "sparse":
                unknown[key] = [f"align={spec.get('align')!r}"]
        if unknown:
            raise UnservableModel(
                f"config.json: lisa_layers {unknown} use spec fields this hfcompress vLLM plugin does not know (a "
                "different modeling version); serve it with the hfcompress version that converted it, or convert again."
            )
        if dense:
            raise UnservableModel(
                f"config.json: lisa_layers {sorted(dense)} use dense Align (an FFN over attention scores), which no "
                "vLLM attention backend can compute; convert again with `hfcompress convert --lisa-align sparse` (the "
                "default) to serve the model in vLLM."
            )
        bad = [k for k in self.lisa_layers if not 0 < int(k) < n] + [i for i in self.dropped_attention_layers if not 0 < i < n]
        if bad:
            raise UnservableModel(f"config.json: layers {bad} of lisa_layers / dropped_attention_layers are outside 1..{n - 1}.")
        for key, spec in self.lisa_layers.items():
            idx = int(key)
            if idx - 1 in self.dropped_attention_layers or idx in self.dropped_attention_layers:
                raise UnservableModel(
                    f"config.json: LISA layer {idx} shares the attention of a dropped-attention layer (or is one); "
                    "convert again with this hfcompress."
                )
            kh = int(spec.get("key_heads", self.num_attention_heads))
            if kh not in (self.num_attention_heads, self.num_key_value_heads) or int(spec["rank"]) % 2:
                raise UnservableModel(f"config.json: lisa_layers['{key}'] {spec} is not a valid LISA spec for this model.")

    @property
    def attention_types(self) -> list[str]:
        types = getattr(self, "layer_types", None)
        if types is not None:
            return list(types)
        window = getattr(self, "sliding_window", None)
        return ["sliding_attention" if window is not None else "full_attention"] * self.num_hidden_layers


@strict
class VllmLisaLlamaConfig(LisaSpecsMixin, LlamaConfig):
    model_type = "lisa_llama"
    lisa_layers: dict | None = None
    fasc_ranks: dict | None = None
    dropped_attention_layers: list | None = None

    def __post_init__(self, **kwargs):
        self.lisa_setup()
        super().__post_init__(**kwargs)

    @property
    def attention_types(self) -> list[str]:
        return ["full_attention"] * self.num_hidden_layers

    @property
    def projection_biases(self) -> dict[str, bool]:
        return dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), self.attention_bias)


@strict
class VllmLisaMistralConfig(LisaSpecsMixin, MistralConfig):
    model_type = "lisa_mistral"
    lisa_layers: dict | None = None
    fasc_ranks: dict | None = None
    dropped_attention_layers: list | None = None

    def __post_init__(self, **kwargs):
        self.lisa_setup()
        super().__post_init__(**kwargs)

    @property
    def attention_types(self) -> list[str]:
        return ["sliding_attention" if self.sliding_window is not None else "full_attention"] * self.num_hidden_layers

    @property
    def projection_biases(self) -> dict[str, bool]:
        return dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), False)


@strict
class VllmLisaQwen2Config(LisaSpecsMixin, Qwen2Config):
    model_type = "lisa_qwen2"
    lisa_layers: dict | None = None
    fasc_ranks: dict | None = None
    dropped_attention_layers: list | None = None
    head_dim: int | None = None

    def __post_init__(self, **kwargs):
        self.lisa_setup()
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        super().__post_init__(**kwargs)

    @property
    def projection_biases(self) -> dict[str, bool]:
        return {"q_proj": True, "k_proj": True, "v_proj": True, "o_proj": False}


@strict
class VllmLisaQwen3Config(LisaSpecsMixin, Qwen3Config):
    model_type = "lisa_qwen3"
    lisa_layers: dict | None = None
    fasc_ranks: dict | None = None
    dropped_attention_layers: list | None = None

    def __post_init__(self, **kwargs):
        self.lisa_setup()
        super().__post_init__(**kwargs)

    @property
    def projection_biases(self) -> dict[str, bool]:
        return dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), self.attention_bias)


@strict
class VllmLisaGemma3Config(LisaSpecsMixin, Gemma3TextConfig):
    model_type = "lisa_gemma3"
    lisa_layers: dict | None = None
    fasc_ranks: dict | None = None
    dropped_attention_layers: list | None = None

    def __post_init__(self, **kwargs):
        self.lisa_setup()
        super().__post_init__(**kwargs)

    @property
    def projection_biases(self) -> dict[str, bool]:
        return dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), self.attention_bias)


CONFIG_CLASSES = {
    cls.model_type: cls
    for cls in (VllmLisaLlamaConfig, VllmLisaMistralConfig, VllmLisaQwen2Config, VllmLisaQwen3Config, VllmLisaGemma3Config)
}
