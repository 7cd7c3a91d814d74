"""What every LisaXxx configuration adds to its family's transformers config (`configuration_lisa_<family>.py`).

Shipped to the Hub as remote code next to the family's configuration file; imports only the standard library.

The family table (`FAMILIES`, below) is the one place the facts of each supported family live: its names, source model
types and transformers classes, its converted classes, its attention types (windows), biases, norms and embedding
scale. The converter (hfcompress/families), these configs and the vLLM plugin (vllm-plugin/) all read it;
it lives here because this file ships with every converted model, which may import nothing but its sibling files.

A family config is `@strict class LisaXxxConfig(LisaConfigMixin, XxxConfig)` with `model_type` its table entry's
`converted_model_type`, declaring the conversion specs as fields (`lisa_layers`, `fasc_ranks`, `key_ranks`,
`value_ranks`, `dropped_attention_layers`) and calling `normalise_specs()` first in its `__post_init__`; the mixin
gives it `attention_types` (each layer's attention type as its family names it), `projection_biases` and
`embedding_scale` from the table.

Cache layer types: a LISA layer caches low-rank keys (H heads x r) and values (KV heads), a layer with low-rank keys
(`key_ranks`) its key latent (one head of width r), and a layer with low-rank values (`value_ranks`) its value latent
(one head), which transformers' own cache layers cannot allocate; their type is the attention type with the "lisa_"
prefix ("lisa_attention" for full attention, "lisa_sliding_attention" for a sliding window), and `lisa_attention.py`
registers the cache layers of those names.
A layer whose attention is dropped caches nothing: "dropped_attention" / "dropped_sliding_attention", transformers'
DummyLayer (the attention type stays readable from the name, for the families that keep only `layer_types`).
"""

from dataclasses import dataclass

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class LisaFamily:
    """One supported family: the facts every reader of the table needs (see the module docstring)."""

    name: str  # the card's tag, the report's source.family; names the converted files (lisa_<name>, ...)
    title: str  # in messages ("the weights do not match the Qwen2 layout"); its class prefix: Lisa<title without spaces>
    model_types: tuple[str, ...]  # source config model_type values of this family
    transformers_config: str  # transformers' config class, e.g. "Qwen2Config"
    transformers_causal_lm: str  # transformers' causal-LM class: the source loader and the distillation teacher
    # config.json fields a source must define (transformers' defaults would be another model's shapes); a custom-code
    # source of an unknown model_type that has Llama's is converted as Llama
    required_fields: tuple[str, ...]
    # each layer's attention type: "full" (every layer), "window" (every layer within `sliding_window`, full when it is
    # None) or "layer_types" (the family config's own per-layer list)
    attention: str
    # q/k/v/o biases: "attention_bias" (all four per the config's field), "qkv" (q/k/v yes, o no) or "none"
    biases: str
    norm: str = "rms"  # "rms": w * x; "gemma": (1 + w) * x
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE
    sandwich_norms: bool = False  # a norm after the attention and around the MLP (Gemma 3)
    scaled_embedding: bool = False  # embeddings times sqrt(hidden_size)
    query_scale_field: str | None = None  # scores scaled by this config field ** -0.5 instead of head_dim ** -0.5
    # GGUF `general.architecture` values converted (transformers loads a "llama" GGUF named *mistral* as Mistral)
    gguf_architectures: tuple[str, ...] = ()

    # the converted model's names follow from the family's: lisa_<name>, configuration_lisa_<name>.Lisa<Title>Config, ...
    @property
    def converted_model_type(self) -> str:  # `model_type` of the converted config.json, e.g. "lisa_qwen2"
        return f"lisa_{self.name}"

    @property
    def config_module(self) -> str:  # remote-code module of the converted config, e.g. "configuration_lisa_qwen2"
        return f"configuration_lisa_{self.name}"

    @property
    def modeling_module(self) -> str:  # remote-code module of the converted model, e.g. "modeling_lisa_qwen2"
        return f"modeling_lisa_{self.name}"

    @property
    def class_prefix(self) -> str:  # "LisaQwen2", "LisaGemma3"
        return "Lisa" + self.title.replace(" ", "")

    @property
    def config_class(self) -> str:
        return f"{self.class_prefix}Config"

    @property
    def model_class(self) -> str:
        return f"{self.class_prefix}Model"

    @property
    def causal_lm_class(self) -> str:  # also config.json's `architectures`, the name vLLM serves it by
        return f"{self.class_prefix}ForCausalLM"

    @property
    def auto_map(self) -> dict[str, str]:
        """The converted config.json's auto_map: AutoConfig, AutoModel (vLLM's Transformers backend loads the base
        model) and AutoModelForCausalLM."""
        return {
            "AutoConfig": f"{self.config_module}.{self.config_class}",
            "AutoModel": f"{self.modeling_module}.{self.model_class}",
            "AutoModelForCausalLM": f"{self.modeling_module}.{self.causal_lm_class}",
        }


