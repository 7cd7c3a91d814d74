"""Atomic cache writes: two processes filling one cache entry at once (two conversions of one model on one
calibration text) both succeed, a failed write leaves nothing, and what killed writers left is cleaned up."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hfcompress.conversion.atomic import atomic_file, private_sibling, save_atomic

WRITER = """
import sys
import time
from pathlib import Path

import torch

from hfcompress.conversion.atomic import save_atomic

path, value = Path(sys.argv[1]), torch.full((64, 1024), float(sys.argv[2]))
(path.parent / f"ready-{sys.argv[2]}").touch()  # both start writing once both have imported torch
while len(list(path.parent.glob("ready-*"))) < 2:
    time.sleep(0.01)
for _ in range(300):
    save_atomic(value, path)
"""


def test_two_processes_writing_one_cache_file_at_once_both_succeed(tmp_path):
    """With one shared temporary name (the old `NAME.partial`) the second rename found its file already moved and
    the conversion died with FileNotFoundError."""
    path = tmp_path / "cache" / "hidden-0.pt"
    path.parent.mkdir()
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(value)], env=env, stderr=subprocess.PIPE) for value in (1, 2)]
    errors = [proc.communicate(timeout=300)[1].decode() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], errors
    value = torch.load(path)
    assert value.shape == (64, 1024) and value.unique().tolist() in ([1.0], [2.0])  # one writer's whole file
    assert sorted(p.name for p in path.parent.iterdir()) == ["hidden-0.pt", "ready-1", "ready-2"]


def test_a_failed_write_leaves_neither_the_file_nor_a_partial_one(tmp_path):
    path = tmp_path / "entry.pt"
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_file(path) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []
    save_atomic({"a": 1}, path)
    assert torch.load(path) == {"a": 1} and list(tmp_path.iterdir()) == [path]


def test_partials_of_dead_processes_are_removed_and_others_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = tmp_path / "entry.pt"
    stale_file = tmp_path / f"entry.pt.partial-{dead.pid}-0badf00d"
    stale_dir = tmp_path / f"entry.pt.partial-{dead.pid}-0ddba11a"
    live = tmp_path / f"entry.pt.partial-{os.getppid()}-1234abcd"  # a writer still running
    foreign = tmp_path / "entry.pt.partial-old-copy"  # not of our form: not ours to remove
    other = tmp_path / f"other.pt.partial-{dead.pid}-0badf00d"  # another entry's: its own writer cleans it
    stale_file.write_bytes(b"half")
    stale_dir.mkdir()
    (stale_dir / "part-00000.safetensors").write_bytes(b"half")
    for kept in (live, foreign, other):
        kept.write_bytes(b"x")
    mine = private_sibling(path)
    assert not stale_file.exists() and not stale_dir.exists()
    assert live.exists() and foreign.exists() and other.exists()
    assert mine.parent == tmp_path and mine.name.startswith(f"entry.pt.partial-{os.getpid()}-") and not mine.exists()
