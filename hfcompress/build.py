"""Step 5, build: a converted model (the family's LisaXxxForCausalLM) from the original weights plus the fitted LISA
and FASC modules, and the atomic write of the output directory (weights, config with auto_map, remote code, tokenizer, card, report).
"""

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch import nn

from .errors import WRITE_FAILED_EXIT, HfcompressError
from .families import family_for, family_of
from .lisa.weights import is_lisa_parameter
from .remote import write_remote_code


def converted_config(original_config, entries: dict):
    """The converted config of the original's family (LisaLlamaConfig, LisaQwen2Config, ..., with its auto_map) of
    the original config plus the methods' entries (lisa_layers, fasc_ranks, ...)."""
    family = family_of(original_config)
    config_cls, _ = family.remote_classes()
    base = original_config.to_dict()
    for key in ("model_type", "architectures", "auto_map", "quantization_config", "transformers_version", *entries):
        base.pop(key, None)
    config = config_cls(**base, **entries)
    config.architectures = [family.causal_lm_class]
    config.auto_map = family.auto_map
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


def write_output_dir(out_dir: Path, overwrite: bool, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp)` into a temporary sibling directory and rename it into place only when it succeeded.

    A crash, Ctrl-C or full disk leaves no directory at `out_dir` that looks complete; an existing output is
    replaced only after the new one is complete.
    """
    out_dir = refuse_existing_output(out_dir.resolve(), overwrite)
    tmp = None
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary directory
        write(tmp)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            out_dir.rename(old)
            try:
                tmp.rename(out_dir)
            except BaseException:
                old.rename(out_dir)  # put the earlier output back
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    except BaseException as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            raise HfcompressError(_write_failure(out_dir, err), exit_code=WRITE_FAILED_EXIT) from err
        raise
    return out_dir


def _write_failure(out_dir: Path, err: OSError) -> str:
    kept = "nothing was written and any earlier output there is untouched"
    if err.errno == errno.ENOSPC:
        return (
            f"The disk is full while writing {out_dir}: free some space and rerun the same command "
            f"(calibration is cached); {kept}."
        )
    where = f" ({err.filename})" if err.filename else ""
    return f"Cannot write {out_dir}: {err.strerror or err}{where}; {kept}: check permissions and free space, then rerun."


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


def save_companion_files(tokenizer, generation_config, directory: Path) -> None:
    """Everything beside the weights and config.json: tokenizer, generation config and, once the config.json already in
    `directory` is checked to carry the auto_map, the remote-code files (only those the model imports; the kernels only
    where a layer uses them)."""
    _save_tokenizer(tokenizer, directory)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    auto_map = family_for(config["model_type"]).auto_map
    if config.get("auto_map") != auto_map:
        raise HfcompressError("Internal error: config.json was saved without its auto_map.")
    write_remote_code(config, directory)
