"""Quantization on top of a conversion: torchao weight-only weights (`convert --quantize-weights`), the backends a KV
cache quantization needs, and the real bytes a cache holds.

Weights: the written output is loaded back through transformers' torchao integration (`TorchAoConfig`), which
quantizes every nn.Linear of the decoder, FASC factors (FascLinear's proj_in / proj_out) and LISA's low-rank Q/K
included (not the embedding, nor the lm_head, as transformers leaves them, nor the dense Align's tiny FFN: KEEP_FLOAT),
and saved again: config.json carries its
`quantization_config`, so a plain `from_pretrained(DIR, trust_remote_code=True)` loads it quantized.
int8 only: torchao 0.18's int4 weight-only layouts have no CPU kernel (plain and preshuffled need mslk, a CUDA
library; tile_packed_to_4d needs a CUDA GPU; the CPU layout of earlier releases is gone).

KV cache: `generate(cache_implementation="quantized", cache_config={"backend": "quanto" | "hqq", "nbits": 4})` on a
converted model builds the remote code's LisaQuantizedCache (modeling/lisa_attention.py); `check_kv_backend` says, in
one sentence, what to install when the backend is missing.
"""

import importlib.util
import math
import shutil
import tempfile
from pathlib import Path

import torch

from ..errors import HfcompressError

WEIGHT_SCHEMES = ("none", "int8", "int4")  # accepted by the option; int4 is refused with the reason (see above)
TORCHAO_PIN = "torchao==0.18.0"
KV_BACKENDS = {"quanto": ("optimum.quanto", "optimum-quanto==0.2.7", (2, 4)), "hqq": ("hqq", "hqq==0.2.8.post1", (1, 2, 3, 4, 8))}


def check_weight_backend(scheme: str) -> None:
    if scheme == "none":
        return
    if scheme == "int4":
        raise HfcompressError(
            "--quantize-weights int4 needs torchao's CUDA-only int4 kernels (mslk), which a CPU build cannot run: use "
            "--quantize-weights int8."
        )
    if importlib.util.find_spec("torchao") is None:
        raise HfcompressError(f"--quantize-weights {scheme} needs torchao: install it with `pip install {TORCHAO_PIN}`.")


def check_kv_backend(backend: str, nbits: int) -> None:
    """A KV cache quantization the installed backends can serve, or one sentence naming what to install or choose."""
    if backend not in KV_BACKENDS:
        raise HfcompressError(f"Unknown KV cache backend '{backend}': choose one of {', '.join(KV_BACKENDS)}.")
    module, package, bits = KV_BACKENDS[backend]
    if nbits not in bits:
        raise HfcompressError(f"The {backend} KV cache backend quantizes to {', '.join(map(str, bits))} bits, not {nbits}.")
    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        raise HfcompressError(f"The {backend} KV cache backend needs {package.split('==')[0]}: install it with `pip install {package}`.")


# transformers' default (the output embedding), and the dense Align's FFN across heads: LisaHeadAlign reads its weights
# directly (batched matmuls over the score entries), which torchao's Int8Tensor does not serve; a few hundred parameters
KEEP_FLOAT = ["lm_head", r".*\.align\.ffn_in", r".*\.align\.ffn_out"]


def torchao_config(scheme: str):
    """transformers' TorchAoConfig of a weight scheme (int8: Int8WeightOnlyConfig, one scale per output row)."""
    check_weight_backend(scheme)
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig(), modules_to_not_convert=KEEP_FLOAT)


