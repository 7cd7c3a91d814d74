"""The conversion's configuration, validated as a whole before any network or model work (as mergekit validates
its merge config). One name has one meaning: `max_ppl_increase` is the quality gate, `lisa.ppl_budget` the LISA layer
search's budget.

Options come in groups, each owning its fields (default and command-line help: options.option), its range checks and,
where the model matters, its check against the model: the methods' (LisaOptions, FascOptions, DistillOptions, each in
its method's package), and here the text, output and device groups (whose fields ConvertOptions holds flat:
`options.seq_len`) and QuantizeOptions. ConvertOptions adds the source, the gate and the whole-model steps, and keeps
only the rules that cross groups.

Checks that need the source's shapes (layer numbers, the low-rank Q/K rank) run in `check_against_model`, right
after the source's config.json is read and before calibration.
"""

import math
import re
from dataclasses import MISSING, dataclass, field
from pathlib import Path

import torch

from .build import converted_config
from ..distill import DistillOptions
from ..distill.options import launched_processes
from ..errors import HfcompressError
from ..fasc import FascOptions
from ..keys import KeyOptions
from ..lisa import LisaOptions
from .options import at_least, option
from ..paths import default_cache_dir
from ..serving.quantize import WEIGHT_SCHEMES, check_weight_backend
from ..sources.text import AUTO, check_text_option

__all__ = [
    "DEVICE_PATTERN", "DTYPES", "OUTPUT_DTYPES", "QUANTIZE_WEIGHTS_HELP", "TEXT_HELP", "ConvertOptions", "DeviceOptions",
    "DistillOptions", "FascOptions", "LisaOptions", "OutputOptions", "QuantizeOptions", "TextOptions", "check_device",
    "default_cache_dir", "parse_size", "resolve_device",
]  # fmt: skip

OUTPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # --dtype, not auto
DTYPES = ("auto", *OUTPUT_DTYPES)
DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
TEXT_HELP = "auto, mix, wiki, builtin, wikitext-2, hf:OWNER/NAME[:CONFIG] or a UTF-8 FILE (README: Calibration and evaluation text)"


QUANTIZE_WEIGHTS_HELP = (
    "Weight-only quantization of the written model (torchao; loads quantized with plain from_pretrained): none or "
    "int8 (int4: torchao has no CPU kernel for it)."
)


@dataclass
class QuantizeOptions:
    """`convert --quantize-weights` (quantize.py): none (default) or int8 (torchao weight-only, one scale per row)."""

    weights: str = option("none", QUANTIZE_WEIGHTS_HELP)

    def validate(self) -> None:
        """The scheme, and the package it needs (one sentence naming what to install), before any model work."""
        if self.weights not in WEIGHT_SCHEMES:
            raise HfcompressError(f"Unknown --quantize-weights '{self.weights}': choose one of {', '.join(WEIGHT_SCHEMES)}.")
        check_weight_backend(self.weights)


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
class TextOptions:
    """The calibration and evaluation texts (text.py) and how much of them is read."""

    calib_text: str = option(AUTO, f"Calibration text: {TEXT_HELP}.")  # FILE path, "mix", "builtin", "wiki", ... (text.py)
    eval_text: str = option(AUTO, f"Perplexity text (held out): {TEXT_HELP}.")
    # a second evaluation text of another domain (text.py): numpy-docs (auto) | news | usenet | FILE | ... | none
    ood_text: str = option(
        AUTO, "Second gated perplexity text, of another domain: auto, numpy-docs, news, usenet, FILE, ... or none."
    )
    calib_sequences: int = option(16, "Number of calibration sequences.")
    seq_len: int = option(256, "Calibration sequence length in tokens.")
    eval_tokens: int = option(4096, "Tokens of held-out text scored for perplexity.")
    eval_context: int = 512

    def check_sizes(self) -> None:
        at_least(self.calib_sequences, 1, "--calib-sequences")
        at_least(self.seq_len, 16, "--seq-len")
        at_least(self.eval_tokens, 2, "--eval-tokens")
        at_least(self.eval_context, 16, "--eval-context")

    def check_texts(self) -> None:
        check_text_option(self.calib_text, "calibration")
        check_text_option(self.eval_text, "evaluation")
        check_text_option(self.ood_text, "other-domain")


@dataclass
class OutputOptions:
    """What is written and where it goes: the weights' dtype and shards, extra licence files, the Hub push."""

    dtype: str = option("auto", "Saved weights: auto (the source's), float32, bfloat16, float16.")  # DTYPES
    max_shard_size: str = option("2GB", "Largest output safetensors shard, e.g. 2GB or 500MB.")
    # --licence-file: terms to ship beside the source's own
    licence_files: list[Path] = option(MISSING, "A licence or terms file to ship too (repeatable).", "--licence-file", factory=list)
    push_to: str | None = option(None, "Hub repo to create/update with the converted model.")
    private: bool = option(False, "Create the pushed repo as private.", "--private")
    overwrite: bool = option(False, "Replace an earlier hfcompress output at --out.", "--overwrite")
    force: bool = option(False, "Push even when the perplexity gate failed.", "--force")

    @property
    def max_shard_bytes(self) -> int:
        return parse_size(self.max_shard_size)

    def check_dtype(self) -> None:
        if self.dtype not in DTYPES:
            raise HfcompressError(f"Unknown --dtype '{self.dtype}': choose one of {', '.join(DTYPES)}.")

    def check_destination(self) -> None:
        """The Hub repo id, the licence files and --private."""
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


@dataclass
class DeviceOptions:
    """Where layers are computed."""

    device: str = option("auto", "Where layers are computed: auto, cpu, cuda or cuda:N.")  # auto (first CUDA device, else CPU) | cpu | cuda | cuda:N


