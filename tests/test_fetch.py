"""Issue 14: fetching a source. Hub sources through a mirror that serves only what huggingface_hub's downloads ask,
pinned to the commit resolved, found again offline by branch or tag; the card and licence files come along, code
never does. GGUF sources are identified from their header, before anything is parsed or dequantised.

The Hub is the real local server of tests/hub_server.py driven by the real huggingface_hub client.
"""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from hfcompress.cli import app
from hfcompress.errors import HfcompressError
from hfcompress.sources.source import (
    BUILTIN_GGUF,
    HUB_ALLOW_PATTERNS,
    _builtin_gguf,
    gguf_architecture,
    resolve_source,
)
from tests.conftest import HUB_USER

runner = CliRunner()
REPO = f"{HUB_USER}/tiny"


@pytest.fixture(autouse=True)
def _network(fast_network, monkeypatch):
    """conftest's short Hub retry backoff, with a 5 s HTTP timeout."""
    monkeypatch.setenv("HFCOMPRESS_HTTP_TIMEOUT", "5")


def upload(hub_api, directory: Path, repo: str = REPO) -> str:
    hub_api.create_repo(repo, exist_ok=True)
    return hub_api.upload_folder(folder_path=str(directory), repo_id=repo).oid


def unrevisioned_info_requests(hub, repo: str = REPO) -> list:
    return [r for r in hub.requests_matching("GET") if r.path.split("?")[0].rstrip("/") == f"/api/models/{repo}"]


def go_offline(monkeypatch) -> None:
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)


def snapshot_ref(source, revision: str) -> str:
    return (Path(source.path).parent.parent / "refs" / revision).read_text()


def assert_refused(result, *needles: str) -> None:
    """Exit 2 and one sentence, starting 'error:', with each needle."""
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].startswith("error:"), result.output
    text = " ".join(result.output.split())
    for needle in needles:
        assert needle in text, result.output


# --------------------------------------------------------------------------------------- a mirror of the Hub
def test_mirror_without_unrevisioned_model_info(hub_inprocess, hub_api, tiny_llama_dir, monkeypatch):
    from huggingface_hub.errors import HfHubHTTPError

    from hfcompress.sources.source import load_source

    sha = upload(hub_api, tiny_llama_dir)
    hub_inprocess.unrevisioned_info = False
    # what the tool used to ask; over https huggingface_hub reads this 401 as RepositoryNotFoundError ("not found")
    with pytest.raises(HfHubHTTPError) as refused:
        hub_api.model_info(REPO)
    assert refused.value.response.status_code == 401
    hub_inprocess.clear_requests()

    source = resolve_source(REPO)
    assert (source.commit_sha, source.revision) == (sha, "main")
    assert Path(source.path).name == sha  # the snapshot of the commit recorded
    assert not unrevisioned_info_requests(hub_inprocess)
    assert hub_inprocess.requests_matching("GET", f"/api/models/{REPO}/revision/main")
    downloads = hub_inprocess.requests_matching(contains=f"/{REPO}/resolve/")
    assert downloads and all(f"/resolve/{sha}/" in r.path for r in downloads), [r.path for r in downloads]
    assert all(r.status in (200, 206, 302) for r in hub_inprocess.requests)
    model, _ = load_source(source)  # a complete, loadable snapshot
    assert type(model).__name__ == "LlamaForCausalLM"

    go_offline(monkeypatch)  # the rerun with HF_HUB_OFFLINE=1 finds it by branch name
    offline = resolve_source(REPO)
    assert (offline.path, offline.commit_sha) == (source.path, sha)


