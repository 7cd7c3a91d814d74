"""Step 5, build: a converted model (the family's LisaXxxForCausalLM) from the original weights plus the fitted LISA
and FASC modules, and the files the output holds beside the weights (config with auto_map, remote code, tokenizer);
the output directory itself is written atomically by atomic.atomic_directory (output.py).
"""

import json
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn

from .. import __version__
from ..errors import HfcompressError
from ..families import family_for, family_of
from ..lisa.weights import is_lisa_parameter
from ..remote import import_remote, write_remote_code


def converted_config(original_config, entries: dict):
    """The converted config of the original's family (LisaLlamaConfig, LisaQwen2Config, ..., with its auto_map) of
    the original config plus the methods' entries (lisa_layers, fasc_ranks, ...)."""
    family = family_of(original_config)
    config_cls, _ = family.remote_classes()
    base = original_config.to_dict()
    for key in ("model_type", "architectures", "auto_map", "quantization_config", "transformers_version", "hfcompress_version", *entries):
        base.pop(key, None)
    config = config_cls(**base, **entries)
    config.architectures = [family.causal_lm_class]
    config.auto_map = family.auto_map
    # the converter's version: the vLLM plugin (hfcompress-vllm) serves only the models of its own version and reads
    # config.json alone before any model work (the remote code ignores the field)
    config.hfcompress_version = __version__
    return config


def in_converted_classes(original: nn.Module) -> nn.Module:
    """The original model in its family's converted classes, converting nothing (sharing the original's tensors)."""
    config = converted_config(original.config, {"lisa_layers": {}, "fasc_ranks": {}})
    return assemble(config, original.state_dict(), next(original.parameters()).dtype)


def cast_floating(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype` if it holds floats; integer buffers (a sparse Align's head indices) stay as they are."""
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def assemble(config, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32, cls=None) -> nn.Module:
    """A model of `config` (its family's converted causal LM, or `cls`) holding exactly `state`, built on the meta
    device (no random weights allocated); non-persistent buffers computed by the modules themselves. Every parameter
    and persistent buffer must be in `state`."""
    if cls is None:
        _, cls = family_of(config).remote_classes()
    with init_empty_weights(include_buffers=False):  # buffers are made as usual: RoPE's, Gemma's embedding scale
        model = cls(config)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    result = model.load_state_dict({k: cast_floating(v, dtype) for k, v in state.items() if k not in tied}, strict=False, assign=True)
    missing = sorted(set(result.missing_keys) - tied)
    if missing or result.unexpected_keys:
        raise HfcompressError(
            f"Internal error: converted weights do not match the model's layout "
            f"(missing {missing[:5]}, unexpected {result.unexpected_keys[:5]})."
        )
    model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise HfcompressError(f"Internal error: {left[:3]} were not loaded.")
    return model.eval().requires_grad_(False)


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Unique parameters (tied weights counted once), split into attention Q/K, other attention, MLP, rest."""
    seen, sizes = set(), {}
    for name, param in model.named_parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            sizes[name] = param.numel()
    return count_parameters(sizes)


def count_parameters(sizes: dict[str, int]) -> dict[str, int]:
    """{parameter name: numel} (each tensor once) split into attention Q/K, other attention, MLP, rest; also the
    embeddings (input and, untied, output: most of a small model with a large vocabulary, e.g. 63% of Gemma-3-270M)
    and the total without them."""
    counts = {"total": 0, "attention_qk": 0, "attention_other": 0, "mlp": 0, "other": 0, "embeddings": 0}
    for name, numel in sizes.items():
        counts["total"] += numel
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            counts["embeddings"] += numel
        if any(part in name for part in ("q_proj", "k_proj", "q_norm", "k_norm")) or is_lisa_parameter(name):
            counts["attention_qk"] += numel
        elif "self_attn" in name:
            counts["attention_other"] += numel
        elif ".mlp." in name:
            counts["mlp"] += numel
        else:
            counts["other"] += numel
    counts["without_embeddings"] = counts["total"] - counts["embeddings"]
    return counts


def refuse_existing_output(out_dir: Path, overwrite: bool) -> Path:
    if out_dir.exists() and not overwrite:
        raise HfcompressError(f"Output directory {out_dir} already exists: pass --overwrite or choose another --out.")
    return out_dir


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Parameters to `dtype`, in place; buffers such as the RoPE frequencies stay as they are.

    `module.to(dtype)` would round those too: transformers recomputes them in float32 when it loads a model, so a
    model whose buffers went through bfloat16 no longer computes what the saved one does.
    """
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


# what transformers 5.x writes into tokenizer_config.json about how the tokenizer was loaded here (not settings of
# the tokenizer: a pushed repo saying "local_files_only": true is misleading), and tokenizer code we never ship
_TOKENIZER_LOAD_KEYS = ("is_local", "local_files_only", "_commit_hash", "auto_map")


def _save_tokenizer(tokenizer, directory: Path) -> None:
    """`tokenizer.save_pretrained` with a tokenizer_config.json that names a standard transformers tokenizer class
    and declares no code, so that `AutoTokenizer` resolves it from the file alone. (It still loads config.json
    first, whose auto_map makes transformers 5.x ask about custom code when `trust_remote_code` is not given: see
    tests/test_remote_repo.py.)"""
    tokenizer.save_pretrained(directory)
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return
    tokenizer_config = json.loads(path.read_text())
    for key in _TOKENIZER_LOAD_KEYS:
        tokenizer_config.pop(key, None)
    if type(tokenizer).__module__.startswith("transformers."):  # save_pretrained writes it; make sure
        tokenizer_config.setdefault("tokenizer_class", type(tokenizer).__name__)
    path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def with_cache_layout(config: dict, directory: Path) -> dict:
    """`config` (config.json's dict) with the `source` of each sparse-Align LISA layer (its head matching, the
    `align.source` of the weights written in `directory`): the KV cache layout of every layer then follows from
    config.json alone (the vLLM plugin lays its cache out before it reads any weight)."""
    lisa_spec = import_remote("configuration_lisa").lisa_spec
    heads, specs = config["num_attention_heads"], config.get("lisa_layers") or {}
    wanted = {f"model.layers.{k}.self_attn.align.source": k for k, s in specs.items() if lisa_spec(s, heads)["align"] == "sparse"}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            for name in wanted.keys() & set(handle.keys()):
                specs[wanted.pop(name)]["source"] = handle.get_tensor(name).tolist()
    if wanted:
        raise HfcompressError(f"Internal error: the weights in {directory} hold no {sorted(wanted)[0]}.")
    return config


def save_companion_files(tokenizer, generation_config, directory: Path) -> None:
    """Everything beside the weights and config.json: tokenizer, generation config and, once the config.json already in
    `directory` is checked to carry the auto_map, the cache layout of its LISA layers (`with_cache_layout`) and the
    remote-code files (only those the model imports; the kernels only where a layer uses them)."""
    _save_tokenizer(tokenizer, directory)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    path = directory / "config.json"
    config = json.loads(path.read_text())
    auto_map = family_for(config["model_type"]).auto_map
    if config.get("auto_map") != auto_map:
        raise HfcompressError("Internal error: config.json was saved without its auto_map.")
    config = with_cache_layout(config, directory)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")  # as transformers' save_pretrained writes it
    write_remote_code(config, directory)
