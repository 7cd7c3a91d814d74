"""The conversion's configuration, validated as a whole before any network or model work (as mergekit validates
its merge config): every range, every enum and every combination of options. One name has one meaning:
`max_ppl_increase` is the quality gate, `lisa.ppl_budget` the LISA layer search's budget.

Checks that need the source's shapes (layer numbers, the low-rank Q/K rank) run in `check_against_model`, right
after the source's config.json is read and before calibration.
"""

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .distill import DISTILL_DATA, DistillOptions
from .errors import HfcompressError
from .fasc import FascOptions
from .lisa import LisaOptions
from .quantize import WEIGHT_SCHEMES, check_weight_backend
from .text import AUTO, check_text_option

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


QUANTIZE_WEIGHTS_HELP = (
    "Weight-only quantization of the written model (torchao; loads quantized with plain from_pretrained): none or "
    "int8 (int4: torchao has no CPU kernel for it)."
)


@dataclass
class QuantizeOptions:
    """`convert --quantize-weights` (quantize.py): none (default) or int8 (torchao weight-only, one scale per row)."""

    weights: str = "none"

    def validate(self) -> None:
        """The scheme, and the package it needs (one sentence naming what to install), before any model work."""
        if self.weights not in WEIGHT_SCHEMES:
            raise HfcompressError(f"Unknown --quantize-weights '{self.weights}': choose one of {', '.join(WEIGHT_SCHEMES)}.")
        check_weight_backend(self.weights)


def default_cache_dir() -> Path:
    return Path(os.environ.get("HFCOMPRESS_CACHE", "~/.cache/hfcompress")).expanduser()


def parse_size(value: str, option: str = "--max-shard-size") -> int:
    """'2GB', '500MB', '200KB', '1.5GiB' -> bytes (decimal units as transformers' save_pretrained reads them)."""
    match = _SIZE_PATTERN.match(str(value))
    if not match:
        raise HfcompressError(f"{option} '{value}' is not a size: write a number and a unit, e.g. 2GB, 500MB or 200KB.")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if size < 1024:
        raise HfcompressError(f"{option} '{value}' is smaller than 1KB: give a size of at least 1KB.")
    return size


