"""Calibration/evaluation text sources: wikitext-2 through `datasets` from a real local Hub, the "auto" fallback to
the offline Wikipedia text when offline or unreachable (no request offline, one bounded probe online, with a notice), and
one-sentence errors for bad values."""

import dataclasses
import gzip
import inspect
import io
import json
import math
import os
import socket
import re
import subprocess
import sys
import threading
from importlib.metadata import distributions
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import hfcompress.sources.text as text_module
from hfcompress.cli import app
from hfcompress.conversion.config import ConvertOptions
from hfcompress.errors import HfcompressError
from hfcompress.sources.text import (
    BUILTIN_TEXT_NAME,
    C4_FILE,
    C4_REPO,
    WIKI_TEXT_NAME,
    WIKITEXT_CONFIG,
    WIKITEXT_REPO,
    builtin_text,
    check_text_option,
    load_text,
    other_domain_ids,
    short_name,
    wiki_file,
)

runner = CliRunner()
FAST = [
    "--calib-sequences", "4", "--seq-len", "64", "--eval-tokens", "512", "--lisa-steps", "5", "--protect-first", "1",
    "--no-probe", "--no-speed", "--max-ppl-increase", "1000",
    "--distill-tokens", "0",
]
# The layout of the real Salesforce/wikitext repo: per-config parquet files named by the configs in README.md.
WIKITEXT_README = f"""---
configs:
- config_name: {WIKITEXT_CONFIG}
  data_files:
  - split: test
    path: {WIKITEXT_CONFIG}/test-*
  - split: train
    path: {WIKITEXT_CONFIG}/train-*
---
# wikitext (test copy)
"""


def _parquet(rows: list[str]) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(pa.table({"text": rows}), buffer)
    return buffer.getvalue()


@pytest.fixture
def wikitext_hub(local_hub):
    """The local Hub with a small Salesforce/wikitext: train and test splits of real English lines (wikitext-style
    rows: one line each, trailing newline). Yields (hub, commit sha, train rows, test rows)."""
    lines = [line + "\n" for line in builtin_text().splitlines()]
    cut = len(lines) * 3 // 4
    train, test = lines[:cut], lines[cut:]
    sha = local_hub.upload_files(
        WIKITEXT_REPO,
        {
            "README.md": WIKITEXT_README.encode(),
            f"{WIKITEXT_CONFIG}/train-00000-of-00001.parquet": _parquet(train),
            f"{WIKITEXT_CONFIG}/test-00000-of-00001.parquet": _parquet(test),
        },
        repo_type="dataset",
    )
    yield local_hub, sha, train, test


# The layout of the real allenai/c4 repo: one config per variant, json.gz shards named so.
C4_README = """---
configs:
- config_name: en
  default: true
  data_files:
  - split: train
    path: en/c4-train.*-of-01024.json.gz
  - split: validation
    path: en/c4-validation.*-of-00008.json.gz
---
# c4 (test copy)
"""


def licence_paragraphs() -> list[str]:
    """Real English prose the machine has: the paragraphs (20 words or more) of the licence files of the installed
    distributions, unique, in a fixed order. Not web text: it stands in for C4's documents."""
    paragraphs = set()
    for dist in distributions():
        for file in dist.files or []:
            if ".dist-info" in str(file) and re.search(r"(LICEN[CS]E|COPYING)[^/]*$", file.name, re.I):
                try:
                    body = file.read_text() or ""
                except (OSError, UnicodeDecodeError):
                    continue
                paragraphs.update(" ".join(p.split()) for p in body.split("\n\n") if len(p.split()) >= 20)
    return sorted(paragraphs)


@pytest.fixture
def c4_hub(wikitext_hub):
    """The local Hub with Salesforce/wikitext (`wikitext_hub`) and a small allenai/c4: its validation shard 0 as the
    real repo names it, JSON lines with text, timestamp and url; the documents are licence paragraphs (real English,
    `licence_paragraphs`), one of them quoting NumPy's documentation. Yields (hub, wikitext sha, c4 sha, documents)."""
    hub, wikitext_sha, _, _ = wikitext_hub
    documents = [p for p in licence_paragraphs() if "numpy" not in p.lower()][:400]
    assert len(documents) == 400, "too few licence paragraphs installed for the C4 stand-in"
    documents[250] = "From NumPy's documentation: " + text_module.numpy_docs_text().text[:2000]
    lines = [json.dumps({"text": doc, "timestamp": "2019-04-20T00:00:00Z", "url": f"https://example.org/{i}"}) for i, doc in enumerate(documents)]
    sha = hub.upload_files(
        C4_REPO,
        {"README.md": C4_README.encode(), C4_FILE: gzip.compress("\n".join(lines).encode() + b"\n", mtime=0)},
        repo_type="dataset",
    )
    yield hub, wikitext_sha, sha, documents


@pytest.fixture(autouse=True)
def _fresh_probe():
    text_module._probe_dataset.cache_clear()  # each test's endpoint is asked afresh
    text_module._hub_domains.cache_clear()
    yield
    text_module._probe_dataset.cache_clear()
    text_module._hub_domains.cache_clear()


