"""Issue #7: every bad input, fault and interruption gives one clear sentence and an exit code; nothing is lost and
no token leaks.

The Hub is the real local server of tests/hub_server.py driven by the real huggingface_hub client; models are tiny
random Llamas. The CLI runs in-process (CliRunner), except where real stderr logging matters (a subprocess).
"""

import errno
import json
import shutil
import socket
import subprocess
import sys
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

    from hfcompress.source import resolve_source

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
    assert_refused(convert(str(tiny_llama_dir), "--out", str(out)), 2, "tokenizer", "cannot be loaded", out=out)
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
    result = convert(str(tiny_llama_dir), "--out", str(out), "--share-ratio", "0", *FAST)
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
    from hfcompress.source import load_source, resolve_source

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
    command = [str(tiny), "--out", str(out), "--max-ppl-increase", "1000", "--fasc-budget", "0.8", *FAST]

    with monkeypatch.context() as m:
        interrupt_at(m, "validate: perplexity")  # after calibration, the fits and every converted layer
        result = convert(*command)
    assert result.exit_code == 130 and "interrupted" in result.output and "resume" in result.output
    assert not out.exists() and not leftovers(tmp_path)
    before = {k: v for k, v in cache_state(cache).items() if "/convert-" not in k}  # the layer files go into the output
    kinds = {name.split("/")[-1].split("-")[0].removesuffix(".pt") for name in before}
    assert {"hidden", "similarity", "fit", "grad", "factors"} <= kinds, before  # statistics and trained modules

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
    from hfcompress.stream import LayerStream

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
    import hfcompress.output as convert_module

    tiny, cache = warm
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(cache))
    out = tmp_path / "o"
    out.mkdir()
    (out / "earlier.txt").write_text("an earlier conversion")
    (out / "hfcompress_report.json").write_text("{}")  # --overwrite replaces only an earlier output
    real_write_output_dir = convert_module.write_output_dir

    def disk_fills_up(out_dir, overwrite, write):
        def write_until_full(tmp: Path) -> None:
            (tmp / "model.safetensors").write_bytes(b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "model.safetensors"))

        return real_write_output_dir(out_dir, overwrite, write_until_full)

    monkeypatch.setattr(convert_module, "write_output_dir", disk_fills_up)
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
    import hfcompress.calibrate as calibrate

    def no_space(obj, path):
        Path(path).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(calibrate.torch, "save", no_space)
    assert calibrate.load_or_compute(tmp_path / "stats.pt", lambda: {"x": 1}) == {"x": 1}
    assert list(tmp_path.iterdir()) == []  # no partial file left behind


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


def test_push_does_not_double_retry_what_huggingface_hub_retries(hub_inprocess, output_dir):
    repo = f"{HUB_USER}/tiny-lisa"
    hub_inprocess.inject_fault("POST", f"/api/models/{repo}/preupload/", *[503] * 10)
    result = push(output_dir, repo)
    assert result.exit_code == 4, result.output
    assert len(hub_inprocess.requests_matching("POST", "/preupload/")) == 6  # huggingface_hub's 1 + 5 retries, once
    assert commit_requests(hub_inprocess, repo) == 0


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


# -------------------------------------------------------------------------------- forced push, no token leaked
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
         "--max-ppl-increase", "-100", "--force", "--no-back-off", *FAST],
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
    from hfcompress.calibrate import fingerprinted_sources

    package = Path(hfcompress.__file__).resolve().parent
    names = {str(p.relative_to(package)) for p in fingerprinted_sources(package)}
    assert {"passes.py", "calibrate.py", "lisa/fit.py", "fasc/__init__.py", "distill/__init__.py", "validate.py", "cli.py"} <= names
    assert not {"card.py", "evaluate.py", "vllm_engine.py", "vllm_plugin/model.py", "vllm_plugin/lowrank.py"} & names
