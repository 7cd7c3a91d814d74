"""The converted configs as vLLM reads them: the remote code's own config classes (modeling/configuration_lisa_*.py, the
copy bundled in this plugin's wheel, imported in-process by remote_config.py; no trust_remote_code), each with the
checks of what this plugin serves.

Before anything else, while vLLM parses config.json (`from_dict`): the installed vLLM must be of the supported range and
the model's converter of this plugin's version (versions.py), each refusal one sentence naming what to install.

`layer_types` of a converted config names cache layer types ("lisa_attention", "dropped_sliding_attention", ...); for
vLLM (and, for the families that keep a `layer_types` field, the family config of vLLM's transformers) it is turned back
into attention types, and the conversion's own view is kept in `lisa_cache_types`.

What the plugin cannot serve is refused here, while vLLM parses config.json (before it builds the model or allocates
any memory), with one sentence that names config.json, the layers, and the conversion option to use instead. That
includes a model whose LISA layers state no `source` (the head matching the cache layout follows, written into
config.json since this version): the plugin lays out the cache from config.json alone, never from the weights.

The families served are those of the remote code's family table (`configuration_lisa.FAMILIES`): one config class
each, `CONFIG_CLASSES`.
"""

from huggingface_hub.dataclasses import strict

from .remote_config import import_remote
from .versions import VersionMismatch, check_converter, check_vllm

_lisa = import_remote("configuration_lisa")
# the spec keys of a LISA layer the modeling (and this plugin) implements
LISA_SPEC_KEYS = set(_lisa.lisa_spec({"rank": 0}, 1))
# layer type of a converted config (an attention type, or a LISA / dropped cache layer type) -> attention type
CACHE_TYPES = {**{t: t for t in _lisa.LISA_CACHE_TYPES}, **_lisa.ATTENTION_TYPES}


class UnservableModel(ValueError):
    """A converted model (or a config field) this plugin cannot serve; the message is one sentence for the user."""


class LisaServableMixin:
    """Before a remote config's own __post_init__: refuses unknown layer kinds and hands the family config attention
    types; after it: refuses what the plugin cannot serve, and keeps the cache layer types in `lisa_cache_types`."""

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        # config.json as vLLM (AutoConfig.from_pretrained) reads it; not a config built in code (transformers builds
        # default instances, e.g. in to_diff_dict, that state no converter version)
        try:
            check_vllm()
            check_converter(config_dict)
        except VersionMismatch as err:
            raise UnservableModel(str(err)) from None
        return super().from_dict(config_dict, **kwargs)

    def __post_init__(self, **kwargs):
        types = vars(self).get("layer_types")  # a field in the families that keep one (Qwen2, Qwen3, Gemma 3)
        if types is not None:
            self.layer_types = self.attention_types_of(types)
        super().__post_init__(**kwargs)
        self.lisa_cache_types = self.cache_layer_types()
        if "layer_types" in vars(self):  # the remote config wrote its cache layer types back
            self.layer_types = self.attention_types_of(self.layer_types)
        self.check_servable()

    @staticmethod
    def attention_types_of(types: list[str]) -> list[str]:
        unknown = sorted(set(types) - set(CACHE_TYPES))
        if unknown:
            raise UnservableModel(
                f"config.json: layer_types {unknown} are layer kinds this hfcompress vLLM plugin does not serve; "
                "install the hfcompress-vllm release of the hfcompress version that converted the model."
            )
        return [CACHE_TYPES[t] for t in types]

    def check_servable(self) -> None:
        n = self.num_hidden_layers
        dense, unknown = [], {}
        for key, spec in self.lisa_layers.items():
            extra = set(spec) - LISA_SPEC_KEYS
            if extra:
                unknown[key] = sorted(extra)
            align = spec.get("align", _lisa.DEFAULT_ALIGN)
            if align == "dense":
                dense.append(int(key))
            elif align != "sparse":
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
        unstated = sorted(int(k) for k, spec in self.lisa_layers.items() if spec.get("source") is None)
        if unstated:
            raise UnservableModel(
                f"config.json: lisa_layers {unstated} state no `source` (the head matching their KV cache is laid out "
                "by): the model was converted by an hfcompress older than this plugin; convert it again with this one."
            )
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


def served(remote_module: str, remote_class: str) -> type:
    """The remote config class with this plugin's checks (a module-level class of this module: vLLM pickles configs)."""
    base = getattr(import_remote(remote_module), remote_class)
    cls = strict(type(f"Vllm{remote_class}", (LisaServableMixin, base), {"__module__": __name__}))
    globals()[cls.__name__] = cls
    return cls


FAMILIES = _lisa.FAMILIES  # the one family table
LisaFamily = _lisa.LisaFamily
# converted model_type -> its config class with this plugin's checks
CONFIG_CLASSES = {
    family.converted_model_type: served(family.config_module, family.config_class) for family in FAMILIES.values()
}
