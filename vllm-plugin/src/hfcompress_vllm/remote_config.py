"""The remote code's configuration files (configuration_lisa.py: the family table and the LISA specs;
configuration_lisa_<family>.py: each family's config class), imported in-process as one synthetic package.

Where they come from: the wheel of this plugin bundles the converter's modeling/ folder at build time (hatch_build.py
copies it to `hfcompress_vllm/remote_code/`), so the plugin reads the very table the converter of the same version
wrote its models with, without importing hfcompress (whose transformers range excludes vLLM's). Reading the files a
converted model ships instead would need the model's directory before vLLM has parsed its config.json (the config
classes must be registered first), and a Hub id may have none on disk yet. In a source checkout (an editable install)
the files are the top-level modeling/ folder itself.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACKAGE_NAME = "hfcompress_vllm_remote_code"
_HERE = Path(__file__).resolve().parent


def modeling_dir() -> Path:
    """The bundled copy (a wheel), else modeling/ of the checkout this package lies in (src/hfcompress_vllm)."""
    for candidate in (_HERE / "remote_code", _HERE.parents[2] / "modeling"):
        if (candidate / "configuration_lisa.py").is_file():
            return candidate
    raise ImportError("hfcompress-vllm is installed without its remote-code configuration files; reinstall it.")


def import_remote(module: str) -> ModuleType:
    """One remote-code module, e.g. `import_remote("configuration_lisa")` (its flat relative imports resolve within
    the same folder, as transformers resolves them in a model's repo)."""
    if PACKAGE_NAME not in sys.modules:
        spec = importlib.machinery.ModuleSpec(PACKAGE_NAME, None, is_package=True)
        spec.submodule_search_locations = [str(modeling_dir())]
        sys.modules[PACKAGE_NAME] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"{PACKAGE_NAME}.{module}")