@dataclass(kw_only=True)
class ConvertOptions(TextOptions, OutputOptions, DeviceOptions):
    """Every option of `convert`: the text, output and device groups' fields, the source, the quality gate, the
    whole-model steps and the method groups."""

    source: str
    out: Path
    revision: str | None = option(None, "Branch, tag or commit of a Hub source (default: main).")
    # accept a source that declares custom code (its code is still never run)
    trust_remote_code: bool = option(
        False, "Accept a source that declares custom code (auto_map); its code is never run.", "--trust-remote-code"
    )
    max_ppl_increase: float = option(10.0, "Quality gate: largest allowed perplexity increase, in percent.")  # percent
    # a failed gate converts again with fewer changes (pipeline.fewer_changes) instead of ending the run; None =
    # wherever --share-ratio or --kv-budget sets how much changes, on one process (backs_off)
    back_off: bool | None = option(
        None, "When the quality gate fails, convert again with fewer changes until it passes: fewer shared layers, or a "
        "--kv-budget closer to 1 (default: on where --share-ratio or --kv-budget sets them).", "--back-off/--no-back-off",
    )  # fmt: skip
    cache_dir: Path = field(default_factory=default_cache_dir)
    seed: int = option(0, "Random seed (fitting and probes).")
    # factual-recall probe; None = when the whole model fits in memory
    probe: bool | None = option(None, "Factual-recall probe of both models (default: when they fit).", "--probe/--no-probe")
    # prefill/decode speed side by side; None = when both models fit
    speed: bool | None = option(None, "Tokens/s of both models side by side (default: when they fit).", "--speed/--no-speed")
    # training-free peers at the same KV saving (peers.py); None = when the model fits
    peers: bool | None = option(
        None, "Score attention/layer dropping and a 4-bit KV cache at this KV saving (default: when the model fits).",
        "--peers/--no-peers",
    )  # fmt: skip
    lisa: LisaOptions = field(default_factory=LisaOptions)
    fasc: FascOptions = field(default_factory=FascOptions)
    keys: KeyOptions = field(default_factory=KeyOptions)
    distill: DistillOptions = field(default_factory=DistillOptions)
    quantize: QuantizeOptions = field(default_factory=QuantizeOptions)

    @property
    def changes_layers(self) -> bool:
        """Whether a method creates parameters (shares a layer, factorises one, compresses keys): what distillation can
        train. A plan that only drops attention creates none."""
        shares = self.lisa.plan != "drop" and self.lisa.shares_layers
        return shares or self.fasc.budget < 1.0 or self.keys.kv_budget < 1.0

    def validate(self) -> "ConvertOptions":
        """Raise one HfcompressError naming the first bad value or combination; cheap, touches no network. Each group
        checks its own options; the rules here cross groups."""
        self.check_dtype()
        check_device(self.device)
        parse_size(self.max_shard_size)
        self.check_sizes()
        if not (math.isfinite(self.max_ppl_increase) and self.max_ppl_increase >= 0):  # a negative gate fails every run
            raise HfcompressError(
                f"--max-ppl-increase must be a finite percentage >= 0 (the largest perplexity increase allowed), got "
                f"{self.max_ppl_increase}."
            )
        self.check_texts()
        self.check_destination()
        self.lisa.validate()
        self.fasc.validate()
        self.keys.validate()
        self.distill.validate()
        if self.distill.tokens and not self.distill.trains_something(self.changes_layers):
            raise HfcompressError(
                "--distill-tokens trains what the conversion creates, and this one shares no layer, factorises none and "
                "compresses no keys: set --kv-budget below 1.0, share layers (--share-ratio, --lisa-layers, "
                "--lisa-ppl-budget), set --fasc-budget below 1.0, or add --distill-lora-rank."
            )
        self.quantize.validate()
        self.distill.check_launch()
        self.check_back_off()
        return self

    @property
    def backs_off(self) -> bool:
        """Whether a failed gate converts again with fewer changes: asked for, or by default wherever it can (the count
        comes from --share-ratio, or the budget from --kv-budget, on one process)."""
        if self.back_off is None:
            return self._back_off_refusal() is None
        return self.back_off

    def check_back_off(self) -> None:
        """An explicit --back-off where it cannot lower a count is refused; the default then just stays off."""
        if self.back_off and (refusal := self._back_off_refusal()):
            raise HfcompressError(refusal)

    def _back_off_refusal(self) -> str | None:
        """Why --back-off cannot run with these options, or None: it lowers the count --share-ratio asks for, or raises
        --kv-budget towards 1, on one process (the gate after distillation is the main process's)."""
        if launched_processes() > 1:
            return "--back-off runs on one process: launch without accelerate/torchrun, or drop --back-off."
        if self.keys.kv_budget < 1.0:
            return None  # the key budget can always move towards 1
        chosen_by = {"--lisa-layers": self.lisa.layers, "--lisa-ppl-budget": self.lisa.ppl_budget}
        for flag, value in chosen_by.items():
            if value is not None:
                return (
                    f"--back-off lowers the number of layers --share-ratio changes, and {flag} chooses them instead: "
                    f"drop {flag} (use --share-ratio) or drop --back-off."
                )
        if not self.lisa.shares_layers:
            return (
                "--back-off removes shared layers or raises --kv-budget when the gate fails, and this conversion shares "
                "none and compresses no keys (--kv-budget 1.0): drop --back-off."
            )
        return None

    def check_against_model(self, config) -> None:
        """Checks that need the source's config (layer count, attention types and shapes), each group's own; run before
        calibration."""
        converted = converted_config(config, {})  # the family's view: attention types per layer, head_dim
        self.lisa.check_against_model(converted)
        self.keys.check_against_model(converted)


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
