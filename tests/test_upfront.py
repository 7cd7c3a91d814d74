"""Issue #43: failures a user can trust. What the options and the source's small files tell is refused before any
model work, in one sentence with the documented exit code; `push` verifies the output before any network call.

Real files on disk and real CLI runs (CliRunner, or a subprocess where a fresh process matters), the local Hub server
(tests/hub_server.py) with the real huggingface_hub client for the pushes; tiny random Llamas (tests/tiny_models.py).
"""

import json
import shutil
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hfcompress.cli import app
from tests.conftest import HUB_USER
from tests.helpers import one_error

runner = CliRunner()
FAST = [
    "--calib-sequences", "6", "--seq-len", "64", "--eval-tokens", "256", "--lisa-steps", "5", "--protect-first", "1",
    "--no-probe", "--no-speed", "--no-peers", "--distill-tokens", "0", "--calib-text", "builtin", "--eval-text", "builtin",
    "--ood-text", "none", "--max-ppl-increase", "1000",
]
QUICK = 20  # seconds: a refusal before any model work (CliRunner in this process; generous for a busy 2-core machine)


def refused_before_work(args: list[str], cache: Path, out: Path, exit_code: int, *needles: str) -> str:
    """Run `hfcompress ARGS`; it must be refused with `exit_code` and the needles in one sentence, quickly, with
    nothing in the calibration cache and no --out written."""
    start = time.perf_counter()
    text = one_error(runner.invoke(app, args), exit_code, *needles)
    assert time.perf_counter() - start < QUICK
    assert "Traceback" not in text
    assert not [p for p in cache.rglob("*") if p.is_file()] and not out.exists(), text
    return text


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("HFCOMPRESS_CACHE", str(path))
    return path


# ------------------------------------------------------------------------------- item 1: the source's small files
def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    path.write_text(json.dumps(change(data)))


