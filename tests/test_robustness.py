"""Issue #7: every bad input, fault and interruption gives one clear sentence and an exit code; nothing is lost and
no token leaks.

The Hub is the real local server of tests/hub_server.py driven by the real huggingface_hub client; models are tiny
random Llamas. The CLI runs in-process (CliRunner), except where real stderr logging matters (a subprocess).
"""

import errno
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
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from hfcompress.cli import app
from tests.conftest import HUB_USER
from tests.hub_server import subprocess_env

runner = CliRunner()
# the calibration settings every conversion here shares, so the cache warmed by one test serves the next
FAST = [
    "--calib-sequences", "6", "--seq-len", "64", "--eval-tokens", "256", "--lisa-steps", "5", "--protect-first", "1",
    "--no-probe", "--no-speed", "--no-peers",  # the peers have their own tests (test_layer_plan.py)
    "--distill-tokens", "0",
    # the 465 kB built-in text, no other-domain text: tokenising the 4.3 MB offline mixture (test_text_sources.py
    # tests it) cost each conversion more than its tiny model's work
    "--calib-text", "builtin", "--eval-text", "builtin", "--ood-text", "none",
]
SECRET = "hf_SeCrEt0123456789abcdefghijklmnopqrs"  # shaped like a real user access token


@pytest.fixture(autouse=True)
def _network(fast_network, monkeypatch):
    """conftest's short Hub timeouts, and four push attempts."""
    monkeypatch.setenv("HFCOMPRESS_PUSH_ATTEMPTS", "4")


def convert(*args: str):
    return runner.invoke(app, ["convert", *args])


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def assert_refused(result, exit_code: int, *needles: str, out: Path) -> None:
    """One sentence with each needle, the exit code, and no output directory (complete or partial)."""
    assert result.exit_code == exit_code, result.output
    message = result.output.strip().splitlines()[-1]
    assert message.startswith("error:"), result.output
    for needle in needles:
        assert needle in result.output, result.output
    assert not out.exists() and not leftovers(out.parent)


def upload(hub_api, tiny_dir: Path, repo: str) -> str:
    hub_api.create_repo(repo)
    return hub_api.upload_folder(folder_path=str(tiny_dir), repo_id=repo).oid


# ------------------------------------------------------------------------------------------ bad sources: exit 2
def test_unknown_repo_and_revision(hub_inprocess, hub_api, tiny_llama_dir, tmp_path):
    out = tmp_path / "o"
    assert_refused(convert(f"{HUB_USER}/nope", "--out", str(out)), 2, "was not found", "hf auth login", out=out)
    upload(hub_api, tiny_llama_dir, f"{HUB_USER}/tiny")
    result = convert(f"{HUB_USER}/tiny", "--revision", "v9", "--out", str(out))
    assert_refused(result, 2, "Revision 'v9' does not exist", out=out)


@pytest.mark.parametrize("with_token, status", [(False, 401), (True, 403)])
def test_gated_repo(hub_inprocess, hub_api, tiny_llama_dir, tmp_path, monkeypatch, with_token, status):
    repo = f"{HUB_USER}/gated"
    upload(hub_api, tiny_llama_dir, repo)
    hub_inprocess.set_gated(repo, allowed_users=["someone-else"])
    if not with_token:
        monkeypatch.delenv("HF_TOKEN")
    out = tmp_path / "o"
    assert_refused(convert(repo, "--out", str(out)), 2, "is gated", "accept its terms", "hf auth login", out=out)
    assert any(r.status == status for r in hub_inprocess.requests_matching(contains="/resolve/"))
    assert not hub_inprocess.requests_matching(contains="model.safetensors")  # refused before the weights


def test_no_network_and_offline_mode(hub_inprocess, hub_api, tiny_llama_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    from hfcompress.sources.source import resolve_source

    repo = f"{HUB_USER}/tiny"
    upload(hub_api, tiny_llama_dir, repo)
    cached = resolve_source(repo)  # fills the HF cache
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(c, "ENDPOINT", dead)
    out = tmp_path / "o"
    result = convert(f"{HUB_USER}/other", "--out", str(out))
    assert_refused(result, 2, "Cannot reach the Hub", "local model directory", "HF_HUB_OFFLINE=1", out=out)

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)  # the remedy the message names
    offline = resolve_source(repo)
    assert (offline.path, offline.commit_sha) == (cached.path, cached.commit_sha)
    assert_refused(convert(f"{HUB_USER}/other", "--out", str(out)), 2, "not in the local Hub cache", out=out)


def edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def test_unsupported_architecture(tiny_llama_dir, tmp_path):
    out = tmp_path / "o"
    edit_config(tiny_llama_dir, model_type="mamba", architectures=["MambaForCausalLM"])
    for flags in ([], ["--trust-remote-code"]):  # the flag never widens the supported architectures
        result = convert(str(tiny_llama_dir), "--out", str(out), *flags)
        assert_refused(
            result, 2, "'mamba' model",
            "supports only: llama (LlamaForCausalLM), mistral (MistralForCausalLM), qwen2 (Qwen2ForCausalLM), "
            "qwen3 (Qwen3ForCausalLM), gemma3_text (Gemma3ForCausalLM)", out=out,
        )  # fmt: skip


def rewrite_weights(directory: Path, change) -> None:
    path = directory / "model.safetensors"
    tensors = {name: array.copy() for name, array in load_file(path).items()}
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _truncate(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _garble_header(d: Path) -> None:
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")


def _drop_tensor(d: Path) -> None:
    rewrite_weights(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))


def _nan_weight(d: Path) -> None:
    rewrite_weights(d, lambda t: t["model.layers.2.self_attn.v_proj.weight"].__setitem__((0, 0), float("nan")))


