"""The source's tensors, read a group at a time, and the output's shards, written a tensor at a time.

- `Checkpoint`: safetensors files (sharded or not) opened lazily; `load(names)` reads only those tensors.
- `open_checkpoint`: any resolved source as a Checkpoint, with its config in its family's transformers class. A GGUF
  is dequantised once (by transformers' GGUF loader, into the family's class) and cached as a float32 safetensors
  file, so every later step and rerun streams it like any other checkpoint.
- `check_checkpoint`: the family's layout (names and shapes, from its model class on the meta device) and finite
  values, tensor by tensor, before any compute.
- `pack_shards`: the converted layer files concatenated into shards of at most --max-shard-size, with the index.
"""

import json
import math
import os
import shutil
from pathlib import Path

import torch

from .atomic import atomic_file, private_sibling
from .calibrate import cache_key
from ..errors import HfcompressError, full_disk_errno
from ..families import FAMILIES, family_of
from ..progress import console, progress_bar
from ..sources.source import (
    ResolvedSource,
    _first_line,
    check_gguf_architecture,
    source_identity,
)


def _corrupt(name: str, err: BaseException) -> HfcompressError:
    return HfcompressError(
        f"The weights of {name} are corrupt or truncated ({type(err).__name__}: {_first_line(err)}): "
        "download or save them again."
    )


class Checkpoint:
    """The tensors of a safetensors checkpoint by name, read one group at a time."""

    def __init__(self, directory: Path, name: str) -> None:
        from safetensors import safe_open

        self.directory, self.name = Path(directory), name
        index = self.directory / "model.safetensors.index.json"
        self.files: dict[str, str] = {}
        self.shapes: dict[str, list[int]] = {}
        paths = sorted({self.directory / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.is_file() else sorted(self.directory.glob("*.safetensors"))
        try:
            for path in paths:
                with safe_open(path, "pt") as handle:
                    for key in handle.keys():
                        self.files[key] = path.name
                        self.shapes[key] = list(handle.get_slice(key).get_shape())
        except Exception as err:  # safetensors raises several types on a damaged file
            raise _corrupt(name, err) from err

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        missing = [n for n in names if n not in self.files]
        if missing:
            raise HfcompressError(f"{self.name} lacks the weights {missing[:3]}: the checkpoint is incomplete.")
        tensors = {}
        try:
            for file in sorted({self.files[n] for n in names}):
                with safe_open(self.directory / file, "pt") as handle:
                    tensors.update({n: handle.get_tensor(n) for n in names if self.files[n] == file})
        except HfcompressError:
            raise
        except Exception as err:
            raise _corrupt(self.name, err) from err
        return tensors

    def float32_bytes(self) -> int:
        """Size of all tensors in float32, the working dtype."""
        return sum(math.prod(s) * 4 for s in self.shapes.values())


def gguf_cache_dir(source: ResolvedSource, cache_dir: Path) -> Path:
    return cache_dir / f"gguf-{cache_key(source_identity(source))}"


def open_checkpoint(source: ResolvedSource, cache_dir: Path):
    """(Checkpoint, source config in its family's config class) of a resolved source; a GGUF is dequantised into the
    cache on first use."""
    config_class, _ = FAMILIES[source.family].transformers_classes()
    if not source.gguf_file:
        return Checkpoint(Path(source.path), source.name), config_class.from_pretrained(source.path)
    directory = gguf_cache_dir(source, cache_dir)
    if not (directory / "config.json").is_file():
        dequantise_gguf(Path(source.path) / source.gguf_file, directory)
    return Checkpoint(directory, source.name), config_class.from_pretrained(directory)


def dequantise_gguf(path: Path, directory: Path) -> None:
    """Write a GGUF's tensors as float32 safetensors files in `directory`, one group of tensors at a time.

    transformers' GGUF loader maps the names and undoes llama.cpp's q/k permutation (its tensor processor); it would
    hold every dequantised tensor at once, so its per-tensor steps are driven here and each layer's tensors are
    written as soon as the GGUF moves on to the next layer. The directory appears complete or not at all."""
    import numpy as np
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    check_gguf_architecture(path)  # from the header, in a moment: a refused GGUF costs no parse nor dequantising
    console.log(f"dequantising {path.name} once into {directory} (float32 safetensors)")
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)  # its config fields, for the tensor processor
    parsed["tensors"] = {}
    reader = GGUFReader(str(path))
    processor = TENSOR_PROCESSORS.get(read_field(reader, "general.architecture")[0], TensorProcessor)(config=parsed["config"])
    _, causal_lm = family_of(config).transformers_classes()
    with torch.device("meta"):
        mapping = get_gguf_hf_weights_map(causal_lm(config), processor)
    # a directory of this process's own: two conversions of one GGUF at once must not write into each other's files
    tmp = private_sibling(directory)
    tmp.mkdir(parents=True)
    group, group_key, written = {}, None, 0

    def flush() -> None:
        nonlocal written
        if group:
            part = f"part-{written:05d}.safetensors"
            _save_file(group, tmp / part, directory / part)
            written += 1
            group.clear()

    try:
        for tensor in progress_bar(reader.tensors, "fetch: dequantise the GGUF"):
            result = processor.process(
                weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name, tensor_key_mapping=mapping, parsed_parameters=parsed
            )
            if result.name not in mapping:
                continue
            name = mapping[result.name]
            key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "rest"
            if key != group_key:
                flush()
                group_key = key
            group[name] = torch.from_numpy(np.array(result.weights, dtype=np.float32))  # a writable copy
        flush()
        config.save_pretrained(tmp)
    except BaseException:  # a full disk, an interruption: no half-dequantised copy stays in the cache
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if (directory / "config.json").is_file():  # another process finished first: its copy is as good as ours
        shutil.rmtree(tmp)
        return
    shutil.rmtree(directory, ignore_errors=True)  # a leftover without config.json is incomplete
    try:
        tmp.rename(directory)
    except OSError:
        if not (directory / "config.json").is_file():
            raise
        shutil.rmtree(tmp)


def expected_shapes(config) -> dict[str, list[int]]:
    """Every tensor transformers' causal LM of the config's family holds for `config`, with its shape (built on the
    meta device)."""
    _, causal_lm = family_of(config).transformers_classes()
    with torch.device("meta"):
        model = causal_lm(config)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def check_checkpoint(checkpoint: Checkpoint, config) -> None:
    """Refuse a checkpoint that misses or adds tensors (transformers would fill missing ones with random values),
    has other shapes than the config says, or holds NaN/inf; values are read one tensor at a time."""
    expected = expected_shapes(config)
    found = {k: v for k, v in checkpoint.shapes.items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected)) + sorted(k for k in set(found) & set(expected) if found[k] != expected[k])
    if missing or unexpected:
        raise HfcompressError(
            f"The weights of {checkpoint.name} do not match the {family_of(config).title} layout (missing {missing[:3]}, "
            f"unexpected or mismatched {unexpected[:3]}): it is an incomplete checkpoint or not a {family_of(config).title} model."
        )
    for name in progress_bar(sorted(expected), "fetch: checking weights"):
        if not torch.isfinite(checkpoint.load([name])[name]).all():
            raise HfcompressError(f"The weights of {checkpoint.name} contain NaN or inf (in {name}): the checkpoint is broken.")


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors file written under a temporary name and renamed: a file that exists is complete."""
    with atomic_file(path) as tmp:
        _save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp, path)


def _save_file(tensors: dict[str, torch.Tensor], tmp: Path, path: Path) -> None:
    """safetensors' save_file into `tmp`; a write refused for room (its Rust writer's "File too large", "No space
    left") becomes the OSError Python's own writes raise, naming `path`, so it is one sentence and exit code 5."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
    except Exception as err:
        number = full_disk_errno(err)
        if number is None or isinstance(err, OSError):
            raise
        raise OSError(number, os.strerror(number), str(path)) from err


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


