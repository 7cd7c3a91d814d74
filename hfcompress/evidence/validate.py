"""Step 6, validate: perplexity of original and converted on the same held-out tokens, and a reload of the
written directory in a fresh process with trust_remote_code=True whose logits must equal the in-memory model's.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import HfcompressError
from ..memory import available_memory
from ..progress import progress_bar


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
    label: str = "perplexity", prefix: list[int] | tuple = (),
) -> PerplexityResult:
    """Strided perplexity: windows of `context` tokens (`prefix`, e.g. [BOS], then text) advancing by `stride`; each
    text token is scored once, with up to `context - stride` tokens of left context (stride = context - len(prefix)
    gives disjoint windows). Without a prefix a window's first token is context only; with one, it is scored too."""
    body = context - len(prefix)
    stride = stride or body
    if not 0 < stride <= body:
        less = f" (the context {context} less the BOS)" if prefix else ""
        raise HfcompressError(f"The perplexity stride must be in 1..{body}{less}, got {stride}.")
    ids = ids[:max_tokens] if max_tokens else ids
    if len(ids) < 2:
        raise HfcompressError("The evaluation text has fewer than two tokens.")
    head = torch.tensor(list(prefix), dtype=ids.dtype, device=ids.device)
    total_nll, total_tokens, prev_end = 0.0, 0, 0  # ids[prev_end:] are not scored yet
    starts = list(range(0, max(1, len(ids) - (0 if prefix else 1)), stride))
    for begin in progress_bar(starts, label):
        end = min(begin + body, len(ids))
        window = torch.cat([head, ids[begin:end]]).unsqueeze(0)
        logits = model(window, use_cache=False).logits[0, :-1].float()
        nll = nn.functional.cross_entropy(logits, window[0, 1:], reduction="none")
        first = begin if prefix else begin + 1  # nll[t] predicts ids[first + t]
        new = nll[max(prev_end, first) - first :]  # only tokens no earlier window scored
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


_STRUCTURE_SCRIPT = r"""
import json, sys, torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM
directory = sys.argv[1]
config = AutoConfig.from_pretrained(directory, trust_remote_code=True)
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
expected = {k: list(v.shape) for k, v in model.state_dict().items()}
if config.tie_word_embeddings:
    expected.pop("lm_head.weight", None)
index = f"{directory}/model.safetensors.index.json"
try:
    files = sorted(set(json.load(open(index))["weight_map"].values()))
except FileNotFoundError:
    files = ["model.safetensors"]
found = {}
for file in files:
    with safe_open(f"{directory}/{file}", "pt") as handle:
        found.update({k: handle.get_slice(k).get_shape() for k in handle.keys()})
bad = sorted(k for k in set(expected) | set(found) if expected.get(k) != found.get(k))
print(json.dumps({"class": type(model).__name__, "mismatched": bad}))
"""


def check_structure(directory: Path) -> dict:
    """In a fresh process: the config and remote code build the model (meta device, no weights read) and every
    tensor it expects is in the shards with its shape. Used when a float32 reload would not fit in memory."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(directory.parent / f".{directory.name}.modules"))
    proc = subprocess.run([sys.executable, "-c", _STRUCTURE_SCRIPT, str(directory)], capture_output=True, text=True, env=env, timeout=600)
    shutil.rmtree(env["HF_MODULES_CACHE"], ignore_errors=True)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise HfcompressError(f"The written model does not load with trust_remote_code=True: {last[0]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["mismatched"]:
        raise HfcompressError(f"Internal error: the written shards do not match the model's layout ({result['mismatched'][:3]}).")
    return {"mode": "structure (model too large for a float32 reload)", "class": result["class"], "max_abs_logit_diff": None}


RELOAD_MEMORY_FRACTION = 0.4  # the fresh-process reload (float32, whole model) runs only if it needs less of the free RAM
MAX_RELOAD_DIFF = 1e-4


def verify_written(directory: Path, ids: torch.Tensor, expected: torch.Tensor, float32_bytes: int) -> dict:
    """Load the written output as a user would, in a fresh process, and require the logits the conversion computed
    (within 1e-4); a model too large for a float32 reload here is checked for layout instead."""
    if float32_bytes >= RELOAD_MEMORY_FRACTION * available_memory(torch.device("cpu")):
        return check_structure(directory)
    cls, logits = reload_in_fresh_process(directory, ids)
    diff = (logits.float() - expected.float()).abs().max().item()
    if diff > MAX_RELOAD_DIFF:
        raise HfcompressError(f"The written model reloads with different logits (max diff {diff:.2e}); nothing was written.")
    return {"mode": "logits", "class": cls, "max_abs_logit_diff": diff}


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