def _inf_weight(d: Path) -> None:
    rewrite_weights(d, lambda t: t["model.norm.weight"].__setitem__(3, float("inf")))


@pytest.mark.parametrize(
    "damage, needles",
    [
        (_truncate, ["corrupt or truncated", "SafetensorError"]),
        (_garble_header, ["corrupt or truncated"]),
        (_drop_tensor, ["do not match the Llama layout", "model.layers.1.mlp.up_proj.weight"]),
        (_nan_weight, ["NaN or inf", "model.layers.2.self_attn.v_proj.weight"]),
        (_inf_weight, ["NaN or inf", "model.norm.weight"]),
    ],
    ids=["truncated", "garbled-header", "missing-tensor", "nan", "inf"],
)
def test_broken_weights(tiny_llama_dir, tmp_path, damage, needles):
    damage(tiny_llama_dir)
    out = tmp_path / "o"
    assert_refused(convert(str(tiny_llama_dir), "--out", str(out)), 2, *needles, out=out)


def test_tokenizer_missing_or_broken(tiny_llama_dir, tmp_path):
    out = tmp_path / "o"
    (tiny_llama_dir / "tokenizer.json").write_text("{ broken")
    assert_refused(convert(str(tiny_llama_dir), "--out", str(out)), 2, "tokenizer.json is not valid JSON", out=out)
    (tiny_llama_dir / "tokenizer.json").unlink()
    result = convert(str(tiny_llama_dir), "--out", str(out))
    assert_refused(result, 2, "has no tokenizer (tokenizer.json or tokenizer.model)", out=out)


def test_nan_in_calibration(tiny_llama_dir, tmp_path, monkeypatch):
    # finite weights whose attention scores overflow to inf (then NaN): only running the model can see it
    def overflow(t):
        t["model.layers.0.self_attn.q_proj.weight"][:] = 1e20
        t["model.layers.0.self_attn.k_proj.weight"][:] = 1e20

    rewrite_weights(tiny_llama_dir, overflow)
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "o"
    result = convert(str(tiny_llama_dir), "--out", str(out), *FAST)
    assert_refused(result, 2, "NaN/inf activations on the calibration text", out=out)
    assert not list((tmp_path / "cache").rglob("*.pt"))  # nothing broken is cached


def test_nan_perplexity(tiny_llama_dir, tmp_path, monkeypatch):
    # finite weights, finite activations (all calibration sees), logits that overflow
    def overflow(t):
        t["lm_head.weight"][:] = 3e38

    rewrite_weights(tiny_llama_dir, overflow)
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "o"
    result = convert(str(tiny_llama_dir), "--out", str(out), "--share-ratio", "0", "--kv-budget", "1.0", *FAST)  # no backward
    assert_refused(result, 2, "The source model's perplexity is nan", "NaN/inf logits", out=out)


# ------------------------------------------------------------------------------------- code shipped by a source
MARKER_CODE = "import pathlib\npathlib.Path({marker!r}).write_text('executed')\n"


def add_custom_code(directory: Path, marker: Path) -> None:
    """A Llama checkpoint that declares custom model and tokenizer classes whose modules write `marker` on import."""
    for module in ("modeling_evil", "tokenization_evil"):
        (directory / f"{module}.py").write_text(MARKER_CODE.format(marker=str(marker)))
    edit_config(
        directory, model_type="evil_llama", architectures=["EvilForCausalLM"],
        auto_map={"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"},
    )
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    tokenizer_config["tokenizer_class"] = "EvilTokenizer"
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def test_local_source_code_never_runs(tiny_llama_dir, tmp_path):
    from hfcompress.sources.source import load_source, resolve_source

    marker = tmp_path / "MARKER"
    add_custom_code(tiny_llama_dir, marker)
    out = tmp_path / "o"
    result = convert(str(tiny_llama_dir), "--out", str(out))
    assert_refused(result, 2, "ships its own Python code", "auto_map", "--trust-remote-code", out=out)

    source = resolve_source(str(tiny_llama_dir), trust_remote_code=True)
    model, tokenizer = load_source(source)
    assert source.custom_code and type(model).__name__ == "LlamaForCausalLM"
    tokenizer.save_pretrained(tmp_path / "tok")  # what the output directory would get
    assert "auto_map" not in json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert not marker.exists()