def test_push_between_model_info_and_download_is_not_fetched(hub_inprocess, hub_api, tiny_llama_dir, monkeypatch):
    from huggingface_hub import HfApi

    sha = upload(hub_api, tiny_llama_dir)
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    weights = (tiny_llama_dir / "model.safetensors").read_bytes()
    real_model_info = HfApi.model_info
    pushed = []

    def model_info_then_push(self, *args, **kwargs):
        info = real_model_info(self, *args, **kwargs)
        if not pushed:  # someone pushes to main right after the tool resolved it
            later = {**config, "pushed_later": True}
            pushed.append(hub_inprocess.upload_files(REPO, {
                "config.json": json.dumps(later).encode(), "model.safetensors": weights[::-1], "README.md": b"# new",
            }))
        return info

    monkeypatch.setattr(HfApi, "model_info", model_info_then_push)
    source = resolve_source(REPO)
    assert pushed and hub_inprocess.head(REPO) == pushed[0] != sha
    assert source.commit_sha == sha and Path(source.path).name == sha
    assert json.loads((Path(source.path) / "config.json").read_text()) == config  # all of the first commit
    assert (Path(source.path) / "model.safetensors").read_bytes() == weights
    assert not (Path(source.path) / "README.md").exists()
    assert snapshot_ref(source, "main") == sha  # the cache records what was fetched, not the newer head


def test_snapshot_missing_files_of_the_commit_is_refused(hub_inprocess, hub_api, tiny_llama_dir, monkeypatch):
    """A server that answers a download at the commit with another commit's file leaves the snapshot short."""
    import huggingface_hub

    upload(hub_api, tiny_llama_dir)
    real_snapshot_download = huggingface_hub.snapshot_download

    def short_snapshot(*args, **kwargs):
        path = real_snapshot_download(*args, **kwargs)
        (Path(path) / "tokenizer.json").unlink()
        return path

    monkeypatch.setattr(huggingface_hub, "snapshot_download", short_snapshot)
    with pytest.raises(HfcompressError, match=r"is incomplete \(missing \['tokenizer.json'\]\)"):
        resolve_source(REPO)


def test_tag_is_recorded_for_offline_reruns(hub_inprocess, hub_api, tiny_llama_dir, monkeypatch):
    hub_inprocess.unrevisioned_info = False
    first = upload(hub_api, tiny_llama_dir)
    hub_api.create_tag(REPO, tag="v1", revision=first)
    hub_inprocess.upload_files(REPO, {"generation_config.json": b'{"do_sample": false}'})
    head = hub_inprocess.head(REPO)

    tagged = resolve_source(REPO, revision="v1")
    assert (tagged.commit_sha, tagged.revision) == (first, "v1") and snapshot_ref(tagged, "v1") == first
    by_sha = resolve_source(REPO, revision=head)  # a commit: nothing to record
    assert by_sha.commit_sha == head and not (Path(by_sha.path).parent.parent / "refs" / head).exists()
    assert not unrevisioned_info_requests(hub_inprocess)

    go_offline(monkeypatch)
    assert resolve_source(REPO, revision="v1").path == tagged.path
    assert resolve_source(REPO, revision=head).path == by_sha.path
    with pytest.raises(HfcompressError, match="not in the local Hub cache"):
        resolve_source(REPO)  # main was never fetched by name


def test_unknown_repo_and_revision_behind_a_mirror(hub_inprocess, hub_api, tiny_llama_dir, tmp_path):
    hub_inprocess.unrevisioned_info = False
    out = tmp_path / "o"
    assert_refused(runner.invoke(app, ["convert", f"{HUB_USER}/nope", "--out", str(out)]), "was not found")
    upload(hub_api, tiny_llama_dir)
    result = runner.invoke(app, ["convert", REPO, "--revision", "v9", "--out", str(out)])
    assert_refused(result, "Revision 'v9' does not exist")
    assert not out.exists()