@pytest.mark.parametrize(
    "file, content, needles",
    [
        ("config.json", "[1, 2]", ["config.json holds a JSON list, not an object"]),
        ("config.json", '"llama"', ["config.json holds a JSON str, not an object"]),
        ("config.json", lambda c: {**c, "num_hidden_layers": "four"},
         ["config.json of", 'num_hidden_layers = "four", not a whole number > 0']),
        ("config.json", lambda c: {**c, "hidden_size": 64.5}, ["hidden_size = 64.5, not a whole number > 0"]),
        ("config.json", lambda c: {**c, "num_key_value_heads": 3},
         ["num_attention_heads = 4, not a multiple of num_key_value_heads = 3"]),
        ("config.json", lambda c: {**c, "max_position_embeddings": None, "rms_norm_eps": "small"},
         ['rms_norm_eps = "small", not a number']),
        ("config.json", lambda c: {**c, "tie_word_embeddings": "no"}, ['tie_word_embeddings = "no", not true or false']),
        ("config.json", lambda c: {**c, "model_type": ["llama"]}, ['model_type = ["llama"], not a name']),
        ("tokenizer_config.json", "[]", ["tokenizer_config.json holds a JSON list, not an object"]),
        ("tokenizer.json", "{not json", ["tokenizer.json is not valid JSON"]),
        ("tokenizer.json", "{}", ["The tokenizer of", "cannot be loaded", "tokenizer.json or tokenizer.model"]),
        ("model.safetensors.index.json", "7", ["model.safetensors.index.json holds a JSON int, not an object"]),
        ("model.safetensors.index.json", {"weight_map": ["model.safetensors"]},
         ["model.safetensors.index.json of", "has no weight_map of tensor names to shard files"]),
        ("model.safetensors.index.json", {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}},
         ["names the shard model-00002-of-00002.safetensors, which is not there"]),
    ],
    ids=["config-list", "config-string", "layers-string", "hidden-float", "kv-heads", "eps-string", "tie-string",
         "model-type-list", "tokenizer-config-list", "tokenizer-not-json", "tokenizer-empty", "index-int",
         "index-no-map", "index-missing-shard"],
)
def test_a_malformed_source_file_is_named_before_any_model_work(tiny_llama_dir, tmp_path, cache, file, content, needles):
    path = tiny_llama_dir / file
    if callable(content):
        _edit_json(path, content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    out = tmp_path / "o"
    refused_before_work(["convert", str(tiny_llama_dir), "--out", str(out), *FAST], cache, out, 2, *needles)


def test_a_hub_source_with_a_broken_index_downloads_no_weights(tiny_llama_dir, hub_inprocess, tmp_path, cache):
    """The index is fetched and checked before the snapshot: its missing shard is named and no weight is downloaded."""
    repo = f"{HUB_USER}/broken-index"
    files = {p.name: p.read_bytes() for p in tiny_llama_dir.iterdir()}
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    hub_inprocess.upload_files(repo, {**files, "model.safetensors.index.json": json.dumps(index).encode()})
    out = tmp_path / "o"
    refused_before_work(["convert", repo, "--out", str(out), *FAST], cache, out, 2,
                        f"The model.safetensors.index.json of Hub repo {repo} names the shard model-00001-of-00002.safetensors")
    assert not hub_inprocess.requests_matching("GET", ".safetensors?") and not [
        r for r in hub_inprocess.requests if r.path.endswith("model.safetensors")
    ]


def test_a_hub_source_whose_plan_does_not_fit_downloads_no_weights(tiny_llama_dir, hub_inprocess, tmp_path, cache):
    """The options are checked against the Hub source's config.json before its weights are downloaded."""
    repo = f"{HUB_USER}/plan-check"
    hub_inprocess.upload_files(repo, {p.name: p.read_bytes() for p in tiny_llama_dir.iterdir()})
    out = tmp_path / "o"
    refused_before_work(["convert", repo, "--out", str(out), *FAST[: FAST.index("--protect-first")], "--no-probe",
                         "--no-speed", "--no-peers", "--calib-text", "builtin", "--lisa-layers", "2,7"], cache, out, 2,
                        "--lisa-layers [7] are out of range")  # fmt: skip
    assert not [r for r in hub_inprocess.requests if r.path.endswith(".safetensors")]


# ---------------------------------------------------------------------------------- item 2: the options up front
PLAN_BASE = FAST[: FAST.index("--protect-first")] + ["--no-probe", "--no-speed", "--no-peers", "--calib-text", "builtin"]
PLAN_CASES = [
    (["--lisa-layers", "3", "--drop-attention-layers", "2"],
     ["--lisa-layers 3 cannot be shared: it reads the attention of layer 2 below it, which --drop-attention-layers drops"]),
    (["--lisa-layers", "2,3", "--drop-attention-layers", "3"],
     ["--lisa-layers and --drop-attention-layers both name layer 3"]),
    (["--lisa-layers", "1", "--protect-first", "2"],
     ["--lisa-layers 1 is among the 2 shallow layers --protect-first keeps unshared", "--protect-first 1 or less"]),
    (["--lisa-layers", "2,7"], ["--lisa-layers [7] are out of range: layers 1..3 can be shared"]),
    (["--drop-attention-layers", "4"], ["--drop-attention-layers [4] are out of range: give layers 1..3"]),
    (["--share-ratio", "0.75", "--protect-first", "3"], ["--share-ratio 0.75 asks for 3 shared layers but only 1"]),
    (["--lisa-ppl-budget", "5", "--protect-first", "4"], ["--lisa-ppl-budget has no layer to search", "--protect-first 4"]),
    (["--lisa-group-heads", "--lisa-align", "dense"], ["--lisa-group-heads matches heads for sparse Align"]),
    (["--max-ppl-increase", "-5"], ["--max-ppl-increase must be a finite percentage >= 0", "got -5.0"]),
    (["--distill-tokens", str(10**12)], ["--distill-tokens 1000000000000 is more than one process can train on",
                                         "--distill-tokens 10000000000 or less"]),
    (["--distill-tokens", "4096", "--distill-seq-len", "512"], ["--distill-seq-len 512 is longer than the model's context"]),
]


@pytest.mark.parametrize("flags, needles", PLAN_CASES, ids=[" ".join(f) for f, _ in PLAN_CASES])
def test_contradictions_of_the_plan_and_the_model_are_refused_up_front(tiny_llama_dir, tmp_path, cache, flags, needles):
    """Before calibration (nothing in the cache), in seconds; the first was refused only after calibration before."""
    out = tmp_path / "o"
    refused_before_work(["convert", str(tiny_llama_dir), "--out", str(out), *PLAN_BASE, *flags], cache, out, 2, *needles)


def test_an_unwritable_cache_is_refused_before_the_work(tiny_llama_dir, tmp_path, monkeypatch):
    """HFCOMPRESS_CACHE where nothing can be written (procfs) or under a file: exit 5 at once, not at calibration."""
    a_file = tmp_path / "file"
    a_file.write_text("keep")
    out = tmp_path / "o"
    for cache in ("/proc/hfcompress-test/cache", str(a_file / "cache")):
        monkeypatch.setenv("HFCOMPRESS_CACHE", cache)
        start = time.perf_counter()
        one_error(runner.invoke(app, ["convert", str(tiny_llama_dir), "--out", str(out), *FAST]), 5,
                  f"The hfcompress cache {cache} cannot be written", "set HFCOMPRESS_CACHE to a directory you can write")
        assert time.perf_counter() - start < QUICK and not out.exists()
    assert a_file.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["file", "tiny-llama"]


def test_every_option_of_convert_has_its_upfront_check_listed():
    """preflight.CHECKED_OPTIONS names where each option of `convert` is checked: a new option must be added there."""
    import typer.main

    from hfcompress.conversion.preflight import CHECKED_OPTIONS

    command = typer.main.get_command(app).commands["convert"]
    flags = {next((o for o in p.opts if o.startswith("--")), p.name) for p in command.params}
    assert flags == set(CHECKED_OPTIONS), (flags ^ set(CHECKED_OPTIONS))


@pytest.mark.parametrize("command", ["eval", "analyze-json", "analyze-plot"])
def test_result_files_are_checked_before_the_work(tiny_llama_dir, tmp_path, cache, command):
    """`eval --json DIR` failed after the whole evaluation; `analyze --plot/--json` the same after calibration."""
    a_dir = tmp_path / "results"
    a_dir.mkdir()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep")
    flag = "--plot" if command == "analyze-plot" else "--json"
    if command == "eval":
        args = ["eval", str(tiny_llama_dir), "--trust-remote-code", "--no-speed", "--no-probe", "--eval-text", "builtin"]
    else:
        args = ["analyze", str(tiny_llama_dir), "--calib-text", "builtin", "--calib-sequences", "4", "--seq-len", "32"]
    cases = [
        (a_dir, 2, f"{flag} {a_dir} is a directory: give the path of a file to write"),
        (a_file / "x.json", 2, f"{a_file} is a file, not a directory"),
        (Path("/proc/hfcompress-test/x.json"), 5, "cannot be written (", "in /proc): choose a path you can write"),
    ]
    for path, code, *needles in cases:
        start = time.perf_counter()
        text = one_error(runner.invoke(app, [*args, flag, str(path)]), code, *needles)
        assert time.perf_counter() - start < QUICK and "perplexity" not in text.split("error:")[0]
    assert not cache.exists() and a_file.read_text() == "keep" and not any(a_dir.iterdir())


# ------------------------------------------------------------------------------ item 3: push verifies the output
@pytest.fixture(scope="module")
def converted(warm, tmp_path_factory) -> Path:
    """A real conversion of the tiny Llama, in three weight shards with an index (--max-shard-size 300KB)."""
    tiny, cache = warm
    out = tmp_path_factory.mktemp("converted") / "tiny-lisa"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HFCOMPRESS_CACHE", str(cache))
        result = runner.invoke(app, ["convert", str(tiny), "--out", str(out), "--max-shard-size", "300KB", *FAST])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors.index.json").is_file() and (out / "modeling_lisa_llama.py").is_file()
    return out


def _copy(converted: Path, tmp_path: Path) -> Path:
    out = tmp_path / "tiny-lisa"
    shutil.copytree(converted, out)
    return out


def _shard(out: Path) -> str:
    return sorted(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()))[-1]


