"""Issue #30: the user's files are never destroyed, and what can be known before the work is refused before it.

Real files on disk, real processes, the real local Hub server (tests/hub_server.py) with the real huggingface_hub
client; no mocks of the filesystem or of the server. Conversions use the tiny random Llama of tests/tiny_models.py.
"""

import hashlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hfcompress.cli import app
from tests.conftest import HUB_USER
from tests.helpers import one_error as refused

runner = CliRunner()
FAST = [
    "--calib-sequences", "6", "--seq-len", "64", "--eval-tokens", "256", "--lisa-steps", "5", "--protect-first", "1",
    "--no-probe", "--no-speed", "--no-peers", "--distill-tokens", "0", "--calib-text", "builtin", "--eval-text", "builtin",
    "--ood-text", "none", "--max-ppl-increase", "1000",
]
SECRET = "hf_ReAdOnLy0123456789abcdefghijklmnopq"


pytestmark = pytest.mark.usefixtures("fast_network")  # conftest: short Hub timeouts


def convert(*args: str):
    return runner.invoke(app, ["convert", *args])


def digest(path: Path) -> dict[str, str]:
    """Every file under `path` (or the file itself) with its content hash: what "untouched" means."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


# ------------------------------------------------------------------------------------- the source is never written
def _gguf(tmp_path: Path) -> Path:
    path = tmp_path / "models" / "model.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + b"\0" * 60)  # never read: the overlap is refused before the source is opened
    return path


@pytest.mark.parametrize(
    "case, out_of, flags, needle",
    [
        ("equal", lambda src, tmp: src, [], "is the source"),
        ("equal", lambda src, tmp: src, ["--overwrite"], "is the source"),
        ("inside", lambda src, tmp: src / "lisa", [], "is inside the source"),
        ("inside", lambda src, tmp: src / "lisa", ["--overwrite"], "is inside the source"),
        ("contains", lambda src, tmp: tmp, ["--overwrite"], "contains the source"),
        ("link", lambda src, tmp: (tmp / "link").symlink_to(src) or tmp / "link", ["--overwrite"], "is the source"),
        ("link-inside", lambda src, tmp: (tmp / "l2").symlink_to(src) or tmp / "l2" / "x", [], "is inside the source"),
    ],
    ids=["equal", "equal-overwrite", "inside", "inside-overwrite", "contains-overwrite", "link", "link-inside"],
)
def test_out_never_overlaps_a_source_directory(tiny_llama_dir, tmp_path, monkeypatch, case, out_of, flags, needle):
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(tmp_path.parent / f"{tmp_path.name}-cache"))
    before = digest(tiny_llama_dir)
    out = out_of(tiny_llama_dir, tmp_path)
    start = time.perf_counter()
    text = refused(convert(str(tiny_llama_dir), "--out", str(out), *flags, *FAST), 2, needle, "--out")
    assert "--overwrite" not in text.split("error:")[1]  # never the advice to overwrite the source
    assert digest(tiny_llama_dir) == before and sorted(p.name for p in tiny_llama_dir.iterdir()) == sorted(
        Path(f).name for f in before
    )
    assert not Path(os.environ["HFCOMPRESS_CACHE"]).exists()  # refused before any work
    assert time.perf_counter() - start < 30


@pytest.mark.parametrize("where, needle", [("file", "is the source"), ("dir", "contains the source")])
def test_out_never_overlaps_a_gguf_source(tmp_path, monkeypatch, where, needle):
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(tmp_path / "cache"))
    gguf = _gguf(tmp_path)
    before = digest(gguf)
    out = gguf if where == "file" else gguf.parent
    refused(convert(str(gguf), "--out", str(out), "--overwrite"), 2, needle)
    assert digest(gguf) == before


def test_out_never_overlaps_the_caches(tiny_llama_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    (cache / "entry").mkdir(parents=True)
    (cache / "entry" / "hidden-0.pt").write_bytes(b"cached")
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(cache))
    for out in (cache, cache / "o", tmp_path):
        refused(convert(str(tiny_llama_dir), "--out", str(out), "--overwrite"), 2, "--out")
    assert (cache / "entry" / "hidden-0.pt").read_bytes() == b"cached"


def test_overwrite_replaces_only_an_earlier_output(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(tmp_path / "cache"))
    mine = tmp_path / "documents"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    for flags in ([], ["--overwrite"]):
        text = refused(convert(str(tiny_llama_dir), "--out", str(mine), *flags), 2, "is not an hfcompress output",
                       "choose another --out")
        assert "pass --overwrite" not in text
    assert (mine / "thesis.tex").read_text() == "years of work"

    a_file = tmp_path / "file.txt"
    a_file.write_text("keep")
    refused(convert(str(tiny_llama_dir), "--out", str(a_file), "--overwrite"), 2, "is a file")
    assert a_file.read_text() == "keep"

    earlier = tmp_path / "earlier-lisa"
    earlier.mkdir()
    (earlier / "hfcompress_report.json").write_text("{}")
    refused(convert(str(tiny_llama_dir), "--out", str(earlier)), 2, "already holds an hfcompress output",
            "pass --overwrite to replace it")
    assert not (tmp_path / "cache").exists()


def test_unwritable_out_is_refused_before_the_work(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(tmp_path / "cache"))
    for out in ("/proc/hfcompress-test/o", "/proc/self/o"):  # procfs: no directory or file can be made there
        refused(convert(str(tiny_llama_dir), "--out", out), 5, "Cannot write the output beside", "nothing was done")
    assert not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------------------- the model's context
def test_sequence_lengths_beyond_the_context_are_refused_before_the_work(tiny_llama_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(cache))
    out = tmp_path / "o"
    refused(convert(str(tiny_llama_dir), "--out", str(out), "--seq-len", "1024"), 2,
            "--seq-len 1024 is longer than the model's context (256 tokens", "--seq-len 256 or less")
    refused(convert(str(tiny_llama_dir), "--out", str(out), "--seq-len", "64", "--distill-tokens", "4096",
                    "--distill-seq-len", "512"), 2, "--distill-seq-len 512 is longer than the model's context")
    assert not [p for p in cache.rglob("*") if p.is_file()] and not out.exists()  # nothing left in the cache


# ------------------------------------------------------------------------------------------ one run per --out
HOLD_LOCK = """
import sys, time
from pathlib import Path
from hfcompress.conversion.preflight import output_lock
with output_lock(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(120)
"""


def test_a_live_run_holds_out_and_a_killed_one_does_not(tiny_llama_dir, tmp_path, monkeypatch):
    from hfcompress.conversion.preflight import output_lock

    monkeypatch.setenv("HFCOMPRESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "o"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        start = time.perf_counter()
        refused(convert(str(tiny_llama_dir), "--out", str(out), *FAST), 2,
                f"Another hfcompress run (process {holder.pid}) is writing --out {out}", "choose another --out")
        assert time.perf_counter() - start < 30 and not (tmp_path / "cache").exists()  # at once, before any work
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: no cleanup runs
        holder.wait()
    with output_lock(out):  # the kernel dropped the dead run's lock
        pass
    assert not list(tmp_path.glob(".o.lock"))  # a finished run removes its lock file


TWO_RUNS_TIMEOUT = 600


@pytest.mark.slow  # two real conversion processes at once: ~25 s alone, ~70 s on a busy 2-core machine
def test_two_runs_started_together_do_not_both_write(warm, tmp_path):
    """Two conversions into one --out started at the same moment: one writes it, the other is refused (at once by the
    live run's lock, or, if the first was already done, because the output exists) and never reports "wrote"."""
    tiny, cache = warm
    env = {**os.environ, "HFCOMPRESS_CACHE": str(cache), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    out = tmp_path / "o"
    command = [sys.executable, "-m", "hfcompress.cli", "convert", str(tiny), "--out", str(out), *FAST]
    runs = [subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(run.wait(TWO_RUNS_TIMEOUT), run.stderr.read()) for run in runs]
    assert sorted(code for code, _ in results) == [0, 2], results
    winner, loser = sorted(results)
    assert "wrote" in winner[1] and "wrote" not in loser[1]
    assert "Another hfcompress run" in loser[1] or "already holds an hfcompress output" in loser[1], loser[1]
    assert (out / "hfcompress_report.json").is_file() and not list(tmp_path.glob(".o*"))


# ------------------------------------------------------------------------------------------------- push target
def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_push_target_is_checked_before_the_work(hub_inprocess, tiny_llama_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    cache = tmp_path / "cache"
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(cache))
    out = tmp_path / "o"
    repo = f"{HUB_USER}/tiny-lisa"
    line = f"hfcompress push {out} {repo}"

    with monkeypatch.context() as m:  # offline
        m.setattr(c, "HF_HUB_OFFLINE", True)
        refused(convert(str(tiny_llama_dir), "--out", str(out), "--push-to", repo), 4, "HF_HUB_OFFLINE is set",
                "convert without --push-to", line)
    with monkeypatch.context() as m:  # no server answers
        m.setattr(c, "ENDPOINT", _dead_endpoint())
        refused(convert(str(tiny_llama_dir), "--out", str(out), "--push-to", repo), 4, "Cannot reach the Hub", line)

    hub_inprocess.add_token(SECRET, HUB_USER, write=False)
    with monkeypatch.context() as m:  # a real read-only token
        m.setenv("HF_TOKEN", SECRET)
        text = refused(convert(str(tiny_llama_dir), "--out", str(out), "--push-to", repo), 4, "is read-only", line)
        assert SECRET not in text
    with monkeypatch.context() as m:  # a token the server does not know
        m.setenv("HF_TOKEN", "hf_" + "x" * 34)
        refused(convert(str(tiny_llama_dir), "--out", str(out), "--push-to", repo), 4, "HTTP 401", "hf auth login")
    refused(convert(str(tiny_llama_dir), "--out", str(out), "--push-to", "someone-else/tiny-lisa"), 4,
            f"belongs to {HUB_USER}", f"--push-to {HUB_USER}/tiny-lisa")

    assert not cache.exists() and not out.exists()  # all before any work
    assert not hub_inprocess.requests_matching("POST") and repo not in hub_inprocess.repo_ids()
    assert {r.path for r in hub_inprocess.requests} <= {"/api/whoami-v2"}  # read-only requests only


@pytest.mark.slow  # push checks the output loads in a fresh process (~10 s): the fast tier stays under 5 minutes
def test_server_failing_mid_upload_keeps_the_output(warm, hub_inprocess, tmp_path, monkeypatch):
    """The server reads half of every commit and drops the connection: the push is retried (bounded), then exit 4
    with the `hfcompress push` line; the output is complete and kept, the repo unchanged; the line then works."""
    tiny, cache = warm
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(cache))
    monkeypatch.setenv("HFCOMPRESS_PUSH_ATTEMPTS", "3")
    out = tmp_path / "o"
    repo = f"{HUB_USER}/tiny-lisa"
    hub_inprocess.inject_fault("POST", f"/api/models/{repo}/commit/", "cut", "cut", "cut")
    result = convert(str(tiny), "--out", str(out), "--push-to", repo, *FAST)
    text = refused(result, 4, f"Push to {repo} failed", f"hfcompress push {out} {repo}")
    assert "RemoteProtocolError" in text or "ReadError" in text or "ConnectError" in text, text
    assert len(hub_inprocess.requests_matching("POST", f"/api/models/{repo}/commit/")) == 3
    assert set(hub_inprocess.files(repo)) <= {".gitattributes"}  # nothing half-committed
    kept = digest(out)
    assert (out / "hfcompress_report.json").is_file() and (out / "model.safetensors").is_file()

    result = runner.invoke(app, ["push", str(out), repo])  # the command the message gave
    assert result.exit_code == 0, result.output
    local = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert local <= set(hub_inprocess.files(repo)) and digest(out) == kept


# ------------------------------------------------------------------------------------------------- full disk
def _user_namespaces() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _user_namespaces(), reason="no user namespaces here to mount a small tmpfs without root")
def test_too_little_free_disk_is_refused_with_the_figures(warm, tmp_path):
    """--out on a real 256 KB tmpfs (mounted in a private user and mount namespace): refused before calibration,
    with the space needed and free, and nothing written there."""
    tiny, cache = warm
    small = tmp_path / "small"
    small.mkdir()
    script = (
        f"mount -t tmpfs -o size=256k tmpfs {small} && "
        f"{sys.executable} -m hfcompress.cli convert {tiny} --out {small}/o {' '.join(FAST)}; "
        f"code=$?; ls -A {small}; exit $code"
    )
    env = {**os.environ, "HFCOMPRESS_CACHE": str(cache), "COLUMNS": "300"}
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 5, proc.stderr[-3000:]
    text = " ".join(proc.stderr.split())
    assert "Not enough free disk" in text and "output" in text and "is free" in text, proc.stderr[-3000:]
    assert "calibrate: forward" not in proc.stderr  # before the work
    assert proc.stdout.strip() == ""  # nothing left on the small disk


def _file_size_limit(limit: int):
    def apply() -> None:  # in the child: a write past `limit` bytes fails with EFBIG instead of killing it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.parametrize(
    "limit_kb, needle",
    [(700, "File too large"), (300, "could not be written completely")],
    ids=["output-shard", "cache-file"],
)
def test_disk_filling_up_during_the_run(warm, tmp_path, limit_kb, needle):
    """Fault injection in a real process: no file may grow past the limit (RLIMIT_FSIZE; the write fails as on a full
    disk). At 700 KB the calibration cache is written and the output's 0.84 MB weight shard is not; at 300 KB a
    cache file (torch.save) fails first. Exit 5, one sentence, no traceback, the earlier output untouched, nothing
    partial left beside it."""
    tiny, cache = warm
    out = tmp_path / "o"
    out.mkdir()
    (out / "hfcompress_report.json").write_text('{"earlier": true}')
    before = digest(out)
    env = {**os.environ, "HFCOMPRESS_CACHE": str(tmp_path / "cache"), "COLUMNS": "300"}
    proc = subprocess.run(
        [sys.executable, "-m", "hfcompress.cli", "convert", str(tiny), "--out", str(out), "--overwrite",
         "--dtype", "float32", "--share-ratio", "0.25", *FAST],  # a shared layer's fit files: the cache's largest
        env=env, capture_output=True, text=True, timeout=600, preexec_fn=_file_size_limit(limit_kb * 1024),
    )
    assert proc.returncode == 5, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert needle in proc.stderr, proc.stderr[-3000:]
    assert digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "o"]  # no .o.partial-*, .o.old-*, .o.lock, probe
    assert not [p for p in (tmp_path / "cache").rglob("*") if ".partial-" in p.name]  # no half-written cache file


def test_push_command_offline_keeps_the_output_and_gives_the_line(tiny_llama_dir, tmp_path, monkeypatch):
    """`hfcompress push` with HF_HUB_OFFLINE=1 (set for this test by conftest): the push's exit code, a message that
    names HF_HUB_OFFLINE and says to unset it, and the line; not "check free space and permissions" (exit 1)."""
    out = tmp_path / "tiny-lisa"
    shutil.copytree(tiny_llama_dir, out)
    (out / "hfcompress_report.json").write_text(json.dumps({"validation": {"gate_passed": True}}))
    (out / "README.md").write_text("# tiny-lisa\n")
    monkeypatch.setenv("HF_TOKEN", "hf_" + "a" * 34)
    result = runner.invoke(app, ["push", str(out), f"{HUB_USER}/tiny-lisa"])
    text = refused(result, 4, "HF_HUB_OFFLINE=1 is set", "unset HF_HUB_OFFLINE", f"hfcompress push {out} {HUB_USER}/tiny-lisa",
                   f"kept in {out}")
    assert "push it later" not in text
