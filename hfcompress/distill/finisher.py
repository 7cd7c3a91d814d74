"""Distillation as the pipeline's finisher (methods.Finisher): configured by --distill-*, run on the whole converted
model after the streamed conversion, its resumable state in the conversion's work directory."""

from dataclasses import asdict, replace
from pathlib import Path

from torch import nn

from ..conversion.calibrate import cache_key
from ..conversion.methods import Finisher, register
from .data import DistillData
from .options import DistillOptions, launched_processes
from .train import distill, prepare_student


@register
class Distillation(Finisher):
    """The training stage, configured by `--distill-*`. Not given, it runs DEFAULT_TOKENS when the conversion changes
    something and the whole model fits (else it is skipped with a notice); given, it runs or the run is refused."""

    name = "distillation"

    def __init__(self, options: DistillOptions) -> None:
        self.options = replace(options, tokens=options.budget)
        self.asked = options.asked  # given: it runs or the run is refused (methods.Finisher.asked)

    @classmethod
    def from_options(cls, options) -> "Distillation | None":
        distill = options.distill
        if distill.tokens == 0:
            return None
        if distill.tokens is None:  # the default: only where it has something to train, in one process
            if not distill.trains_something(options.changes_layers) or launched_processes() > 1:
                return None
        return cls(distill)

    def settings(self) -> dict:
        """What the trained weights depend on (the resumable state's key): checkpointing changes only memory and time."""
        return {k: v for k, v in asdict(self.options).items() if k != "gradient_checkpointing"}

    def state_dir(self, work: Path) -> Path:
        return work / f"distill-{cache_key(self.settings())}"

    def finish(self, student: nn.Module, teacher: nn.Module, data: DistillData) -> tuple[nn.Module, dict]:
        student = prepare_student(student, self.options)
        record = distill(student, teacher, data, self.options, self.state_dir(data.work))
        if self.options.lora_rank:
            student = student.merge_and_unload()
        if self.options.gradient_checkpointing:
            student.activation_checkpointing_disable()
        return student.eval().requires_grad_(False), record
