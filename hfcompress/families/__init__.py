"""Model families: what hfcompress needs to know about a source architecture, one module per family.

A family (`Family`, below) names the source's transformers classes, the remote-code modules and classes of its
converted model, the converted `model_type` and `auto_map`, the config fields a source must define, the llama.cpp GGUF
architectures that load as it, and the classes `stream.LayerStream` builds layers and the head from (the converted
model's own behaviour, e.g. Qwen2's biases or windows, lives in its remote-code config and modeling files). Every Llama-specific point of the tool (source checks and loading, checkpoint layout, GGUF
dequantising, the streamed layers, the converted config and its remote code, the whole-model teacher, the card's
tag) asks the family of the source config's `model_type` (`family_for`). A new family is a module here with a
`FAMILY` and its entry in `FAMILIES`, plus its `modeling/` files; the driver does not change.
"""

import importlib
from dataclasses import dataclass
from types import ModuleType

from ..errors import HfcompressError
from ..remote import import_remote


@dataclass(frozen=True)
class Family:
    name: str  # the card's tag, the report's source.family
    title: str  # in messages: "the weights do not match the Qwen2 layout"
    model_types: tuple[str, ...]  # source config model_type values of this family
    transformers_config: str  # transformers' config class, e.g. "Qwen2Config"
    transformers_causal_lm: str  # transformers' causal-LM class: the source loader and the distillation teacher
    # config.json fields a source must define (transformers' defaults would be another model's shapes); a custom-code
    # source of an unknown model_type that has Llama's is converted as Llama
    required_fields: tuple[str, ...]
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
    def _class_prefix(self) -> str:  # "LisaQwen2", "LisaGemma3"
        return "Lisa" + self.title.replace(" ", "")

    @property
    def config_class(self) -> str:
        return f"{self._class_prefix}Config"

    @property
    def model_class(self) -> str:
        return f"{self._class_prefix}Model"

    @property
    def causal_lm_class(self) -> str:
        return f"{self._class_prefix}ForCausalLM"

    @property
    def auto_map(self) -> dict[str, str]:
        """The converted config.json's auto_map: AutoConfig, AutoModel (vLLM's Transformers backend loads the base
        model) and AutoModelForCausalLM."""
        return {
            "AutoConfig": f"{self.config_module}.{self.config_class}",
            "AutoModel": f"{self.modeling_module}.{self.model_class}",
            "AutoModelForCausalLM": f"{self.modeling_module}.{self.causal_lm_class}",
        }

    def transformers_classes(self) -> tuple[type, type]:
        """(config class, causal-LM class) of the source in transformers."""
        transformers = importlib.import_module("transformers")
        return getattr(transformers, self.transformers_config), getattr(transformers, self.transformers_causal_lm)

    def modeling(self) -> ModuleType:
        return import_remote(self.modeling_module)

    def remote_classes(self) -> tuple[type, type]:
        """(converted config class, converted causal-LM class) from the remote-code files."""
        config_class = getattr(import_remote(self.config_module), self.config_class)
        return config_class, getattr(self.modeling(), self.causal_lm_class)

    def describe(self) -> str:
        return f"{self.model_types[0]} ({self.transformers_causal_lm})"


def _families() -> dict[str, Family]:
    from . import gemma3, llama, mistral, qwen2, qwen3

    return {module.FAMILY.name: module.FAMILY for module in (llama, mistral, qwen2, qwen3, gemma3)}


FAMILIES: dict[str, Family] = _families()
SUPPORTED_MODEL_TYPES = {t: family for family in FAMILIES.values() for t in family.model_types}
SUPPORTED_GGUF_ARCHITECTURES = tuple(a for family in FAMILIES.values() for a in family.gguf_architectures)


def supported() -> str:
    """The supported families, for refusals: "llama (LlamaForCausalLM), mistral (MistralForCausalLM), ..."."""
    return ", ".join(family.describe() for family in FAMILIES.values())


def family_for(model_type: str | None) -> Family:
    """The family of a source (or converted) config's model_type; refuses an unsupported one by name."""
    for family in FAMILIES.values():
        if model_type in family.model_types or model_type == family.converted_model_type:
            return family
    raise HfcompressError(f"'{model_type}' models cannot be converted; hfcompress supports only: {supported()}.")


def family_of(config) -> Family:
    """The family of a loaded transformers config (source or converted), by its class: a custom-code source read as
    LlamaConfig keeps its own model_type on the instance."""
    return family_for(type(config).model_type)