_BASE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

FAMILIES: dict[str, LisaFamily] = {
    family.name: family
    for family in (
        # Llama (and every source llama.cpp and transformers read as Llama, e.g. SmolLM2): full attention everywhere
        LisaFamily(
            "llama", "Llama", ("llama",), "LlamaConfig", "LlamaForCausalLM", _BASE_FIELDS,
            attention="full", biases="attention_bias", gguf_architectures=("llama",),
        ),
        # Mistral: Llama's layout without biases, an explicit head_dim, one sliding_window every layer applies
        LisaFamily(
            "mistral", "Mistral", ("mistral",), "MistralConfig", "MistralForCausalLM", _BASE_FIELDS,
            attention="window", biases="none",
        ),
        # Qwen2 / Qwen2.5: biases on q/k/v (not o), windows per layer (from use_sliding_window and max_window_layers)
        LisaFamily(
            "qwen2", "Qwen2", ("qwen2",), "Qwen2Config", "Qwen2ForCausalLM", _BASE_FIELDS,
            attention="layer_types", biases="qkv",
        ),
        # Qwen3: per-head q/k norms before RoPE, an explicit head_dim, windows per layer as Qwen2
        LisaFamily(
            "qwen3", "Qwen3", ("qwen3",), "Qwen3Config", "Qwen3ForCausalLM", (*_BASE_FIELDS, "head_dim"),
            attention="layer_types", biases="attention_bias", qk_norm=True,
        ),
        # Gemma 3 (text): (1 + w) norms, also after the attention and around the MLP, q/k norms, embeddings scaled by
        # sqrt(hidden), scores by query_pre_attn_scalar, sliding-window layers interleaved with full ones
        LisaFamily(
            "gemma3", "Gemma 3", ("gemma3_text",), "Gemma3TextConfig", "Gemma3ForCausalLM", (*_BASE_FIELDS, "head_dim"),
            attention="layer_types", biases="attention_bias", norm="gemma", qk_norm=True, sandwich_norms=True,
            scaled_embedding=True, query_scale_field="query_pre_attn_scalar", gguf_architectures=("gemma3",),
        ),
    )
}  # fmt: skip


def family_of_model_type(model_type: str) -> LisaFamily:
    """The table entry of a converted config's model_type ("lisa_qwen2")."""
    for family in FAMILIES.values():
        if family.converted_model_type == model_type:
            return family
    raise KeyError(f"'{model_type}' is not a converted model type of this LISA modeling ({sorted(FAMILIES)})")


