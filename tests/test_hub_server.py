"""The local Hub server works with the REAL huggingface_hub client (and transformers), no mocks."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import httpx2
import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from hub_server import TEST_TOKEN as HUB_TOKEN
from hub_server import TEST_USER as HUB_USER
from hub_server import LocalHub, subprocess_env
from tiny_models import save_tiny_llama

# huggingface_hub's legacy LFS upload passes a file object as `data=` to httpx2, which warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

REPO = f"{HUB_USER}/tiny-llama"
TINY_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def _upload(api: HfApi, folder: Path, repo_id: str = REPO, **kwargs) -> str:
    api.create_repo(repo_id, exist_ok=True, **kwargs)
    return api.upload_folder(folder_path=folder, repo_id=repo_id, commit_message="Upload tiny llama").oid


def test_upload_folder_is_one_commit_and_model_info_matches(local_hub, hub_api, tiny_llama_dir):
    url = hub_api.create_repo(REPO)
    assert url.repo_id == REPO and url.startswith(local_hub.url)
    hub_api.create_repo(REPO, exist_ok=True)  # Hub answers 409, client swallows it
    with pytest.raises(HfHubHTTPError) as exc:
        hub_api.create_repo(REPO)
    assert exc.value.response.status_code == 409

    commit = hub_api.upload_folder(folder_path=tiny_llama_dir, repo_id=REPO, commit_message="Upload tiny llama")
    assert len(commit.oid) == 40 and commit.commit_url.endswith(commit.oid)

    commits = local_hub.commits(REPO)
    assert [c["title"] for c in commits] == ["Upload tiny llama", "initial commit"]
    assert commits[0]["oid"] == commit.oid == local_hub.head(REPO)
    assert commits[0]["files"] == sorted([".gitattributes", *TINY_FILES])

    files = local_hub.files(REPO)
    assert files["model.safetensors"]["lfs"] and not files["config.json"]["lfs"]
    assert local_hub.requests_matching("PUT", "/_lfs_upload/"), "safetensors must go through the LFS upload"
    for name in TINY_FILES:
        assert local_hub.read_file(REPO, name) == (tiny_llama_dir / name).read_bytes()

    info = hub_api.model_info(REPO, revision="main", files_metadata=True)
    assert info.sha == commit.oid
    assert hub_api.model_info(REPO, revision=commit.oid).sha == commit.oid
    assert info.private is False and info.gated is False
    assert info.config["model_type"] == "llama" and info.config["architectures"] == ["LlamaForCausalLM"]
    assert info.safetensors.total == 213_568
    assert {"transformers", "safetensors", "llama"} <= set(info.tags)
    siblings = {s.rfilename: s for s in info.siblings}
    assert set(siblings) == {".gitattributes", *TINY_FILES}
    st = (tiny_llama_dir / "model.safetensors").read_bytes()
    assert siblings["model.safetensors"].lfs.sha256 == hashlib.sha256(st).hexdigest()
    assert siblings["model.safetensors"].size == len(st)

    assert [c.commit_id for c in hub_api.list_repo_commits(REPO)] == [c["oid"] for c in commits]
    assert hub_api.whoami()["name"] == HUB_USER


def test_snapshot_and_file_downloads_are_byte_identical(local_hub, hub_api, tiny_llama_dir, tmp_path):
    sha = _upload(hub_api, tiny_llama_dir)

    snap = snapshot_download(
        REPO,
        revision=sha,
        allow_patterns=["*.json", "*.safetensors"],
        endpoint=local_hub.url,
        token=HUB_TOKEN,
        cache_dir=tmp_path / "cache",
    )
    snap = Path(snap)
    assert snap.name == sha
    assert sorted(p.name for p in snap.iterdir()) == sorted(TINY_FILES)  # .gitattributes filtered out
    for name in TINY_FILES:
        assert (snap / name).read_bytes() == (tiny_llama_dir / name).read_bytes(), name

    local = snapshot_download(REPO, endpoint=local_hub.url, token=HUB_TOKEN, local_dir=tmp_path / "local")
    assert (Path(local) / "model.safetensors").read_bytes() == (tiny_llama_dir / "model.safetensors").read_bytes()

    for revision in ("main", sha):
        path = hf_hub_download(
            REPO, "config.json", revision=revision, endpoint=local_hub.url, token=HUB_TOKEN, cache_dir=tmp_path / "c2"
        )
        assert Path(path).read_bytes() == (tiny_llama_dir / "config.json").read_bytes()
    assert hub_api.file_exists(REPO, "tokenizer.json") and not hub_api.file_exists(REPO, "nope.bin")

    tree = hub_api.list_repo_tree(REPO, recursive=True)
    assert sorted(f.path for f in tree) == sorted([".gitattributes", *TINY_FILES])

    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(REPO, "missing.json", endpoint=local_hub.url, token=HUB_TOKEN, cache_dir=tmp_path / "c3")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(
            REPO, "config.json", revision="no-such-branch", endpoint=local_hub.url, token=HUB_TOKEN,
            cache_dir=tmp_path / "c4",
        )
    with pytest.raises(RevisionNotFoundError):
        hub_api.model_info(REPO, revision="0" * 40)


def test_resolve_headers_and_range_requests(local_hub, hub_api, tiny_llama_dir):
    sha = _upload(hub_api, tiny_llama_dir)
    st = (tiny_llama_dir / "model.safetensors").read_bytes()
    cfg = (tiny_llama_dir / "config.json").read_bytes()
    headers = {"Authorization": f"Bearer {HUB_TOKEN}", "Accept-Encoding": "identity"}
    with httpx2.Client(base_url=local_hub.url, headers=headers) as client:
        r = client.head(f"/{REPO}/resolve/main/model.safetensors")
        assert r.status_code == 200
        assert r.headers["X-Repo-Commit"] == sha
        assert r.headers["X-Linked-Etag"] == r.headers["ETag"] == f'"{hashlib.sha256(st).hexdigest()}"'
        assert int(r.headers["X-Linked-Size"]) == int(r.headers["Content-Length"]) == len(st)
        assert r.headers["Accept-Ranges"] == "bytes"

        r = client.head(f"/{REPO}/resolve/{sha}/config.json")
        git_oid = hashlib.sha1(b"blob %d\0" % len(cfg) + cfg).hexdigest()
        assert r.headers["ETag"] == f'"{git_oid}"' and "X-Linked-Etag" not in r.headers

        r = client.get(f"/{REPO}/resolve/main/model.safetensors", headers={"Range": "bytes=100-199"})
        assert r.status_code == 206 and r.content == st[100:200]
        assert r.headers["Content-Range"] == f"bytes 100-199/{len(st)}"
        r = client.get(f"/{REPO}/resolve/main/model.safetensors", headers={"Range": "bytes=-10"})
        assert r.status_code == 206 and r.content == st[-10:]
        r = client.get(f"/{REPO}/resolve/main/model.safetensors", headers={"Range": f"bytes={len(st)}-"})
        assert r.status_code == 416

        r = client.get(f"/{REPO}/resolve/main/missing.txt")
        assert r.status_code == 404 and r.headers["X-Error-Code"] == "EntryNotFound"
        assert r.headers["X-Repo-Commit"] == sha


def test_commits_are_atomic_and_old_revisions_stay_readable(local_hub, hub_api, tiny_llama_dir, tmp_path):
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    first = _upload(hub_api, tiny_llama_dir)
    second = hub_api.create_commit(
        REPO,
        operations=[
            CommitOperationAdd("README.md", b"---\ntags:\n- compressed\nlicense: mit\n---\n# tiny\n"),
            CommitOperationAdd("weights/extra.bin", b"\x00\x01" * 1000),
            CommitOperationDelete("generation_config.json"),
        ],
        commit_message="second",
    ).oid
    assert second != first and local_hub.head(REPO) == second
    files = local_hub.files(REPO)
    assert "generation_config.json" not in files and files["weights/extra.bin"]["lfs"]
    assert "generation_config.json" in local_hub.files(REPO, first)
    old = hf_hub_download(
        REPO, "generation_config.json", revision=first, endpoint=local_hub.url, token=HUB_TOKEN, cache_dir=tmp_path
    )
    assert Path(old).read_bytes() == (tiny_llama_dir / "generation_config.json").read_bytes()
    info = hub_api.model_info(REPO)
    assert {"compressed", "license:mit"} <= set(info.tags)

    # Stale parent commit -> 412, nothing committed.
    with pytest.raises(HfHubHTTPError) as exc:
        hub_api.create_commit(
            REPO, operations=[CommitOperationAdd("x.txt", b"x")], commit_message="stale", parent_commit=first
        )
    assert exc.value.response.status_code == 412
    # One valid op + one LFS pointer to an object never uploaded -> rejected as a whole.
    payload = [
        {"key": "header", "value": {"summary": "broken", "description": ""}},
        {"key": "file", "value": {"path": "ok.txt", "content": base64.b64encode(b"ok").decode(), "encoding": "base64"}},
        {"key": "lfsFile", "value": {"path": "big.bin", "algo": "sha256", "oid": "ab" * 32, "size": 10}},
    ]
    r = httpx2.post(
        f"{local_hub.url}/api/models/{REPO}/commit/main",
        content=b"".join(json.dumps(x).encode() + b"\n" for x in payload),
        headers={"Authorization": f"Bearer {HUB_TOKEN}", "Content-Type": "application/x-ndjson"},
    )
    assert r.status_code == 422
    assert local_hub.head(REPO) == second and "ok.txt" not in local_hub.files(REPO)
    assert len(local_hub.commits(REPO)) == 3


def test_auth_private_and_gated_errors(local_hub, hub_api, tiny_llama_dir, tmp_path):
    anon = HfApi(endpoint=local_hub.url, token=False)
    with pytest.raises(RepositoryNotFoundError):
        hub_api.model_info("test-user/does-not-exist")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("nobody/nothing", "config.json", endpoint=local_hub.url, token=HUB_TOKEN, cache_dir=tmp_path)

    with pytest.raises(HfHubHTTPError) as exc:
        anon.create_repo(f"{HUB_USER}/anon-repo")
    assert exc.value.response.status_code == 401
    assert f"{HUB_USER}/anon-repo" not in local_hub.repo_ids()
    hub_api.create_repo(f"{HUB_USER}/public")
    with pytest.raises(HfHubHTTPError) as exc:
        anon.upload_file(path_or_fileobj=b"hi", path_in_repo="a.txt", repo_id=f"{HUB_USER}/public")
    assert exc.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as exc:
        HfApi(endpoint=local_hub.url, token="hf_wrong").whoami()
    assert exc.value.response.status_code == 401

    private = f"{HUB_USER}/private"
    _upload(hub_api, tiny_llama_dir, private, private=True)
    assert hub_api.model_info(private).private is True
    with pytest.raises(RepositoryNotFoundError):
        anon.model_info(private)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download(private, "config.json", endpoint=local_hub.url, token=False, cache_dir=tmp_path / "p1")
    hf_hub_download(private, "config.json", endpoint=local_hub.url, token=HUB_TOKEN, cache_dir=tmp_path / "p2")

    gated = f"{HUB_USER}/gated"
    _upload(hub_api, tiny_llama_dir, gated)
    local_hub.set_gated(gated, allowed_users=["vip"])
    assert hub_api.model_info(gated).gated == "manual"  # metadata stays visible, like the Hub
    for token in (HUB_TOKEN, False):
        with pytest.raises(GatedRepoError):
            hf_hub_download(gated, "config.json", endpoint=local_hub.url, token=token, cache_dir=tmp_path / "g")
    local_hub.add_token("hf_vip", "vip")
    hf_hub_download(gated, "config.json", endpoint=local_hub.url, token="hf_vip", cache_dir=tmp_path / "g2")


def test_fault_injection_retry_and_resume(local_hub, hub_api, tiny_llama_dir, tmp_path):
    sha = _upload(hub_api, tiny_llama_dir)
    local_hub.clear_requests()
    local_hub.inject_fault("GET", f"/api/models/{REPO}/tree/", 503)  # listing is retried by the client
    local_hub.inject_fault("GET", f"/{REPO}/resolve/{sha}/model.safetensors", "truncate")  # retried
    snap = snapshot_download(REPO, revision=sha, endpoint=local_hub.url, token=HUB_TOKEN, cache_dir=tmp_path)
    st = (tiny_llama_dir / "model.safetensors").read_bytes()
    assert (Path(snap) / "model.safetensors").read_bytes() == st
    assert [r.status for r in local_hub.requests_matching("GET", "/tree/")] == [503, 200]
    # The first GET was cut after half the body; the client retried. (It only resumes with a Range header from
    # what it already flushed: chunks are 10 MB, so for this small file it restarts from 0.)
    gets = local_hub.requests_matching("GET", "/resolve/" + sha + "/model.safetensors")
    assert len(gets) == 2 and gets[1].status in (200, 206)


@pytest.mark.own_local_hub
def test_lfs_cdn_redirect_mode(tmp_path, monkeypatch, tiny_llama_dir):
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_DISABLE_XET", True)
    with LocalHub(tmp_path / "hub", tokens={HUB_TOKEN: HUB_USER}, cdn_host="localhost") as hub:
        api = HfApi(endpoint=hub.url, token=HUB_TOKEN)
        _upload(api, tiny_llama_dir)
        path = hf_hub_download(REPO, "model.safetensors", endpoint=hub.url, token=HUB_TOKEN, cache_dir=tmp_path / "c")
        assert Path(path).read_bytes() == (tiny_llama_dir / "model.safetensors").read_bytes()
        assert [r.status for r in hub.requests_matching("HEAD", "/resolve/")] == [302]
        (cdn_get,) = hub.requests_matching("GET", "/_cdn/")
        assert cdn_get.status == 200 and "authorization" not in cdn_get.headers  # auth not sent off-Hub


def test_hub_inprocess_fixture_redirects_default_endpoint(hub_inprocess, tiny_llama_dir):
    import os

    api = HfApi()  # no endpoint, no token: taken from the patched constants / HF_TOKEN
    assert api.endpoint == hub_inprocess.url
    assert api.whoami()["name"] == HUB_USER
    sha = _upload(api, tiny_llama_dir)
    path = Path(hf_hub_download(REPO, "config.json"))
    assert path.read_bytes() == (tiny_llama_dir / "config.json").read_bytes()
    assert path.parent.name == sha and str(path).startswith(os.environ["HF_HOME"])


def test_cli_mode(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("hub_server.py")), "--port", "0", "--root", str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        r = httpx2.get(f"{url}/api/whoami-v2", headers={"Authorization": f"Bearer {HUB_TOKEN}"})
        assert r.status_code == 200 and r.json()["name"] == HUB_USER
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_hub_env_fixture_in_subprocess(local_hub, hub_api, hub_env, tiny_llama_dir):
    sha = _upload(hub_api, tiny_llama_dir)
    script = (
        "import sys; from huggingface_hub import HfApi, hf_hub_download, constants;"
        "print(constants.ENDPOINT, constants.HF_HUB_DISABLE_XET, HfApi().whoami()['name']);"
        "print(hf_hub_download(sys.argv[1], 'config.json'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, REPO], env=hub_env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, path = proc.stdout.strip().splitlines()[-2:]
    assert first == f"{local_hub.url} True {HUB_USER}"
    assert path.startswith(hub_env["HF_HOME"]) and Path(path).parent.name == sha
    assert Path(path).read_bytes() == (tiny_llama_dir / "config.json").read_bytes()


# ------------------------------------------------------------------------------------------- transformers subprocess
# Importing torch + transformers costs 10-20 s on a 2-core box. The worker subprocess is therefore started when this
# module starts (only if the test below is selected): it imports everything and loads the local checkpoint while the
# other tests run, then waits on stdin for the repo to load from the local Hub.
_WORKER_TEST = "test_transformers_from_pretrained_in_subprocess"
_WORKER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local_dir = sys.argv[1]
    local_tok = AutoTokenizer.from_pretrained(local_dir)
    local = AutoModelForCausalLM.from_pretrained(local_dir)
    print("ready", flush=True)

    args = json.loads(sys.stdin.readline())
    repo_id, revision = args["repo_id"], args["revision"]
    tok = AutoTokenizer.from_pretrained(repo_id)
    model, loading_info = AutoModelForCausalLM.from_pretrained(repo_id, output_loading_info=True)
    pinned = AutoModelForCausalLM.from_pretrained(repo_id, revision=revision)
    text = "Hello world, this is a tiny test."
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = [m(ids).logits for m in (model, pinned, local)]
    print(json.dumps({
        "loading_info": {k: sorted(map(str, v)) for k, v in loading_info.items()},
        "same_as_local": all(torch.equal(l, logits[2]) for l in logits[:2]),
        "same_tokens": ids[0].tolist() == local_tok(text).input_ids,
        "n_params": sum(p.numel() for p in model.parameters()),
        "ids": ids[0].tolist(),
        "class": type(model).__name__,
    }), flush=True)
    """
)


