"""What every LisaXxx configuration adds to its family's transformers config (`configuration_lisa_<family>.py`).

Shipped to the Hub as remote code next to the family's configuration file; imports nothing.

A family config is `@strict class LisaXxxConfig(LisaConfigMixin, XxxConfig)` declaring the two conversion specs as
fields (`lisa_layers`, `fasc_ranks`), calling `normalise_specs()` first in its `__post_init__`, and defining
`attention_types` (each layer's attention type as its family names it) and `projection_biases`.

Cache layer types: a LISA layer caches low-rank keys (H heads x r) and values (KV heads), which transformers' own cache
layers cannot allocate; its type is its attention type with the "lisa_" prefix ("lisa_attention" for full attention,
"lisa_sliding_attention" for a sliding window), and `lisa_attention.py` registers the cache layers of those names.
A layer whose attention is dropped caches nothing: "dropped_attention" / "dropped_sliding_attention", transformers'
DummyLayer (the attention type stays readable from the name, for the families that keep only `layer_types`).
"""

# attention type -> cache layer type of a LISA layer of that type (the attention types this modeling implements)
LISA_CACHE_TYPES = {"full_attention": "lisa_attention", "sliding_attention": "lisa_sliding_attention"}
# attention type -> cache layer type of a layer whose attention is dropped (it caches nothing)
DROPPED_CACHE_TYPES = {"full_attention": "dropped_attention", "sliding_attention": "dropped_sliding_attention"}
ATTENTION_TYPES = {cache: attention for kinds in (LISA_CACHE_TYPES, DROPPED_CACHE_TYPES) for attention, cache in kinds.items()}
ALIGN_KINDS = ("dense", "sparse")
# what a LISA layer spec means where it leaves a key out: `hfcompress convert`'s defaults (sparse Align; a dense Align's
# FFN 16 wide). The converter writes every key, except `key_heads` where it is one low-rank key per head: a spec
# without `key_heads` means that (its default per KV group is written out), as it has since key_heads exists
DEFAULT_ALIGN = "sparse"
DEFAULT_DENSE_ALIGN_HIDDEN = 16


def lisa_spec(spec: dict, num_attention_heads: int) -> dict:
    """A LISA layer spec (`lisa_layers[layer]`) with every key, the left-out ones at their defaults."""
    align = spec.get("align", DEFAULT_ALIGN)
    hidden = spec.get("align_hidden", DEFAULT_DENSE_ALIGN_HIDDEN if align == "dense" else 0)
    key_heads = spec.get("key_heads", num_attention_heads)
    return {"rank": int(spec["rank"]), "align": align, "align_hidden": int(hidden), "key_heads": int(key_heads)}


def uses_fused_decode(spec: dict, num_attention_heads: int) -> bool:
    """Whether the fused GPU decode kernel (kernels/lisa_kernels.py) serves a LISA layer of this spec: dense Align with
    one low-rank key per head. A converted repo ships the kernel only if it serves one of its layers
    (hfcompress/remote.py)."""
    spec = lisa_spec(spec, num_attention_heads)
    return spec["align"] == "dense" and spec["key_heads"] == num_attention_heads


class LisaConfigMixin:
    r"""
    The two conversion specs `hfcompress convert` writes into a family's config.

    lisa_layers (`dict[str, dict]`, *optional*):
        Layer index (as a string) -> LISA spec of that layer. A listed layer has no `q_proj`/`k_proj` (nor the q/k
        norms of families that have them): its pre-softmax scores are `Align(S_{l-1}) + (x W_Q^lr)(x W_K^lr)^T /
        sqrt(rank)`, where `S_{l-1}` are the previous layer's scores; that layer (its anchor) must have the same
        attention type (full or sliding window), so both see the same keys. Spec keys: `rank` (per-head rank of the
        low-rank Q/K, even), `align` ("sparse", the default: one scaled source head per head, SDPA-friendly; or
        "dense": mix across heads + FFN), `align_hidden` (hidden width of a dense Align's FFN across heads, 0 = linear
        head mix only; default 16 for dense, 0 for sparse), `key_heads` (low-rank key heads: `num_attention_heads`,
        the default, one per head; or `num_key_value_heads`, one per GQA group, read by the group's heads, so the
        layer caches H/KV times fewer low-rank keys). `lisa_spec` reads a spec with these defaults.
    fasc_ranks (`dict[str, int]`, *optional*):
        Module path inside a decoder layer, e.g. `"3.mlp.down_proj"` -> rank k. That linear becomes
        `y = A (B x)` with `B: k x in` (`proj_in`) and `A: out x k` (`proj_out`).
    dropped_attention_layers (`list[int]`, *optional*):
        Layers whose attention sub-block is removed (no q/k/v/o weights, no cache): the layer is its MLP part on the
        residual stream alone. Layer 0 keeps its attention, and so does the anchor of a LISA layer.
    """

    def normalise_specs(self) -> None:
        """JSON round trips give string keys and plain dicts; compare and look up by those."""
        self.lisa_layers = {str(k): dict(v) for k, v in (self.lisa_layers or {}).items()}
        self.fasc_ranks = {str(k): int(v) for k, v in (self.fasc_ranks or {}).items()}
        self.dropped_attention_layers = sorted({int(i) for i in self.dropped_attention_layers or []})

    def cache_layer_types(self) -> list[str]:
        """Per layer, the type its cache layer is built from (see the module docstring)."""
        dropped = set(self.dropped_attention_layers)
        return [
            DROPPED_CACHE_TYPES[t] if i in dropped else LISA_CACHE_TYPES[t] if str(i) in self.lisa_layers else t
            for i, t in enumerate(self.attention_types)
        ]

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
            if idx - 1 in self.dropped_attention_layers:
                raise ValueError(f"LISA layer {idx} cannot share the attention of layer {idx - 1}: that layer's is dropped.")
        for idx in self.dropped_attention_layers:
            if not 0 < idx < self.num_hidden_layers:
                raise ValueError(f"dropped attention layer {idx} must be in 1..{self.num_hidden_layers - 1}.")
            if str(idx) in self.lisa_layers:
                raise ValueError(f"layer {idx} is both a LISA layer and a dropped attention layer: it can be only one.")
