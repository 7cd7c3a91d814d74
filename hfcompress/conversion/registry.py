"""The methods and finishers the driver runs: importing their modules registers them (methods.register)."""

from .. import distill, fasc, keys, lisa
from .methods import FINISHERS, METHODS, Finisher, Method


def build_methods(options) -> tuple[list[Method], list[Finisher]]:
    """Every registered method in apply order, built from `options` (ConvertOptions), and the finishers the options
    turn on."""
    methods = [cls.from_options(options) for cls in sorted(METHODS.values(), key=lambda cls: cls.order)]
    finishers = [f for f in (cls.from_options(options) for cls in FINISHERS.values()) if f is not None]
    return methods, finishers