# ------------------------------------------------------------------------------- card and licence files, no code
@pytest.mark.parametrize(
    "name, fetched",
    [
        ("README.md", True), ("LICENSE", True), ("LICENSE.txt", True), ("LICENSE.md", True), ("license.txt", True),
        ("License.md", True), ("LICENCE", True), ("LICENSE-MIT.txt", True), ("NOTICE", True), ("NOTICE.md", True),
        ("Notice.txt", True), ("USE_POLICY.md", True), ("use_policy.txt", True),
        ("LICENSE.py", False), ("NOTICE.sh", False), ("LICENSE/x.py", False), ("USE_POLICY.pyc", False),
        ("modeling_llama.py", False), ("docs/README.md", False), ("README.py", False), ("LICENSE.so", False),
    ],
)
def test_allow_patterns_take_card_and_licences_but_no_code(name, fetched):
    from huggingface_hub.utils import filter_repo_objects

    assert (list(filter_repo_objects([name], allow_patterns=HUB_ALLOW_PATTERNS)) == [name]) is fetched


def test_hub_source_brings_its_card_and_licences(hub_inprocess, hub_api, tiny_llama_dir):
    import huggingface_hub.constants as c

    extra = {
        "README.md": b"---\nlicense: llama3.2\n---\n# tiny\n", "LICENSE.txt": b"licence text", "USE_POLICY.md": b"use",
        "NOTICE": b"notice", "LICENSE.py": b"raise SystemExit", "modeling_tiny.py": b"raise SystemExit",
    }
    for name, data in extra.items():
        (tiny_llama_dir / name).write_bytes(data)
    upload(hub_api, tiny_llama_dir)
    source = resolve_source(REPO)
    names = {p.name for p in Path(source.path).iterdir()}
    assert {"README.md", "LICENSE.txt", "USE_POLICY.md", "NOTICE", "config.json", "model.safetensors"} <= names
    assert not list(Path(c.HF_HUB_CACHE).rglob("*.py"))


