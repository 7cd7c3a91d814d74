"""Progress of every long step, on stderr so stdout stays machine-readable.

On a terminal: rich progress bars. Anywhere else (a file, a pipe, a CI log): plain lines a person can follow, with
the count, the percentage, the time spent and an estimate of the time left, e.g.
`[12:01:07] convert: layer by layer 12/30 (40%), 1:02 elapsed, about 1:33 left`. Steps of up to PER_ITEM_LINES items
(layers) get a line each, longer ones a line per tenth, at most one a second and at least one every PLAIN_INTERVAL
seconds; a step that takes under a second prints its final count only. A step with no count (a speed run, a
model load) runs inside `heartbeat`, which prints a "still running" line whenever the console was silent for
PLAIN_INTERVAL seconds.
"""

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

T = TypeVar("T")


def _log_width() -> int | None:
    """Off a terminal (a log file, CI) with no COLUMNS set, 160 columns instead of rich's 80, so that a progress line
    stays one line in the log; on a terminal, or with COLUMNS, rich's own choice."""
    if os.environ.get("COLUMNS"):
        return None
    try:
        return None if sys.stderr.isatty() else 160
    except (AttributeError, ValueError):  # a closed or replaced stream
        return 160


class _Console(Console):
    """rich's Console, noting when it last printed a log line: the heartbeat speaks only after a silence."""

    last_line = time.monotonic()

    def log(self, *objects, **kwargs) -> None:
        self.last_line = time.monotonic()
        super().log(*objects, **kwargs)


console = _Console(stderr=True, log_path=False, width=_log_width())  # no "pipeline.py:161" on every line
PER_ITEM_LINES = 64
PLAIN_INTERVAL = float(os.environ.get("HFCOMPRESS_PROGRESS_INTERVAL", "30"))


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class PlainProgress:
    """Progress as log lines: `update(done)` prints when a line is due (see the module docstring)."""

    def __init__(self, description: str, total: int | None, done: int = 0, unit: str = "", per_item: bool = True) -> None:
        self.description, self.total, self.unit = description, total, unit
        self.start_done = self.last_done = done
        self.started = self.last_time = time.perf_counter()
        self.per_item = per_item and total is not None and total <= PER_ITEM_LINES

    def due(self, done: int, now: float) -> bool:
        """The last item; otherwise at most a line a second: every item (layers) or every tenth; and at least one
        line every PLAIN_INTERVAL seconds. A quick step prints its final line only."""
        since = now - self.last_time
        if self.total is None:
            return since >= PLAIN_INTERVAL
        if done >= self.total or since >= PLAIN_INTERVAL:
            return True
        return since >= 1.0 and (self.per_item or 10 * done // self.total > 10 * self.last_done // self.total)

    def update(self, done: int, extra: str = "") -> None:
        now = time.perf_counter()
        if not self.due(done, now):
            return
        self.last_done, self.last_time = done, now
        elapsed = now - self.started
        if self.total:
            count = f"{done:,}/{self.total:,}{self.unit} ({100 * done // self.total}%)"
        else:
            count = f"{done:,}{self.unit}"
        timing = f"{duration(elapsed)} elapsed"
        moved = done - self.start_done
        if self.total and moved > 0 and done < self.total:
            timing += f", about {duration(elapsed / moved * (self.total - done))} left"
        console.log(f"{self.description} {count}{extra}, {timing}", highlight=False)


def progress_bar(items: Iterable[T], description: str, total: int | None = None, done: int = 0) -> Iterator[T]:
    """`items`, counted on a bar (or in log lines); `done` items of the `total` were done before (a resumed step:
    `items` are the rest, and the count reads 13/30, not 1/18)."""
    if total is None and hasattr(items, "__len__"):
        total = done + len(items)  # type: ignore[arg-type]
    if not console.is_terminal:
        plain = PlainProgress(description, total, done)
        for count, item in enumerate(items, start=done + 1):
            yield item
            plain.update(count)
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(description, total=total, completed=done)
        for item in items:
            yield item
            progress.advance(task)


@contextmanager
def training_bar(total_tokens: int, description: str, done: int = 0) -> Iterator[Callable[..., None]]:
    """A token-count bar showing the last loss, tokens/s and the ETA; yields `advance(tokens, loss=, tokens_per_s=)`."""
    if not console.is_terminal:
        plain = PlainProgress(description, total_tokens, done, unit=" tokens", per_item=False)
        state = {"done": done}

        def advance_plain(tokens: int, loss: float, tokens_per_s: float) -> None:
            state["done"] += tokens
            plain.update(state["done"], f", loss {loss:.4f}, {tokens_per_s:,.0f} tok/s")

        yield advance_plain
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f} tokens"),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[tokens_per_s]:,.0f} tok/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(description, total=total_tokens, completed=done, loss=float("nan"), tokens_per_s=0.0)

        def advance(tokens: int, loss: float, tokens_per_s: float) -> None:
            progress.update(task, advance=tokens, loss=loss, tokens_per_s=tokens_per_s)

        yield advance


_activities: list[list[str]] = []  # the open heartbeats, innermost last: [description, detail]


def activity(detail: str) -> None:
    """What the innermost heartbeat's block is doing now, for its next line (e.g. "round 2/3, converted")."""
    if _activities:
        _activities[-1][1] = detail


@contextmanager
def heartbeat(description: str) -> Iterator[None]:
    """While the block runs, a line `description: still running (detail), M:SS elapsed` whenever the console printed
    nothing for PLAIN_INTERVAL seconds (the innermost open heartbeat speaks), so that a log shows a live run at least
    every PLAIN_INTERVAL seconds even through a step that counts nothing."""
    entry = [description, ""]
    _activities.append(entry)
    started, stop = time.perf_counter(), threading.Event()

    def beat() -> None:
        while not stop.wait(min(1.0, PLAIN_INTERVAL / 4)):
            if _activities and _activities[-1] is entry and time.monotonic() - console.last_line >= PLAIN_INTERVAL:
                detail, elapsed = f" ({entry[1]})" if entry[1] else "", duration(time.perf_counter() - started)
                console.log(f"{description}: still running{detail}, {elapsed} elapsed", highlight=False)

    thread = threading.Thread(target=beat, name=f"heartbeat: {description}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        _activities.remove(entry)
