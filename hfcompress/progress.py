"""Progress bars for every long step (rich, on stderr so stdout stays machine-readable)."""

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
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


@contextmanager
def training_bar(total_tokens: int, description: str, done: int = 0) -> Iterator[Callable[..., None]]:
    """A token-count bar showing the last loss, tokens/s and the ETA; yields `advance(tokens, loss=, tokens_per_s=)`."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f} tokens"),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[tokens_per_s]:,.0f} tok/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False, disable=not console.is_terminal) as progress:
        task = progress.add_task(description, total=total_tokens, completed=done, loss=float("nan"), tokens_per_s=0.0)

        def advance(tokens: int, loss: float, tokens_per_s: float) -> None:
            progress.update(task, advance=tokens, loss=loss, tokens_per_s=tokens_per_s)

        yield advance
