"""Distillation: the pipeline's training stage, after the streamed conversion.

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
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from .atomic import save_atomic
from .calibrate import cache_key, load_or_compute
from .errors import HfcompressError
from .fasc import is_fasc_parameter
from .lisa import LOWRANK_INPUT_RMS, is_lisa_parameter
from .methods import Finisher, register
from .progress import console, progress_bar, training_bar
from .text import prefixed
from .validate import perplexity

LORA_TARGETS = ("v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # dense linears every layer keeps
CHECKPOINT_SECONDS = 120.0  # save the training state this often (and at every curve point)
CURVE_FIRST_POINT = 16_384  # curve points at 0, 16k, 64k, 256k, ... tokens (x4) and at the budget
KL_LOG_EVERY = 16_384  # tokens per averaged point of the KL curve
DEFAULT_TOKENS = 16_384  # when --distill-tokens is not given and the whole model fits (measured: benchmarks/scaling)
# where the training windows come from: the calibration text, text the original model samples itself, or both
DISTILL_DATA = ("calibration", "generated", "mixed")
GREEDY_START_TOKENS = 4  # generated windows: a random first token, then this many greedy ones, then sampling (LLM-QAT)
GENERATE_BATCH = 16


@dataclass
class DistillOptions:
    """`--distill-*`: the training stage's budget and optimiser."""

    tokens: int | None = None  # training tokens (0 = off; None = DEFAULT_TOKENS when the whole model fits, else off)
    seq_len: int = 512  # tokens per training window
    batch_size: int = 1  # windows per step
    lr: float = 1e-3  # AdamW for LISA's new modules (small, freshly fitted), cosine decay to 0, 5% warm-up
    weight_lr: float = 5e-5  # for FASC factors and LoRA adapters: full weight matrices diverge at the modules' rate
    lora_rank: int = 0  # LoRA (peft) on the frozen dense linears, merged before saving; 0 = only the new parameters
    curve_tokens: int = 2048  # evaluation tokens per text at each curve point (the final figure uses --eval-tokens)
    gradient_checkpointing: bool = False  # recompute each layer's activations in backward: less memory, one more forward
    data: str = "calibration"  # DISTILL_DATA; mixed: calibration windows at even steps, generated ones at odd steps

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


@dataclass
class DistillData:
    """What the stage trains and measures on."""

    train_ids: torch.Tensor  # 1-D calibration-text token ids
    evaluations: dict[str, torch.Tensor]  # text name -> held-out ids, for the curve
    eval_context: int
    work: Path  # the conversion's work directory: the resumable state goes in a subdirectory
    seed: int
    prefix: list[int] = field(default_factory=list)  # in front of every window: [BOS] or nothing (text.window_prefix)


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


def window_starts(ids: torch.Tensor, seq_len: int, batch_size: int, steps: int, seed: int) -> torch.Tensor:
    """(steps, batch) random start offsets of training windows in `ids`: every step's batch is fixed by the seed, so
    a resumed run sees exactly the batches an uninterrupted one would."""
    if len(ids) <= seq_len:
        raise HfcompressError(
            f"The calibration text has {len(ids)} tokens, fewer than one distillation window of {seq_len}: lower "
            "--distill-seq-len or give a longer --calib-text."
        )
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(len(ids) - seq_len, (steps, batch_size), generator=generator)


@torch.no_grad()
def generated_windows(teacher: nn.Module, count: int, length: int, prefix: list[int], seed: int) -> torch.Tensor:
    """(count, length) token ids the original model writes itself, for distillation on text of no particular domain
    (LLM-QAT's data-free recipe, arXiv 2305.17888, which found this start better than all-greedy or all-sampled): a
    uniformly random first token, GREEDY_START_TOKENS greedy ones, then sampling from the full distribution at
    temperature 1, with end-of-text suppressed so every window is full. Seeded: a rerun writes the same windows."""
    device = next(teacher.parameters()).device
    first = torch.randint(teacher.config.vocab_size, (count, 1), generator=torch.Generator().manual_seed(seed))
    head = torch.tensor(prefix, dtype=torch.long).expand(count, -1)
    greedy = min(GREEDY_START_TOKENS, length - 1)
    sampled = length - 1 - greedy
    # every setting explicit: the model's generation_config (an instruct model's low temperature, say) must not apply
    eos = teacher.config.eos_token_id
    fixed = dict(pad_token_id=(eos[0] if isinstance(eos, list) else eos) or 0, use_cache=True)
    rows = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for part in progress_bar(list(torch.cat([head, first], dim=1).split(GENERATE_BATCH)), "distill: generate windows"):
            ids = part.to(device)
            if greedy:
                ids = teacher.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=greedy,
                                       min_new_tokens=greedy, **fixed)
            if sampled:
                ids = teacher.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                       top_p=1.0, max_new_tokens=sampled, min_new_tokens=sampled, **fixed)
            rows.append(ids[:, len(prefix):].cpu())
    return torch.cat(rows)


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


def training_windows(teacher: nn.Module, data: DistillData, options: DistillOptions, state_dir: Path):
    """step -> its (batch, seq_len) training ids, prefix included: calibration windows at seeded random offsets,
    windows the original model generated (made once, kept with the resumable state), or the two alternating."""
    steps, body = options.steps, options.seq_len - len(data.prefix)  # text tokens per window after the prefix
    generated_steps = {"calibration": 0, "generated": steps, "mixed": steps // 2}[options.data]
    generated = None
    if generated_steps:
        count = generated_steps * options.batch_size
        generated = load_or_compute(
            state_dir / f"generated-{count}x{body}.pt", lambda: generated_windows(teacher, count, body, data.prefix, data.seed)
        )
    def generated_batch(index: int) -> torch.Tensor:
        return prefixed(data.prefix, generated[index * options.batch_size : (index + 1) * options.batch_size])

    if options.data == "generated":
        return generated_batch
    starts = window_starts(data.train_ids, body, options.batch_size, steps, data.seed)
    offsets = torch.arange(body)

    def window(step: int) -> torch.Tensor:
        if options.data == "mixed" and step % 2:
            return generated_batch(step // 2)
        return prefixed(data.prefix, data.train_ids[starts[step][:, None] + offsets])

    return window


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
            if tokens % KL_LOG_EVERY < tokens_per_step or step == steps:
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


@register
class Distillation(Finisher):
    """The training stage, configured by `--distill-*`. Not given, it runs DEFAULT_TOKENS when the conversion changes
    something and the whole model fits (else it is skipped with a notice); given, it runs or the run is refused."""

    name = "distillation"

    def __init__(self, options: DistillOptions) -> None:
        self.options = replace(options, tokens=options.budget)
        self.asked = options.tokens is not None

    @classmethod
    def from_options(cls, options) -> "Distillation | None":
        distill = options.distill
        if distill.tokens == 0:
            return None
        if distill.tokens is None:  # the default: only where it has something to train, in one process
            if not (options.changes_layers or distill.lora_rank) or int(os.environ.get("WORLD_SIZE", "1")) > 1:
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
