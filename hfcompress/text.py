"""Real English text for calibration and perplexity, with a fixed held-out split.

Offline default: the CPython language reference shipped as `pydoc_data.topics` (~465 kB of English prose).
`--calib-text FILE` / `--eval-text FILE` replace it. Calibration never sees the held-out part.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import HfcompressError

BUILTIN_TEXT_NAME = "python-language-reference (pydoc_data.topics)"
HELD_OUT_FRACTION = 0.25


def builtin_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def read_text_file(path: Path) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise HfcompressError(f"Cannot read text file {path}: {err}.") from err
    if len(text.split()) < 200:
        raise HfcompressError(f"Text file {path} is too short: give at least a few thousand words.")
    return text


@dataclass
class TokenSplit:
    """Token ids of one text, cut into a calibration part and a held-out evaluation part."""

    name: str
    calibration: torch.Tensor  # 1-D int64
    held_out: torch.Tensor  # 1-D int64


def tokenize(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def tokenize_split(tokenizer, text: str, name: str) -> TokenSplit:
    ids = tokenize(tokenizer, text)
    cut = int(len(ids) * (1 - HELD_OUT_FRACTION))
    return TokenSplit(name=name, calibration=ids[:cut], held_out=ids[cut:])


def chunk(ids: torch.Tensor, seq_len: int, count: int | None = None) -> torch.Tensor:
    """Non-overlapping (count, seq_len) windows from the start of `ids`."""
    available = len(ids) // seq_len
    if available == 0:
        raise HfcompressError(f"The text has {len(ids)} tokens, fewer than one sequence of {seq_len}.")
    n = available if count is None else min(count, available)
    return ids[: n * seq_len].view(n, seq_len)
