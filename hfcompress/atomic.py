"""Files and directories written under a name of the writing process's own, then renamed into place.

A reader never sees half a file, and two processes filling one cache at once (two conversions of one model on one
calibration text) never write into each other's files: the first rename wins, the second replaces it with the same
content. What a killed process left behind is removed by the next writer of the same path.
"""

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

PARTIAL = ".partial-"  # NAME.partial-PID-RANDOM


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def private_sibling(path: Path) -> Path:
    """A name beside `path` that only this process writes; the partial files or directories of dead processes with
    the same target are removed first."""
    for stale in path.parent.glob(f"{path.name}{PARTIAL}*-*"):
        pid = stale.name[len(path.name) + len(PARTIAL) :].split("-")[0]
        if pid.isdigit() and not process_alive(int(pid)):  # a name not of this form is not ours to remove
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
    return path.with_name(f"{path.name}{PARTIAL}{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yields the private name to write; renames it to `path` when the block succeeds, removes it when it fails."""
    path = Path(path)
    tmp = private_sibling(path)
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def save_atomic(value: object, path: Path) -> None:
    with atomic_file(path) as tmp:
        torch.save(value, tmp)