BROKEN = {
    "auto-map-file": (lambda out: (out / "modeling_lisa_llama.py").unlink(),
                      ["lacks modeling_lisa_llama.py, which config.json's auto_map names"]),
    "imported-module": (lambda out: (out / "lisa_attention.py").unlink(),
                        ["lacks lisa_attention.py, which the remote code imports"]),
    "shard": (lambda out: (out / _shard(out)).unlink(), ["lacks the weight shard model-0000", "which model.safetensors.index.json names"]),
    "syntax": (lambda out: (out / "configuration_lisa.py").write_text("def broken(:\n"),
               ["configuration_lisa.py is not valid remote code (SyntaxError"]),
    "does-not-load": (lambda out: (out / "configuration_lisa.py").open("a").write("\nraise RuntimeError('broken on import')\n"),
                      ["does not load in a fresh process with trust_remote_code=True", "broken on import",
                       "nothing was pushed"]),
}


@pytest.mark.slow  # one tiny conversion (~30 s on 2 busy cores), then fresh-process load checks
@pytest.mark.parametrize("case", list(BROKEN))
def test_push_refuses_an_output_that_would_not_load_before_any_request(converted, hub_inprocess, tmp_path, case):
    """Before: a directory missing its remote code was uploaded with exit 0. Now the missing or broken file is named
    in one sentence, exit 2, and the Hub sees no request at all."""
    out = _copy(converted, tmp_path)
    breaks, needles = BROKEN[case]
    breaks(out)
    text = one_error(runner.invoke(app, ["push", str(out), f"{HUB_USER}/tiny-lisa"]), 2, *needles)
    assert "Traceback" not in text
    assert not hub_inprocess.requests, [r.path for r in hub_inprocess.requests]


