"""Locate and import the remote-code files (modeling/, kernels/) that ship to the Hub with every converted model.

In a wheel they live under `hfcompress/remote_code/`; in a source checkout they are the top-level folders. The
files use flat relative imports (that is how transformers loads remote code), so in-process they are imported
as one synthetic package whose search path spans both folders. Only the files the model imports ship: the modules
named in the family's auto_map and, transitively, every module they import relatively (`remote_code_files`).
"""

import ast
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


def _relative_imports(path: Path) -> list[str]:
    """Module names this file imports relatively (`from .x import y`, `from . import x`), anywhere in it (also
    inside try/except, as the guarded kernel import is)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level != 1 or "." in (node.module or ""):
                dots = "." * node.level
                raise ImportError(f"{path.name}: remote code imports its siblings flat, not '{dots}{node.module}'")
            names.extend([node.module] if node.module else [alias.name for alias in node.names])
    return names


def remote_code_files(auto_map: dict[str, str]) -> list[Path]:
    """Every file that is copied flat into a converted model's repo: the modules named in `auto_map` (a family's) and
    those they import relatively, transitively (modeling/ first, then kernels/). Nothing the model never imports
    ships."""
    folders = [modeling_dir(), kernels_dir()]
    found: dict[str, Path] = {}
    pending = sorted({ref.split(".")[0] for ref in auto_map.values()})
    while pending:
        module = pending.pop()
        if module in found:
            continue
        paths = [folder / f"{module}.py" for folder in folders if (folder / f"{module}.py").is_file()]
        if len(paths) != 1:
            where = " and ".join(str(f) for f in folders)
            raise FileNotFoundError(f"remote-code module '{module}' found {len(paths)} times in {where} (expected once)")
        found[module] = paths[0]
        pending.extend(_relative_imports(paths[0]))
    return sorted(found.values(), key=lambda path: (folders.index(path.parent), path.name))


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
