"""Model families: what hfcompress needs to know about a source architecture.

The facts of each family (its names, source model types and transformers classes, the converted model's classes,
model_type and auto_map, the config fields a source must define, the llama.cpp GGUF architectures that load as it,
its attention types, biases and norms) live in ONE table, `FAMILIES` of the remote code's `configuration_lisa.py`,
which the converted model's configuration and the vLLM plugin read too; it lives there because that file ships to the
Hub with every converted model and may import only its siblings. `Family` (below) is a table entry with what only
the converter does with it: import its transformers and remote-code classes. Every Llama-specific point of the tool
(source checks and loading, checkpoint layout, GGUF dequantising, the streamed layers, the converted config and its
remote code, the whole-model teacher, the card's tag) asks the family of the source config's `model_type`
(`family_for`). A new family is an entry in that table plus its `modeling/` files; the driver does not change.
"""

import dataclasses
import importlib
from types import ModuleType

from ..errors import HfcompressError
from ..remote import import_remote

LisaFamily = import_remote("configuration_lisa").LisaFamily


@dataclasses.dataclass(frozen=True)
class Family(LisaFamily):
    """A family of the table, with the converter's imports of its classes."""

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
    table = import_remote("configuration_lisa").FAMILIES
    fields = [f.name for f in dataclasses.fields(LisaFamily)]
    return {name: Family(**{f: getattr(entry, f) for f in fields}) for name, entry in table.items()}


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
