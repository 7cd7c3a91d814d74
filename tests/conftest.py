"""Shared pytest fixtures.

Local Hub fixtures (see ``tests/hub_server.py``): ``local_hub``, ``hub_env``, ``hub_inprocess``, ``hub_api``.
``fast_network``: short Hub timeouts for the tests of network failures.
Tiny model fixtures (see ``tests/tiny_models.py``): ``tiny_llama_dir`` (a private copy), ``warm`` (one per module,
with a calibration cache its conversions share).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so `hub_server` / `tiny_models` import with or without __init__.py

from hub_server import HF_ENV_TO_DROP, TEST_TOKEN, TEST_USER, LocalHub, subprocess_env  # noqa: E402
from tiny_models import save_tiny_llama  # noqa: E402

HUB_TOKEN = TEST_TOKEN  # "hf_dummy_test_token"
HUB_USER = TEST_USER  # "test-user"


_OMP_NUM_THREADS = os.environ.get("OMP_NUM_THREADS")  # as the run was started: what the slow tier keeps
_TORCH_THREADS: list[int] = []  # torch's own default, read once


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Fast-tier tests (not marked slow) run torch on one thread, in this process and, through OMP_NUM_THREADS, in the
    processes they start: their models are tiny, and OpenMP's second thread costs more in synchronisation than it
    gains (several times more on a busy machine). Set before the test's fixtures, so a module fixture first built for
    a fast test builds with one thread too. The slow tier (real SmolLM2) keeps the defaults; tests/vllm its own."""
    if "vllm" in item.path.relative_to(Path(__file__).parent).parts[:-1]:
        return
    import torch

    if not _TORCH_THREADS:
        _TORCH_THREADS.append(torch.get_num_threads())
    slow = item.get_closest_marker("slow") is not None
    torch.set_num_threads(_TORCH_THREADS[0] if slow else 1)
    if not slow:
        os.environ["OMP_NUM_THREADS"] = "1"
    elif _OMP_NUM_THREADS is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = _OMP_NUM_THREADS


@pytest.fixture(autouse=True)
def _offline_unless_local_hub(request, monkeypatch):
    """Tests that do not talk to the local Hub run with HF_HUB_OFFLINE=1 (in this process and in subprocesses), so
    the "auto" calibration/evaluation text is the built-in one: deterministic, and never a download. Tests using the
    local Hub fixtures stay online against it (it has no Salesforce/wikitext or allenai/c4 unless a test creates them,
    so "auto" there is the offline mixture too, after one line for each Hub domain left out)."""
    if "local_hub" in request.fixturenames or request.node.get_closest_marker("own_local_hub"):
        return
    import huggingface_hub.constants as hf_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(autouse=True, scope="session")
def _one_parsed_text_cache(tmp_path_factory):
    """Tests keep their calibration caches apart (HFCOMPRESS_CACHE per test), but parsing the Wikipedia excerpt takes
    ~10 s and depends on nothing a test changes: one parsed copy serves the session, its subprocesses included."""
    os.environ["HFCOMPRESS_TEXT_CACHE"] = str(tmp_path_factory.mktemp("texts"))
    yield
    os.environ.pop("HFCOMPRESS_TEXT_CACHE", None)


# ----------------------------------------------------------------------------------------------------- local Hub
@pytest.fixture
def local_hub(tmp_path_factory, monkeypatch):
    """A fresh, empty, running ``LocalHub`` (function scope: every test gets its own server and storage).

    * ``local_hub.url`` is the endpoint (``http://127.0.0.1:<port>``); the only accepted token is
      ``HUB_TOKEN = "hf_dummy_test_token"`` (user ``HUB_USER = "test-user"``); add more with ``add_token``.
    * Inspect state with ``local_hub.commits(repo_id)``, ``.files(repo_id, revision)``, ``.read_file(...)``,
      ``.head(repo_id)``, ``.requests`` (request log); seed repos server-side with ``.upload_files(repo_id, {...})``;
      gate/privatize with ``.set_gated(repo_id, allowed_users=...)`` / ``.set_private(repo_id)``; inject faults with
      ``.inject_fault("GET", "/org/name/resolve/", 503)`` (also ``"reset"``, ``"truncate"``, ``"delay:2"``,
      ``"stall:2"``, ``"echo-auth:403"``).
    * Also forces ``huggingface_hub.constants.HF_HUB_DISABLE_XET = True`` in this process (hf_xet is installed and
      the local Hub has no Xet backend): uploads then go through the legacy LFS protocol.

    In-process code does NOT see this server by default: ``huggingface_hub`` reads ``HF_ENDPOINT`` once, at import
    time. Either pass ``endpoint=local_hub.url`` (and ``token=HUB_TOKEN``) explicitly to ``HfApi(...)``,
    ``hf_hub_download(...)``, ``snapshot_download(...)`` (preferred), or use the ``hub_inprocess`` fixture which
    monkeypatches ``huggingface_hub.constants`` so that default-endpoint calls (e.g. ``from_pretrained("org/name")``
    inside this process) hit the local Hub. Subprocesses: use ``env=hub_env``.
    """
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    hub = LocalHub(tmp_path_factory.mktemp("localhub"), tokens={HUB_TOKEN: HUB_USER})
    hub.start()
    try:
        yield hub
    finally:
        hub.stop()


