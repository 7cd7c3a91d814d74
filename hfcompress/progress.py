"""Progress bars for every long step (rich, on stderr so stdout stays machine-readable)."""

from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

T = TypeVar("T")
console = Console(stderr=True)


def progress_bar(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False, disable=not console.is_terminal) as progress:
        yield from progress.track(items, total=total, description=description)