def test_hub_source_code_never_downloaded_or_run(hub_inprocess, hub_api, tiny_llama_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    marker = tmp_path / "MARKER"
    add_custom_code(tiny_llama_dir, marker)
    repo = f"{HUB_USER}/evil"
    upload(hub_api, tiny_llama_dir, repo)
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "o"
    result = convert(repo, "--out", str(out))
    assert_refused(result, 2, "ships its own Python code", "--trust-remote-code", out=out)
    assert not hub_inprocess.requests_matching(contains="model.safetensors")  # refused before the weights

    plot = tmp_path / "sim.png"
    analyze = ["analyze", repo, "--trust-remote-code", "--plot", str(plot), *FAST[:4], "--calib-text", "builtin"]
    result = runner.invoke(app, analyze)
    assert result.exit_code == 0, result.output
    assert plot.is_file() and not marker.exists()
    assert not hub_inprocess.requests_matching(contains=".py")  # never even downloaded
    assert not list(Path(hf_constants.HF_HUB_CACHE).rglob("*.py"))


# ---------------------------------------------------------------------------- interruption, resume, disk full
def cache_state(cache: Path) -> dict[str, int]:
    return {str(p.relative_to(cache)): p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}


def fail_at(monkeypatch, step: str, error: BaseException) -> None:
    """Raise `error` as the pipeline announces `step` (every step is logged on the console when it starts)."""
    from hfcompress.progress import console

    log = console.log

    def failing_log(*objects, **kwargs):
        if any(f"[bold cyan]{step}[/]" == str(o) for o in objects):
            raise error
        return log(*objects, **kwargs)

    monkeypatch.setattr(console, "log", failing_log)


def interrupt_at(monkeypatch, step: str) -> None:
    """Ctrl-C as the pipeline announces `step`."""
    fail_at(monkeypatch, step, KeyboardInterrupt())


def test_interrupted_conversion_resumes_from_cache(warm, tmp_path, monkeypatch):
    tiny, cache = warm
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(cache))
    out = tmp_path / "o"
    command = [str(tiny), "--out", str(out), "--max-ppl-increase", "1000", "--fasc-budget", "0.8", "--share-ratio", "0.5", *FAST]

    with monkeypatch.context() as m:
        interrupt_at(m, "validate: perplexity")  # after calibration, the fits and every converted layer
        result = convert(*command)
    assert result.exit_code == 130 and "interrupted" in result.output and "resume" in result.output
    assert not out.exists() and not leftovers(tmp_path)
    before = {k: v for k, v in cache_state(cache).items() if "/convert-" not in k}  # the layer files go into the output
    kinds = {name.split("/")[-1].split("-")[0].removesuffix(".pt") for name in before}
    assert {"hidden", "similarity", "fit", "grad", "factors", "keys"} <= kinds, before  # statistics and trained modules

    result = convert(*command)  # the same command again
    assert result.exit_code == 0, result.output
    assert {k: v for k, v in cache_state(cache).items() if k in before} == before  # reused, not recomputed
    assert (out / "hfcompress_report.json").is_file()


def test_interrupted_write_leaves_no_output(warm, tmp_path, monkeypatch):
    tiny, cache = warm
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(cache))
    out = tmp_path / "o"
    interrupt_at(monkeypatch, "validate: fresh-process reload")  # inside the write: weights already on disk
    result = convert(str(tiny), "--out", str(out), "--max-ppl-increase", "1000", *FAST)
    assert result.exit_code == 130, result.output
    assert not out.exists() and not leftovers(tmp_path)


@pytest.mark.parametrize(
    "error, exit_code, needles",
    [
        (OSError(errno.EACCES, "Permission denied", "/cache/hidden-3.pt"), 5, ["Permission denied (/cache/hidden-3.pt)", "check free space and permissions"]),
        (OSError(errno.ENOENT, "No such file or directory", "/cache/fit-1.pt"), 1, ["No such file or directory (/cache/fit-1.pt)"]),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"), 1, ["Out of memory", "--calib-sequences"]),
        (MemoryError(), 1, ["Out of memory"]),
    ],
)
def test_unexpected_os_and_memory_errors_are_one_sentence(warm, tmp_path, monkeypatch, error, exit_code, needles):
    tiny, cache = warm
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(cache))
    out = tmp_path / "o"
    fail_at(monkeypatch, "validate: perplexity", error)
    result = convert(str(tiny), "--out", str(out), "--max-ppl-increase", "1000", *FAST)
    assert result.exit_code == exit_code, result.output
    assert result.output.startswith("error:") or "\nerror: " in result.output, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # handled: an exit status, not a traceback
    assert all(n in result.output for n in needles), result.output
    assert "HFCOMPRESS_TRACEBACK=1" in result.output and not out.exists()
    assert ("rerun the same command" in result.output) == isinstance(error, OSError)  # out of memory: other options
    assert cache_state(cache)  # a finished calibration stays cached

    monkeypatch.setenv("HFCOMPRESS_TRACEBACK", "1")  # the traceback, for a bug report
    result = convert(str(tiny), "--out", str(out), "--max-ppl-increase", "1000", *FAST)
    assert result.exception is error