@pytest.mark.slow  # shares the conversion above
def test_push_of_a_complete_output_uploads_it(converted, hub_inprocess, tmp_path):
    out = _copy(converted, tmp_path)
    repo = f"{HUB_USER}/tiny-lisa"
    result = runner.invoke(app, ["push", str(out), repo])
    assert result.exit_code == 0, result.output
    local = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert local <= set(hub_inprocess.files(repo))

    report = json.loads((out / "hfcompress_report.json").read_text())
    report["validation"]["gate_passed"] = False
    (out / "hfcompress_report.json").write_text(json.dumps(report))
    one_error(runner.invoke(app, ["push", str(out), repo]), 3, "failed the quality gate", "--force")


# ------------------------------------------------------------------------------------- item 4: true advice
def test_eval_of_a_plain_model_says_what_it_is(tiny_llama_dir, tmp_path):
    """A plain Llama ships no code: the message no longer tells the user to trust code it does not have."""
    text = one_error(runner.invoke(app, ["eval", str(tiny_llama_dir)]), 2,
                     "is not an hfcompress output (no hfcompress_report.json) but a plain 'llama' model that ships no code",
                     f"--baseline {tiny_llama_dir}")
    assert "--trust-remote-code" not in text
    _edit_json(tiny_llama_dir / "config.json", lambda c: {**c, "auto_map": {"AutoConfig": "x.Config"}})
    one_error(runner.invoke(app, ["eval", str(tiny_llama_dir)]), 2, "add --trust-remote-code to run the modeling code")


@pytest.mark.parametrize("args", [["--context", "1"], ["--stride", "0"], ["--context", "64", "--stride", "65"]])
def test_eval_windows_that_make_no_sense_are_refused_before_any_model_loads(tiny_llama_dir, tmp_path, args):
    started = time.perf_counter()
    result = runner.invoke(app, ["eval", str(tiny_llama_dir), "--no-speed", "--no-probe", *args])
    assert result.exit_code == 2 and "--context must be at least 2 tokens and --stride in 1..--context" in " ".join(result.output.split())
    assert time.perf_counter() - started < 20



def test_a_calibration_text_shorter_than_a_distillation_window_is_refused():
    """pipeline.check_resources runs it on the tokenised texts, before calibration (a text file is refused below a
    few thousand words anyway, so the case is a long-context model with a long --distill-seq-len)."""
    from hfcompress.conversion.config import ConvertOptions
    from hfcompress.distill import DistillOptions
    from hfcompress.errors import HfcompressError
    from hfcompress.conversion.preflight import check_distill_text

    options = ConvertOptions(source="x", out=Path("o"), distill=DistillOptions(tokens=4096, seq_len=8192))
    with pytest.raises(HfcompressError, match="has 5000 tokens, fewer than one distillation window of 8191: lower --distill-seq-len"):
        check_distill_text(options, 5000, 1)
    check_distill_text(options, 9000, 1)
    check_distill_text(ConvertOptions(source="x", out=Path("o"), distill=DistillOptions(tokens=0, seq_len=8192)), 5000, 1)
    generated = ConvertOptions(source="x", out=Path("o"), distill=DistillOptions(tokens=4096, seq_len=8192, data="generated"))
    check_distill_text(generated, 5000, 1)  # windows the teacher writes: no text needed


def test_a_perplexity_search_without_a_selection_window_is_refused():
    """--kv-ppl-budget and --lisa-ppl-budget score plans on the calibration text after the calibration sequences: with
    less than one evaluation window of it, the search is refused before calibration, not after."""
    from hfcompress.conversion.config import ConvertOptions
    from hfcompress.conversion.preflight import check_search_text
    from hfcompress.errors import HfcompressError
    from hfcompress.keys import KeyOptions
    from hfcompress.lisa import LisaOptions

    for flag, options in (
        ("--kv-ppl-budget", ConvertOptions(source="x", out=Path("o"), keys=KeyOptions(kv_budget=0.5, plan="keys-values", ppl_budget=10))),
        ("--lisa-ppl-budget", ConvertOptions(source="x", out=Path("o"), lisa=LisaOptions(ppl_budget=10))),
    ):  # fmt: skip
        with pytest.raises(HfcompressError, match=f"{flag} needs {options.eval_context} calibration tokens .* the text has 100"):
            check_search_text(options, 100)
        check_search_text(options, options.eval_context)
    check_search_text(ConvertOptions(source="x", out=Path("o")), 100)  # no search: no selection text needed
