"""`hfcompress eval --engine vllm`, the side that runs in this environment (hfcompress/vllm_engine.py): the windows it
sends to vLLM, whose prompt NLLs summed as it sums them give `validate.perplexity`'s figure, and the refusal without
vLLM's environment. The served model itself is tested in .venv-vllm (tests/vllm)."""

import math

import pytest
import torch
from test_modeling import tiny_config
from transformers import LlamaForCausalLM

from hfcompress.errors import HfcompressError
from hfcompress.validate import perplexity
from hfcompress.vllm_engine import scored_windows, vllm_python


@pytest.mark.parametrize("prefix, stride", [((), None), ((), 7), ((1,), None), ((1,), 5)])
def test_windows_sum_to_validate_perplexity(prefix, stride):
    """Each window's prompt NLLs (what vLLM returns: one per token after the first), less the ones an earlier window
    scored, add up to the perplexity `validate.perplexity` computes on the same model."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    ids = torch.randint(3, 128, (53,))
    windows = scored_windows(ids, 16, stride, 50, list(prefix))
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens, skip in windows:
            window = torch.tensor([tokens])
            nll = torch.nn.functional.cross_entropy(model(window).logits[0, :-1], window[0, 1:], reduction="none")
            total += nll[skip:].sum().item()
            count += len(nll) - skip
        expected = perplexity(model, ids, 16, stride, max_tokens=50, prefix=list(prefix))
    assert count == expected.tokens
    assert math.exp(total / count) == pytest.approx(expected.perplexity, rel=1e-5)


def test_bad_stride_and_short_text_are_refused():
    with pytest.raises(HfcompressError, match=r"stride must be in 1\.\.15"):
        scored_windows(torch.arange(40), 16, 16, None, [1])
    with pytest.raises(HfcompressError, match="fewer than two tokens"):
        scored_windows(torch.arange(1), 16, None, None, [])


def test_missing_vllm_environment_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HFCOMPRESS_VLLM_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(HfcompressError, match="run scripts/install_vllm.sh"):
        vllm_python()