def test_out_of_memory_during_calibration_leaves_no_unfinished_cache(tiny_llama_dir, tmp_path, monkeypatch):
    """The smaller run the message asks for has another cache key: the entry this run began is removed, so nothing
    the next run cannot use stays in the cache (Ctrl-C keeps it: the same command resumes)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(cache))
    out = tmp_path / "o"
    from hfcompress.conversion.stream import LayerStream

    with monkeypatch.context() as m:
        fail_at(m, "calibrate: backward", MemoryError())  # the forward pass finished
        result = convert(str(tiny_llama_dir), "--out", str(out), "--fasc-budget", "0.8", *FAST)
    assert result.exit_code == 1, result.output
    # the forward pass finished: the entry is complete and stays (a smaller --distill-batch-size reuses it)
    assert any(p.name.startswith("hidden-") for p in cache.rglob("*.pt"))

    shutil.rmtree(cache)
    real_run, calls = LayerStream.run, []

    def out_of_memory_at_layer_2(self, *args, **kwargs):  # the third layer of the forward pass runs out of memory
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError()
        return real_run(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(LayerStream, "run", out_of_memory_at_layer_2)
        result = convert(str(tiny_llama_dir), "--out", str(out), *FAST)
    assert result.exit_code == 1 and "Out of memory" in result.output, result.output
    assert "unfinished calibration cache it began" in " ".join(result.output.split()) and "--seq-len" in result.output
    assert not [p for p in cache.rglob("*") if p.is_file() and "gguf-" not in str(p)], list(cache.rglob("*"))


def test_other_runtime_errors_keep_their_traceback(warm, tmp_path, monkeypatch):
    tiny, cache = warm
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(cache))
    bug = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    fail_at(monkeypatch, "validate: perplexity", bug)
    result = convert(str(tiny), "--out", str(tmp_path / "o"), "--max-ppl-increase", "1000", *FAST)
    assert result.exception is bug and "Out of memory" not in result.output


def test_disk_full_keeps_earlier_output(warm, tmp_path, monkeypatch):
    import hfcompress.conversion.output as convert_module

    tiny, cache = warm
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(cache))
    out = tmp_path / "o"
    out.mkdir()
    (out / "earlier.txt").write_text("an earlier conversion")
    (out / "hfcompress_report.json").write_text("{}")  # --overwrite replaces only an earlier output
    real_atomic_directory = convert_module.atomic_directory

    def disk_fills_up(out_dir, write, keep):
        def write_until_full(tmp: Path) -> None:
            (tmp / "model.safetensors").write_bytes(b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "model.safetensors"))

        return real_atomic_directory(out_dir, write_until_full, keep)

    monkeypatch.setattr(convert_module, "atomic_directory", disk_fills_up)
    result = convert(str(tiny), "--out", str(out), "--overwrite", "--max-ppl-increase", "1000", *FAST)
    assert result.exit_code == 5, result.output
    assert "The disk is full" in result.output and "earlier output there is untouched" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["earlier.txt", "hfcompress_report.json"] and not leftovers(tmp_path)


def test_disk_full_while_downloading(hub_inprocess, hub_api, tiny_llama_dir, tmp_path, monkeypatch):
    import huggingface_hub

    upload(hub_api, tiny_llama_dir, f"{HUB_USER}/tiny")

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_space)
    out = tmp_path / "o"
    result = convert(f"{HUB_USER}/tiny", "--out", str(out))
    assert_refused(result, 5, "Cannot store test-user/tiny in the Hub cache (No space left on device)", out=out)


def test_cache_save_on_full_disk_is_skipped(tmp_path, monkeypatch):
    import hfcompress.conversion.calibrate as calibrate

    def no_space(obj, path):
        Path(path).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(calibrate.torch, "save", no_space)
    assert calibrate.load_or_compute(tmp_path / "stats.pt", lambda: {"x": 1}) == {"x": 1}
    assert list(tmp_path.iterdir()) == []  # no partial file left behind


# ---------------------------------------------------------- issue #43: --overwrite, local paths, signals, limits
def cli(*args: str, cache: Path, limit: int | None = None) -> dict:
    """The Popen settings of `hfcompress ARGS` in a real process with the calibration cache `cache`; `limit`: no file
    it writes may grow past so many bytes (RLIMIT_FSIZE), with SIGXFSZ at its default action (kill) as a shell or a
    scheduler may hand it on, so the process itself must ignore it for the write to fail with EFBIG."""

    def file_size_limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "HFCOMPRESS_CACHE": str(cache), "COLUMNS": "300"}
    return {
        "args": [sys.executable, "-m", "hfcompress.cli", *args], "env": env, "text": True,
        "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **({"preexec_fn": file_size_limit} if limit else {}),
    }


def beside(out: Path) -> list[str]:
    """What lies beside `out` that a run made: partial or moved-aside outputs, the lock file."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def one_sentence(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith(("error:", "interrupted"))]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return " ".join(stderr[stderr.index(errors[0]) :].split())


@pytest.mark.slow  # a real conversion or CLI process: the fast tier stays under 5 minutes
def test_overwrite_keeps_the_users_files_and_replaces_the_earlier_run(warm, tmp_path, monkeypatch):
    """--overwrite replaces what the earlier run wrote (its report lists it) and keeps what the user put in the
    output: a directory of evaluation runs, notes. A stale shard of the earlier run does not survive."""
    tiny, cache = warm
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(cache))
    out = tmp_path / "o"
    command = [str(tiny), "--out", str(out), "--max-ppl-increase", "1000", *FAST]
    assert convert(*command).exit_code == 0
    report = json.loads((out / "hfcompress_report.json").read_text())
    assert {"config.json", "model.safetensors", "README.md", "hfcompress_report.json"} <= set(report["files"])
    assert sorted(report["files"]) == sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    report["files"].append("model-00002-of-00002.safetensors")  # as if the earlier run had written two shards
    (out / "hfcompress_report.json").write_text(json.dumps(report))
    (out / "model-00002-of-00002.safetensors").write_bytes(b"stale shard")
    (out / "NOTES.md").write_text("my notes")
    (out / "my_eval_runs" / "run-1").mkdir(parents=True)
    (out / "my_eval_runs" / "run-1" / "results.json").write_text('{"acc": 0.5}')
    (out / "plots" / "mine.png").write_bytes(b"my own plot")  # inside a directory hfcompress writes

    result = convert(*command, "--overwrite")
    assert result.exit_code == 0, result.output
    assert (out / "NOTES.md").read_text() == "my notes"
    assert (out / "my_eval_runs" / "run-1" / "results.json").read_text() == '{"acc": 0.5}'
    assert (out / "plots" / "mine.png").read_bytes() == b"my own plot" and (out / "plots" / "similarity.png").is_file()
    assert not (out / "model-00002-of-00002.safetensors").exists()
    files = json.loads((out / "hfcompress_report.json").read_text())["files"]
    assert "NOTES.md" not in files and not [f for f in files if f.startswith("my_eval_runs")]  # still the user's
    assert not beside(out)


