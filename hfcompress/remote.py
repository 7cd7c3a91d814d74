"""Locate and import the remote-code files (modeling/, kernels/) that ship to the Hub with every converted model.

In a wheel they live under `hfcompress/remote_code/`; in a source checkout they are the top-level folders. The
files use flat relative imports (that is how transformers loads remote code), so in-process they are imported
as one synthetic package whose search path spans both folders.
"""

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACKAGE_NAME = "hfcompress_remote_code"
_HERE = Path(__file__).resolve().parent


def _find_dir(name: str) -> Path:
    for candidate in (_HERE / "remote_code" / name, _HERE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"hfcompress is installed without its '{name}' folder; reinstall the package.")


def modeling_dir() -> Path:
    return _find_dir("modeling")


def kernels_dir() -> Path:
    return _find_dir("kernels")


def cards_dir() -> Path:
    return _find_dir("cards")


def remote_code_files() -> list[Path]:
    """Every file that is copied flat into a converted model's repo."""
    return sorted(modeling_dir().glob("*.py")) + sorted(kernels_dir().glob("*.py"))


def _package() -> ModuleType:
    if PACKAGE_NAME not in sys.modules:
        spec = importlib.machinery.ModuleSpec(PACKAGE_NAME, None, is_package=True)
        spec.submodule_search_locations = [str(modeling_dir()), str(kernels_dir())]
        sys.modules[PACKAGE_NAME] = importlib.util.module_from_spec(spec)
    return sys.modules[PACKAGE_NAME]


def import_remote(module: str) -> ModuleType:
    """Import one remote-code module, e.g. `import_remote("modeling_lisa_llama")`."""
    _package()
    return importlib.import_module(f"{PACKAGE_NAME}.{module}")


def lisa_classes():
    """(LisaLlamaConfig, LisaLlamaForCausalLM) from the remote-code files."""
    config_module = import_remote("configuration_lisa_llama")
    modeling_module = import_remote("modeling_lisa_llama")
    return config_module.LisaLlamaConfig, modeling_module.LisaLlamaForCausalLM


AUTO_MAP = {
    "AutoConfig": "configuration_lisa_llama.LisaLlamaConfig",
    "AutoModelForCausalLM": "modeling_lisa_llama.LisaLlamaForCausalLM",
}