# attention type -> cache layer type of a LISA layer of that type (the attention types this modeling implements)
LISA_CACHE_TYPES = {"full_attention": "lisa_attention", "sliding_attention": "lisa_sliding_attention"}
# attention type -> cache layer type of a layer whose attention is dropped (it caches nothing)
DROPPED_CACHE_TYPES = {"full_attention": "dropped_attention", "sliding_attention": "dropped_sliding_attention"}
ATTENTION_TYPES = {cache: attention for kinds in (LISA_CACHE_TYPES, DROPPED_CACHE_TYPES) for attention, cache in kinds.items()}
ALIGN_KINDS = ("dense", "sparse")
# what a LISA layer spec means where it leaves a key out: `hfcompress convert`'s defaults (sparse Align; a dense Align's
# FFN 16 wide). The converter writes every key, except `key_heads` where it is one low-rank key per head: a spec
# without `key_heads` means that (its default per KV group is written out), as it has since key_heads exists; and
# `source` (a sparse Align's head matching), which conversions before it did not write: None
DEFAULT_ALIGN = "sparse"
DEFAULT_DENSE_ALIGN_HIDDEN = 16


def lisa_spec(spec: dict, num_attention_heads: int) -> dict:
    """A LISA layer spec (`lisa_layers[layer]`) with every key, the left-out ones at their defaults."""
    align = spec.get("align", DEFAULT_ALIGN)
    hidden = spec.get("align_hidden", DEFAULT_DENSE_ALIGN_HIDDEN if align == "dense" else 0)
    key_heads = spec.get("key_heads", num_attention_heads)
    source = spec.get("source")
    return {
        "rank": int(spec["rank"]), "align": align, "align_hidden": int(hidden), "key_heads": int(key_heads),
        "source": None if source is None else [int(h) for h in source],
    }  # fmt: skip


def uses_fused_decode(spec: dict, num_attention_heads: int) -> bool:
    """Whether the fused GPU decode kernel (kernels/lisa_kernels.py) serves a LISA layer of this spec: dense Align with
    one low-rank key per head. A converted repo ships the kernel only if it serves one of its layers
    (hfcompress/remote.py)."""
    spec = lisa_spec(spec, num_attention_heads)
    return spec["align"] == "dense" and spec["key_heads"] == num_attention_heads