ELEMENT_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def write_shard(sources: list[Path], dest: Path) -> dict[str, int]:
    """Concatenate safetensors files into one, one tensor in memory at a time; returns {name: numel}.

    Same layout rules as safetensors' own writer: header padded to 8 bytes, tensors by decreasing element size, so
    every tensor starts aligned to its element size and the data has no holes."""
    from safetensors import safe_open

    handles = [safe_open(path, "pt") for path in sources]
    entries = []  # (element bytes, name, handle, dtype, shape)
    for handle in handles:
        for name in handle.keys():
            piece = handle.get_slice(name)
            entries.append((ELEMENT_BYTES[piece.get_dtype()], name, handle, piece.get_dtype(), piece.get_shape()))
    entries.sort(key=lambda e: -e[0])  # stable: keeps each file's order within an element size
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for size, name, _, dtype, shape in entries:
        nbytes = size * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    try:
        with atomic_file(dest) as tmp, open(tmp, "wb") as out:
            out.write(len(raw).to_bytes(8, "little") + raw)
            for _, name, handle, _, _ in entries:
                out.write(handle.get_tensor(name).contiguous().view(-1).view(torch.uint8).numpy())  # no bytes copy
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror, str(dest)) from err  # write() names no file; the message names the shard
    return {name: math.prod(shape) for _, name, _, _, shape in entries}


def pack_shards(work: Path, directory: Path, names: list[str], max_bytes: int) -> dict[str, int]:
    """Groups consecutive layer files into shards of at most max_bytes (a larger layer gets its own shard) and
    writes them into `directory`, with model.safetensors.index.json when there is more than one. Returns
    {tensor name: numel}."""
    groups, size = [[]], 0
    for name in names:
        file_size = (work / name).stat().st_size
        if groups[-1] and size + file_size > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += file_size
    weight_map, sizes = {}, {}
    for number, group in enumerate(progress_bar(groups, "write: shards"), start=1):
        shard = "model.safetensors" if len(groups) == 1 else f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        written = write_shard([work / name for name in group], directory / shard)
        weight_map.update({key: shard for key in written})
        sizes.update(written)
    if len(groups) > 1:
        total = sum((directory / shard).stat().st_size for shard in set(weight_map.values()))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return sizes