@dataclass
class ConvertOptions:
    source: str
    out: Path
    push_to: str | None = None
    private: bool = False
    revision: str | None = None
    overwrite: bool = False
    force: bool = False
    trust_remote_code: bool = False  # accept a source that declares custom code (its code is still never run)
    max_ppl_increase: float = 10.0  # percent: the quality gate
    calib_text: str = AUTO  # FILE path, "mix", "builtin", "wiki", "wikitext-2" or "auto" (text.py)
    eval_text: str = AUTO
    ood_text: str = AUTO  # a second evaluation text of another domain (text.py): numpy-docs (auto) | news | usenet | FILE | ... | none
    calib_sequences: int = 16
    seq_len: int = 256
    eval_tokens: int = 4096
    eval_context: int = 512
    cache_dir: Path = field(default_factory=default_cache_dir)
    seed: int = 0
    probe: bool | None = None  # factual-recall probe; None = when the whole model fits in memory
    speed: bool | None = None  # prefill/decode speed side by side; None = when both models fit
    peers: bool | None = None  # training-free peers at the same KV saving (peers.py); None = when the model fits
    dtype: str = "auto"  # saved weights: auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto (first CUDA device, else CPU) | cpu | cuda | cuda:N
    max_shard_size: str = "2GB"
    licence_files: list[Path] = field(default_factory=list)  # --licence-file: terms to ship beside the source's own
    lisa: LisaOptions = field(default_factory=LisaOptions)
    fasc: FascOptions = field(default_factory=FascOptions)
    distill: DistillOptions = field(default_factory=DistillOptions)
    quantize: QuantizeOptions = field(default_factory=QuantizeOptions)

    @property
    def changes_layers(self) -> bool:
        """Whether a method creates parameters (shares a layer, or factorises one): what distillation can train. A plan
        that only drops attention creates none."""
        shares = self.lisa.plan != "drop" and not (self.lisa.layers == [] or self.lisa.share_ratio == 0)
        return shares or self.fasc.budget < 1.0

    @property
    def max_shard_bytes(self) -> int:
        return parse_size(self.max_shard_size)

    def validate(self) -> "ConvertOptions":
        """Raise one HfcompressError naming the first bad value or combination; cheap, touches no network."""
        from .fasc import METHODS, TARGETABLE
        from .layer_plan import PLAN_KINDS
        from .lisa import ALIGN_KINDS, LOWRANK_KEYS

        lisa, fasc, distill = self.lisa, self.fasc, self.distill
        if self.dtype not in DTYPES:
            raise HfcompressError(f"Unknown --dtype '{self.dtype}': choose one of {', '.join(DTYPES)}.")
        check_device(self.device)
        parse_size(self.max_shard_size)
        _at_least(self.calib_sequences, 1, "--calib-sequences")
        _at_least(self.seq_len, 16, "--seq-len")
        _at_least(self.eval_tokens, 2, "--eval-tokens")
        _at_least(self.eval_context, 16, "--eval-context")
        if not math.isfinite(self.max_ppl_increase):  # negative is allowed: the conversion must then improve it
            raise HfcompressError(f"--max-ppl-increase must be a finite percentage, got {self.max_ppl_increase}.")
        check_text_option(self.calib_text, "calibration")
        check_text_option(self.eval_text, "evaluation")
        check_text_option(self.ood_text, "other-domain")
        if self.push_to is not None:
            from huggingface_hub.utils import HFValidationError, validate_repo_id

            try:
                validate_repo_id(self.push_to)
                if "/" not in self.push_to:
                    raise HFValidationError("no namespace")
            except HFValidationError:
                raise HfcompressError(f"--push-to '{self.push_to}' is not a Hub repo id: write it as user/name.") from None
        for path in self.licence_files:
            if not Path(path).is_file():
                raise HfcompressError(f"--licence-file {path} is not a file: name the licence or terms file to ship with the model.")
            if Path(path).name in ("README.md", "config.json") or Path(path).suffix in (".py", ".safetensors"):
                raise HfcompressError(f"--licence-file {path} would overwrite a file of the model: pass only licence or terms files.")
        if self.private and not self.push_to:
            raise HfcompressError("--private only applies to a push: add --push-to user/name, or drop --private.")

        if lisa.share_ratio is not None and not 0.0 <= lisa.share_ratio < 1.0:
            raise HfcompressError(f"--share-ratio must be in [0, 1), got {lisa.share_ratio}.")
        given = {"--lisa-layers": lisa.layers, "--lisa-ppl-budget": lisa.ppl_budget, "--share-ratio": lisa.share_ratio}
        chosen_by = [name for name, value in given.items() if value is not None]
        if len(chosen_by) > 1:
            raise HfcompressError(f"{' and '.join(chosen_by)} both choose the shared layers: give only one of them.")
        if lisa.layers is not None and any(layer < 1 for layer in lisa.layers):
            raise HfcompressError(f"--lisa-layers {lisa.layers}: layer 0 has no layer below it to share with; give layers >= 1.")
        if lisa.ppl_budget is not None and not lisa.ppl_budget > 0:
            raise HfcompressError(f"--lisa-ppl-budget must be a percentage > 0, got {lisa.ppl_budget}.")
        if lisa.align not in ALIGN_KINDS:
            raise HfcompressError(f"Unknown --lisa-align '{lisa.align}': choose one of {', '.join(ALIGN_KINDS)}.")
        if lisa.lowrank_keys not in LOWRANK_KEYS:
            raise HfcompressError(f"Unknown --lisa-lowrank-keys '{lisa.lowrank_keys}': choose one of {', '.join(LOWRANK_KEYS)}.")
        _at_least(lisa.protect_first, 0, "--protect-first")
        if lisa.plan not in PLAN_KINDS:
            raise HfcompressError(f"Unknown --layer-plan '{lisa.plan}': choose one of {', '.join(PLAN_KINDS)}.")
        if lisa.plan != "share" and lisa.layers is not None:
            raise HfcompressError(
                f"--layer-plan {lisa.plan} chooses the layers --share-ratio or --lisa-ppl-budget change; with --lisa-layers "
                "name the dropped ones with --drop-attention-layers."
            )
        if lisa.drop_layers is not None and any(layer < 1 for layer in lisa.drop_layers):
            raise HfcompressError(f"--drop-attention-layers {lisa.drop_layers}: layer 0 keeps its attention; give layers >= 1.")
        if lisa.max_chain is not None:
            _at_least(lisa.max_chain, 1, "--lisa-max-chain")
            if lisa.layers is not None:
                raise HfcompressError("--lisa-max-chain caps the layers --share-ratio or --lisa-ppl-budget choose; with --lisa-layers give the layers you want.")
        _at_least(lisa.align_hidden, 0, "--align-hidden")
        _at_least(lisa.steps, 0, "--lisa-steps")
        _at_least(lisa.batch_size, 1, "--lisa-batch-size")
        if not lisa.qk_compression > 1.0:
            raise HfcompressError(f"--qk-compression must be > 1 (how many times smaller Q/K get), got {lisa.qk_compression}.")

        if fasc.method not in METHODS:
            raise HfcompressError(f"Unknown --fasc-method '{fasc.method}': choose one of {', '.join(METHODS)}.")
        if not 0.0 < fasc.budget <= 1.0:
            raise HfcompressError(f"--fasc-budget must be in (0, 1] (1.0 = off), got {fasc.budget}.")
        unknown = [t for t in fasc.targets if t not in TARGETABLE]
        if unknown or not fasc.targets:
            raise HfcompressError(
                f"--fasc-targets {','.join(unknown) or '(empty)'} cannot be factorised: choose from {', '.join(TARGETABLE)} "
                "(q_proj/k_proj are LISA's)."
            )
        if fasc.rho_keep_threshold is not None and not fasc.rho_keep_threshold >= 0:
            raise HfcompressError(f"--fasc-rho-keep must be >= 0, got {fasc.rho_keep_threshold}.")

        if distill.tokens is not None:
            _at_least(distill.tokens, 0, "--distill-tokens")
        _at_least(distill.seq_len, 16, "--distill-seq-len")
        _at_least(distill.batch_size, 1, "--distill-batch-size")
        _at_least(distill.lora_rank, 0, "--distill-lora-rank")
        _at_least(distill.curve_tokens, 2, "--distill-curve-tokens")
        if distill.data not in DISTILL_DATA:
            raise HfcompressError(f"Unknown --distill-data '{distill.data}': choose one of {', '.join(DISTILL_DATA)}.")
        for option, lr in (("--distill-lr", distill.lr), ("--distill-weight-lr", distill.weight_lr)):
            if not (math.isfinite(lr) and lr > 0):
                raise HfcompressError(f"{option} must be a learning rate > 0, got {lr}.")
        if distill.tokens and 0 < distill.tokens < distill.seq_len * distill.batch_size:
            raise HfcompressError(
                f"--distill-tokens {distill.tokens} is less than one step ({distill.batch_size} x {distill.seq_len} tokens): "
                "give more tokens or a shorter --distill-seq-len."
            )
        if distill.tokens == 0 and distill.lora_rank:
            raise HfcompressError("--distill-lora-rank configures distillation, which --distill-tokens 0 turns off.")
        if distill.tokens == 0 and distill.data != "calibration":
            raise HfcompressError("--distill-data configures distillation, which --distill-tokens 0 turns off.")
        if distill.tokens and not self.changes_layers and not distill.lora_rank:
            raise HfcompressError(
                "--distill-tokens trains what the conversion creates, and this one shares no layer and factorises none: "
                "share layers (--share-ratio, --lisa-layers, --lisa-ppl-budget), set --fasc-budget below 1.0, or add --distill-lora-rank."
            )
        self.quantize.validate()
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and distill.tokens:
            raise HfcompressError("--distill-tokens trains the whole model in one process: run it without accelerate launch.")
        return self

    def check_against_model(self, config) -> None:
        """Checks that need the source's config (layer count, attention types and shapes); run before calibration."""
        from .build import converted_config
        from .lisa import (
            check_attention_types, check_drop_layers, lowrank_rank, most_with_max_chain, shareable_layers, too_few_candidates,
        )  # fmt: skip

        config = converted_config(config, {})  # the family's view: attention types per layer, head_dim
        layers = config.num_hidden_layers
        shareable = shareable_layers(config.attention_types)
        check_drop_layers(self.lisa.drop_layers or [], layers)
        if self.lisa.layers is not None:
            bad = [layer for layer in self.lisa.layers if not 0 < layer < layers]
            if bad:
                raise HfcompressError(f"--lisa-layers {bad} are out of range: layers 1..{layers - 1} can be shared.")
            check_attention_types(self.lisa.layers, shareable)
        elif self.lisa.plan != "share" and self.lisa.ppl_budget is None:
            count = round(self.lisa.ratio * layers)
            eligible = layers - max(1, self.lisa.protect_first) - len(set(self.lisa.drop_layers or []))
            if count > eligible:
                raise HfcompressError(
                    f"--share-ratio {self.lisa.ratio} asks for {count} changed layers but only {eligible} are outside the "
                    f"{self.lisa.protect_first} protected shallow layers and --drop-attention-layers: lower --share-ratio."
                )
        elif self.lisa.ppl_budget is None:
            count = round(self.lisa.ratio * layers)
            eligible = [layer for layer, ok in shareable.items() if ok and layer >= max(1, self.lisa.protect_first)]
            candidates = len(eligible) if self.lisa.max_chain is None else most_with_max_chain(eligible, self.lisa.max_chain)
            if count > candidates:
                raise HfcompressError(too_few_candidates(self.lisa, count, candidates))
        if self.lisa.lowrank:
            lowrank_rank(config, self.lisa.qk_compression, self.lisa.lowrank_keys)


def _at_least(value: int, minimum: int, option: str) -> None:
    if not isinstance(value, int) or value < minimum:
        raise HfcompressError(f"{option} must be a whole number >= {minimum}, got {value}.")


def check_device(device: str) -> None:
    """Refuse a device this machine does not have (exit 2), before any work."""
    if not DEVICE_PATTERN.match(device):
        raise HfcompressError(f"Unknown --device '{device}': choose auto, cpu, cuda or cuda:N.")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise HfcompressError(f"--device {device}: this machine has no CUDA device (or torch is a CPU build); use --device cpu.")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise HfcompressError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0.")


def resolve_device(device: str, process_index: int = 0):
    """The torch.device layers are onloaded to: auto = this process's CUDA device when there is one, else the CPU."""
    import torch

    check_device(device)
    if device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", process_index % torch.cuda.device_count())
    if device == "cuda":
        return torch.device("cuda", process_index % torch.cuda.device_count())
    return torch.device(device)