@pytest.fixture
def hub_env(local_hub, tmp_path_factory) -> dict[str, str]:
    """Full environment (``os.environ`` copy + overrides) for subprocesses talking to ``local_hub``.

    Use as ``subprocess.run([...], env=hub_env)``. Overrides: ``HF_ENDPOINT=<local_hub.url>``,
    ``HF_TOKEN=hf_dummy_test_token``, ``HF_HOME=<fresh tmp dir>`` (so the HF cache is ``$HF_HOME/hub``),
    ``HF_HUB_DISABLE_XET=1``, ``HF_HUB_DISABLE_TELEMETRY=1``, ``HF_HUB_OFFLINE=0``, ``TRANSFORMERS_OFFLINE=0``,
    ``HF_HUB_ETAG_TIMEOUT=5``, ``HF_HUB_DOWNLOAD_TIMEOUT=10``, ``HF_HUB_DISABLE_PROGRESS_BARS=1``,
    ``HF_HUB_DISABLE_UPDATE_CHECK=1``. Inherited ``HF_HUB_CACHE``/``HF_TOKEN_PATH``/... are removed
    (see ``hub_server.subprocess_env``, also usable without the fixture).
    """
    return subprocess_env(local_hub.url, tmp_path_factory.mktemp("hf_home"), HUB_TOKEN)


@pytest.fixture
def hub_inprocess(local_hub, hub_env, monkeypatch):
    """Point THIS process's ``huggingface_hub`` at ``local_hub`` (yields ``local_hub``).

    Monkeypatches ``huggingface_hub.constants`` (ENDPOINT, HUGGINGFACE_CO_URL_TEMPLATE, HF_HOME, HF_HUB_CACHE,
    HF_TOKEN_PATH, HF_HUB_OFFLINE) and sets the ``hub_env`` variables in ``os.environ`` (``HF_TOKEN`` is read at call
    time), so code that does not take an ``endpoint`` argument (``hf_hub_download(repo, f)``, ``HfApi()``,
    ``transformers`` ``from_pretrained("org/name")``) talks to the local Hub with the test token and a fresh cache.
    """
    import huggingface_hub.constants as c

    for key, value in hub_env.items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)
    for key in HF_ENV_TO_DROP:
        monkeypatch.delenv(key, raising=False)
    hf_home = hub_env["HF_HOME"]
    monkeypatch.setattr(c, "ENDPOINT", local_hub.url)
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", local_hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(c, "HF_HOME", hf_home)
    monkeypatch.setattr(c, "HF_HUB_CACHE", os.path.join(hf_home, "hub"))
    monkeypatch.setattr(c, "HF_TOKEN_PATH", os.path.join(hf_home, "token"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    yield local_hub


@pytest.fixture
def hub_api(local_hub):
    """``HfApi(endpoint=local_hub.url, token=HUB_TOKEN)``."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=local_hub.url, token=HUB_TOKEN)


@pytest.fixture
def fast_network(monkeypatch):
    """Short Hub timeouts and retry backoff (``HFCOMPRESS_HTTP_TIMEOUT=2``, ``HFCOMPRESS_RETRY_DELAY=0.05``) for the
    tests of network failures; afterwards ``huggingface_hub`` gets its default HTTP client back (hfcompress installs
    its own). A module takes it with ``pytestmark = pytest.mark.usefixtures("fast_network")``, or changes a value in
    an autouse fixture of its own that asks for it and calls ``monkeypatch.setenv``."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import default_client_factory

    monkeypatch.setenv("HFCOMPRESS_HTTP_TIMEOUT", "2")
    monkeypatch.setenv("HFCOMPRESS_RETRY_DELAY", "0.05")
    yield
    set_client_factory(default_client_factory)


# ----------------------------------------------------------------------------------------------------- tiny models
@pytest.fixture(scope="session")
def _tiny_llama_template(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_template") / "tiny-llama")


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> tuple[Path, Path]:
    """(tiny model dir, calibration cache dir) shared by the conversions of one test module: the first conversion
    with a module's settings fills the cache, the next ones reuse it. A change to the model dir is seen by the
    module's later tests."""
    root = tmp_path_factory.mktemp("warm")
    return save_tiny_llama(root / "tiny-llama"), root / "cache"


@pytest.fixture
def tiny_llama_dir(_tiny_llama_template, tmp_path) -> Path:
    """A private copy (safe to modify) of a tiny random LlamaForCausalLM checkpoint + real BPE tokenizer.

    Files: config.json, generation_config.json, model.safetensors (fp32, ~0.86 MB, 213,568 params),
    tokenizer.json, tokenizer_config.json. hidden 64, 4 layers, 4 heads / 2 kv heads, intermediate 128, vocab 512,
    untied lm_head, bos=1 eos=pad=2. Built once per session with ``tiny_models.save_tiny_llama`` (numpy + tokenizers,
    no torch import); loads with ``AutoModelForCausalLM`` / ``AutoTokenizer``. For a checkpoint written by
    ``transformers`` itself use ``save_tiny_llama(path, method="transformers")``.
    """
    dst = tmp_path / "tiny-llama"
    shutil.copytree(_tiny_llama_template, dst)
    return dst