def test_overwrite_of_an_earlier_output_without_a_file_list(tmp_path):
    """A report from before the list of files: the names hfcompress writes are the earlier run's, the rest the user's."""
    from hfcompress.conversion.output import user_entries

    earlier = tmp_path / "o"
    (earlier / "plots").mkdir(parents=True)
    for name in ("hfcompress_report.json", "config.json", "model-00001-of-00002.safetensors", "tokenizer.json",
                 "modeling_lisa_llama.py", "README.md", "NOTICE", "NOTES.md", "eval.json"):  # fmt: skip
        (earlier / name).write_text("{}")
    (earlier / "my_eval_runs").mkdir()
    assert user_entries(earlier) == ["NOTES.md", "eval.json", "my_eval_runs"]
    (earlier / "hfcompress_report.json").write_text(json.dumps({"files": ["config.json", "plots/similarity.png"]}))
    assert "NOTES.md" in user_entries(earlier) and "config.json" not in user_entries(earlier)
    assert "plots" not in user_entries(earlier) and "README.md" in user_entries(earlier)  # the list is what it wrote


def test_overwrite_still_refuses_a_directory_that_is_no_output(tiny_llama_dir, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "NOTES.md").write_text("my notes")
    result = convert(str(tiny_llama_dir), "--out", str(out), "--overwrite")
    assert result.exit_code == 2 and "is not an hfcompress output" in result.output, result.output
    assert [p.name for p in out.iterdir()] == ["NOTES.md"]


def test_public_paths():
    from hfcompress.evidence.report import public_command, without_local_paths

    assert public_command(["convert", "/home/alice/models/tiny", "--out=/tmp/x/o", "--calib-text", "~/c.txt", "me/model",
                           "--out", "rel/o"]) == "hfcompress convert tiny --out=o --calib-text c.txt me/model --out rel/o"  # fmt: skip
    text = "/home/alice/corpus.txt, first 75%; 12 tokens/s, 1/4, https://huggingface.co/me/model, (~/x/y.txt)"
    assert without_local_paths({"a": [text]}) == {"a": ["corpus.txt, first 75%; 12 tokens/s, 1/4, https://huggingface.co/me/model, (y.txt)"]}


@pytest.mark.slow  # a real conversion or CLI process: the fast tier stays under 5 minutes
def test_no_absolute_local_path_in_the_output(warm, tmp_path, tmp_path_factory):
    """Every file of the output (what `push` uploads) is free of the local directories: the source's, the output's,
    the cache's, a text file's, this checkout's, the home directory. A real process, so the command line is real."""
    tiny, cache = warm
    out = tmp_path / "o"
    text = tmp_path / "my texts" / "notes.txt"
    text.parent.mkdir()
    text.write_text(" ".join(f"Paragraph {i} says something plain about the weather and the sea." for i in range(400)))
    args = [arg if arg != "none" else str(text) for arg in FAST]  # --ood-text: a file given by its absolute path
    proc = subprocess.run(**cli("convert", str(tiny), "--out", str(out), "--max-ppl-increase", "1000", *args, cache=cache),
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    local = {str(tmp_path_factory.getbasetemp()), str(Path.cwd()), str(Path.home()), sys.prefix, "/tmp/"}
    leaks = {str(p.relative_to(out)): [d for d in local if d.encode() in p.read_bytes()] for p in out.rglob("*") if p.is_file()}
    assert not {name: dirs for name, dirs in leaks.items() if dirs}, leaks
    report = json.loads((out / "hfcompress_report.json").read_text())
    assert report["source"]["name"] == report["source"]["path"] == tiny.name
    assert report["calibration"]["cache_dir"] == Path(report["calibration"]["cache_dir"]).name
    assert report["command"].startswith(f"hfcompress convert {tiny.name} --out o ") and "--ood-text notes.txt" in report["command"]
    assert f"hfcompress convert {tiny.name} --out o" in (out / "README.md").read_text()


@pytest.fixture(scope="module")
def wide_vocabulary(tmp_path_factory) -> Path:
    """A tiny Llama with a 2048-token vocabulary: its embeddings and lm_head (rest.safetensors, 1.05 MB) are the
    largest file a conversion writes into the cache, and the output's one shard (1.6 MB) is larger still."""
    from tests.tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("wide") / "tiny-wide", vocab_size=2048)


@pytest.mark.parametrize(
    "limit_kb, where", [(700, "rest.safetensors"), (1200, "model.safetensors")], ids=["cache-safetensors", "output-shard"]
)
@pytest.mark.slow  # a real conversion or CLI process: the fast tier stays under 5 minutes
def test_file_size_limit_while_writing_weights(wide_vocabulary, tmp_path, limit_kb, where):
    """A real file size limit (RLIMIT_FSIZE, as a full disk) reached by safetensors' writer in the cache (it raised
    SafetensorError, a traceback and exit 1) or by the output's shard: one sentence, exit 5, the earlier output and
    the user's file in it untouched, nothing partial beside it or in the cache, the work done so far cached."""
    out, cache = tmp_path / "o", tmp_path / "cache"
    out.mkdir()
    (out / "hfcompress_report.json").write_text('{"earlier": true}')
    (out / "NOTES.md").write_text("my notes")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    command = ["convert", str(wide_vocabulary), "--out", str(out), "--overwrite", "--max-ppl-increase", "1000", *FAST]
    proc = subprocess.run(**cli(*command, cache=cache, limit=limit_kb * 1024), timeout=600)
    assert proc.returncode == 5, proc.stderr[-3000:]
    message = one_sentence(proc.stderr)
    assert "File too large" in message and where in message and "rerun the same command" in message, message
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and not beside(out)
    assert list(cache.rglob("hidden-*.pt")) and list(cache.rglob("layer-*.safetensors"))  # kept for the rerun
    assert not [p for p in cache.rglob("*") if ".partial-" in p.name]