def load_quantized(directory: Path, scheme: str, dtype=torch.float32):
    """A written output (remote code) loaded with its weights quantized by `scheme` on the fly."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        directory, trust_remote_code=True, dtype=dtype, quantization_config=torchao_config(scheme)
    ).eval()


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _weight_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name in WEIGHT_FILES or (p.name.startswith("model-") and p.suffix == ".safetensors")]


def quantize_written(directory: Path, scheme: str, max_shard_size: str = "2GB") -> None:
    """Replace the weights of a written output by their `scheme` quantization and add its quantization_config to
    config.json (the rest of config.json, the remote code, tokenizer and generation config stay as written)."""
    import json

    directory = Path(directory)
    model = load_quantized(directory, scheme, dtype="auto")
    with tempfile.TemporaryDirectory(dir=directory.parent, prefix=f".{directory.name}.quantized-") as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        quantization = json.loads((Path(tmp) / "config.json").read_text())["quantization_config"]
        for old in _weight_files(directory):
            old.unlink()
        for new in _weight_files(Path(tmp)):
            shutil.move(str(new), directory / new.name)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def reloaded_logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    """The logits of a written (quantized) output loaded as the fresh-process reload check loads it (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def _tensor_bytes(obj, seen: set) -> int:
    """Bytes of the tensors in `obj` (a tensor, a quantized tensor subclass, or containers of them), each storage once."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__"):  # a tensor subclass (plain tensors and Parameters have none)
            names, _ = obj.__tensor_flatten__()  # quanto's QBitsTensor: packed data, scale, shift; torchao's Int8Tensor
            return sum(_tensor_bytes(getattr(obj, name), seen) for name in names)
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), obj.numel()) if obj.numel() else id(obj)
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(value, seen) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(value, seen) for value in obj)
    return 0


KV_ATTRIBUTES = ("keys", "values", "_quantized_keys", "_quantized_values", "chunks")


def kv_cache_bytes(cache) -> int:
    """The bytes a cache holds: every layer's full-precision keys and values (the residual window of a quantized
    layer) and its quantized states (packed codes, scales and zeros), read from the tensors themselves."""
    seen: set = set()
    return sum(_tensor_bytes(getattr(layer, name, None), seen) for layer in cache.layers for name in KV_ATTRIBUTES)


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's parameters and buffers as stored (a torchao Int8Tensor: its int8 data and scales)."""
    seen: set = set()
    return sum(_tensor_bytes(t, seen) for t in [*model.parameters(), *model.buffers()])


@torch.no_grad()
def cached_logits(model, ids: torch.Tensor, new_cache, context: int = 512, chunk: int = 32) -> list[torch.Tensor]:
    """Logits of `ids` (1-D) read through a cache, as generation reads it: disjoint windows of `context` tokens, each
    fed `chunk` tokens at a time into a fresh `new_cache()` (a quantized cache: every chunk attends to the quantized
    past, its own tokens and the full-precision residual window). One (window length, vocab) tensor per window."""
    out = []
    for begin in range(0, len(ids) - 1, context):
        window = ids[begin : begin + context].unsqueeze(0)
        cache = new_cache()
        chunks = [model(window[:, s : s + chunk], cache=cache, use_cache=True).logits[0] for s in range(0, window.shape[1], chunk)]
        out.append(torch.cat(chunks).float())
    return out


def cached_perplexity(model, ids: torch.Tensor, new_cache, context: int = 512, chunk: int = 32) -> tuple[float, int]:
    """(perplexity, tokens scored) of `ids` from `cached_logits` (each window's first token is context only)."""
    return window_perplexity(ids, cached_logits(model, ids, new_cache, context, chunk), context)


def window_perplexity(ids: torch.Tensor, windows: list[torch.Tensor], context: int = 512) -> tuple[float, int]:
    """(perplexity, tokens scored) of `ids` from the logits of its disjoint windows of `context` tokens."""
    total, count = 0.0, 0
    for begin, logits in zip(range(0, len(ids) - 1, context), windows):
        target = ids[begin + 1 : begin + logits.shape[0]]
        total += torch.nn.functional.cross_entropy(logits[: len(target)], target, reduction="sum").item()
        count += len(target)
    return math.exp(total / count), count


@torch.no_grad()
def kv_bytes_per_token(model, ids: torch.Tensor, cache) -> float:
    """KV bytes per token read from `cache`'s tensors after prefilling `ids` (1-D) in one call."""
    model(ids.unsqueeze(0), cache=cache, use_cache=True)
    return kv_cache_bytes(cache) / len(ids)


def lisa_quantized_cache(model, backend: str = "quanto", **options):
    """The LisaQuantizedCache of a converted model's own remote code (the copy transformers loaded it from)."""
    import importlib

    module = importlib.import_module(type(model).__module__.rsplit(".", 1)[0] + ".lisa_attention")
    return module.LisaQuantizedCache(backend, model.config, **options)
