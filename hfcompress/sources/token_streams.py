"""The token streams one conversion reads, cut from its texts before any model work, and the windows they are scored in.

- the calibration sequences (N, T) from the calibration text's start: the statistics and fits see only these;
- the selection tokens, the calibration text after them: candidate plans are scored on them (no fit saw them);
- the evaluation texts, held out: the gate scores every one (the calibration domain's first, then another domain's);
- the reload prompt: the written output, loaded in a fresh process, must reproduce its logits.

Every window starts with the tokenizer's prefix ([BOS] where the tokenizer starts texts with it).
"""

from dataclasses import dataclass

import torch

from ..conversion.config import ConvertOptions
from ..errors import HfcompressError
from ..progress import console
from .text import chunk, other_domain_ids, prefixed, text_streams, window_prefix

SELECTION_TOKENS = 2048  # calibration-text tokens after the sequences: score candidate plans
RELOAD_PROBE_TOKENS = 256  # prompt whose logits the reloaded output must reproduce (long enough for RoPE errors to show)


@dataclass(frozen=True)
class TokenStreams:
    calib_ids: torch.Tensor  # the calibration text's ids (distillation draws its windows from all of them)
    calib_name: str
    sequences: torch.Tensor  # (N, T) calibration sequences from its start
    selection_ids: torch.Tensor  # up to SELECTION_TOKENS calibration-text ids after the sequences
    evaluations: dict[str, torch.Tensor]  # held-out text name -> ids: the calibration domain first, then another domain
    prefix: list[int]  # in front of every window: [BOS] where the tokenizer starts texts with it (text.window_prefix)
    reload_prompt: torch.Tensor  # (1, T): the prefix, then the start of the calibration domain's held-out text


def token_streams(options: ConvertOptions, tokenizer) -> TokenStreams:
    calib_tokens = options.calib_sequences * options.seq_len
    calib_ids, calib_name, eval_ids, eval_name = text_streams(
        tokenizer, options.calib_text, options.eval_text, calib_tokens + SELECTION_TOKENS + options.distill.budget, options.seed
    )
    prefix = window_prefix(tokenizer)
    sequences = prefixed(prefix, chunk(calib_ids, options.seq_len - len(prefix), options.calib_sequences))
    if len(sequences) < options.calib_sequences:
        console.log(
            f"[yellow]calibration: {calib_name} has {len(calib_ids):,} tokens, {len(sequences)} sequences of "
            f"{options.seq_len}, not the {options.calib_sequences} asked for: give a longer --calib-text to calibrate on more[/]"
        )
    used = len(sequences) * (options.seq_len - len(prefix))
    selection_ids = calib_ids[used : used + SELECTION_TOKENS]
    evaluations = {eval_name: eval_ids}
    other = other_domain_ids(tokenizer, options.ood_text, calib_name)
    if other is not None:
        evaluations[other[1]] = other[0]
    held_out = next(iter(evaluations.values()))  # the calibration domain's
    reload_prompt = prefixed(prefix, held_out[: min(RELOAD_PROBE_TOKENS, len(held_out)) - len(prefix)]).unsqueeze(0)
    return TokenStreams(calib_ids, calib_name, sequences, selection_ids, evaluations, prefix, reload_prompt)


def windows(ids: torch.Tensor, context: int, max_tokens: int | None = None, prefix: list[int] = ()) -> list[torch.Tensor]:
    """Disjoint windows of `context` tokens (`prefix`, then text), as validate.perplexity scores them by default."""
    ids = ids[:max_tokens] if max_tokens else ids
    if len(ids) < 2:
        raise HfcompressError("The evaluation text has fewer than two tokens.")
    body = context - len(prefix)
    return [prefixed(list(prefix), ids[begin : begin + body]) for begin in range(0, max(1, len(ids) - (0 if prefix else 1)), body)]
