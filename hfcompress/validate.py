"""Step 6, validate: perplexity of original and converted on the same held-out tokens, and a reload of the
written directory in a fresh process with trust_remote_code=True whose logits must equal the in-memory model's.
"""

import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import HfcompressError
from .progress import progress_bar


@dataclass
class PerplexityResult:
    perplexity: float
    tokens: int
    context: int
    stride: int

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def perplexity(
    model: nn.Module, ids: torch.Tensor, context: int = 512, stride: int | None = None, max_tokens: int | None = None,
    label: str = "perplexity",
) -> PerplexityResult:
    """Strided perplexity: windows of `context` tokens advancing by `stride`; each token is scored once, with up
    to `context - stride` tokens of left context (stride = context gives disjoint windows)."""
    stride = stride or context
    if not 0 < stride <= context:
        raise HfcompressError(f"The perplexity stride must be in 1..context ({context}), got {stride}.")
    ids = ids[:max_tokens] if max_tokens else ids
    if len(ids) < 2:
        raise HfcompressError("The evaluation text has fewer than two tokens.")
    total_nll, total_tokens, prev_end = 0.0, 0, 0
    starts = list(range(0, max(1, len(ids) - 1), stride))
    for begin in progress_bar(starts, label):
        end = min(begin + context, len(ids))
        window = ids[begin:end].unsqueeze(0)
        logits = model(window, use_cache=False).logits[0, :-1].float()
        nll = nn.functional.cross_entropy(logits, window[0, 1:], reduction="none")  # nll[t] predicts begin+1+t
        new = nll[max(prev_end, begin + 1) - begin - 1 :]  # only tokens no earlier window scored
        total_nll += new.sum().item()
        total_tokens += new.numel()
        prev_end = end
        if end == len(ids):
            break
    return PerplexityResult(math.exp(total_nll / total_tokens), total_tokens, context, stride)


_RELOAD_SCRIPT = r"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
directory, ids_path, out_path = sys.argv[1:4]
AutoTokenizer.from_pretrained(directory, trust_remote_code=True)  # as the card's usage snippet does
model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32)
model.eval()
with torch.no_grad():
    logits = model(torch.load(ids_path), use_cache=False).logits
torch.save({"logits": logits, "class": type(model).__name__}, out_path)
"""


def reload_in_fresh_process(directory: Path, ids: torch.Tensor, timeout: float = 600) -> tuple[str, torch.Tensor]:
    """Load `directory` as a user would (AutoModelForCausalLM, trust_remote_code=True) in a new interpreter."""
    with tempfile.TemporaryDirectory() as tmp:
        ids_path, out_path = Path(tmp) / "ids.pt", Path(tmp) / "out.pt"
        torch.save(ids, ids_path)
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(Path(tmp) / "modules"))
        proc = subprocess.run(
            [sys.executable, "-c", _RELOAD_SCRIPT, str(directory), str(ids_path), str(out_path)],
            capture_output=True, text=True, timeout=timeout, env=env,
        )
        if proc.returncode != 0:
            last = proc.stderr.strip().splitlines()[-1:] or ["no output"]
            raise HfcompressError(f"The written model does not load with trust_remote_code=True: {last[0]}")
        result = torch.load(out_path)
    return result["class"], result["logits"]


def compare_reload(model: nn.Module, directory: Path, ids: torch.Tensor) -> dict:
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits.float()
    cls, logits = reload_in_fresh_process(directory, ids)
    return {"class": cls, "max_abs_logit_diff": (logits.float() - expected).abs().max().item()}


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
