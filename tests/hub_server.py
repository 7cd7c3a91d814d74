"""A small, real, local Hugging Face Hub-compatible HTTP server for tests.

Standard library only. It speaks enough of the Hub's HTTP API for the real ``huggingface_hub`` client
(``HfApi``, ``hf_hub_download``, ``snapshot_download``, ``upload_folder``/``create_commit`` through the
legacy LFS protocol, i.e. with ``HF_HUB_DISABLE_XET=1``) and for ``transformers.from_pretrained``.

In tests::

    hub = LocalHub(tmp_dir)            # tokens default to {"hf_dummy_test_token": "test-user"}
    url = hub.start()                  # "http://127.0.0.1:<port>"
    ...
    hub.stop()

From a shell::

    python tests/hub_server.py --port 8765 --root /tmp/hub    # prints the URL, serves until Ctrl-C

Implemented endpoints (``{T}`` is ``models``/``datasets``/``spaces``; ``{prefix}`` is ``""``, ``datasets/``
or ``spaces/``):

* ``GET /api/whoami-v2``
* ``GET /api/{T}`` (list), ``GET /api/{T}/{repo}``, ``GET /api/{T}/{repo}/revision/{rev}`` (repo info; the
  un-revisioned ``GET /api/{T}/{repo}`` answers 401 when ``unrevisioned_info=False``, like a mirror that serves
  only what ``snapshot_download`` asks)
* ``GET /api/{T}/{repo}/tree/{rev}[/{path}]`` (``recursive``, paginated with a ``Link`` header)
* ``POST /api/{T}/{repo}/paths-info/{rev}``
* ``GET /api/{T}/{repo}/commits/{rev}``, ``GET /api/{T}/{repo}/refs``
* ``POST|DELETE /api/{T}/{repo}/branch/{name}``, ``POST /api/{T}/{repo}/tag/{rev}``, ``DELETE .../tag/{name}``
* ``PUT /api/{T}/{repo}/settings`` (``private``/``visibility``/``gated``)
* ``POST /api/repos/create``, ``DELETE /api/repos/delete``
* ``POST /api/{T}/{repo}/preupload/{rev}``, ``POST /api/{T}/{repo}/commit/{rev}`` (NDJSON, ``create_pr``)
* ``POST /{prefix}{repo}.git/info/lfs/objects/batch``, ``PUT /_lfs_upload/{oid}?sig=...``,
  ``POST /{prefix}{repo}.git/info/lfs/objects/verify``
* ``HEAD|GET /{prefix}{repo}/resolve/{rev}/{path}`` (``Range`` supported; optional CDN-style redirect of LFS files
  to another host name, see ``cdn_host``)

Errors follow the Hub (``X-Error-Code``/``X-Error-Message`` headers + ``{"error": ...}`` body) so that
``hf_raise_for_status`` raises ``RepositoryNotFoundError``, ``RevisionNotFoundError``,
``RemoteEntryNotFoundError``, ``GatedRepoError``...

Access model (simplified): any known token may read every repo (private included) and write everywhere, unless it was
added with ``write=False``. Unknown tokens get ``401 Invalid credentials in Authorization header`` on every endpoint.
Without a token, private repos answer ``401`` + ``RepoNotFound`` (like the Hub) and write endpoints answer ``401``.
Gated repos: repo info and tree listing work; file downloads answer ``401`` (no token) / ``403`` (token of a user not
in the allowed list) with ``X-Error-Code: GatedRepo``.
"""

from __future__ import annotations

import argparse
import base64
import copy
import datetime as _dt
import fnmatch
import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import parse_qs, quote, unquote, urlsplit

TEST_TOKEN = "hf_dummy_test_token"
TEST_USER = "test-user"
DEFAULT_TOKENS = {TEST_TOKEN: TEST_USER}
REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
# Subpaths after a repo id in /api/{T}/... urls (used to tell "ns/name/..." from canonical "name/...").
_API_SUBPATHS = {
    "revision", "tree", "paths-info", "preupload", "commit", "commits", "refs", "branch", "tag", "settings",
    "resolve", "blob", "raw", "discussions",
}
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_RANGE_RE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$", re.IGNORECASE)
_LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"
# What the Hub puts in a new repo's first commit ("initial commit").
DEFAULT_GITATTRIBUTES = """*.7z filter=lfs diff=lfs merge=lfs -text
*.arrow filter=lfs diff=lfs merge=lfs -text
*.bin filter=lfs diff=lfs merge=lfs -text
*.bz2 filter=lfs diff=lfs merge=lfs -text
*.ckpt filter=lfs diff=lfs merge=lfs -text
*.ftz filter=lfs diff=lfs merge=lfs -text
*.gguf filter=lfs diff=lfs merge=lfs -text
*.gz filter=lfs diff=lfs merge=lfs -text
*.h5 filter=lfs diff=lfs merge=lfs -text
*.joblib filter=lfs diff=lfs merge=lfs -text
*.lfs.* filter=lfs diff=lfs merge=lfs -text
*.mlmodel filter=lfs diff=lfs merge=lfs -text
*.model filter=lfs diff=lfs merge=lfs -text
*.msgpack filter=lfs diff=lfs merge=lfs -text
*.npy filter=lfs diff=lfs merge=lfs -text
*.npz filter=lfs diff=lfs merge=lfs -text
*.onnx filter=lfs diff=lfs merge=lfs -text
*.ot filter=lfs diff=lfs merge=lfs -text
*.parquet filter=lfs diff=lfs merge=lfs -text
*.pb filter=lfs diff=lfs merge=lfs -text
*.pickle filter=lfs diff=lfs merge=lfs -text
*.pkl filter=lfs diff=lfs merge=lfs -text
*.pt filter=lfs diff=lfs merge=lfs -text
*.pth filter=lfs diff=lfs merge=lfs -text
*.rar filter=lfs diff=lfs merge=lfs -text
*.safetensors filter=lfs diff=lfs merge=lfs -text
saved_model/**/* filter=lfs diff=lfs merge=lfs -text
*.tar.* filter=lfs diff=lfs merge=lfs -text
*.tar filter=lfs diff=lfs merge=lfs -text
*.tflite filter=lfs diff=lfs merge=lfs -text
*.tgz filter=lfs diff=lfs merge=lfs -text
*.wasm filter=lfs diff=lfs merge=lfs -text
*.xz filter=lfs diff=lfs merge=lfs -text
*.zip filter=lfs diff=lfs merge=lfs -text
*.zst filter=lfs diff=lfs merge=lfs -text
*tfevents* filter=lfs diff=lfs merge=lfs -text
"""


# Env vars that would redirect the HF cache or the token away from what `subprocess_env` sets.
HF_ENV_TO_DROP = (
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_XET_CACHE",
    "HF_ASSETS_CACHE",
    "TRANSFORMERS_CACHE",
    "HF_TOKEN_PATH",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN",
)


