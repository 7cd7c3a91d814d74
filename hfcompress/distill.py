"""Finishers: end-to-end distillation after the streamed conversion. The whole converted model learns to match the
original model's next-token distributions (KL) on calibration sequences, training only a chosen set of parameters.

- LISA tuning: all shared layers' new parameters (Align, low-rank Q/K) jointly, so each layer is trained for
  its effect on the output instead of on its own attention output alone.
- FASC healing: LoRA adapters (peft) on the FASC factors, merged before saving, so the saved model keeps
  exactly the converted shapes.
"""

import time

import torch
from torch import nn

from .errors import HfcompressError
from .lisa import is_lisa_parameter
from .methods import Finisher, register
from .progress import progress_bar

HEAL_TARGETS = ["proj_in", "proj_out"]  # the two factors of every FascLinear


def distill(
    student: nn.Module,
    teacher: nn.Module,
    sequences: torch.Tensor,
    parameters: list[nn.Parameter],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    label: str,
) -> dict:
    """AdamW on `parameters` minimising KL(teacher || student) per token; returns a record of the run."""
    start = time.perf_counter()
    device = next(student.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, steps))
    losses = []
    for _ in progress_bar(range(steps), label):
        ids = sequences[torch.randint(len(sequences), (batch_size,), generator=generator)].to(device)
        with torch.no_grad():
            target = torch.log_softmax(teacher(ids, use_cache=False).logits.float(), dim=-1)
        logits = student(input_ids=ids, use_cache=False).logits.float()
        loss = nn.functional.kl_div(torch.log_softmax(logits, dim=-1), target, log_target=True, reduction="sum")
        loss = loss / (ids.shape[0] * ids.shape[1])
        if not torch.isfinite(loss):
            raise HfcompressError(f"{label}: the distillation loss became NaN/inf; lower the learning rate.")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    window = max(1, min(10, len(losses) // 4))
    return {
        "steps": steps,
        "lr": lr,
        "batch_size": batch_size,
        "kl_first": sum(losses[:window]) / window if losses else None,
        "kl_last": sum(losses[-window:]) / window if losses else None,
        "seconds": round(time.perf_counter() - start, 1),
    }


def tune_lisa_end_to_end(
    converted: nn.Module, original: nn.Module, sequences: torch.Tensor, steps: int, lr: float = 2e-3,
    batch_size: int = 2, seed: int = 0,
) -> dict:
    """Jointly train every shared layer's Align and low-rank Q/K against the original's output distribution."""
    converted.requires_grad_(False)
    parameters = [p for name, p in converted.named_parameters() if is_lisa_parameter(name)]
    if not parameters:
        raise HfcompressError("--lisa-tune-steps needs shared layers: set --share-ratio above 0 or --lisa-layers.")
    for p in parameters:
        p.requires_grad_(True)
    converted.train()
    record = distill(converted, original, sequences, parameters, steps, lr, batch_size, seed, "lisa: end-to-end tuning")
    converted.eval().requires_grad_(False)
    return record


def heal_with_lora(
    converted: nn.Module, original: nn.Module, sequences: torch.Tensor, steps: int, rank: int = 8,
    lr: float = 5e-4, batch_size: int = 2, seed: int = 0,
) -> tuple[nn.Module, dict]:
    """LoRA on the FASC factors, distilled from the original, then merged; returns (merged model, record)."""
    from peft import LoraConfig, get_peft_model

    if not any(type(m).__name__ == "FascLinear" for m in converted.modules()):
        raise HfcompressError("--heal-steps needs FASC-compressed layers: set --fasc-budget below 1.0.")
    peft_model = get_peft_model(
        converted, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=HEAL_TARGETS)
    )
    peft_model.train()
    parameters = [p for p in peft_model.parameters() if p.requires_grad]
    record = distill(peft_model, original, sequences, parameters, steps, lr, batch_size, seed, "heal: LoRA distillation")
    record["lora_rank"] = rank
    return peft_model.merge_and_unload().eval().requires_grad_(False), record


class _DistillFinisher(Finisher):
    """A finisher run for `steps` distillation steps, the count read from DistillOptions.<option>."""

    option: str

    def __init__(self, steps: int, seed: int) -> None:
        self.steps, self.seed = steps, seed

    @classmethod
    def from_options(cls, options) -> "_DistillFinisher | None":
        steps = getattr(options.distill, cls.option)
        return cls(steps, options.seed) if steps else None


@register
class LisaTuning(_DistillFinisher):
    name, option = "lisa_tuning", "lisa_tune_steps"

    def finish(self, student: nn.Module, teacher: nn.Module, sequences: torch.Tensor) -> tuple[nn.Module, dict]:
        return student, tune_lisa_end_to_end(student, teacher, sequences, self.steps, seed=self.seed)


@register
class FascHealing(_DistillFinisher):
    name, option = "fasc_healing", "heal_steps"

    def finish(self, student: nn.Module, teacher: nn.Module, sequences: torch.Tensor) -> tuple[nn.Module, dict]:
        return heal_with_lora(student, teacher, sequences, self.steps, seed=self.seed)
