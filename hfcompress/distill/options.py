"""The distillation stage's options (`--distill-*`): every field's default and help, their range checks (`validate`),
the token budget and the learning curve's points."""

import math
import os
from dataclasses import dataclass

from ..errors import HfcompressError
from ..conversion.options import at_least, option

DEFAULT_TOKENS = 16_384  # when --distill-tokens is not given and the whole model fits (measured: benchmarks/scaling)
# where the training windows come from: the calibration text, text the original model samples itself, or both
DISTILL_DATA = ("calibration", "generated", "mixed")
CURVE_FIRST_POINT = 16_384  # curve points at 0, 16k, 64k, 256k, ... tokens (x4) and at the budget
# the stage draws every window's offset up front (8 bytes a window): 10**12 tokens would need 16 GB of them before the
# first step (an out-of-memory failure); 10**10 keeps them at 160 MB (512-token windows) and is more than a day of
# training even at 100k tokens/s
MAX_TOKENS = 10**10


def launched_processes() -> int:
    """The processes this run was launched as (accelerate launch and torchrun set WORLD_SIZE): distillation trains the
    whole model in one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class DistillOptions:
    """`--distill-*`: the training stage's budget and optimiser."""

    # training tokens (0 = off; None = DEFAULT_TOKENS when the whole model fits, else off)
    tokens: int | None = option(
        None, f"Distillation tokens (KL to the original; default {DEFAULT_TOKENS} when the model fits; 0 = off)."
    )
    seq_len: int = option(512, "Distillation: tokens per training window.")
    batch_size: int = option(1, "Distillation: windows per step.")
    # AdamW for LISA's new modules (small, freshly fitted), cosine decay to 0, 5% warm-up
    lr: float = option(1e-3, "Distillation: learning rate of LISA's new modules.")
    # for FASC factors and LoRA adapters: full weight matrices diverge at the modules' rate
    weight_lr: float = option(5e-5, "Distillation: learning rate of FASC factors and LoRA adapters.")
    # LoRA (peft) on the frozen dense linears, merged before saving; 0 = only the new parameters
    lora_rank: int = option(0, "Distillation: LoRA rank on the unchanged linears, merged (0 = off).")
    # evaluation tokens per text at each curve point (the final figure uses --eval-tokens)
    curve_tokens: int = option(2048, "Distillation: evaluation tokens per text at each learning-curve point.")
    # recompute each layer's activations in backward: less memory, one more forward
    gradient_checkpointing: bool = option(
        False, "Distillation: recompute activations (less memory, slower).", "--distill-gradient-checkpointing"
    )
    # DISTILL_DATA; mixed: calibration windows at even steps, generated ones at odd steps
    data: str = option("calibration", "Distillation windows: calibration (text), generated (by the original) or mixed.")

    @property
    def budget(self) -> int:
        """The token budget: `tokens`, or DEFAULT_TOKENS when not given."""
        return DEFAULT_TOKENS if self.tokens is None else self.tokens

    @property
    def steps(self) -> int:
        return math.ceil(self.budget / (self.seq_len * self.batch_size))

    def curve_points(self) -> list[int]:
        """Token counts at which the curve measures perplexity: 0, 16k, 64k, ... below the budget, and the budget."""
        points, point = [0], CURVE_FIRST_POINT
        while point < self.budget:
            points.append(point)
            point *= 4
        return points + [self.steps * self.seq_len * self.batch_size]

    @property
    def asked(self) -> bool:
        """Whether --distill-tokens was given: then the stage runs or the run is refused; not given, it runs only
        where it can (the whole model fits, something to train, one process)."""
        return self.tokens is not None

    def trains_something(self, changes_layers: bool) -> bool:
        """Whether the stage has parameters to train: what the conversion creates (`changes_layers`), or LoRA adapters."""
        return changes_layers or bool(self.lora_rank)

    def validate(self) -> "DistillOptions":
        """Every range, enum and combination of the --distill-* options (one HfcompressError naming the first bad one)."""
        if self.tokens is not None:
            at_least(self.tokens, 0, "--distill-tokens")
            if self.tokens > MAX_TOKENS:
                raise HfcompressError(
                    f"--distill-tokens {self.tokens} is more than one process can train on (at most {MAX_TOKENS:,}): "
                    f"give --distill-tokens {MAX_TOKENS} or less."
                )
        at_least(self.seq_len, 16, "--distill-seq-len")
        at_least(self.batch_size, 1, "--distill-batch-size")
        at_least(self.lora_rank, 0, "--distill-lora-rank")
        at_least(self.curve_tokens, 2, "--distill-curve-tokens")
        if self.data not in DISTILL_DATA:
            raise HfcompressError(f"Unknown --distill-data '{self.data}': choose one of {', '.join(DISTILL_DATA)}.")
        for flag, lr in (("--distill-lr", self.lr), ("--distill-weight-lr", self.weight_lr)):
            if not (math.isfinite(lr) and lr > 0):
                raise HfcompressError(f"{flag} must be a learning rate > 0, got {lr}.")
        if self.tokens and 0 < self.tokens < self.seq_len * self.batch_size:
            raise HfcompressError(
                f"--distill-tokens {self.tokens} is less than one step ({self.batch_size} x {self.seq_len} tokens): "
                "give more tokens or a shorter --distill-seq-len."
            )
        if self.tokens == 0 and self.lora_rank:
            raise HfcompressError("--distill-lora-rank configures distillation, which --distill-tokens 0 turns off.")
        if self.tokens == 0 and self.data != "calibration":
            raise HfcompressError("--distill-data configures distillation, which --distill-tokens 0 turns off.")
        return self

    def check_launch(self) -> None:
        """Refuse --distill-tokens in a launch of several processes (the stage trains the whole model in one)."""
        if launched_processes() > 1 and self.tokens:
            raise HfcompressError("--distill-tokens trains the whole model in one process: run it without accelerate launch.")