def write_llama_gguf(source: Path, dest: Path) -> Path:
    """A float32 llama GGUF of a tiny checkpoint (gguf's own writer): its config, BPE tokenizer and tensors, the
    embeddings first, as llama.cpp orders them."""
    import numpy as np
    from gguf import GGUFWriter, TokenType

    config = json.loads((source / "config.json").read_text())
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    tensors = load_file(source / "model.safetensors")
    writer = GGUFWriter(str(dest), "llama")
    writer.add_name("tiny")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    vocab = [token for token, _ in sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])]
    special = {token["content"] for token in tokenizer.get("added_tokens", [])}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types([TokenType.CONTROL if token in special else TokenType.NORMAL for token in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    names = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}  # fmt: skip
    layers = [key for key in tensors if key.startswith("model.layers.")]
    for key in ["model.embed_tokens.weight", *layers, "model.norm.weight", "lm_head.weight"]:
        if key in names:
            name = names[key]
        else:  # model.layers.I.PART.weight
            index, part = key.split(".")[2], ".".join(key.split(".")[3:-1])
            name = f"blk.{index}.{parts[part]}"
        writer.add_tensor(f"{name}.weight", np.ascontiguousarray(tensors[key], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


@pytest.mark.slow  # a real conversion or CLI process: the fast tier stays under 5 minutes
def test_file_size_limit_while_dequantising_a_gguf(wide_vocabulary, tmp_path):
    """The GGUF's one-time float32 copy in the cache meets a real file size limit at its first part (the 512 KB
    embeddings): one sentence, exit 5 (it was SafetensorError, a traceback, and the half-written copy stayed)."""
    gguf = write_llama_gguf(wide_vocabulary, tmp_path / "tiny-wide.gguf")
    out, cache = tmp_path / "o", tmp_path / "cache"
    proc = subprocess.run(**cli("convert", str(gguf), "--out", str(out), *FAST, cache=cache, limit=300 * 1024), timeout=600)
    assert proc.returncode == 5, proc.stderr[-3000:]
    message = one_sentence(proc.stderr)
    assert "File too large" in message and "part-00000.safetensors" in message and "rerun" in message, message
    assert not out.exists() and not beside(out)
    assert not [p for p in cache.rglob("*") if p.name.startswith("gguf-")]  # no partial copy, none that looks done


def wait_for(condition, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.slow  # a real conversion or CLI process: the fast tier stays under 5 minutes
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_termination_signal_is_handled_like_ctrl_c(warm, tmp_path, signum):
    """What `timeout`, systemd and job schedulers send, while the output is being written (its partial directory
    exists): one sentence, exit 128 + the signal, no output, nothing beside it (partial directory, lock), the cache
    kept for the rerun."""
    tiny, cache = warm
    out = tmp_path / "o"
    proc = subprocess.Popen(**cli("convert", str(tiny), "--out", str(out), "--max-ppl-increase", "1000", *FAST, cache=cache))
    try:
        wait_for(lambda: any(".partial-" in name for name in beside(out)) or proc.poll() is not None)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, stderr[-3000:]
    message = one_sentence(stderr)
    assert f"interrupted by {signal.Signals(signum).name}" in message and "rerun the same command" in message
    assert not out.exists() and not beside(out)
    assert list(cache.rglob("hidden-*.pt"))


@pytest.mark.slow  # a real conversion or CLI process: the fast tier stays under 5 minutes
def test_killed_run_leftovers_are_removed_by_the_next_run(warm, tmp_path, monkeypatch):
    """SIGKILL cannot be handled: its partial output directory stays, until the next run into the same --out removes
    it. A partial directory of a run that is still alive is left alone."""
    tiny, cache = warm
    out = tmp_path / "o"
    command = [str(tiny), "--out", str(out), "--max-ppl-increase", "1000", *FAST]
    proc = subprocess.Popen(**cli("convert", *command, cache=cache))
    try:
        wait_for(lambda: any(".partial-" in name for name in beside(out)) or proc.poll() is not None)
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    killed = [name for name in beside(out) if f".partial-{proc.pid}-" in name]
    assert killed and not out.exists()
    alive = tmp_path / f".o.partial-{os.getpid()}-0a1b2c3d"  # a live run's (this process)
    alive.mkdir()

    monkeypatch.setenv("HFCOMPRESS_CACHE", str(cache))
    result = convert(*command)
    assert result.exit_code == 0, result.output
    assert beside(out) == [alive.name] and (out / "hfcompress_report.json").is_file()


def test_an_output_moved_aside_by_a_killed_run_is_put_back(tmp_path):
    from hfcompress.conversion.atomic import remove_leftovers

    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is no process's now
    out = tmp_path / "o"
    moved = tmp_path / f".o.old-{dead.pid}"
    moved.mkdir()
    (moved / "hfcompress_report.json").write_text("{}")
    remove_leftovers(out)  # killed between moving the earlier output aside and renaming the new one into place
    assert (out / "hfcompress_report.json").is_file() and not moved.exists()
    moved.mkdir()
    remove_leftovers(out)  # killed after the swap: `out` is the newer output
    assert not moved.exists() and (out / "hfcompress_report.json").is_file()


# ------------------------------------------------------------------------------------------------------- push
@pytest.fixture
def output_dir(tiny_llama_dir, tmp_path) -> Path:
    """A stand-in for a finished output directory (push only reads files)."""
    directory = tmp_path / "tiny-lisa"
    directory.mkdir()
    for f in tiny_llama_dir.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    report = {"validation": {"gate_passed": True, "gate_message": "perplexity 10 -> 10.5 (+5%), limit +10%"}}
    (directory / "hfcompress_report.json").write_text(json.dumps(report))
    (directory / "README.md").write_text("---\nlibrary_name: transformers\n---\n# tiny-lisa\n")
    return directory


def push(directory: Path, repo: str, *flags: str):
    return runner.invoke(app, ["push", str(directory), repo, *flags])


def commit_requests(hub, repo: str) -> int:
    return len(hub.requests_matching("POST", f"/api/models/{repo}/commit/"))


def remote_files(hub, repo: str) -> set[str]:
    return set(hub.files(repo)) - {".gitattributes"}


@pytest.mark.parametrize("fault", [503, 500, 429, "stall:1.5", "reset"], ids=str)
def test_push_retries_transient_failures(hub_inprocess, output_dir, monkeypatch, fault):
    monkeypatch.setenv("HFCOMPRESS_HTTP_TIMEOUT", "1")  # a stalled commit times out after 1 s
    repo = f"{HUB_USER}/tiny-lisa"
    hub_inprocess.inject_fault("POST", f"/api/models/{repo}/commit/", fault, fault)
    result = push(output_dir, repo)
    assert result.exit_code == 0, result.output
    assert commit_requests(hub_inprocess, repo) == 3
    assert remote_files(hub_inprocess, repo) == {p.name for p in output_dir.iterdir()}
    assert len([c for c in hub_inprocess.commits(repo) if "hfcompress" in str(c)]) == 1


@pytest.mark.slow  # push checks the output loads in a fresh process (~10 s): the fast tier stays under 5 minutes
def test_push_gives_up_without_half_updating_the_repo(hub_inprocess, output_dir):
    repo = f"{HUB_USER}/tiny-lisa"
    old = {"README.md": b"old card", "config.json": b"{}", "model-00001-of-00002.safetensors": b"old shard"}
    hub_inprocess.create_repo(repo)
    hub_inprocess.upload_files(repo, old)
    old_head = hub_inprocess.head(repo)
    hub_inprocess.inject_fault("POST", f"/api/models/{repo}/commit/", *[503] * 10)
    before = {p.name: p.read_bytes() for p in output_dir.iterdir()}

    result = push(output_dir, repo)
    assert result.exit_code == 4, result.output
    assert f"hfcompress push {output_dir} {repo}" in " ".join(result.output.split())
    assert commit_requests(hub_inprocess, repo) == 4  # bounded
    assert hub_inprocess.head(repo) == old_head and remote_files(hub_inprocess, repo) == set(old)
    assert {p.name: p.read_bytes() for p in output_dir.iterdir()} == before  # local output kept

    hub_inprocess.faults.clear()
    result = push(output_dir, repo)  # the command the message gave
    assert result.exit_code == 0, result.output
    assert remote_files(hub_inprocess, repo) == set(before)  # the complete new set, old shard gone, one commit
    assert hub_inprocess.commits(repo)[1]["oid"] == old_head


@pytest.mark.slow  # push checks the output loads in a fresh process (~10 s): the fast tier stays under 5 minutes
def test_push_does_not_double_retry_what_huggingface_hub_retries(hub_inprocess, output_dir):
    repo = f"{HUB_USER}/tiny-lisa"
    hub_inprocess.inject_fault("POST", f"/api/models/{repo}/preupload/", *[503] * 10)
    result = push(output_dir, repo)
    assert result.exit_code == 4, result.output
    assert len(hub_inprocess.requests_matching("POST", "/preupload/")) == 6  # huggingface_hub's 1 + 5 retries, once
    assert commit_requests(hub_inprocess, repo) == 0


@pytest.mark.slow  # push checks the output loads in a fresh process (~10 s): the fast tier stays under 5 minutes
def test_push_auth_errors_are_not_retried(hub_inprocess, output_dir, monkeypatch):
    repo = f"{HUB_USER}/tiny-lisa"
    hub_inprocess.inject_fault("POST", f"/api/models/{repo}/commit/", 401)
    result = push(output_dir, repo)
    assert result.exit_code == 4 and "refused the push" in result.output and "hf auth login" in result.output
    assert commit_requests(hub_inprocess, repo) == 1

    # a real read-only token: creating the (existing) repo passes, the upload is refused mid-way
    hub_inprocess.add_token(SECRET, HUB_USER, write=False)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    result = push(output_dir, repo)
    assert result.exit_code == 4 and "HTTP 403" in result.output, result.output
    assert f"hfcompress push {output_dir} {repo}" in " ".join(result.output.split())
    assert remote_files(hub_inprocess, repo) == set()


def test_token_echoed_by_the_server_is_redacted(hub_inprocess, output_dir, monkeypatch):
    repo = f"{HUB_USER}/tiny-lisa"
    hub_inprocess.add_token(SECRET, HUB_USER)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    hub_inprocess.inject_fault("POST", f"/api/models/{repo}/commit/", "echo-auth:403")
    result = push(output_dir, repo)
    assert result.exit_code == 4
    assert "Bearer hf_***" in result.output and SECRET not in result.output


def test_gate_failed_directory_needs_force(hub_inprocess, output_dir):
    repo = f"{HUB_USER}/tiny-lisa"
    report = {"validation": {"gate_passed": False, "gate_message": "perplexity 10 -> 20 (+100%), limit +10%"}}
    (output_dir / "hfcompress_report.json").write_text(json.dumps(report))
    result = push(output_dir, repo)
    assert result.exit_code == 3 and "failed the quality gate" in result.output and "--force" in result.output
    assert repo not in hub_inprocess.repo_ids()
    assert push(output_dir, repo, "--force").exit_code == 0
    assert "hfcompress_report.json" in remote_files(hub_inprocess, repo)


@pytest.mark.slow  # push checks the output loads in a fresh process (~10 s): the fast tier stays under 5 minutes
def test_push_uploads_only_what_hfcompress_wrote(hub_inprocess, output_dir):
    """The user's notes and evaluation runs that --overwrite keeps in an output are never uploaded: only the files the
    report lists (or, for a report from before that list, the names hfcompress writes), each of them; the console
    names what was left out."""
    ours = sorted(p.name for p in output_dir.iterdir()) + ["plots/similarity.png"]
    (output_dir / "plots").mkdir()
    (output_dir / "plots" / "similarity.png").write_bytes(b"png")
    (output_dir / "NOTES.md").write_text("my private notes")
    (output_dir / "my_eval_runs" / "run-1").mkdir(parents=True)
    (output_dir / "my_eval_runs" / "run-1" / "results.json").write_text('{"acc": 0.5}')
    old_report = json.loads((output_dir / "hfcompress_report.json").read_text())
    for repo, report in ((f"{HUB_USER}/listed", {**old_report, "files": ours}), (f"{HUB_USER}/unlisted", old_report)):
        (output_dir / "hfcompress_report.json").write_text(json.dumps(report))
        result = push(output_dir, repo)
        assert result.exit_code == 0, result.output
        assert remote_files(hub_inprocess, repo) == set(ours), repo
        said = " ".join(result.output.split())
        assert "leaving out 2 files that hfcompress did not write (NOTES.md, my_eval_runs/run-1/results.json)" in said


@pytest.mark.slow  # a real conversion or CLI process: the fast tier stays under 5 minutes
def test_push_interrupted_by_sigterm_says_the_output_is_complete(local_hub, hub_env, output_dir):
    """SIGTERM while the commit is in flight: not "nothing was written" but the complete output and the command that
    pushes it; exit 143, nothing half-pushed, the output untouched."""
    repo = f"{HUB_USER}/tiny-lisa"
    local_hub.inject_fault("POST", f"/api/models/{repo}/commit/", "stall:20")  # the commit hangs until the signal
    before = {p.name: p.read_bytes() for p in output_dir.iterdir()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hfcompress.cli", "push", str(output_dir), repo], text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env={**hub_env, "HFCOMPRESS_HTTP_TIMEOUT": "60", "COLUMNS": "300"},
    )
    try:
        wait_for(lambda: local_hub.requests_matching("POST", f"/api/models/{repo}/commit/") or proc.poll() is not None)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr[-3000:]
    message = one_sentence(stderr)
    assert message.startswith("interrupted by SIGTERM: the output in") and "is complete and kept" in message, message
    assert f"run `hfcompress push {output_dir} {repo}` to push it" in message and "nothing was written" not in message
    assert remote_files(local_hub, repo) == set()
    assert {p.name: p.read_bytes() for p in output_dir.iterdir()} == before


# -------------------------------------------------------------------------------- forced push, no token leaked
@pytest.mark.slow  # push checks the output loads in a fresh process (~10 s): the fast tier stays under 5 minutes
def test_forced_push_card_and_no_token_anywhere(warm, local_hub, tmp_path):
    """A real process: every line it logs, every file it writes, and what it pushes is free of the token."""
    tiny, cache = warm
    local_hub.add_token(SECRET, HUB_USER)
    repo = f"{HUB_USER}/tiny-lisa"
    out = tmp_path / "o"
    env = {
        **subprocess_env(local_hub.url, tmp_path / "hf_home", SECRET),
        "HFCOMPRESS_CACHE": str(cache), "HFCOMPRESS_RETRY_DELAY": "0.05", "COLUMNS": "250",
    }
    local_hub.inject_fault("POST", f"/api/models/{repo}/commit/", "echo-auth:503")  # retried; logs it
    proc = subprocess.run(
        [sys.executable, "-m", "hfcompress.cli", "convert", str(tiny), "--out", str(out), "--push-to", repo,
         "--max-ppl-increase", "0", "--force", "--no-back-off", "--share-ratio", "0.25", "--kv-budget", "1.0", *FAST],
        # any increase fails the gate: one shared layer's (the tiny model's keys lose nothing)
        env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "retry 1/3" in proc.stderr  # the echoed failure went through the log

    card = local_hub.read_file(repo, "README.md").decode()
    assert "failed the hfcompress quality gate" in card and "--force" in card
    assert json.loads(local_hub.read_file(repo, "hfcompress_report.json"))["validation"]["gate_passed"] is False

    assert SECRET not in proc.stdout + proc.stderr
    written = [p for root in (out, cache) for p in root.rglob("*") if p.is_file()]
    assert {"config.json", "README.md", "hfcompress_report.json"} <= {p.name for p in written}
    assert not [p for p in written if SECRET.encode() in p.read_bytes()]
    assert not [f for f in local_hub.files(repo) if SECRET.encode() in local_hub.read_file(repo, f)]


def test_code_fingerprint_covers_what_a_conversion_caches_and_nothing_else():
    """The cache key's code hash reads every module that computes what a conversion caches (statistics, fits, trained
    weights), and not the serving plugin, the card or the eval command: editing those keeps hours of calibration."""
    import hfcompress
    from hfcompress.conversion.calibrate import fingerprinted_sources

    package = Path(hfcompress.__file__).resolve().parent
    names = {str(p.relative_to(package)) for p in fingerprinted_sources(package)}
    assert {"conversion/passes.py", "conversion/calibrate.py", "lisa/fit.py", "fasc/__init__.py", "distill/__init__.py",
            "evidence/validate.py", "cli.py"} <= names
    assert not {"evidence/card.py", "evidence/evaluate.py", "serving/vllm_engine.py"} & names