def subprocess_env(endpoint: str, hf_home: str | os.PathLike, token: str | None = TEST_TOKEN) -> dict[str, str]:
    """``os.environ`` copy pointing ``huggingface_hub``/``transformers`` in a child process at ``endpoint``."""
    env = {k: v for k, v in os.environ.items() if k not in HF_ENV_TO_DROP}
    env.pop("HF_TOKEN", None)
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(hf_home),
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_OFFLINE="0",
        TRANSFORMERS_OFFLINE="0",
        HF_HUB_ETAG_TIMEOUT="5",
        HF_HUB_DOWNLOAD_TIMEOUT="10",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_UPDATE_CHECK="1",
    )
    if token:
        env["HF_TOKEN"] = token
    return env


class HubError(Exception):
    """Raised inside handlers; turned into a Hub-style error response."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}


@dataclass
class RequestRecord:
    method: str
    path: str  # raw path, query string included
    status: int | None = None
    headers: dict = field(default_factory=dict)  # request headers (lower-cased keys)


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _split_repo_type(repo_type: str | None) -> str:
    repo_type = repo_type or "model"
    if repo_type not in URL_PREFIX:
        raise ValueError(f"unknown repo_type {repo_type!r}")
    return repo_type


def _parse_front_matter(text: str) -> dict:
    """Tiny YAML subset parser for README.md metadata (``key: value`` and ``key:`` + ``- item`` lists)."""
    if not text.startswith("---"):
        return {}
    lines = text.splitlines()[1:]
    data: dict[str, Any] = {}
    key = None
    for line in lines:
        if line.strip() == "---":
            break
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.lstrip().startswith("- ") and key is not None:
            if not isinstance(data.get(key), list):
                data[key] = []
            data[key].append(line.lstrip()[2:].strip().strip("'\""))
        elif ":" in line and not line.startswith(" "):
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if value.startswith("[") and value.endswith("]"):
                data[key] = [v.strip().strip("'\"") for v in value[1:-1].split(",") if v.strip()]
            else:
                data[key] = value.strip("'\"") if value else None
    return data


class LocalHub:
    """In-process Hub server. Thread-safe; state persisted under ``root`` (reloaded on construction)."""

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        tokens: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        lfs_threshold: int = 10 * 1024 * 1024,
        init_gitattributes: bool = True,
        tree_page_size: int = 1000,
        cdn_host: str | None = None,
        unrevisioned_info: bool = True,
        verbose: bool = False,
    ):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "blobs").mkdir(exist_ok=True)
        (self.root / "tmp").mkdir(exist_ok=True)
        self.tokens: dict[str, str] = dict(DEFAULT_TOKENS if tokens is None else tokens)
        self.read_only_tokens: set[str] = set()
        self.host = host
        self.port = port
        self.lfs_threshold = lfs_threshold
        self.init_gitattributes = init_gitattributes
        self.tree_page_size = tree_page_size
        # If set (e.g. "localhost" while the server binds 127.0.0.1), resolve of LFS files answers a 302 to
        # http://{cdn_host}:{port}/_cdn/... like the real Hub's CDN redirect (another origin: no auth forwarded).
        self.cdn_host = cdn_host
        # False: the un-revisioned repo info (GET /api/models/{repo}) answers a bare 401, as a Hub mirror does that
        # serves only the revision-qualified endpoints huggingface_hub's downloads use (/revision/{rev}, tree,
        # resolve); huggingface_hub reads that 401 as RepositoryNotFoundError. Can be changed while serving.
        self.unrevisioned_info = unrevisioned_info
        self.verbose = verbose
        # Fault injection: (METHOD or "*", path prefix) -> list of actions consumed one per matching request.
        # An action is an int status code (e.g. 503), "reset" (close the connection without answering),
        # "truncate" (GET resolve only: send headers and half the body then close), "delay:<seconds>" (then answer
        # normally), "stall:<seconds>" (wait, then close without answering or applying the request) or
        # "echo-auth:<status>" (answer <status> with the request's Authorization header quoted in the error message) or
        # "cut" (a server that fails mid-upload: read half of the request's body, then close the connection without
        # answering or applying the request).
        self.faults: dict[tuple[str, str], list] = {}
        self.requests: list[RequestRecord] = []
        self._lock = threading.RLock()
        self._repos: dict[tuple[str, str], dict] = {}
        self._secret = secrets.token_bytes(16)
        self._counter = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None
        self._load()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        """Start serving in a daemon thread; return the base URL (no trailing slash)."""
        if self._server is not None:
            return self.url  # type: ignore[return-value]
        server = ThreadingHTTPServer((self.host, self.port), _Handler)
        server.daemon_threads = True
        server.hub = self  # type: ignore[attr-defined]
        self._server = server
        self.port = server.server_address[1]
        self.url = f"http://{self.host}:{self.port}"
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="LocalHub", daemon=True)
        self._thread.start()
        return self.url

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> "LocalHub":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ test helpers (server side, no HTTP)
    def add_token(self, token: str, user: str, *, write: bool = True) -> None:
        self.tokens[token] = user
        if write:
            self.read_only_tokens.discard(token)
        else:
            self.read_only_tokens.add(token)

    def inject_fault(self, method: str, path_prefix: str, *actions) -> None:
        """E.g. ``hub.inject_fault("GET", "/org/model/resolve/", 503)`` → next matching GET answers 503 once.

        Actions (consumed one per matching request): see ``self.faults`` in ``__init__``."""
        with self._lock:
            self.faults.setdefault((method.upper(), path_prefix), []).extend(actions)

    def clear_requests(self) -> None:
        with self._lock:
            self.requests.clear()

    def requests_matching(self, method: str | None = None, contains: str = "") -> list[RequestRecord]:
        with self._lock:
            return [r for r in self.requests if (method is None or r.method == method) and contains in r.path]

    def create_repo(
        self, repo_id: str, *, repo_type: str = "model", private: bool = False, gated: Any = False, exist_ok=False
    ) -> str:
        repo_type = _split_repo_type(repo_type)
        with self._lock:
            key = (repo_type, repo_id)
            if key in self._repos:
                if exist_ok:
                    return self._repos[key]["refs"]["main"]
                raise ValueError(f"repo {repo_id} exists")
            repo = {
                "type": repo_type,
                "id": repo_id,
                "private": bool(private),
                "gated": gated,
                "gated_allowed": [],
                "created_at": _now_iso(),
                "refs": {},
                "tags": {},
                "commits": {},
                "pr_count": 0,
            }
            files = {}
            if self.init_gitattributes:
                files[".gitattributes"] = DEFAULT_GITATTRIBUTES.encode()
            tree = {p: self._store_regular(data) for p, data in files.items()}
            oid = self._new_commit(repo, None, tree, "initial commit", "", "system")
            repo["refs"]["main"] = oid
            self._repos[key] = repo
            self._save(repo)
            return oid

    def delete_repo(self, repo_id: str, *, repo_type: str = "model") -> None:
        repo_type = _split_repo_type(repo_type)
        with self._lock:
            repo = self._repos.pop((repo_type, repo_id))
            path = self._state_path(repo)
            if path.exists():
                path.unlink()

    def set_private(self, repo_id: str, private: bool = True, *, repo_type: str = "model") -> None:
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            repo["private"] = bool(private)
            self._save(repo)

    def set_gated(self, repo_id: str, allowed_users=(), *, mode: Any = "manual", repo_type: str = "model") -> None:
        """Gate a repo. ``mode=False`` un-gates it. Users in ``allowed_users`` keep access to files."""
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            repo["gated"] = mode
            repo["gated_allowed"] = list(allowed_users)
            self._save(repo)

    def upload_files(
        self,
        repo_id: str,
        files: dict[str, bytes | None],
        *,
        message: str = "server-side commit",
        revision: str = "main",
        repo_type: str = "model",
        lfs: bool | None = None,
    ) -> str:
        """Commit ``{path: bytes}`` (``None`` deletes) directly, creating the repo if needed. Returns the commit."""
        repo_type = _split_repo_type(repo_type)
        with self._lock:
            if (repo_type, repo_id) not in self._repos:
                self.create_repo(repo_id, repo_type=repo_type)
            repo = self._repo(repo_type, repo_id)
            head = repo["refs"][revision]
            tree = dict(repo["commits"][head]["tree"])
            for path, data in files.items():
                if data is None:
                    tree.pop(path, None)
                    continue
                is_lfs = lfs if lfs is not None else self._should_be_lfs(tree, path, len(data), data[:512])
                tree[path] = self._store_lfs_bytes(data) if is_lfs else self._store_regular(data)
            oid = self._new_commit(repo, head, tree, message, "", "system")
            repo["refs"][revision] = oid
            self._save(repo)
            return oid

    def repo_ids(self, repo_type: str | None = None) -> list[str]:
        with self._lock:
            return sorted(rid for (rt, rid) in self._repos if repo_type is None or rt == repo_type)

    def head(self, repo_id: str, revision: str = "main", *, repo_type: str = "model") -> str:
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            oid = self._resolve_rev(repo, revision)
            if oid is None:
                raise KeyError(revision)
            return oid

    def commits(self, repo_id: str, revision: str = "main", *, repo_type: str = "model") -> list[dict]:
        """Commits reachable from ``revision``, newest first: {oid, title, message, parents, author, date, files}."""
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            out = []
            for c in self._history(repo, self.head(repo_id, revision, repo_type=repo_type)):
                out.append(
                    {
                        "oid": c["oid"],
                        "title": c["title"],
                        "message": c["message"],
                        "parents": list(c["parents"]),
                        "author": c["author"],
                        "date": c["date"],
                        "files": sorted(c["tree"]),
                    }
                )
            return out

    def files(self, repo_id: str, revision: str = "main", *, repo_type: str = "model") -> dict[str, dict]:
        """Files at ``revision``: ``{path: {"size", "sha256", "oid", "lfs"}}``."""
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            return copy.deepcopy(repo["commits"][self.head(repo_id, revision, repo_type=repo_type)]["tree"])

    def read_file(self, repo_id: str, path: str, revision: str = "main", *, repo_type: str = "model") -> bytes:
        entry = self.files(repo_id, revision, repo_type=repo_type)[path]
        return self._blob_path(entry["sha256"]).read_bytes()

    # ------------------------------------------------------------------ storage internals
    def _state_path(self, repo: dict) -> Path:
        return self.root / "repos" / (repo["type"] + "s") / (repo["id"] + ".json")

    def _save(self, repo: dict) -> None:
        path = self._state_path(repo)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{threading.get_ident()}")
        tmp.write_text(json.dumps(repo))
        os.replace(tmp, path)

    def _load(self) -> None:
        base = self.root / "repos"
        if not base.exists():
            return
        for path in base.rglob("*.json"):
            repo = json.loads(path.read_text())
            self._repos[(repo["type"], repo["id"])] = repo

    def _repo(self, repo_type: str, repo_id: str) -> dict:
        return self._repos[(_split_repo_type(repo_type), repo_id)]

    def _blob_path(self, sha256: str) -> Path:
        return self.root / "blobs" / sha256

    def _store_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = self._blob_path(sha)
        if not path.exists():
            tmp = self.root / "tmp" / secrets.token_hex(8)
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return sha

    def _store_regular(self, data: bytes) -> dict:
        return {"size": len(data), "sha256": self._store_bytes(data), "oid": git_blob_oid(data), "lfs": False}

    def _store_lfs_bytes(self, data: bytes) -> dict:
        return self._lfs_entry(self._store_bytes(data), len(data))

    @staticmethod
    def _lfs_entry(sha256: str, size: int) -> dict:
        pointer = _LFS_POINTER.format(oid=sha256, size=size).encode()
        return {"size": size, "sha256": sha256, "oid": git_blob_oid(pointer), "lfs": True, "pointer_size": len(pointer)}

    def _new_commit(self, repo: dict, parent: str | None, tree: dict, title: str, message: str, author: str) -> str:
        with self._lock:
            self._counter += 1
            seed = json.dumps([repo["id"], parent, sorted(tree.items()), title, time.time_ns(), self._counter])
            oid = hashlib.sha1(seed.encode()).hexdigest()
            repo["commits"][oid] = {
                "oid": oid,
                "parents": [parent] if parent else [],
                "title": title,
                "message": message,
                "author": author,
                "date": _now_iso(),
                "tree": tree,
            }
            return oid

    def _resolve_rev(self, repo: dict, rev: str) -> str | None:
        if rev in repo["refs"]:
            return repo["refs"][rev]
        if rev in repo["tags"]:
            return repo["tags"][rev]
        if rev.startswith("refs/heads/") and rev[11:] in repo["refs"]:
            return repo["refs"][rev[11:]]
        if rev.startswith("refs/tags/") and rev[10:] in repo["tags"]:
            return repo["tags"][rev[10:]]
        if _COMMIT_RE.match(rev) and rev in repo["commits"]:
            return rev
        return None

    def _history(self, repo: dict, oid: str) -> Iterator[dict]:
        while oid:
            c = repo["commits"][oid]
            yield c
            oid = c["parents"][0] if c["parents"] else None

    @staticmethod
    def _lfs_patterns(tree: dict, blob_reader) -> list[str]:
        entry = tree.get(".gitattributes")
        if entry is None:
            return []
        patterns = []
        for line in blob_reader(entry["sha256"]).decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) >= 2 and "filter=lfs" in parts[1:]:
                patterns.append(parts[0])
        return patterns

    def _should_be_lfs(self, tree: dict, path: str, size: int, sample: bytes) -> bool:
        if size == 0:
            return False
        if size >= self.lfs_threshold or b"\x00" in sample:
            return True
        if path.endswith((".safetensors", ".bin", ".gguf", ".pt", ".pth")):
            return True
        name = path.rsplit("/", 1)[-1]
        for pat in self._lfs_patterns(tree, lambda sha: self._blob_path(sha).read_bytes()):
            if fnmatch.fnmatchcase(path if "/" in pat else name, pat):
                return True
        return False

    def _lfs_sig(self, oid: str) -> str:
        return hmac.new(self._secret, oid.encode(), hashlib.sha256).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "LocalHub/1.0"

    @property
    def hub(self) -> LocalHub:
        return self.server.hub  # type: ignore[attr-defined]

    def log_message(self, format, *args):  # noqa: A002
        if self.hub.verbose:
            super().log_message(format, *args)

    # ------------------------------------------------------------------ plumbing
    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def send_response(self, code, message=None):
        if self._record is not None:
            self._record.status = code
        super().send_response(code, message)

    def _dispatch(self, method: str) -> None:
        self._record = RequestRecord(method, self.path, None, {k.lower(): v for k, v in self.headers.items()})
        self._body: bytes | None = None
        self._body_consumed = False
        self._truncate = False
        with self.hub._lock:
            self.hub.requests.append(self._record)
        split = urlsplit(self.path)
        self._query = parse_qs(split.query, keep_blank_values=True)
        self._raw_path = split.path
        try:
            action = self._take_fault(method, split.path)
            if action is not None:
                if isinstance(action, str) and action.startswith("delay:"):
                    time.sleep(float(action.split(":", 1)[1]))
                elif isinstance(action, str) and action.startswith("stall:"):
                    time.sleep(float(action.split(":", 1)[1]))  # a dead server: no answer, request not applied
                    self._drain_body()
                    self.close_connection = True
                    return
                elif isinstance(action, str) and action.startswith("echo-auth:"):
                    # a misbehaving proxy that quotes the request's credentials back in its error
                    self._drain_body()
                    echoed = self.headers.get("Authorization", "")
                    raise HubError(int(action.split(":", 1)[1]), f"Rejected request with {echoed}", code="Echo")
                elif action == "reset":
                    self._drain_body()
                    self._hang_up()
                    return
                elif action == "truncate":
                    self._truncate = True
                elif action == "cut":
                    length = int(self.headers.get("Content-Length") or 0)
                    if length:
                        self.rfile.read(max(1, length // 2))
                    else:  # chunked: the first chunk only
                        next(self._iter_body(), None)
                    self._body_consumed = True
                    self._hang_up()
                    return
                else:
                    self._drain_body()
                    raise HubError(int(action), f"Injected fault {action}", headers={"Retry-After": "0"})
            self._auth()
            resp = self._route(method, [unquote(s) for s in split.path.split("/")[1:]])
            self._drain_body()  # keep the keep-alive connection in sync even if a handler ignored the body
            if resp is not None:
                self._send(*resp)
        except HubError as e:
            self._drain_body()
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # pragma: no cover - bug in the server: make it visible in the client error
            import traceback

            traceback.print_exc()
            self._drain_body()
            try:
                self._send_error(HubError(500, f"Internal error in LocalHub: {type(e).__name__}: {e}"))
            except OSError:
                self.close_connection = True

    def _take_fault(self, method: str, path: str):
        with self.hub._lock:
            for (m, prefix), actions in self.hub.faults.items():
                if actions and (m == "*" or m == method) and path.startswith(prefix):
                    return actions.pop(0)
        return None

    def _iter_body(self) -> Iterator[bytes]:
        if self._body_consumed:
            return
        self._body_consumed = True
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                line = self.rfile.readline()
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return
                yield self.rfile.read(size)
                self.rfile.readline()
        else:
            remaining = int(self.headers.get("Content-Length") or 0)
            while remaining > 0:
                chunk = self.rfile.read(min(remaining, 1 << 20))
                if not chunk:
                    raise ConnectionResetError("client closed connection while sending body")
                remaining -= len(chunk)
                yield chunk

    def _read_body(self) -> bytes:
        if self._body is None:
            self._body = b"".join(self._iter_body())
        return self._body

    def _drain_body(self) -> None:
        for _ in self._iter_body():
            pass

    def _hang_up(self) -> None:
        """Drop the connection without an answer (the client sees a reset)."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _json_body(self) -> Any:
        body = self._read_body()
        try:
            return json.loads(body or b"{}")
        except ValueError:
            raise HubError(400, "Invalid JSON body")

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content_type="application/json"):
        self.send_response(status)
        headers = dict(headers or {})
        headers.setdefault("Content-Type", content_type)
        headers.setdefault("Content-Length", str(len(body)))
        headers.setdefault("X-Request-Id", "Root=" + secrets.token_hex(8))
        for k, v in headers.items():
            self.send_header(k, str(v))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    @staticmethod
    def _json(obj: Any, status: int = 200, headers: dict | None = None) -> tuple:
        """A JSON response, sent by ``_dispatch`` once the hub lock is released."""
        return (status, json.dumps(obj).encode(), headers)

    def _send_error(self, e: HubError) -> None:
        headers = dict(e.headers)
        if e.code:
            headers["X-Error-Code"] = e.code
        headers["X-Error-Message"] = e.message.replace("\n", " ")
        self._send(e.status, json.dumps({"error": e.message}).encode(), headers)

    # ------------------------------------------------------------------ auth / access
    def _auth(self) -> None:
        self.user: str | None = None
        self.token: str | None = None
        auth = self.headers.get("Authorization")
        if not auth:
            return
        scheme, _, token = auth.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or token not in self.hub.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        self.token = token
        self.user = self.hub.tokens[token]

    def _require_write(self) -> None:
        if self.user is None:
            raise HubError(401, "You must be authenticated to access this resource (no token provided).")
        if self.token in self.hub.read_only_tokens:
            raise HubError(403, "You don't have the rights to write: this token is read-only.")

    def _get_repo(self, repo_type: str, repo_id: str) -> dict:
        repo = self.hub._repos.get((repo_type, repo_id))
        if repo is None or (repo["private"] and self.user is None):
            status = 401 if self.user is None else 404
            raise HubError(status, "Repository not found", code="RepoNotFound")
        return repo

    def _check_gated(self, repo: dict) -> None:
        if repo.get("gated") and self.user not in repo.get("gated_allowed", []):
            kind = repo["type"]
            msg = (
                f"Access to {kind} {repo['id']} is restricted. You must have access to it and be authenticated to "
                "access it. Please log in."
                if self.user is None
                else f"Access to {kind} {repo['id']} is restricted and you are not in the authorized list. "
                f"Visit {self.hub.url}/{URL_PREFIX[kind]}{repo['id']} to ask for access."
            )
            raise HubError(401 if self.user is None else 403, msg, code="GatedRepo")

    def _get_commit(self, repo: dict, rev: str) -> dict:
        oid = self.hub._resolve_rev(repo, rev)
        if oid is None:
            raise HubError(404, f"Invalid rev id: {rev}", code="RevisionNotFound")
        return repo["commits"][oid]

    def _repo_web_url(self, repo: dict) -> str:
        return f"{self.hub.url}/{URL_PREFIX[repo['type']]}{repo['id']}"

    # ------------------------------------------------------------------ routing
    def _route(self, method: str, segs: list[str]) -> None:
        if segs and segs[-1] == "" and len(segs) > 1:
            segs = segs[:-1]
        if segs[:1] == ["api"]:
            return self._route_api(method, segs[1:])
        if segs[:1] == ["_lfs_upload"] and len(segs) == 2 and method == "PUT":
            return self._lfs_put(segs[1])
        if segs[:1] == ["_cdn"] and len(segs) == 2 and method in ("GET", "HEAD"):
            return self._cdn_get(segs[1])
        # /{prefix}{repo}.git/info/lfs/objects/{batch,verify}
        for i, s in enumerate(segs):
            if s.endswith(".git") and segs[i + 1 : i + 4] == ["info", "lfs", "objects"] and method == "POST":
                repo_type, repo_id = self._split_prefixed(segs[:i] + [s[:-4]])
                rest = segs[i + 4 :]
                if rest == ["batch"]:
                    return self._lfs_batch(repo_type, repo_id)
                if rest == ["verify"]:
                    return self._lfs_verify(repo_type, repo_id)
        # /{prefix}{repo}/resolve/{rev}/{path}
        if "resolve" in segs and method in ("GET", "HEAD"):
            i = segs.index("resolve")
            repo_type, repo_id = self._split_prefixed(segs[:i])
            if len(segs) >= i + 3:
                return self._resolve(repo_type, repo_id, segs[i + 1], "/".join(segs[i + 2 :]))
        raise HubError(404, f"Not found: {method} {self._raw_path}")

    @staticmethod
    def _split_prefixed(segs: list[str]) -> tuple[str, str]:
        repo_type = "model"
        if len(segs) >= 2 and segs[0] in REPO_TYPES:
            repo_type, segs = REPO_TYPES[segs[0]], segs[1:]
        return repo_type, "/".join(segs)

    def _route_api(self, method: str, segs: list[str]) -> None:
        if method != "GET":
            self._read_body()  # small JSON/NDJSON bodies: read before taking the hub lock
        if segs == ["whoami-v2"] and method == "GET":
            return self._whoami()
        if segs == ["repos", "create"] and method == "POST":
            return self._create_repo()
        if segs == ["repos", "delete"] and method == "DELETE":
            return self._delete_repo()
        if segs == ["validate-yaml"] and method == "POST":
            return self._json({"errors": [], "warnings": []})
        if not segs or segs[0] not in REPO_TYPES:
            raise HubError(404, f"Not found: {method} {self._raw_path}")
        repo_type, rest = REPO_TYPES[segs[0]], segs[1:]
        if not rest:
            if method == "GET":
                return self._list_repos(repo_type)
            raise HubError(405, "Method not allowed")
        if len(rest) >= 2 and rest[1] not in _API_SUBPATHS:
            repo_id, tail = f"{rest[0]}/{rest[1]}", rest[2:]
        else:
            repo_id, tail = rest[0], rest[1:]
        op = tail[0] if tail else None
        args = tail[1:]
        with self.hub._lock:
            if op is None and method == "GET":
                if not self.hub.unrevisioned_info:
                    raise HubError(401, "Unauthorized: this mirror serves only revision-qualified repo info")
                return self._repo_info(repo_type, repo_id, "main")
            if op == "revision" and len(args) == 1 and method == "GET":
                return self._repo_info(repo_type, repo_id, args[0])
            if op == "tree" and args and method == "GET":
                return self._tree(repo_type, repo_id, args[0], "/".join(args[1:]))
            if op == "paths-info" and len(args) == 1 and method == "POST":
                return self._paths_info(repo_type, repo_id, args[0])
            if op == "commits" and len(args) == 1 and method == "GET":
                return self._list_commits(repo_type, repo_id, args[0])
            if op == "refs" and not args and method == "GET":
                return self._refs(repo_type, repo_id)
            if op == "preupload" and len(args) == 1 and method == "POST":
                return self._preupload(repo_type, repo_id, args[0])
            if op == "settings" and not args and method == "PUT":
                return self._settings(repo_type, repo_id)
            if op == "branch" and len(args) == 1 and method in ("POST", "DELETE"):
                return self._branch(method, repo_type, repo_id, args[0])
            if op == "tag" and len(args) == 1 and method in ("POST", "DELETE"):
                return self._tag(method, repo_type, repo_id, args[0])
        if op == "commit" and len(args) == 1 and method == "POST":
            return self._commit(repo_type, repo_id, args[0])
        raise HubError(404, f"Not found: {method} {self._raw_path}")

    # ------------------------------------------------------------------ endpoints: account / repos
    def _whoami(self) -> None:
        if self.user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return self._json(
            {
                "type": "user",
                "id": hashlib.sha1(self.user.encode()).hexdigest()[:24],
                "name": self.user,
                "fullname": self.user,
                "email": f"{self.user}@example.com",
                "emailVerified": True,
                "isPro": False,
                "orgs": [],
                "auth": {
                    "type": "access_token",
                    "accessToken": {
                        "displayName": "test token",
                        "role": "read" if self.token in self.hub.read_only_tokens else "write",
                    },
                },
            }
        )

    def _create_repo(self) -> None:
        self._require_write()
        payload = self._json_body()
        name = payload.get("name")
        if not name or not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", name):
            raise HubError(400, f"Invalid repo name: {name!r}")
        repo_type = payload.get("type") or "model"
        if repo_type not in URL_PREFIX:
            raise HubError(400, f"Invalid repo type {repo_type!r}")
        namespace = payload.get("organization") or self.user
        repo_id = f"{namespace}/{name}"
        visibility = payload.get("visibility")
        private = payload.get("private") if visibility is None else visibility == "private"
        with self.hub._lock:
            url = f"{self.hub.url}/{URL_PREFIX[repo_type]}{repo_id}"
            if (repo_type, repo_id) in self.hub._repos:
                return (
                    409,
                    json.dumps({"error": f"You already created this {repo_type} repo", "url": url}).encode(),
                    {"X-Error-Message": f"You already created this {repo_type} repo"},
                )
            self.hub.create_repo(repo_id, repo_type=repo_type, private=bool(private))
        return self._json({"url": url, "name": repo_id, "id": repo_id})

    def _delete_repo(self) -> None:
        self._require_write()
        payload = self._json_body()
        repo_type = payload.get("type") or "model"
        repo_id = f"{payload.get('organization') or self.user}/{payload.get('name')}"
        with self.hub._lock:
            self._get_repo(repo_type, repo_id)
            self.hub.delete_repo(repo_id, repo_type=repo_type)
        return self._json({})

    def _settings(self, repo_type: str, repo_id: str) -> None:
        self._require_write()
        repo = self._get_repo(repo_type, repo_id)
        payload = self._json_body()
        if "private" in payload:
            repo["private"] = bool(payload["private"])
        if "visibility" in payload:
            repo["private"] = payload["visibility"] == "private"
        if "gated" in payload:
            repo["gated"] = payload["gated"] or False
        self.hub._save(repo)
        return self._json({})

    def _list_repos(self, repo_type: str) -> None:
        q = self._query
        author = (q.get("author") or [None])[0]
        search = (q.get("search") or [None])[0]
        limit = int((q.get("limit") or [0])[0] or 0)
        out = []
        with self.hub._lock:
            for (rt, rid), repo in sorted(self.hub._repos.items()):
                if rt != repo_type or (repo["private"] and self.user is None):
                    continue
                if author and rid.split("/")[0] != author:
                    continue
                if search and search.lower() not in rid.lower():
                    continue
                info = self._info_dict(repo, repo["commits"][repo["refs"]["main"]])
                out.append({k: info[k] for k in ("_id", "id", "private", "gated", "tags", "likes", "downloads",
                                                 "createdAt", "lastModified") if k in info}
                           | ({"modelId": rid, "library_name": info.get("library_name"),
                               "pipeline_tag": info.get("pipeline_tag")} if repo_type == "model" else {}))
        return self._json(out[:limit] if limit else out)

    # ------------------------------------------------------------------ endpoints: read
    def _info_dict(self, repo: dict, commit: dict) -> dict:
        tree = commit["tree"]
        blobs = self.hub._blob_path
        card: dict = {}
        if "README.md" in tree:
            try:
                card = _parse_front_matter(blobs(tree["README.md"]["sha256"]).read_text(errors="replace"))
            except OSError:
                card = {}
        info: dict[str, Any] = {
            "_id": hashlib.sha1(f"{repo['type']}/{repo['id']}".encode()).hexdigest()[:24],
            "id": repo["id"],
            "author": repo["id"].split("/")[0] if "/" in repo["id"] else None,
            "sha": commit["oid"],
            "lastModified": commit["date"],
            "createdAt": repo["created_at"],
            "private": repo["private"],
            "gated": repo.get("gated") or False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": [],
            "usedStorage": sum(e["size"] for e in tree.values()),
        }
        files_md = "blobs" in self._query and self._query["blobs"][0].lower() in ("1", "true")
        for path in sorted(tree):
            e = tree[path]
            sib: dict[str, Any] = {"rfilename": path}
            if files_md:
                sib.update(size=e["size"], blobId=e["oid"])
                if e["lfs"]:
                    sib["lfs"] = {"size": e["size"], "sha256": e["sha256"], "pointerSize": e["pointer_size"]}
            info["siblings"].append(sib)
        tags: list[str] = []
        if repo["type"] == "model":
            info["modelId"] = repo["id"]
            if "config.json" in tree:
                try:
                    cfg = json.loads(blobs(tree["config.json"]["sha256"]).read_bytes())
                except (OSError, ValueError):
                    cfg = {}
                config: dict[str, Any] = {k: cfg[k] for k in ("architectures", "model_type") if k in cfg}
                if "quantization_config" in cfg:
                    config["quantization_config"] = cfg["quantization_config"]
                if "tokenizer_config.json" in tree:
                    try:
                        tok = json.loads(blobs(tree["tokenizer_config.json"]["sha256"]).read_bytes())
                        config["tokenizer_config"] = {
                            k: tok[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template")
                            if k in tok
                        }
                    except (OSError, ValueError):
                        pass
                info["config"] = config
                info["library_name"] = "transformers"
                tags.append("transformers")
                if cfg.get("model_type"):
                    tags.append(cfg["model_type"])
                if any(a.endswith("ForCausalLM") for a in cfg.get("architectures") or []):
                    info["pipeline_tag"] = "text-generation"
                    info["transformersInfo"] = {"auto_model": "AutoModelForCausalLM", "pipeline_tag": "text-generation",
                                                "processor": "AutoTokenizer"}
            st = self._safetensors_summary(tree)
            if st is not None:
                info["safetensors"] = st
                tags.append("safetensors")
            if any(p.endswith(".gguf") for p in tree):
                tags.append("gguf")
        else:
            info["cardData"] = card or None
        if card:
            info["cardData"] = card
            for key in ("library_name", "pipeline_tag"):
                if card.get(key):
                    info[key] = card[key]
            card_tags = card.get("tags") or []
            tags.extend(card_tags if isinstance(card_tags, list) else [card_tags])
            if card.get("license"):
                tags.append(f"license:{card['license']}")
            base = card.get("base_model")
            for b in base if isinstance(base, list) else [base] if base else []:
                tags.append(f"base_model:{b}")
        info["tags"] = list(dict.fromkeys(tags))
        info["spaces"] = []
        expand = self._query.get("expand") or self._query.get("expand[]")
        if expand:
            info = {k: v for k, v in info.items() if k in ("_id", "id") or k in expand}
        return info

    def _safetensors_summary(self, tree: dict) -> dict | None:
        params: dict[str, int] = {}
        found = False
        for path, e in tree.items():
            if not path.endswith(".safetensors"):
                continue
            try:
                with open(self.hub._blob_path(e["sha256"]), "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(n))
            except (OSError, ValueError, struct.error):
                continue
            found = True
            for name, t in header.items():
                if name == "__metadata__":
                    continue
                count = 1
                for d in t.get("shape", []):
                    count *= d
                params[t["dtype"]] = params.get(t["dtype"], 0) + count
        return {"parameters": params, "total": sum(params.values())} if found else None

    def _repo_info(self, repo_type: str, repo_id: str, rev: str) -> None:
        repo = self._get_repo(repo_type, repo_id)
        commit = self._get_commit(repo, rev)
        return self._json(self._info_dict(repo, commit))

    def _tree_entries(self, tree: dict, base: str, recursive: bool) -> list[dict]:
        base = base.strip("/")
        prefix = base + "/" if base else ""
        if base and base not in self._dirs(tree) and base not in tree:
            raise HubError(404, f"Entry not found: {base}", code="EntryNotFound")
        if base in tree:
            raise HubError(400, f"{base} is a file, not a directory")
        files, dirs = [], set()
        for path in tree:
            if not path.startswith(prefix):
                continue
            rel = path[len(prefix) :]
            parts = rel.split("/")
            for i in range(1, len(parts)):
                if recursive or i == 1:
                    dirs.add(prefix + "/".join(parts[:i]))
            if recursive or len(parts) == 1:
                files.append(path)
        out = [{"type": "directory", "oid": self._dir_oid(tree, d), "size": 0, "path": d} for d in dirs]
        out += [self._file_entry(p, tree[p]) for p in files]
        return sorted(out, key=lambda e: e["path"])

    @staticmethod
    def _dirs(tree: dict) -> set[str]:
        out = set()
        for p in tree:
            parts = p.split("/")
            for i in range(1, len(parts)):
                out.add("/".join(parts[:i]))
        return out

    @staticmethod
    def _dir_oid(tree: dict, d: str) -> str:
        items = sorted((p, e["oid"]) for p, e in tree.items() if p.startswith(d + "/"))
        return hashlib.sha1(json.dumps(items).encode()).hexdigest()

    @staticmethod
    def _file_entry(path: str, e: dict) -> dict:
        out: dict[str, Any] = {"type": "file", "oid": e["oid"], "size": e["size"], "path": path}
        if e["lfs"]:
            out["lfs"] = {"oid": e["sha256"], "size": e["size"], "pointerSize": e["pointer_size"]}
        return out

    def _tree(self, repo_type: str, repo_id: str, rev: str, path: str) -> None:
        repo = self._get_repo(repo_type, repo_id)
        commit = self._get_commit(repo, rev)
        recursive = (self._query.get("recursive") or ["false"])[0].lower() in ("1", "true")
        entries = self._tree_entries(commit["tree"], path, recursive)
        cursor = int((self._query.get("cursor") or ["0"])[0] or 0)
        page = entries[cursor : cursor + self.hub.tree_page_size]
        headers = {}
        if cursor + self.hub.tree_page_size < len(entries):
            qs = f"recursive={str(recursive).lower()}&cursor={cursor + self.hub.tree_page_size}"
            headers["Link"] = f'<{self.hub.url}{self._raw_path}?{qs}>; rel="next"'
        return self._json(page, headers=headers)

    def _paths_info(self, repo_type: str, repo_id: str, rev: str) -> None:
        repo = self._get_repo(repo_type, repo_id)
        commit = self._get_commit(repo, rev)
        body = self._read_body()
        if "json" in self.headers.get("Content-Type", ""):
            paths = json.loads(body or b"{}").get("paths", [])
        else:
            paths = parse_qs(body.decode(), keep_blank_values=True).get("paths", [])
        tree, dirs, out = commit["tree"], self._dirs(commit["tree"]), []
        for p in paths:
            p = p.strip("/")
            if p in tree:
                out.append(self._file_entry(p, tree[p]))
            elif p in dirs:
                out.append({"type": "directory", "oid": self._dir_oid(tree, p), "size": 0, "path": p})
        return self._json(out)

    def _list_commits(self, repo_type: str, repo_id: str, rev: str) -> None:
        repo = self._get_repo(repo_type, repo_id)
        commit = self._get_commit(repo, rev)
        out = [
            {
                "id": c["oid"],
                "title": c["title"],
                "message": c["message"],
                "authors": [{"user": c["author"], "avatar": None}],
                "date": c["date"],
            }
            for c in self.hub._history(repo, commit["oid"])
        ]
        return self._json(out)

    def _refs(self, repo_type: str, repo_id: str) -> None:
        repo = self._get_repo(repo_type, repo_id)
        branches = [
            {"name": n, "ref": f"refs/heads/{n}", "targetCommit": oid}
            for n, oid in sorted(repo["refs"].items())
            if not n.startswith("refs/pr/")
        ]
        prs = [
            {"name": n, "ref": n, "targetCommit": oid} for n, oid in sorted(repo["refs"].items()) if n.startswith("refs/pr/")
        ]
        tags = [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": oid} for n, oid in sorted(repo["tags"].items())]
        out: dict[str, Any] = {"branches": branches, "converts": [], "tags": tags}
        if self._query.get("include_prs"):
            out["pullRequests"] = prs
        return self._json(out)

    def _resolve(self, repo_type: str, repo_id: str, rev: str, path: str) -> None:
        with self.hub._lock:
            repo = self._get_repo(repo_type, repo_id)
            self._check_gated(repo)
            commit = self._get_commit(repo, rev)
            entry = commit["tree"].get(path)
        headers = {"X-Repo-Commit": commit["oid"], "Access-Control-Expose-Headers": "X-Repo-Commit,X-Linked-Etag"}
        if entry is None:
            raise HubError(404, "Entry not found", code="EntryNotFound", headers=headers)
        name = path.rsplit("/", 1)[-1]
        headers["Content-Disposition"] = f"inline; filename*=UTF-8''{quote(name)}; filename=\"{name}\""
        if entry["lfs"]:
            etag = f'"{entry["sha256"]}"'
            headers.update({"ETag": etag, "X-Linked-Etag": etag, "X-Linked-Size": str(entry["size"])})
            if self.hub.cdn_host:
                sha = entry["sha256"]
                location = f"http://{self.hub.cdn_host}:{self.hub.port}/_cdn/{sha}?sig={self.hub._lfs_sig(sha)}"
                headers["Location"] = location
                return self._send(302, b"", headers)
        else:
            headers["ETag"] = f'"{entry["oid"]}"'
        self._serve_blob(entry["sha256"], entry["size"], headers)

    def _cdn_get(self, sha: str) -> None:
        sig = (self._query.get("sig") or [""])[0]
        if not hmac.compare_digest(sig, self.hub._lfs_sig(sha)) or not self.hub._blob_path(sha).exists():
            raise HubError(403, "Invalid or expired signature")
        size = self.hub._blob_path(sha).stat().st_size
        self._serve_blob(sha, size, {"ETag": f'"{sha}"'})

    def _serve_blob(self, sha256: str, size: int, headers: dict) -> None:
        headers["Accept-Ranges"] = "bytes"
        start, end = 0, size - 1
        status = 200
        rng = self.headers.get("Range")
        if rng:
            m = _RANGE_RE.match(rng)
            if m is None or (not m.group(1) and not m.group(2)):
                raise HubError(416, f"Invalid range {rng!r}", headers={"Content-Range": f"bytes */{size}"})
            a, b = m.group(1), m.group(2)
            if a:
                start, end = int(a), min(int(b), size - 1) if b else size - 1
            else:
                start, end = max(size - int(b), 0), size - 1
            if start >= size or start > end:
                raise HubError(416, "Range not satisfiable", headers={"Content-Range": f"bytes */{size}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        length = max(end - start + 1, 0)
        headers["Content-Length"] = str(length)
        self.send_response(status)
        headers.setdefault("Content-Type", "application/octet-stream")
        for k, v in headers.items():
            self.send_header(k, str(v))
        self.end_headers()
        if self.command == "HEAD":
            return
        limit = length // 2 if self._truncate else length
        with open(self.hub._blob_path(sha256), "rb") as f:
            f.seek(start)
            remaining = limit
            while remaining > 0:
                chunk = f.read(min(remaining, 1 << 20))
                if not chunk:
                    break
                self.wfile.write(chunk)
                remaining -= len(chunk)
        if self._truncate:
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ------------------------------------------------------------------ endpoints: write
    def _branch(self, method: str, repo_type: str, repo_id: str, name: str) -> None:
        self._require_write()
        repo = self._get_repo(repo_type, repo_id)
        if method == "DELETE":
            if name not in repo["refs"] or name == "main":
                raise HubError(404 if name != "main" else 403, f"Cannot delete branch {name}", code="RevisionNotFound")
            del repo["refs"][name]
        else:
            payload = self._json_body()
            if name in repo["refs"]:
                raise HubError(409, f"Reference already exists: refs/heads/{name}")
            repo["refs"][name] = self._get_commit(repo, payload.get("startingPoint") or "main")["oid"]
        self.hub._save(repo)
        return self._json({})

    def _tag(self, method: str, repo_type: str, repo_id: str, arg: str) -> None:
        self._require_write()
        repo = self._get_repo(repo_type, repo_id)
        if method == "DELETE":
            if arg not in repo["tags"]:
                raise HubError(404, f"Tag {arg} not found", code="RevisionNotFound")
            del repo["tags"][arg]
        else:
            payload = self._json_body()
            tag = payload.get("tag")
            if not tag:
                raise HubError(400, "Missing tag")
            if tag in repo["tags"]:
                raise HubError(409, f"Tag {tag} already exists")
            repo["tags"][tag] = self._get_commit(repo, arg)["oid"]
        self.hub._save(repo)
        return self._json({})

    def _preupload(self, repo_type: str, repo_id: str, rev: str) -> None:
        self._require_write()
        repo = self._get_repo(repo_type, repo_id)
        payload = self._json_body()
        create_pr = bool(self._query.get("create_pr"))
        tree = self._get_commit(repo, "main" if create_pr else rev)["tree"]
        ignore = [
            line.strip()
            for line in (payload.get("gitIgnore") or "").splitlines()
            if line.strip() and not line.startswith("#")
        ]
        out = []
        for f in payload.get("files", []):
            path, size = f["path"], int(f.get("size", 0))
            sample = base64.b64decode(f.get("sample") or "")
            lfs = self.hub._should_be_lfs(tree, path, size, sample)
            existing = tree.get(path)
            oid = None
            if existing is not None:
                oid = existing["sha256"] if existing["lfs"] else existing["oid"]
            name = path.rsplit("/", 1)[-1]
            ignored = any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(path, p) for p in ignore)
            out.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": ignored, "oid": oid})
        return self._json({"files": out})

    def _lfs_batch(self, repo_type: str, repo_id: str) -> None:
        self._require_write()
        with self.hub._lock:
            self._get_repo(repo_type, repo_id)
        payload = self._json_body()
        if payload.get("operation") != "upload":
            raise HubError(400, "Only the 'upload' operation is supported")
        objects = []
        verify_href = f"{self.hub.url}/{URL_PREFIX[repo_type]}{repo_id}.git/info/lfs/objects/verify"
        for obj in payload.get("objects", []):
            oid, size = obj["oid"], int(obj["size"])
            blob = self.hub._blob_path(oid)
            if blob.exists() and blob.stat().st_size == size:
                objects.append({"oid": oid, "size": size})  # already there: no actions
                continue
            href = f"{self.hub.url}/_lfs_upload/{oid}?size={size}&sig={self.hub._lfs_sig(oid)}"
            objects.append(
                {
                    "oid": oid,
                    "size": size,
                    "authenticated": True,
                    "actions": {"upload": {"href": href}, "verify": {"href": verify_href}},
                }
            )
        body = json.dumps({"transfer": "basic", "objects": objects, "hash_algo": "sha256"}).encode()
        return (200, body, {"Content-Type": "application/vnd.git-lfs+json"})

    def _lfs_put(self, oid: str) -> None:
        sig = (self._query.get("sig") or [""])[0]
        if not re.match(r"^[0-9a-f]{64}$", oid) or not hmac.compare_digest(sig, self.hub._lfs_sig(oid)):
            raise HubError(403, "Invalid upload signature")
        expected_size = int((self._query.get("size") or ["-1"])[0])
        tmp = self.hub.root / "tmp" / secrets.token_hex(8)
        h, n = hashlib.sha256(), 0
        try:
            with open(tmp, "wb") as f:
                for chunk in self._iter_body():
                    h.update(chunk)
                    n += len(chunk)
                    f.write(chunk)
            if h.hexdigest() != oid or (expected_size >= 0 and n != expected_size):
                raise HubError(400, f"Uploaded content does not match oid/size (got sha256 {h.hexdigest()}, {n} bytes)")
            os.replace(tmp, self.hub._blob_path(oid))
        finally:
            if tmp.exists():
                tmp.unlink()
        self._send(200, b"", {"ETag": f'"{oid}"'})

    def _lfs_verify(self, repo_type: str, repo_id: str) -> None:
        self._require_write()
        payload = self._json_body()
        blob = self.hub._blob_path(payload.get("oid", ""))
        if not blob.exists() or blob.stat().st_size != int(payload.get("size", -1)):
            raise HubError(404, f"LFS object {payload.get('oid')} not found")
        return self._json({"success": True})

    def _commit(self, repo_type: str, repo_id: str, rev: str) -> None:
        self._require_write()
        body = self._read_body()
        with self.hub._lock:
            repo = self._get_repo(repo_type, repo_id)
        try:
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        except ValueError:
            raise HubError(400, "Invalid NDJSON payload")
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "First NDJSON line must be the commit header")
        header = lines[0]["value"]
        # Stage everything (blobs are content-addressed, so storing before the ref update is harmless).
        staged: list[tuple[str, str, dict | None]] = []
        for item in lines[1:]:
            key, value = item.get("key"), item.get("value") or {}
            path = (value.get("path") or "").strip("/")
            if not path or ".." in path.split("/"):
                raise HubError(400, f"Invalid path {value.get('path')!r}")
            if key == "file":
                if value.get("encoding", "base64") != "base64":
                    raise HubError(400, "Only base64 encoding is supported")
                data = base64.b64decode(value.get("content", ""))
                staged.append(("add", path, self.hub._store_regular(data)))
            elif key == "lfsFile":
                oid = value.get("oid", "")
                blob = self.hub._blob_path(oid)
                if not re.match(r"^[0-9a-f]{64}$", oid) or not blob.exists():
                    raise HubError(
                        422, f"Your push was rejected because an LFS pointer pointed to a file that does not exist ({oid})"
                    )
                size = blob.stat().st_size
                if value.get("size") is not None and int(value["size"]) != size:
                    raise HubError(422, f"LFS object {oid} has size {size}, not {value['size']}")
                staged.append(("add", path, LocalHub._lfs_entry(oid, size)))
            elif key == "deletedFile":
                staged.append(("del", path, None))
            elif key == "deletedFolder":
                staged.append(("deldir", path, None))
            else:
                raise HubError(400, f"Unknown commit operation {key!r}")
        create_pr = bool(self._query.get("create_pr"))
        with self.hub._lock:
            repo = self._get_repo(repo_type, repo_id)
            if rev not in repo["refs"] and not rev.startswith("refs/heads/"):
                if self.hub._resolve_rev(repo, rev) is not None:
                    raise HubError(400, f"Invalid rev id: {rev} is not a branch")
                raise HubError(404, f"Invalid rev id: {rev}", code="RevisionNotFound")
            branch = rev[11:] if rev.startswith("refs/heads/") else rev
            if branch not in repo["refs"]:
                raise HubError(404, f"Invalid rev id: {rev}", code="RevisionNotFound")
            parent = repo["refs"][branch]
            if header.get("parentCommit") and header["parentCommit"] != parent:
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            tree = dict(repo["commits"][parent]["tree"])
            for op, path, entry in staged:
                if op == "add":
                    tree[path] = entry
                elif op == "del":
                    if path not in tree:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", code="EntryNotFound")
                    del tree[path]
                else:
                    doomed = [p for p in tree if p.startswith(path + "/")]
                    if not doomed:
                        raise HubError(404, f"A folder with this name doesn't exist: {path}", code="EntryNotFound")
                    for p in doomed:
                        del tree[p]
            oid = self.hub._new_commit(
                repo, parent, tree, header.get("summary") or "Upload", header.get("description") or "", self.user
            )
            out: dict[str, Any] = {"success": True, "hookOutput": "", "commitOid": oid}
            if create_pr:
                repo["pr_count"] += 1
                num = repo["pr_count"]
                repo["refs"][f"refs/pr/{num}"] = oid
                out["pullRequestUrl"] = f"{self._repo_web_url(repo)}/discussions/{num}"
            else:
                repo["refs"][branch] = oid
            self.hub._save(repo)
        out["commitUrl"] = f"{self._repo_web_url(repo)}/commit/{oid}"
        return self._json(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Local Hugging Face Hub-compatible server (for tests).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--root", default=None, help="storage dir (default: a new temp dir)")
    parser.add_argument(
        "--token", action="append", default=[], metavar="TOKEN=USER",
        help=f"accepted token (repeatable; default {next(iter(DEFAULT_TOKENS))}={next(iter(DEFAULT_TOKENS.values()))})",
    )
    parser.add_argument(
        "--no-unrevisioned-info", action="store_true",
        help="answer 401 to GET /api/{T}/{repo} (no /revision/{rev}), like a mirror",
    )
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    tokens = dict(t.split("=", 1) for t in args.token) if args.token else None
    root = args.root or tempfile.mkdtemp(prefix="localhub-")
    hub = LocalHub(
        root, tokens=tokens, host=args.host, port=args.port, unrevisioned_info=not args.no_unrevisioned_info,
        verbose=args.verbose,
    )
    url = hub.start()
    print(url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        hub.stop()
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
