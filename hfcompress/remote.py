"""Locate and import the remote-code files (modeling/, kernels/) that ship to the Hub with every converted model.

In a wheel they live under `hfcompress/remote_code/`; in a source checkout they are the top-level folders. The
files use flat relative imports (that is how transformers loads remote code), so in-process they are imported
as one synthetic package whose search path spans both folders. Only the files the model imports ship: the modules
named in the family's auto_map and, transitively, every module they import relatively (`remote_code_files`); the
kernels/ files only with a model that has a layer they serve (`uses_kernels`), and without them the modeling's guarded
kernel import is left out of the copy that ships (`write_remote_code`). One file more ships with every model that has a
LISA layer, imported by nothing: the shared layer's reference (`REFERENCE_MODULE`), that its paths are tested against.
"""

import ast
import importlib
import importlib.machinery
import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

from transformers.dynamic_module_utils import get_relative_imports

PACKAGE_NAME = "hfcompress_remote_code"
# modeling/lisa_reference.py: the shared-layer attention written plainly, for whoever checks a path of the model (a
# port, a kernel) against it; torch only, so it needs nothing else in the repo
REFERENCE_MODULE = "lisa_reference"
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


def relative_imports(path: Path) -> list[str]:
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


def remote_code_files(auto_map: dict[str, str], kernels: bool = True) -> list[Path]:
    """Every file that is copied flat into a converted model's repo: the modules named in `auto_map` (a family's) and
    those they import relatively, transitively (modeling/ first, then kernels/; with `kernels=False`, no kernels/
    module nor what only it imports). Nothing the model never imports ships."""
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
        if not kernels and paths[0].parent == folders[1]:
            continue
        found[module] = paths[0]
        pending.extend(relative_imports(paths[0]))
    return sorted(found.values(), key=lambda path: (folders.index(path.parent), path.name))


def _kernel_modules() -> set[str]:
    return {path.stem for path in kernels_dir().glob("*.py")}


def uses_kernels(config: dict) -> bool:
    """Whether a converted model's config (config.json's dict) has a layer the kernels/ code serves (the fused decode
    step of a dense-Align layer with one low-rank key per head: `configuration_lisa.uses_fused_decode`)."""
    uses_fused_decode = import_remote("configuration_lisa").uses_fused_decode
    specs = (config.get("lisa_layers") or {}).values()
    return any(uses_fused_decode(spec, config["num_attention_heads"]) for spec in specs)


def _without_kernel_imports(path: Path) -> str:
    """The source of a modeling file with each relative import of a kernels/ module replaced by `raise ImportError`:
    the copy that ships with a model that uses no kernel. transformers' remote-code loader scans a module's text for
    relative imports (try blocks and functions included) and requires every one in the repo, so the import line itself
    must go. Each such import must be the whole body of a `try` that handles ImportError: its fallback then runs."""
    source = path.read_text()
    lines = source.splitlines(keepends=True)
    kernel_modules = _kernel_modules()
    for node in ast.walk(ast.parse(source, filename=str(path))):
        body = getattr(node, "body", None)  # a statement list (a lambda's is one expression)
        imports = [s for s in body if isinstance(s, ast.ImportFrom) and s.level == 1] if isinstance(body, list) else []
        for statement in imports:
            if statement.module not in kernel_modules:
                continue
            handled = isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id == "ImportError" for h in node.handlers
            )
            if not handled or node.body != [statement] or statement.lineno != statement.end_lineno:
                raise ImportError(
                    f"{path.name}:{statement.lineno}: a kernels/ import must be a one-line `try` body that handles "
                    "ImportError (the copy shipped without the kernels replaces it)"
                )
            line = lines[statement.lineno - 1]
            indent = line[: len(line) - len(line.lstrip())]
            lines[statement.lineno - 1] = f'{indent}raise ImportError("no kernel ships with this model: no layer uses one")\n'
    return "".join(lines)


def write_remote_code(config: dict, directory: Path) -> list[str]:
    """Copy into `directory` (a converted model's repo) the remote-code files its config (config.json's dict) needs:
    `remote_code_files` of its auto_map, the kernels/ files only where `uses_kernels`, and the reference where a layer
    is a LISA layer. The names written."""
    kernels = uses_kernels(config)
    files = remote_code_files(config["auto_map"], kernels=kernels)
    if config.get("lisa_layers"):
        files.append(modeling_dir() / f"{REFERENCE_MODULE}.py")
    names = []
    for file in files:
        if kernels or not set(relative_imports(file)) & _kernel_modules():
            shutil.copy2(file, directory / file.name)
        else:
            (directory / file.name).write_text(_without_kernel_imports(file))
        names.append(file.name)
    # transformers' own scan: every module a shipped file imports relatively must ship (or loading fails)
    wanted = {module for name in names for module in get_relative_imports(directory / name)}
    if missing := wanted - {Path(name).stem for name in names}:
        raise ImportError(f"Internal error: the remote code in {directory} imports {sorted(missing)}, not shipped.")
    return names


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