class LisaConfigMixin:
    r"""
    The conversion specs `hfcompress convert` writes into a family's config.

    lisa_layers (`dict[str, dict]`, *optional*):
        Layer index (as a string) -> LISA spec of that layer. A listed layer has no `q_proj`/`k_proj` (nor the q/k
        norms of families that have them): its pre-softmax scores are `Align(S_{l-1}) + (x W_Q^lr)(x W_K^lr)^T /
        sqrt(rank)`, where `S_{l-1}` are the previous layer's scores; that layer (its anchor) must have the same
        attention type (full or sliding window), so both see the same keys. Spec keys: `rank` (per-head rank of the
        low-rank Q/K, even), `align` ("sparse", the default: one scaled source head per head, SDPA-friendly; or
        "dense": mix across heads + FFN), `align_hidden` (hidden width of a dense Align's FFN across heads, 0 = linear
        head mix only; default 16 for dense, 0 for sparse), `key_heads` (low-rank key heads: `num_attention_heads`,
        the default, one per head; or `num_key_value_heads`, one per GQA group, read by the group's heads, so the
        layer caches H/KV times fewer low-rank keys), `source` (sparse Align only: per head, the head of layer l-1
        whose scores it reads, as the checkpoint's `align.source`; written so that a server can lay out the cache from
        config.json alone). `lisa_spec` reads a spec with these defaults.
    fasc_ranks (`dict[str, int]`, *optional*):
        Module path inside a decoder layer, e.g. `"3.mlp.down_proj"` -> rank k. That linear becomes
        `y = A (B x)` with `B: k x in` (`proj_in`) and `A: out x k` (`proj_out`).
    key_ranks (`dict[str, int]`, *optional*):
        Layer index (as a string) -> width r of that layer's key latent. The layer keeps its attention, but its keys
        (pre-RoPE, after any k_norm, all KV heads side by side: width KV x head_dim) pass through `key_latent`:
        `z = B k` (`proj_in`, r x width) is what the cache holds, and the keys the queries read are `RoPE(A z)`
        (`proj_out`, width x r), rotated at their positions in the cache (the queries of such a layer too, so only
        position differences count, as in every RoPE attention). A layer can have low-rank keys or be a LISA layer,
        not both, and a layer whose attention is dropped has none.
    value_ranks (`dict[str, int]`, *optional*):
        Layer index (as a string) -> width r of that layer's value latent. Its values (all KV heads side by side) pass
        through `value_latent`: `z = B v` (`proj_in`) is what the cache holds (one head of width r), and the values the
        attention reads are `A z` (`proj_out`). Values carry no RoPE, so any cached token's are rebuilt alike. Not on
        a LISA layer nor a dropped one; independent of `key_ranks`.
    dropped_attention_layers (`list[int]`, *optional*):
        Layers whose attention sub-block is removed (no q/k/v/o weights, no cache): the layer is its MLP part on the
        residual stream alone. Layer 0 keeps its attention, and so does the anchor of a LISA layer.
    """

    @property
    def lisa_family(self) -> LisaFamily:
        # the class's model_type: an instance may carry the source's (a kwarg of the source config's dict)
        return family_of_model_type(type(self).model_type)

    @property
    def attention_types(self) -> list[str]:
        """Per layer, its attention type ("full_attention" / "sliding_attention"), by the family's rule."""
        rule = self.lisa_family.attention
        if rule == "layer_types":  # the family config's list holds cache layer types: back to attention types
            return [ATTENTION_TYPES.get(t, t) for t in self.layer_types]
        windowed = rule == "window" and self.sliding_window is not None
        return ["sliding_attention" if windowed else "full_attention"] * self.num_hidden_layers

    @property
    def projection_biases(self) -> dict[str, bool]:
        rule = self.lisa_family.biases
        if rule == "qkv":
            return {"q_proj": True, "k_proj": True, "v_proj": True, "o_proj": False}
        return dict.fromkeys(PROJECTIONS, bool(self.attention_bias) if rule == "attention_bias" else False)

    @property
    def embedding_scale(self) -> float:
        """What the input embeddings are multiplied by (Gemma 3: sqrt(hidden_size))."""
        return self.hidden_size**0.5 if self.lisa_family.scaled_embedding else 1.0

    def normalise_specs(self) -> None:
        """JSON round trips give string keys and plain dicts; compare and look up by those."""
        self.lisa_layers = {str(k): dict(v) for k, v in (self.lisa_layers or {}).items()}
        self.fasc_ranks = {str(k): int(v) for k, v in (self.fasc_ranks or {}).items()}
        self.key_ranks = {str(k): int(v) for k, v in (self.key_ranks or {}).items()}
        self.value_ranks = {str(k): int(v) for k, v in (self.value_ranks or {}).items()}
        self.dropped_attention_layers = sorted({int(i) for i in self.dropped_attention_layers or []})

    def cache_layer_types(self) -> list[str]:
        """Per layer, the type its cache layer is built from (see the module docstring)."""
        dropped = set(self.dropped_attention_layers)
        return [
            DROPPED_CACHE_TYPES[t] if i in dropped else LISA_CACHE_TYPES[t] if self.caches_own_layout(i) else t
            for i, t in enumerate(self.attention_types)
        ]

    def caches_own_layout(self, idx: int) -> bool:
        """Whether layer idx caches keys or values of another shape than the family's (a LISA layer's low-rank keys, a
        key or value latent)."""
        return str(idx) in self.lisa_layers or str(idx) in self.key_ranks or str(idx) in self.value_ranks

    def validate_layer_type(self):
        """One attention type per layer, of those this modeling implements (the library's list of layer types does not
        hold the "lisa_" cache types)."""
        types = self.attention_types
        if len(types) != self.num_hidden_layers or not set(types) <= set(LISA_CACHE_TYPES):
            raise ValueError(f"attention types {types} must be {self.num_hidden_layers} of {sorted(LISA_CACHE_TYPES)}.")

    def validate_architecture(self):
        super().validate_architecture()
        types = self.attention_types
        for key, spec in self.lisa_layers.items():
            idx = int(key)
            if not 0 < idx < self.num_hidden_layers:
                raise ValueError(f"LISA layer {idx} must be in 1..{self.num_hidden_layers - 1} (layer 0 has no anchor)")
            if types[idx] != types[idx - 1]:
                raise ValueError(
                    f"LISA layer {idx} ({types[idx]}) cannot share the attention of layer {idx - 1} "
                    f"({types[idx - 1]}): a shared layer's anchor must have its attention type."
                )
            if int(spec["rank"]) < 0 or int(spec["rank"]) % 2:
                raise ValueError(f"LISA layer {idx}: rank must be an even number >= 0, got {spec['rank']}.")
            key_heads = lisa_spec(spec, self.num_attention_heads)["key_heads"]
            if key_heads not in (self.num_attention_heads, self.num_key_value_heads):
                raise ValueError(
                    f"LISA layer {idx}: key_heads must be num_attention_heads ({self.num_attention_heads}) or "
                    f"num_key_value_heads ({self.num_key_value_heads}), got {key_heads}."
                )
            if spec.get("align", DEFAULT_ALIGN) not in ALIGN_KINDS:
                raise ValueError(f"LISA layer {idx}: align must be 'dense' or 'sparse', got {spec['align']!r}.")
            source = lisa_spec(spec, self.num_attention_heads)["source"]
            heads = self.num_attention_heads
            if source is not None and (len(source) != heads or not all(0 <= h < heads for h in source)):
                raise ValueError(f"LISA layer {idx}: source must name one of the {heads} heads per head, got {source}.")
            if idx - 1 in self.dropped_attention_layers:
                raise ValueError(f"LISA layer {idx} cannot share the attention of layer {idx - 1}: that layer's is dropped.")
        width = self.num_key_value_heads * self.head_dim
        for key, rank in self.key_ranks.items():
            idx = int(key)
            if not 0 <= idx < self.num_hidden_layers:
                raise ValueError(f"low-rank key layer {idx} must be in 0..{self.num_hidden_layers - 1}.")
            if not 0 < rank <= width:
                raise ValueError(f"low-rank key layer {idx}: its rank must be in 1..{width} (KV heads x head_dim), got {rank}.")
            if key in self.lisa_layers:
                raise ValueError(f"layer {idx} is both a LISA layer and a low-rank key layer: it can be only one.")
            if idx in self.dropped_attention_layers:
                raise ValueError(f"layer {idx} has low-rank keys and its attention dropped: it can be only one.")
        for key, rank in self.value_ranks.items():
            idx = int(key)
            if not 0 <= idx < self.num_hidden_layers:
                raise ValueError(f"low-rank value layer {idx} must be in 0..{self.num_hidden_layers - 1}.")
            if not 0 < rank <= width:
                raise ValueError(
                    f"low-rank value layer {idx}: its rank must be in 1..{width} (KV heads x head_dim), got {rank}."
                )
            if key in self.lisa_layers:
                raise ValueError(f"layer {idx} is both a LISA layer and a low-rank value layer: it can be only one.")
            if idx in self.dropped_attention_layers:
                raise ValueError(f"layer {idx} has low-rank values and its attention dropped: it can be only one.")
        for idx in self.dropped_attention_layers:
            if not 0 < idx < self.num_hidden_layers:
                raise ValueError(f"dropped attention layer {idx} must be in 1..{self.num_hidden_layers - 1}.")
            if str(idx) in self.lisa_layers:
                raise ValueError(f"layer {idx} is both a LISA layer and a dropped attention layer: it can be only one.")