# ----------------------------------------------------------------------------------------------------- GGUF
def write_gguf(path: Path, architecture: str, vocab: int = 8, big_endian: bool = False) -> Path:
    """A small real GGUF (gguf's GGUFWriter): the given architecture, a tokenizer vocabulary and one tensor."""
    from gguf import GGUFEndian, GGUFWriter

    writer = GGUFWriter(str(path), architecture, endianess=GGUFEndian.BIG if big_endian else GGUFEndian.LITTLE)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"tok{i}" for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_tensor("token_embd.weight", np.zeros((vocab, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def no_gguf_parsing(monkeypatch):
    """Fail the test if gguf's reader, transformers' GGUF config conversion or the dequantiser runs."""
    import gguf
    import gguf.gguf_reader
    import transformers
    import transformers.modeling_gguf_pytorch_utils as tf_gguf

    from hfcompress.conversion import checkpoint

    def forbidden(*args, **kwargs):
        raise AssertionError("a refused GGUF must not be parsed, converted nor dequantised")

    monkeypatch.setattr(checkpoint, "dequantise_gguf", forbidden)
    monkeypatch.setattr(gguf, "GGUFReader", forbidden)
    monkeypatch.setattr(gguf.gguf_reader, "GGUFReader", forbidden)
    monkeypatch.setattr(tf_gguf, "load_gguf_checkpoint", forbidden)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", forbidden)


@pytest.mark.parametrize("architecture, big_endian", [("gemma2", False), ("mamba", False), ("qwen2", True)])
def test_unsupported_gguf_refused_from_its_header(tmp_path, no_gguf_parsing, architecture, big_endian):
    path = write_gguf(tmp_path / f"{architecture}.gguf", architecture, vocab=4096, big_endian=big_endian)
    result = runner.invoke(app, ["convert", str(path), "--out", str(tmp_path / "o")])
    assert_refused(result, f"architecture '{architecture}'", "only GGUF architecture 'llama'", "pass a Llama GGUF")
    assert not (tmp_path / "o").exists()


def raw_gguf(*fields: bytes, version: int = 3, kv_count: int | None = None) -> bytes:
    header = b"GGUF" + struct.pack("<IQQ", version, 0, len(fields) if kv_count is None else kv_count)
    return header + b"".join(fields)


def gguf_string(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


def kv_string(key: str, value: str) -> bytes:
    return gguf_string(key) + struct.pack("<I", 8) + gguf_string(value)


def test_gguf_header_read_past_other_fields(tmp_path):
    tokens = gguf_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3) + b"".join(map(gguf_string, "abc"))
    scores = gguf_string("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 3) + struct.pack("<3f", 0, 1, 2)
    nested = gguf_string("x.nested") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 4, 2) + struct.pack("<2I", 1, 2)
    count = gguf_string("x.count") + struct.pack("<I", 10) + struct.pack("<Q", 7)
    path = tmp_path / "m.gguf"
    path.write_bytes(raw_gguf(tokens, scores, nested, count, kv_string("general.architecture", "mamba")))
    assert gguf_architecture(path) == "mamba"


@pytest.mark.parametrize(
    "content, needles",
    [
        (b"PK\x03\x04 a zip archive", ["is not a GGUF file", "GGUF magic bytes"]),
        (b"", ["is not a GGUF file"]),
        (b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n", ["Git LFS pointer"]),
        (b"GGUF\x03\x00", ["truncated or damaged GGUF file", "download it again"]),
        (raw_gguf(gguf_string("general.architecture")[:6]), ["truncated or damaged GGUF file"]),
        (raw_gguf(kv_count=5), ["truncated or damaged GGUF file"]),
        (raw_gguf(gguf_string("general.name") + struct.pack("<I", 77)), ["truncated or damaged GGUF file"]),
        (raw_gguf(kv_string("general.name", "x")), ["names no architecture", "general.architecture"]),
        (raw_gguf(version=1), ["GGUF file of version 1", "only versions 2 and 3"]),
    ],
    ids=["zip", "empty", "lfs-pointer", "truncated-counts", "truncated-key", "missing-fields", "bad-type",
         "no-architecture", "version-1"],
)
def test_not_a_readable_gguf(tmp_path, no_gguf_parsing, content, needles):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    assert_refused(runner.invoke(app, ["convert", str(path), "--out", str(tmp_path / "o")]), *needles)


def test_llama_gguf_still_resolves():
    """The built-in SmolLM2 GGUF (llama.cpp architecture "llama") passes the header check and the config check."""
    path = _builtin_gguf()
    assert path.name == BUILTIN_GGUF and gguf_architecture(path) == "llama"
    source = resolve_source(str(path))
    assert (source.kind, source.gguf_file) == ("gguf", BUILTIN_GGUF)


DEQUANTISE = """
import sys
from pathlib import Path
from hfcompress.conversion.checkpoint import dequantise_gguf
dequantise_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
"""


@pytest.mark.slow
def test_two_conversions_dequantise_one_gguf_at_once(tmp_path):
    """Two processes dequantising the built-in GGUF into one cache directory at the same time (two conversions
    started together) both end with the complete checkpoint; neither writes into the other's files. The partial
    directory a killed conversion left is removed."""
    import subprocess
    import sys

    from transformers import LlamaConfig

    from hfcompress.conversion.checkpoint import Checkpoint, check_checkpoint

    directory = tmp_path / "gguf-cache"
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"gguf-cache.partial-{dead.pid}-0badf00d").mkdir()
    (tmp_path / f"gguf-cache.partial-{dead.pid}-0badf00d" / "part-00000.safetensors").write_bytes(b"half written")
    procs = [
        subprocess.Popen([sys.executable, "-c", DEQUANTISE, str(_builtin_gguf()), str(directory)], env=env, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    errors = [proc.communicate()[1].decode() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], errors
    check_checkpoint(Checkpoint(directory, "smollm2"), LlamaConfig.from_pretrained(directory))
    assert [p.name for p in tmp_path.iterdir()] == ["gguf-cache"]  # no partial directory left behind, old or new
