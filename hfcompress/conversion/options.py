"""How an option group declares an option: one dataclass field holding its default, its command-line help (and flags,
where the CLI spells them differently from the parameter's name).

Each group (lisa/options.py LisaOptions, fasc/options.py FascOptions, distill/options.py DistillOptions, and the text,
output and device groups in config.py) owns its fields, their defaults and help, their range checks (`validate`) and,
where the model matters, its check against the model. The CLI builds every typer.Option from a group's field
(cli.option), so a default or a help text is written once; ConvertOptions keeps only the rules that cross groups.
"""

from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from ..errors import HfcompressError


def option(default: Any = MISSING, help: str = "", *flags: str, factory: Any = MISSING, **cli: Any) -> Any:
    """A dataclass field with its command-line help (`flags`: the CLI's spelling, e.g. "--lowrank/--no-lowrank"; `cli`:
    further typer.Option settings, e.g. hidden=True). A field without help has no command-line option."""
    return field(default=default, default_factory=factory, metadata={"help": help, "flags": flags, "cli": cli})


@dataclass(frozen=True)
class OptionSpec:
    """What the CLI needs of one field: its default, flags, help and further typer.Option settings."""

    default: Any
    flags: tuple[str, ...]
    help: str
    cli: dict


def option_spec(group: type, name: str) -> OptionSpec:
    """The command-line spec of field `name` of option group `group`."""
    found: Field = {f.name: f for f in fields(group)}[name]
    default = found.default_factory() if found.default_factory is not MISSING else found.default
    meta = found.metadata
    return OptionSpec(default, tuple(meta.get("flags", ())), meta.get("help", ""), dict(meta.get("cli", {})))


def at_least(value: int, minimum: int, flag: str) -> None:
    """Refuse option `flag` unless `value` is a whole number >= minimum."""
    if not isinstance(value, int) or value < minimum:
        raise HfcompressError(f"{flag} must be a whole number >= {minimum}, got {value}.")
