"""What the distillation stage trains and measures on: the calibration text's windows at seeded offsets, windows the
original model writes itself, or both alternating."""

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..conversion.calibrate import load_or_compute
from ..errors import HfcompressError
from ..progress import progress_bar
from ..sources.text import prefixed
from .options import DistillOptions

GREEDY_START_TOKENS = 4  # generated windows: a random first token, then this many greedy ones, then sampling (LLM-QAT)
GENERATE_BATCH = 16


@dataclass
class DistillData:
    """What the stage trains and measures on."""

    train_ids: torch.Tensor  # 1-D calibration-text token ids
    evaluations: dict[str, torch.Tensor]  # text name -> held-out ids, for the curve
    eval_context: int
    work: Path  # the conversion's work directory: the resumable state goes in a subdirectory
    seed: int
    prefix: list[int] = field(default_factory=list)  # in front of every window: [BOS] or nothing (text.window_prefix)


def require_window(text_tokens: int, window: int) -> None:
    """Training windows of `window` tokens drawn from a text of `text_tokens` need a longer text."""
    if text_tokens <= window:
        raise HfcompressError(
            f"The calibration text has {text_tokens} tokens, fewer than one distillation window of {window}: lower "
            "--distill-seq-len or give a longer --calib-text."
        )


def window_starts(ids: torch.Tensor, seq_len: int, batch_size: int, steps: int, seed: int) -> torch.Tensor:
    """(steps, batch) random start offsets of training windows in `ids`: every step's batch is fixed by the seed, so
    a resumed run sees exactly the batches an uninterrupted one would."""
    require_window(len(ids), seq_len)
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
