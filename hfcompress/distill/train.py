"""Distillation, the training loop: the pipeline's training stage, after the streamed conversion.

Every parameter the conversion created (LISA's Align and low-rank Q/K, FASC's factors), and optionally LoRA adapters
on the weights it left unchanged, is trained together, end to end: the whole converted model learns the original's
next-token distribution by KL(original || converted), on a token budget (`--distill-tokens`) streamed as windows
from the calibration text (never from the evaluation texts). Layer-local fits only match each layer's attention
output; this stage trains each new module for its effect on the output, which is what perplexity measures.

- Checkpointed: the trainable tensors, the optimiser and the learning curve are saved every few minutes in the
  conversion's work directory; a rerun of the same command resumes at the last checkpoint.
- The learning curve (KL per step, perplexity on every evaluation text at a few token counts) goes into the report,
  and from there into a plot on the card.
"""

import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from ..conversion.atomic import save_atomic
from ..errors import HfcompressError
from ..fasc.weights import is_fasc_parameter
from ..lisa.fit import LOWRANK_INPUT_RMS
from ..lisa.weights import is_lisa_parameter
from ..progress import console, training_bar
from ..evidence.validate import perplexity
from .data import DistillData, training_windows
from .options import DistillOptions

LORA_TARGETS = ("v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # dense linears every layer keeps
CHECKPOINT_SECONDS = 120.0  # save the training state this often (and at every curve point)
KL_LOG_EVERY = 16_384  # tokens per averaged point of the KL curve, at most (a long run)
KL_MIN_POINTS = 32  # a shorter run logs more often, down to every step: its plot shows the losses it trained on


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters the conversion created: LISA's and FASC's (every other weight is the original's)."""
    return [(name, p) for name, p in model.named_parameters() if is_lisa_parameter(name) or is_fasc_parameter(name)]


def curve_perplexities(model: nn.Module, data: DistillData, tokens: int) -> dict[str, float]:
    model.eval()
    with torch.no_grad():
        result = {
            name: perplexity(
                model, ids.to(next(model.parameters()).device), data.eval_context, max_tokens=tokens,
                label=f"distill: perplexity ({name})", prefix=data.prefix,
            ).perplexity
            for name, ids in data.evaluations.items()
        }
    model.train()
    return result


@torch.no_grad()
def lowrank_input_scales(student: nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """Per shared layer (its q_lowrank's module name): LOWRANK_INPUT_RMS / RMS of its input on `ids`, the factor the
    local fit also applies to the low-rank Q/K weights' rate (lisa.LOWRANK_INPUT_RMS: Adam's step is a fixed size in
    weight space, so the same rate moves the scores of larger inputs faster)."""
    rms: dict[str, float] = {}
    hooks = [
        module.register_forward_pre_hook(lambda _, args, name=name: rms.__setitem__(name, args[0].float().pow(2).mean().sqrt().item()))
        for name, module in student.named_modules()
        if name.endswith("q_lowrank")
    ]
    try:
        student(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: LOWRANK_INPUT_RMS / max(value, 1e-6) for name, value in rms.items()}


def distill(student: nn.Module, teacher: nn.Module, data: DistillData, options: DistillOptions, state_dir: Path) -> dict:
    """AdamW on the student's trainable parameters minimising KL(teacher || student) per token, resumable from
    `state_dir`. Returns the record for the report (settings, timings, the learning curve)."""
    device = next(student.parameters()).device
    named = [(n, p) for n, p in student.named_parameters() if p.requires_grad]
    parameters = [p for _, p in named]
    if not parameters:
        raise HfcompressError("--distill-tokens has nothing to train: the conversion changed no layer.")
    steps, tokens_per_step = options.steps, options.seq_len * options.batch_size
    window = training_windows(teacher, data, options, state_dir)
    # LISA's modules at options.lr, their low-rank Q/K weights scaled by their input's RMS (measured on the first
    # window) as in the local fit; FASC factors and LoRA adapters at options.weight_lr
    scales = lowrank_input_scales(student, window(0)[:1].to(device))
    lowrank = {n: scales[m.replace("k_lowrank", "q_lowrank")] for n, _ in named
               if (m := n.rsplit(".", 1)[0]).endswith(("q_lowrank", "k_lowrank"))}
    groups = [{"params": [p for n, p in named if is_lisa_parameter(n) and n not in lowrank], "lr": options.lr}]
    groups += [{"params": [p], "lr": options.lr * lowrank[n]} for n, p in named if n in lowrank]
    groups.append({"params": [p for n, p in named if not is_lisa_parameter(n)], "lr": options.weight_lr})
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    points = options.curve_points()
    state_file = state_dir / "state.pt"
    record = {
        **asdict(options), "steps": steps, "train_tokens_available": len(data.train_ids),
        "trainable_parameters": sum(p.numel() for p in parameters), "kl": [], "perplexity": [], "seconds": 0.0,
        "lowrank_lr_scale": {name.split(".self_attn")[0].rsplit(".", 1)[-1]: round(v, 4) for name, v in scales.items()},
    }
    step = 0
    if state_file.is_file():  # resume: the trainable tensors, the optimiser and the curve so far
        saved = torch.load(state_file, weights_only=False)
        with torch.no_grad():
            for name, p in named:
                p.copy_(saved["parameters"][name])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        step, record = saved["step"], saved["record"]
        record["resumed_at_step"] = step

    def save() -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        parameters_now = {name: p.detach().cpu().clone() for name, p in named}
        save_atomic({"parameters": parameters_now, "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                     "step": step, "record": record}, state_file)

    def measure(tokens: int) -> None:
        if not any(row["tokens"] == tokens for row in record["perplexity"]):
            point = curve_perplexities(student, data, options.curve_tokens)
            record["perplexity"].append({"tokens": tokens, **point})
            shown = ", ".join(f"{name.split(' (')[0]} {value:.3f}" for name, value in point.items())
            console.log(f"distill: {tokens:,} tokens trained: perplexity {shown}", highlight=False)

    student.train()
    teacher.eval()
    started, kl_sum, kl_count = time.perf_counter(), 0.0, 0
    log_every = max(1, min(KL_LOG_EVERY // tokens_per_step, steps // KL_MIN_POINTS))  # steps per KL curve point
    seconds_before = record["seconds"]
    if step == 0:
        measure(0)
    last_save = time.perf_counter()  # the first checkpoint comes CHECKPOINT_SECONDS after training starts
    with training_bar(steps * tokens_per_step, "distill: KL to the original", done=step * tokens_per_step) as advance:
        while step < steps:
            ids = window(step).to(device)
            with torch.no_grad():
                target = torch.log_softmax(teacher(ids, use_cache=False).logits.float(), dim=-1)
            logits = student(input_ids=ids, use_cache=False).logits.float()
            loss = nn.functional.kl_div(torch.log_softmax(logits, dim=-1), target, log_target=True, reduction="sum")
            loss = loss / ids.numel()
            if not torch.isfinite(loss):
                raise HfcompressError(f"Distillation diverged at step {step} (loss {loss.item()}): lower --distill-lr.")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            kl_sum, kl_count = kl_sum + loss.item(), kl_count + 1
            tokens = step * tokens_per_step
            if step % log_every == 0 or step == steps:
                record["kl"].append({"tokens": tokens, "kl": kl_sum / kl_count})
                kl_sum, kl_count = 0.0, 0
            elapsed = time.perf_counter() - started
            advance(tokens_per_step, loss=loss.item(), tokens_per_s=(tokens - record.get("resumed_at_step", 0) * tokens_per_step) / elapsed)
            at_point = any(tokens - tokens_per_step < point <= tokens for point in points[1:])
            if at_point:
                measure(tokens)
            if at_point or time.perf_counter() - last_save > CHECKPOINT_SECONDS or step == steps:
                record["seconds"] = round(seconds_before + time.perf_counter() - started, 1)
                save()
                last_save = time.perf_counter()
                if not console.is_terminal:  # the bar is off in logs: one line per checkpoint instead
                    console.log(f"distill: step {step}/{steps}, loss {loss.item():.4f}, {record['seconds']:.0f} s (checkpoint saved)")
    student.eval()
    record["seconds"] = round(seconds_before + time.perf_counter() - started, 1)
    record["tokens_per_s"] = round(steps * tokens_per_step / max(record["seconds"], 1e-9), 1)
    return record


def prepare_student(student: nn.Module, options: DistillOptions) -> nn.Module:
    """Freeze the original weights, unfreeze the new ones; wrap in LoRA adapters when asked."""
    student.requires_grad_(False)
    for _, p in trainable_parameters(student):
        p.requires_grad_(True)
    if options.gradient_checkpointing:  # non-reentrant: the embeddings are frozen, so no input needs a gradient
        student.activation_checkpointing_enable({"use_reentrant": False})
    if options.lora_rank:
        from peft import LoraConfig, get_peft_model

        # exact names of the still-dense linears: a FASC-factorised down_proj is no nn.Linear for peft
        targets = [n for n, m in student.named_modules() if isinstance(m, nn.Linear) and n.endswith(LORA_TARGETS)]
        student = get_peft_model(
            student, LoraConfig(r=options.lora_rank, lora_alpha=2 * options.lora_rank, lora_dropout=0.0, target_modules=targets)
        )
        for _, p in trainable_parameters(student):  # peft froze everything but its adapters
            p.requires_grad_(True)
    return student