@pytest.fixture
def log(monkeypatch) -> io.StringIO:
    """What text.py logs, unwrapped (a wide console)."""
    buffer = io.StringIO()
    monkeypatch.setattr(text_module, "console", Console(file=buffer, width=400))
    return buffer


def cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hfcompress.cli", *args], env={**env, "COLUMNS": "300"}, capture_output=True, text=True
    )


LOAD_BOTH = """
import json
import math
from hfcompress.sources.text import load_text
print(json.dumps({role: [t.name, t.text, t.held_out] for role in ("calibration", "evaluation") for t in [load_text(
    "wikitext-2", role)]}))
"""


@pytest.mark.parametrize("mirror", [False, True], ids=["hub", "mirror without un-revisioned info"])
def test_wikitext2_loads_through_datasets(wikitext_hub, hub_env, mirror):
    hub, sha, train, test = wikitext_hub
    hub.unrevisioned_info = not mirror  # a mirror answers 401 on the bare /api/datasets/{repo}
    proc = subprocess.run([sys.executable, "-c", LOAD_BOTH], env=hub_env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    # calibration reads train, evaluation test: the standard protocol, lines joined as in the HF perplexity guide
    assert loaded["calibration"] == [f"{WIKITEXT_REPO} {WIKITEXT_CONFIG}, train split @{sha[:8]}", "\n\n".join(train), False]
    assert loaded["evaluation"] == [f"{WIKITEXT_REPO} {WIKITEXT_CONFIG}, test split @{sha[:8]}", "\n\n".join(test), False]
    assert hub.requests_matching(contains=f"/datasets/{WIKITEXT_REPO}/resolve/{sha}/{WIKITEXT_CONFIG}/test-")


LOAD_NAMED = """
import json
import math
from hfcompress.sources.text import load_text
print(json.dumps({role: load_text("hf:Salesforce/wikitext:wikitext-2-raw-v1", role).name for role in ("calibration", "evaluation")}))
"""


def test_any_hub_dataset_by_name(wikitext_hub, hub_env):
    hub, sha, train, test = wikitext_hub
    proc = subprocess.run([sys.executable, "-c", LOAD_NAMED], env=hub_env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = json.loads(proc.stdout.strip().splitlines()[-1])
    assert names == {
        "calibration": f"{WIKITEXT_REPO} {WIKITEXT_CONFIG}, train split @{sha[:8]}",
        "evaluation": f"{WIKITEXT_REPO} {WIKITEXT_CONFIG}, test split @{sha[:8]}",
    }
    with pytest.raises(HfcompressError, match="write a Hub dataset as hf:owner/name"):
        check_text_option("hf:wikitext", "calibration")


# ------------------------------------------------------------------------------------------- the online mixture
# Run first in every subprocess of the online-mixture tests: each domain cut to 40,000 characters (the offline ones to
# their last, so no offline domain repeats the start of the wikitext-2 stand-in, which is the Python reference too) and
# C4's skipped head to 200 documents, so the tiny tokenizer gets through six domains in seconds.
SMALL_ONLINE_MIXTURE = """
import dataclasses
import hfcompress.sources.text as text
full = text.mixture_domains()
text.mixture_domains = lambda: [text.Text(d.name, d.text[-40_000:], True) for d in full]
text.HUB_DOMAIN_CHARS = 40_000
text.HUB_DOMAINS = (text.HUB_DOMAINS[0], dataclasses.replace(text.HUB_DOMAINS[1], skip=200))
"""
OFFLINE_DOMAINS = ["enwiki-sample", "lee-news", "python-language-reference", "usenet-sample"]

LOAD_ONLINE = SMALL_ONLINE_MIXTURE + """
import json
import sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
calibration = text.load_text("auto", "calibration")
evaluation = text.load_text("auto", "evaluation", fallback=calibration)
streams = {seed: text.text_streams(tokenizer, "auto", "auto", 1, seed) for seed in (0, 1)}
print(json.dumps({
    "name": calibration.name, "same": evaluation is calibration,
    "parts": [[d.name, d.text, d.dataset.to_dict() if d.dataset else None] for d in calibration.parts],
    "datasets": text.hub_datasets(streams[0][1]),
    "streams": {seed: [s[0].tolist(), s[1], s[2].tolist(), s[3]] for seed, s in streams.items()},
}))
"""


def _assert_split_per_domain(tokenizer, text, split) -> None:
    """Each domain's calibration blocks are its own first 75%, shuffled; its held-out last 25% is evaluated and in no
    calibration step."""
    from hfcompress.sources.text import MIX_BLOCK_TOKENS, tokenize_split

    blocks = lambda ids: [tuple(b.tolist()) for b in ids.split(MIX_BLOCK_TOKENS)]  # noqa: E731
    for index, domain in enumerate(text.parts):
        own = tokenize_split(tokenizer, domain.text, domain.name)
        mine = split.calibration[split.owner == index]
        whole = own.calibration[: len(own.calibration) // MIX_BLOCK_TOKENS * MIX_BLOCK_TOKENS]
        assert len(mine) == len(whole) and sorted(blocks(mine)) == sorted(blocks(whole)) and len(blocks(mine)) >= 15
        held = blocks(own.held_out[: len(own.held_out) // MIX_BLOCK_TOKENS * MIX_BLOCK_TOKENS])
        assert held and set(held) <= set(blocks(split.held_out))  # its held-out part is evaluated ...
        assert not set(held) & set(blocks(split.calibration))  # ... and in no calibration step
    assert len(split.held_out) == sum(held // MIX_BLOCK_TOKENS * MIX_BLOCK_TOKENS for _, held in split.domains.values())


@pytest.mark.skipif(wiki_file() is None, reason="gensim (three of the mixture's domains) is not installed")
def test_auto_online_is_the_mixture_of_six_domains(c4_hub, hub_env, tiny_llama_dir):
    """When the Hub answers, "auto" is the offline domains plus wikitext-2 (its train split) and C4 (validation shard
    0 after GPTQ's evaluation documents), each pinned to the revision the Hub names, NumPy-free, split 75% / 25% on its
    own and interleaved in equal shares (seeded); evaluation scores every domain's held-out part, the same for any seed;
    the calibration datasets are listed for the card."""
    from transformers import AutoTokenizer

    from hfcompress.sources.text import MIX_BLOCK_TOKENS, HubDataset, Text, mixture_split

    hub, wikitext_sha, c4_sha, documents = c4_hub
    proc = subprocess.run([sys.executable, "-c", LOAD_ONLINE, str(tiny_llama_dir)], env=hub_env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    names = [*OFFLINE_DOMAINS, f"wikitext-2 @{wikitext_sha[:8]}", f"c4 @{c4_sha[:8]}"]
    assert [short_name(name) for name, _, _ in loaded["parts"]] == names
    assert loaded["name"] == f"mixture of {', '.join(names)} (equal shares of {MIX_BLOCK_TOKENS}-token blocks)"
    assert loaded["same"]  # evaluation reads the calibration mixture's held-out parts: one load, one tokenisation
    wikitext_train = {"id": WIKITEXT_REPO, "config": WIKITEXT_CONFIG, "split": "train", "revision": wikitext_sha}
    c4_validation = {"id": C4_REPO, "config": None, "split": "validation", "revision": c4_sha, "data_files": C4_FILE}
    assert [dataset for _, _, dataset in loaded["parts"]] == [None] * 4 + [wikitext_train, c4_validation]
    assert loaded["datasets"] == [wikitext_train, c4_validation]
    assert hub.requests_matching(contains=f"/datasets/{C4_REPO}/resolve/{c4_sha}/{C4_FILE}")  # the revision probed

    wikitext, c4 = loaded["parts"][4][1], loaded["parts"][5][1]
    kept = [doc for doc in documents[200:] if "NumPy" not in doc]
    assert c4.startswith(kept[0] + "\n\n" + kept[1]) and 40_000 <= len(c4) < 40_000 + max(map(len, kept))
    assert not any(doc in c4 for doc in documents[:200])  # GPTQ's C4 evaluation documents (here: the first 200)
    assert "numpy" not in (wikitext + c4).lower()  # the planted NumPy quote is dropped
    docs = text_module.numpy_docs_text().text
    for _, body, _ in loaded["parts"]:  # the third domain is in no calibration domain
        assert docs[1000:1200] not in body and docs[5000:5200] not in body

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    parts = tuple(Text(name, body, True, HubDataset(**dataset) if dataset else None) for name, body, dataset in loaded["parts"])
    mixture = Text(loaded["name"], "", True, parts=parts)
    split = mixture_split(tokenizer, mixture, seed=0)
    _assert_split_per_domain(tokenizer, mixture, split)
    shares = split.shares(split.balanced_tokens)
    assert len(shares) == 6 and max(shares.values()) - min(shares.values()) <= MIX_BLOCK_TOKENS
    (calib0, calib_name, eval0, eval_name), (calib1, _, eval1, _) = loaded["streams"]["0"], loaded["streams"]["1"]
    assert calib0 == split.calibration[: split.balanced_tokens].tolist() and eval0 == split.held_out.tolist()
    assert calib1 != calib0 and len(calib1) == len(calib0) and eval1 == eval0  # the seed draws blocks and order only
    assert (calib_name, eval_name) == (f"{mixture.name}, first 75% of each", f"{mixture.name}, held-out last 25% of each")

    assert other_domain_ids(tokenizer, "auto", calib_name)[1].startswith("numpy-docs (")  # the gate's third domain
    with pytest.raises(HfcompressError, match="--ood-text wikitext-2: the calibration mixture has wikitext-2"):
        other_domain_ids(tokenizer, "wikitext-2", calib_name)


LOAD_ONLINE_NAMES = SMALL_ONLINE_MIXTURE + """
import json
calibration = text.load_text("auto", "calibration")
evaluation = text.load_text("auto", "evaluation", fallback=calibration)
print(json.dumps({"name": calibration.name, "same": evaluation is calibration}))
"""


@pytest.mark.skipif(wiki_file() is None, reason="gensim (three of the mixture's domains) is not installed")
def test_a_hub_domain_that_fails_is_left_out_with_one_line(c4_hub, hub_env):
    """C4's shard failing on the server (HTTP 404 for every download of it): one console line names it and why, and
    the mixture goes on with the offline domains and wikitext-2; evaluation does not try again."""
    hub, wikitext_sha, _, _ = c4_hub
    hub.inject_fault("*", f"/datasets/{C4_REPO}/resolve/", *[404] * 50)
    proc = subprocess.run([sys.executable, "-c", LOAD_ONLINE_NAMES], env={**hub_env, "COLUMNS": "400"}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    names = [*OFFLINE_DOMAINS, f"wikitext-2 @{wikitext_sha[:8]}"]
    assert loaded["name"] == f"mixture of {', '.join(names)} (equal shares of 512-token blocks)" and loaded["same"]
    failures = [line for line in proc.stderr.splitlines() if "left out" in line]
    assert len(failures) == 1, proc.stderr[-3000:]
    assert f"calibration mixture: c4 left out (Cannot load {C4_REPO} ({C4_FILE}, validation split): " in failures[0]
    assert f"evaluation text: {loaded['name']}, held-out last 25% of each (auto: the Hub is reachable)" in proc.stderr


LOAD_ONLINE_WITHIN = SMALL_ONLINE_MIXTURE + """
import json
import os
import time
text.HUB_LOAD_TIMEOUT_S = 3.0
start = time.monotonic()
calibration = text.load_text("auto", "calibration")
print(json.dumps({"name": calibration.name, "offline": text.offline_text().name, "seconds": time.monotonic() - start}), flush=True)
os._exit(0)  # the abandoned load ends on its own (the client's timeouts); the test does not wait for it
"""


@pytest.mark.skipif(wiki_file() is None, reason="gensim (three of the mixture's domains) is not installed")
def test_a_stalled_hub_domain_is_left_out_in_bounded_time(c4_hub, hub_env):
    """C4's files on a server that accepts the request and never answers (and no wikitext-2, so C4 is the only load):
    the loads end at HUB_LOAD_TIMEOUT_S (3 s here), C4 is left out with one line, and "auto" goes on without it."""
    hub, _, _, _ = c4_hub
    hub.delete_repo(WIKITEXT_REPO, repo_type="dataset")
    hub.inject_fault("*", f"/datasets/{C4_REPO}/resolve/", *["stall:60"] * 20)
    proc = subprocess.run([sys.executable, "-c", LOAD_ONLINE_WITHIN], env={**hub_env, "COLUMNS": "400"}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded["name"] == loaded["offline"]
    assert loaded["seconds"] < 15  # 3 s for the load, then the offline domains; the stalled download alone takes minutes
    failures = [line for line in proc.stderr.splitlines() if "left out" in line]
    assert len(failures) == 2 and "wikitext-2 left out" in failures[0]
    assert "calibration mixture: c4 left out (not loaded within 3 s; its download resumes on the next run)" in failures[1]


def test_auto_online_without_hub_datasets_is_the_offline_mixture(local_hub, monkeypatch, log, hub_traffic):
    """A Hub that answers but has neither dataset (a mirror without them): one bounded probe each, one line each, no
    load, and "auto" is the offline mixture, exactly as offline."""
    _online(monkeypatch, local_hub.url)
    _forbid_wikitext_load(monkeypatch)
    calibration = load_text("auto", "calibration")
    evaluation = load_text("auto", "evaluation", fallback=calibration)
    timeout = text_module.PROBE_TIMEOUT_S
    assert hub_traffic.probes == [(local_hub.url, WIKITEXT_REPO, timeout), (local_hub.url, C4_REPO, timeout)]
    assert evaluation is calibration and calibration.name == text_module.offline_text().name
    lines = log.getvalue().splitlines()
    assert len(lines) == 4, lines
    assert f"calibration mixture: wikitext-2 left out ({local_hub.url} answered HTTP 401 for {WIKITEXT_REPO})" in lines[0]
    assert f"calibration mixture: c4 left out ({local_hub.url} answered HTTP 401 for {C4_REPO})" in lines[1]
    assert f"calibration text: {calibration.name}, first 75% of each (auto: no Hub domain of the mixture loaded)" in lines[2]


CLI_WITH_SMALL_ONLINE_MIXTURE = SMALL_ONLINE_MIXTURE + """
from hfcompress.cli import main
main()
"""


@pytest.mark.skipif(wiki_file() is None, reason="gensim (three of the mixture's domains) is not installed")
@pytest.mark.slow  # a full convert + eval of the tiny model in subprocesses: ~60 s on 2 cores
def test_convert_and_eval_use_the_online_mixture_when_the_hub_answers(c4_hub, hub_env, tiny_llama_dir, tmp_path):
    """A conversion of a Hub source with the defaults, online: calibrated on the six-domain mixture, gated on its
    held-out parts and on numpy-docs; the report and the card name the mixture and its Hub datasets (not in the
    model-index: the mixture's held-out text is no Hub split); `eval` scores the same tokens. (A local source's "auto"
    never asks the Hub: tests/test_offline_run.py.)"""
    import yaml

    hub, wikitext_sha, c4_sha, _ = c4_hub
    hub.upload_files("test-user/tiny", {p.name: p.read_bytes() for p in tiny_llama_dir.iterdir()})
    env = {**hub_env, "HFCOMPRESS_CACHE": str(tmp_path / "cache"), "COLUMNS": "400"}
    out = tmp_path / "out"
    run_cli = lambda args: subprocess.run(  # noqa: E731
        [sys.executable, "-c", CLI_WITH_SMALL_ONLINE_MIXTURE, *args], env=env, capture_output=True, text=True
    )
    proc = run_cli(["convert", "test-user/tiny", "--out", str(out), *FAST])
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = [*OFFLINE_DOMAINS, f"wikitext-2 @{wikitext_sha[:8]}", f"c4 @{c4_sha[:8]}"]
    mixture = f"mixture of {', '.join(names)} (equal shares of 512-token blocks)"
    assert f"calibration text: {mixture}, first 75% of each (auto: the Hub is reachable)" in proc.stderr
    report = json.loads((out / "hfcompress_report.json").read_text())
    assert report["calibration"]["text"] == f"{mixture}, first 75% of each"
    assert report["calibration"]["dataset"] is None  # a mixture is no one Hub dataset split ...
    assert [d["id"] for d in report["calibration"]["datasets"]] == [WIKITEXT_REPO, C4_REPO]  # ... it read two
    assert [d["revision"] for d in report["calibration"]["datasets"]] == [wikitext_sha, c4_sha]
    texts = report["validation"]["texts"]
    assert [row["eval_text"] for row in texts][0] == f"{mixture}, held-out last 25% of each"
    assert texts[1]["eval_text"].startswith("numpy-docs (") and all(row["dataset"] is None for row in texts)
    card = (out / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["datasets"] == [WIKITEXT_REPO, C4_REPO] and "model-index" not in meta

    proc = run_cli(["eval", str(out), "--eval-tokens", "512", "--no-speed", "--no-probe", "--json", str(tmp_path / "e.json")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads((tmp_path / "e.json").read_text())
    assert measured["eval_text"] == f"{mixture}, held-out last 25% of each"
    assert measured["models"]["model"]["perplexity"]["perplexity"] == pytest.approx(
        report["validation"]["converted"]["perplexity"], rel=1e-4
    )  # the same held-out tokens as convert scored


def _timeouts(seconds: float) -> dict:
    """The per-request timeouts an HTTP client gets for `timeout=seconds` (httpx: connect, read, write, pool)."""
    return dict.fromkeys(("connect", "read", "write", "pool"), seconds)


@pytest.fixture
def hub_traffic(monkeypatch) -> SimpleNamespace:
    """Records what is asked of the Hub in this process: `probes`, one (endpoint, repo, timeout) per
    `HfApi.dataset_info` call, and `requests`, one (method, url, timeouts) per HTTP request huggingface_hub's client
    actually sends (retries and redirects included). Both still go through to the real implementation."""
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub import HfApi

    traffic = SimpleNamespace(probes=[], requests=[])
    real_info, real_send = HfApi.dataset_info, httpx2.HTTPTransport.handle_request

    def dataset_info(self, *args, **kwargs):
        bound = inspect.signature(real_info).bind(self, *args, **kwargs).arguments
        traffic.probes.append((self.endpoint, bound["repo_id"], bound.get("timeout")))
        return real_info(self, *args, **kwargs)

    def handle_request(self, request):
        traffic.requests.append((request.method, str(request.url), request.extensions.get("timeout")))
        return real_send(self, request)

    monkeypatch.setattr(HfApi, "dataset_info", dataset_info)
    monkeypatch.setattr(httpx2.HTTPTransport, "handle_request", handle_request)
    return traffic


def _forbid_wikitext_load(monkeypatch) -> None:
    def load(*args):
        raise AssertionError(f"a Hub dataset was loaded {args}: 'auto' must not try it here")

    monkeypatch.setattr(text_module, "_load_wikitext", load)
    monkeypatch.setattr(text_module, "_load_rows", load)


def test_auto_is_the_offline_mixture_when_offline(log, hub_traffic, monkeypatch):
    """With HF_HUB_OFFLINE "auto" takes the offline mixture of domains without asking the Hub at all (no probe, no HTTP
    request, no datasets load), so an offline machine never waits on the network; without gensim, the mixture is the
    built-in text alone, and its name says so."""
    _forbid_wikitext_load(monkeypatch)  # not even a cached copy
    text = load_text("auto", "calibration")  # the autouse fixture of conftest.py set HF_HUB_OFFLINE
    assert hub_traffic.probes == [] and hub_traffic.requests == []
    domains = ["enwiki-sample", "lee-news", "python-language-reference", "usenet-sample"] if wiki_file() else ["python-language-reference"]
    assert text.held_out and [short_name(d.name) for d in text.parts] == domains
    assert text.name.startswith(f"mixture of {', '.join(domains)} (")
    assert log.getvalue().count("\n") == 1
    assert f"calibration text: {text.name}, first 75% of each (auto: HF_HUB_OFFLINE is set)" in log.getvalue()
    monkeypatch.setattr(text_module, "gensim_data_file", lambda relative: None)  # an install without gensim
    alone = text_module.offline_text()
    assert "only the Python language reference is installed" in log.getvalue()
    assert [d.name for d in alone.parts] == [BUILTIN_TEXT_NAME] and alone.name.startswith("mixture of python-language-reference (")


def _online(monkeypatch, endpoint: str) -> None:
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(c, "ENDPOINT", endpoint)
    # no user-agent telemetry: huggingface_hub would fetch its agent registry from the same endpoint once a process
    monkeypatch.setattr(c, "HF_HUB_DISABLE_TELEMETRY", True)


def _probe_url(endpoint: str) -> str:
    return f"{endpoint}/api/datasets/{WIKITEXT_REPO}/revision/main"  # revision-qualified: what a mirror serves


def test_auto_falls_back_fast_when_the_hub_is_unreachable(monkeypatch, log, hub_traffic):
    """Connection refused: calibration and evaluation together send ONE request, with the probe timeout (no retries,
    no second probe for evaluation, no datasets load), then both fall back to the offline text."""
    endpoint = "http://127.0.0.1:9"  # nothing listens on the discard port: connection refused
    _online(monkeypatch, endpoint)
    _forbid_wikitext_load(monkeypatch)
    calibration = load_text("auto", "calibration")
    evaluation = load_text("auto", "evaluation", fallback=calibration)
    timeout = text_module.PROBE_TIMEOUT_S
    assert hub_traffic.probes == [(endpoint, WIKITEXT_REPO, timeout)]
    assert hub_traffic.requests == [("GET", _probe_url(endpoint), _timeouts(timeout))]
    assert evaluation is calibration and calibration.name == text_module.offline_text().name  # its held-out part
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and all("the Hub at http://127.0.0.1:9 is unreachable (ConnectError)" in line for line in lines)
    assert f"evaluation text: {calibration.name}, held-out last 25% of each (auto:" in lines[1]


def test_auto_is_bounded_when_the_hub_never_answers(monkeypatch, log, hub_traffic):
    """A server that accepts connections and never replies (a dead proxy): the one request carries the configured
    PROBE_TIMEOUT_S, the wait ends in a ReadTimeout (the timeout, not an answer or a reset) and "auto" falls back."""
    monkeypatch.setattr(text_module, "PROBE_TIMEOUT_S", 0.5)  # not the default: the configured value is what is sent
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshake; nobody ever reads or answers
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        _online(monkeypatch, endpoint)
        _forbid_wikitext_load(monkeypatch)
        # A safety net, not a timing check: were no timeout applied, the read would block forever; closing the
        # listener then resets the connection (ReadError, not ReadTimeout) and the test fails instead of hanging.
        watchdog = threading.Timer(60, silent.close)
        watchdog.start()
        try:
            text = load_text("auto", "evaluation")
        finally:
            watchdog.cancel()
    assert hub_traffic.probes == [(endpoint, WIKITEXT_REPO, 0.5)]
    assert hub_traffic.requests == [("GET", _probe_url(endpoint), _timeouts(0.5))]
    assert text.name == text_module.offline_text().name
    assert f"the Hub at {endpoint} is unreachable (ReadTimeout)" in log.getvalue()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["convert", "{model}", "--out", "{out}", "--calib-text", "wikitext2"], "--calib-text 'wikitext2' is neither a file nor a text name"),
        (["convert", "{model}", "--out", "{out}", "--eval-text", "{missing}"], "--eval-text '{missing}' is neither a file nor a text name"),
        (["analyze", "{model}", "--calib-text", "{missing}"], "--calib-text '{missing}' is neither a file nor a text name"),
        # --trust-remote-code: a plain model directory passes eval's model check, so the text option is what fails
        (["eval", "{model}", "--trust-remote-code", "--eval-text", "wikipedia"], "--eval-text 'wikipedia' is neither a file nor a text name"),
    ],
)
def test_bad_text_option_is_one_sentence_and_exit_2(args, needle, tiny_llama_dir, tmp_path):
    values = {"model": str(tiny_llama_dir), "missing": str(tmp_path / "missing.txt"), "out": str(tmp_path / "out")}
    result = runner.invoke(app, [a.format(**values) for a in args])
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert message.startswith("error:") and needle.format(**values) in message
    assert message.endswith("'builtin', 'wiki', 'wikitext-2' or 'auto'.")
    assert not (tmp_path / "out").exists()


def test_explicit_wikitext2_unreachable_is_one_sentence(monkeypatch, tiny_llama_dir, tmp_path):
    _online(monkeypatch, "http://127.0.0.1:9")
    result = runner.invoke(app, ["analyze", str(tiny_llama_dir), "--calib-text", "wikitext-2", "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split("error:")[-1].split())
    assert message.startswith("--calib-text wikitext-2: the Hub at http://127.0.0.1:9 is unreachable")
    assert "HF_HUB_OFFLINE=1" in message and "'builtin'" in message


def test_explicit_wikitext2_offline_without_a_cached_copy(tiny_llama_dir, tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    proc = cli(["analyze", str(tiny_llama_dir), "--calib-text", "wikitext-2", "--plot", str(tmp_path / "p.png")], env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: Cannot load {WIKITEXT_REPO} ({WIKITEXT_CONFIG}, train split):"), proc.stderr[-2000:]


def test_windows_start_with_bos_where_the_tokenizer_starts_texts_with_it(tiny_llama_dir):
    """Gemma and Llama 3 tokenizers put BOS first, and their models score far worse without it: every window then
    starts with BOS, and every text token is scored exactly once (the first of each window too, predicted from BOS)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hfcompress.sources.token_streams import windows
    from hfcompress.sources.text import window_prefix
    from hfcompress.evidence.validate import perplexity

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)  # its post-processor writes <s> first
    assert window_prefix(tokenizer) == [tokenizer.bos_token_id] == [1]
    tokenizer.bos_token = None
    assert window_prefix(tokenizer) == []

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    )).eval()  # fmt: skip
    ids = torch.randint(3, 64, (50,))
    assert [len(w) for w in windows(ids, 16, prefix=[1])] == [16, 16, 16, 6] and all(w[0] == 1 for w in windows(ids, 16, prefix=[1]))
    with torch.no_grad():
        direct = sum(
            -model(w[None]).logits[0, :-1].log_softmax(-1).gather(1, w[1:, None]).sum().item() for w in windows(ids, 16, prefix=[1])
        )
        disjoint = perplexity(model, ids, 16, prefix=[1])
        strided = perplexity(model, ids, 16, stride=5, prefix=[1])
        plain = perplexity(model, ids, 16)
    assert disjoint.tokens == strided.tokens == 50 and disjoint.perplexity == pytest.approx(math.exp(direct / 50), rel=1e-6)
    assert plain.tokens == 50 - 4  # without BOS, a window's first token is only context


@pytest.mark.skipif(wiki_file() is None, reason="gensim (the Wikipedia excerpt) is not installed")
def test_wiki_is_prose_of_the_whole_excerpt_held_out_by_role(tiny_llama_dir):
    """`wiki`: every article of the excerpt, markup, tables, captions and reference sections gone; calibration and
    evaluation read disjoint parts, and it can be the other-domain text of a builtin calibration."""
    from transformers import AutoTokenizer

    from hfcompress.sources.text import part_name

    text = load_text("wiki", "calibration")
    assert text.name == WIKI_TEXT_NAME and text.held_out
    body = text.text
    assert len(body) > 2_500_000 and body.startswith("Anarchism\n\n")
    assert "Autism is a neurodevelopmental disorder" in body and "\n\nAlgorithm\n\n" in body
    for markup in ("thumb|", "\nCategory:", "\n|", "\nReferences\n", "\nExternal links\n"):
        assert markup not in body, markup
    for markup in ("[[", "{{", "<ref"):  # thousands in the dump; a few malformed ones survive the parser
        assert body.count(markup) < 20, markup
    assert part_name(text, "calibration").endswith("first 75%") and part_name(text, "evaluation").endswith("last 25%")
    assert load_text("wiki", "evaluation").text == body  # the same text, cut by role
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids, name = other_domain_ids(tokenizer, "wiki", "python-language-reference (pydoc_data.topics), first 75%")
    assert name == WIKI_TEXT_NAME and len(ids) > 128_000  # room for the anchors' calibration sizes
    with pytest.raises(HfcompressError, match="--ood-text is the calibration text"):
        other_domain_ids(tokenizer, "wiki", f"{WIKI_TEXT_NAME}, first 75%")


# ------------------------------------------------------------------------------------------- the calibration mixture
def test_interleave_gives_equal_shares_seeded_and_keeps_every_token():
    """Every prefix of an interleaved stream holds its streams in equal shares (to one block) until the shortest is
    spent; the seed fixes the order (same seed: same ids, another seed: another order of the same blocks); without a
    generator blocks keep their order, round by round in the streams' order."""
    from hfcompress.sources.text import interleave

    streams = [torch.arange(0, 5000), torch.arange(10_000, 11_200), torch.arange(20_000, 22_000)]  # 3 "domains"
    owner = lambda ids: ids // 10_000  # noqa: E731  which stream an id came from
    ids, balanced = interleave(streams, 100, torch.Generator().manual_seed(0))
    assert sorted(ids.tolist()) == sorted(torch.cat(streams).tolist())  # nothing lost, nothing repeated
    assert len(interleave([torch.arange(250)], 100, None)[0]) == 200  # whole blocks only
    assert balanced == 3 * 1200  # 12 blocks of each before the 1,200-token stream is spent
    for prefix in range(300, balanced + 1, 300):  # after every round: exactly equal shares
        assert owner(ids[:prefix]).bincount(minlength=3).tolist() == [prefix // 3] * 3
    for prefix in range(1, balanced, 37):  # anywhere in between: within one block
        counts = owner(ids[:prefix]).bincount(minlength=3)
        assert int(counts.max() - counts.min()) <= 100
    again, _ = interleave(streams, 100, torch.Generator().manual_seed(0))
    other, _ = interleave(streams, 100, torch.Generator().manual_seed(1))
    assert torch.equal(ids, again) and not torch.equal(ids, other) and sorted(other.tolist()) == sorted(ids.tolist())
    assert ids[:100].tolist() != list(range(100)) or ids[100:200].tolist() != list(range(10_000, 10_100))  # shuffled
    plain, _ = interleave(streams, 100, None)
    assert plain[:300].tolist() == [*range(100), *range(10_000, 10_100), *range(20_000, 20_100)]


@pytest.fixture
def small_mixture(monkeypatch):
    """The real mixture's domains, each cut to its first 40,000 characters (the tiny tokenizer makes ~2 tokens a word:
    the whole mixture takes minutes to tokenise on 2 cores), with different lengths so one runs out first."""
    if wiki_file() is None:
        pytest.skip("gensim (three of the mixture's domains) is not installed")
    full = text_module.mixture_domains()
    cut = [text_module.Text(d.name, d.text[: 40_000 - 8_000 * (i == 1)], True) for i, d in enumerate(full)]
    monkeypatch.setattr(text_module, "mixture_domains", lambda: cut)
    return full


def test_mixture_splits_each_domain_and_calibrates_on_all_in_equal_shares(tiny_llama_dir, small_mixture):
    """`mix`: four real domains, each split on its own; the calibration stream (what calibration sequences, layer
    selection and distillation read) is every domain's first 75% in equal shares, seeded; the evaluation stream is
    every domain's last 25%, the same for any seed, and shares no block with calibration."""
    from transformers import AutoTokenizer

    from hfcompress.sources.text import MIX_BLOCK_TOKENS, mixture_split, text_streams

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    names = [short_name(d.name) for d in small_mixture]
    assert names == ["enwiki-sample", "lee-news", "python-language-reference", "usenet-sample"]
    usenet = small_mixture[3].text
    assert "Path:" not in usenet and usenet.count("Message-ID:") < 3  # 200 header blocks dropped (one post quotes one)
    assert len(usenet) > 250_000 and "\n\nSpace Calendar - 04/27/93\n\n" in usenet  # a Subject line, then the body
    text = load_text("mix", "calibration")

    split = mixture_split(tokenizer, text, seed=0)
    _assert_split_per_domain(tokenizer, text, split)
    shares = split.shares(split.balanced_tokens)
    assert max(shares.values()) - min(shares.values()) <= MIX_BLOCK_TOKENS and len(shares) == 4
    assert split.balanced_tokens >= 4 * min(calib for calib, _ in split.domains.values()) - 4 * MIX_BLOCK_TOKENS

    other = mixture_split(tokenizer, text, seed=1)
    assert torch.equal(other.held_out, split.held_out)  # evaluation does not depend on the seed
    assert not torch.equal(other.calibration[:5_000], split.calibration[:5_000])
    assert torch.equal(mixture_split(tokenizer, text, seed=0).calibration, split.calibration)

    calib_ids, calib_name, eval_ids, eval_name = text_streams(tokenizer, "mix", "auto", 10_000, seed=0)
    assert torch.equal(calib_ids, split.calibration[: split.balanced_tokens])  # distillation's windows: balanced too
    assert torch.equal(eval_ids, split.held_out)
    assert calib_name == f"{text.name}, first 75% of each" and eval_name == f"{text.name}, held-out last 25% of each"
    big, *_ = text_streams(tokenizer, "mix", "auto", split.balanced_tokens + 5000, seed=0)
    assert len(big) == split.balanced_tokens + 5000  # more than the balanced part when a run asks for more


def test_the_gate_always_has_a_domain_no_step_saw(tiny_llama_dir, small_mixture, monkeypatch):
    """`--ood-text auto` is NumPy's API documentation, in no calibration text; a text that is part of the calibration
    mixture is refused as the other-domain text; a conversion's gate (token_streams) scores the mixture's held-out
    part and the third domain."""
    from transformers import AutoTokenizer

    from hfcompress.sources.token_streams import token_streams
    from hfcompress.sources.text import NUMPY_DOCS, numpy_docs_name

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    mixture = load_text("mix", "calibration")
    real = text_module.numpy_docs_text()
    docs = real.text
    assert len(docs) > 500_000 and "Parameters\n----------" in docs and "Returns\n-------" in docs
    assert ">>>" not in docs and "\nExamples\n--------" not in docs  # prose, not code
    for part in small_mixture:  # the third domain is in no calibration domain (whole texts)
        assert docs[1000:1200] not in part.text and docs[-300:-100] not in part.text
    monkeypatch.setattr(text_module, "numpy_docs_text", lambda: text_module.Text(real.name, docs[:30_000], False))
    ids, name = other_domain_ids(tokenizer, "auto", f"{mixture.name}, first 75% of each")
    assert name == real.name == numpy_docs_name() and name.startswith("numpy-docs (NumPy ") and len(ids) > 5_000
    assert other_domain_ids(tokenizer, NUMPY_DOCS, BUILTIN_TEXT_NAME)[1] == name
    for part in mixture.parts:
        with pytest.raises(HfcompressError, match="--ood-text is part of the calibration text"):
            other_domain_ids(tokenizer, "builtin" if part.name == BUILTIN_TEXT_NAME else str(_named(part)), f"{mixture.name}, first 75% of each")

    options = ConvertOptions(source="x", out=tiny_llama_dir / "out", calib_text="mix", calib_sequences=4, seq_len=64)
    options.distill.tokens = 0
    streams = token_streams(options, tokenizer)
    assert list(streams.evaluations) == [f"{mixture.name}, held-out last 25% of each", name]
    assert torch.equal(streams.evaluations[name], ids)  # the third domain, scored from its start


def _named(part) -> str:
    """The --ood-text name of one domain of the mixture."""
    return {"enwiki-sample": "wiki", "lee-news": "news", "usenet-sample": "usenet"}[short_name(part.name)]