@pytest.fixture(scope="module", autouse=True)
def _transformers_worker(request, tmp_path_factory):
    if not any(item.name == _WORKER_TEST for item in request.session.items):
        yield None
        return
    root = tmp_path_factory.mktemp("transformers_worker")
    hub = LocalHub(root / "hub", tokens={HUB_TOKEN: HUB_USER})
    hub.start()
    model_dir = save_tiny_llama(root / "tiny-llama")
    env = subprocess_env(hub.url, root / "hf_home", HUB_TOKEN)
    stderr = open(root / "stderr.txt", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER_SCRIPT, str(model_dir)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    try:
        yield SimpleNamespace(hub=hub, env=env, proc=proc, model_dir=model_dir, stderr=root / "stderr.txt")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        stderr.close()
        hub.stop()


@pytest.mark.own_local_hub
def test_transformers_from_pretrained_in_subprocess(_transformers_worker, monkeypatch):
    import huggingface_hub.constants as hf_constants

    w = _transformers_worker
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    sha = _upload(HfApi(endpoint=w.hub.url, token=HUB_TOKEN), w.model_dir)
    stdout, _ = w.proc.communicate(json.dumps({"repo_id": REPO, "revision": sha}) + "\n", timeout=300)
    assert w.proc.returncode == 0, w.stderr.read_text()[-5000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["class"] == "LlamaForCausalLM"
    assert out["same_as_local"] and out["same_tokens"], out
    assert out["n_params"] == 213_568
    assert not any(out["loading_info"].get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), out
    assert out["ids"][0] == 1 and len(out["ids"]) > 3  # <s> + real BPE pieces
    refs_main = Path(w.env["HF_HOME"]) / "hub" / f"models--{REPO.replace('/', '--')}" / "refs" / "main"
    assert refs_main.read_text() == sha  # cache lives in HF_HOME and "main" resolved to the uploaded commit
    # Really downloaded from the local Hub, with the token from HF_TOKEN.
    gets = w.hub.requests_matching("GET", f"/{REPO}/resolve/")
    assert any(r.path.endswith("/model.safetensors") for r in gets)
    assert all(r.headers.get("authorization") == f"Bearer {HUB_TOKEN}" for r in gets)
