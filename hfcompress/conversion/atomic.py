"""Files and directories written under a name of the writing process's own, then renamed into place.

A reader never sees half a file, and two processes filling one cache at once (two conversions of one model on one
calibration text) never write into each other's files: the first rename wins, the second replaces it with the same
content. What a killed process left behind is removed by the next writer of the same path.

The output directory is written the same way (`atomic_directory`): as `.NAME.partial-PID-RANDOM` beside it, renamed
to NAME only when complete; a later run removes the partial directories of processes that are gone.
"""

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import WRITE_FAILED_EXIT, HfcompressError, full_disk_errno

PARTIAL = ".partial-"  # NAME.partial-PID-RANDOM
OLD = ".old-"  # .NAME.old-PID: an earlier output while the new one is renamed into its place


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _dead_writer(stale: Path, prefix: str) -> bool:
    """Whether `stale`, named PREFIX + PID[-...], was left by a process that no longer runs (a name not of this form
    is not ours to remove)."""
    pid = stale.name[len(prefix) :].split("-")[0]
    return pid.isdigit() and not process_alive(int(pid))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_dead_partials(path: Path) -> None:
    for stale in path.parent.glob(f"{path.name}{PARTIAL}*-*"):
        if _dead_writer(stale, path.name + PARTIAL):
            _remove(stale)


def private_sibling(path: Path) -> Path:
    """A name beside `path` that only this process writes; the partial files or directories of dead processes with
    the same target are removed first."""
    _remove_dead_partials(path)
    return path.with_name(f"{path.name}{PARTIAL}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_leftovers(out: Path) -> None:
    """What runs killed without a chance to clean up (SIGKILL, a power cut) left beside the output directory `out`:
    their partial directories are removed, and an earlier output that a run killed mid-swap had moved aside goes back
    to `out` when nothing took its place (else it is removed: `out` holds the newer output, with its copies of the
    user's files). Runs that are alive are left alone."""
    out = Path(out).expanduser().resolve()
    _remove_dead_partials(out.with_name(f".{out.name}"))
    for old in out.parent.glob(f".{out.name}{OLD}*"):
        if _dead_writer(old, f".{out.name}{OLD}"):
            if out.exists() or out.is_symlink():
                _remove(old)
            else:
                old.rename(out)


def atomic_directory(out: Path, write: Callable[[Path], None], keep: Callable[[Path], list[str]]) -> Path:
    """Run `write(tmp)` into a private sibling directory of `out` and rename it to `out` only when it succeeded.

    An existing `out` (an earlier output, --overwrite) is replaced only then, and the entries `keep(out)` names (the
    user's own files and directories in it) are copied into the new output first: until the swap, `out` is untouched.
    A failure or an interruption leaves no directory at `out` that looks complete and nothing beside it; a full disk
    or a file size limit is one sentence with exit code 5."""
    out = out.resolve()
    remove_leftovers(out)
    tmp = private_sibling(out.with_name(f".{out.name}"))
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        if out.exists():
            for name in keep(out):
                if not (tmp / name).exists():  # a name the new output writes is the new output's
                    _copy(out / name, tmp / name)
            old = out.with_name(f".{out.name}{OLD}{os.getpid()}")
            out.rename(old)
            try:
                tmp.rename(out)
            except BaseException:
                old.rename(out)  # put the earlier output back
                raise
            _remove(old)
        else:
            tmp.rename(out)
    except BaseException as err:
        _remove(tmp)
        number = None if isinstance(err, HfcompressError) else full_disk_errno(err)
        if number is not None:
            raise HfcompressError(_full_disk(out, err, number), exit_code=WRITE_FAILED_EXIT) from err
        if isinstance(err, OSError):
            where = f" ({_written_name(err.filename)})" if err.filename else ""
            raise HfcompressError(
                f"Cannot write {out}: {err.strerror or err}{where}; nothing was written and any earlier output there is "
                "untouched: check permissions, then rerun the same command, which resumes from the cache.",
                exit_code=WRITE_FAILED_EXIT,
            ) from err
        raise
    return out


def _copy(source: Path, target: Path) -> None:
    """A file, link or directory tree, links kept as links; its parent directory made where the new output has none."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir() and not source.is_symlink():
        shutil.copytree(source, target, symlinks=True)
    else:
        shutil.copy2(source, target, follow_symlinks=False)


def _written_name(filename: str | bytes) -> str:
    """The name of the file a write failed on, as the output would have it (not its private partial name)."""
    return Path(os.fsdecode(filename)).name.split(PARTIAL)[0]


def _full_disk(out: Path, err: BaseException, number: int) -> str:
    reason = os.strerror(number) if not isinstance(err, OSError) else (err.strerror or os.strerror(number))
    where = f" at {_written_name(err.filename)}" if isinstance(err, OSError) and err.filename else ""
    return (
        f"The disk is full or a file size limit was reached ({reason}{where}) while writing {out}: free some space "
        "or raise the limit, then rerun the same command, which resumes from the cache; nothing was written and any "
        "earlier output there is untouched."
    )


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
