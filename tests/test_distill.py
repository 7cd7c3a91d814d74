"""The distillation stage on the tiny random Llama: it trains only what the conversion created (plus merged LoRA when
asked), lowers the KL to the original, resumes an interrupted run to exactly the uninterrupted result, and the
quality gate covers every evaluation text."""

import pytest
import torch
from torch import nn
from transformers import AutoTokenizer, LlamaForCausalLM

from hfcompress.distill import train as distill_module
from hfcompress.conversion.calibrate import collect_attention_inputs
from hfcompress.distill import (
    Distillation,
    DistillData,
    DistillOptions,
    trainable_parameters,
)
from hfcompress.errors import HfcompressError
from hfcompress.lisa import LisaOptions
from hfcompress.evidence.gate import quality_gate
from hfcompress.sources.text import (
    NEWS_TEXT_NAME,
    builtin_text,
    news_file,
    other_domain_ids,
    tokenize,
)
from hfcompress.evidence.validate import PerplexityResult
from research.inmemory import build_converted_model, fit_lisa, measure_similarity

OPTIONS = DistillOptions(tokens=8 * 2 * 32, seq_len=32, batch_size=2, lr=5e-3, curve_tokens=128)


@pytest.fixture
def models(tiny_llama_dir):
    torch.manual_seed(0)
    teacher = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    with torch.no_grad():  # random weights give near-uniform next-token distributions (KL ~1e-7): make them peaked
        teacher.lm_head.weight.mul_(30)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tokenize(tokenizer, builtin_text()[:60_000])
    sequences = ids[: 8 * 64].view(8, 64)
    inputs = collect_attention_inputs(teacher, sequences)
    lisa = LisaOptions(layers=[2, 3], steps=2, align="sparse")
    fitted = fit_lisa(teacher, inputs, [2, 3], measure_similarity(teacher, inputs), lisa)
    student = build_converted_model(teacher, fitted, {})
    return teacher, student, ids[8 * 64 :], ids[:2000]


def kl(student: nn.Module, teacher: nn.Module, ids: torch.Tensor) -> float:
    windows = ids[: 4 * 64].view(4, 64)
    with torch.no_grad():
        target = torch.log_softmax(teacher(windows).logits, -1)
        log_probs = torch.log_softmax(student(windows).logits, -1)
    return nn.functional.kl_div(log_probs, target, log_target=True, reduction="sum").item() / windows.numel()


def run_stage(student, teacher, train_ids, eval_ids, work, options=OPTIONS):
    data = DistillData(train_ids, {"held-out": eval_ids}, 64, work, seed=0)
    return Distillation(options).finish(student, teacher, data)


def test_distillation_trains_only_new_parameters_and_lowers_kl(models, tmp_path):
    teacher, student, train_ids, eval_ids = models
    before = {k: v.clone() for k, v in student.state_dict().items()}
    kl_before = kl(student, teacher, eval_ids)
    student, record = run_stage(student, teacher, train_ids, eval_ids, tmp_path)
    assert kl(student, teacher, eval_ids) < kl_before
    new = {name for name, _ in trainable_parameters(student)}
    assert new and all("q_lowrank" in n or "k_lowrank" in n or ".align." in n for n in new)
    after = student.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and changed <= new  # every original weight is frozen
    assert record["steps"] == 8 and [p["tokens"] for p in record["perplexity"]] == [0, 512]
    assert record["trainable_parameters"] == sum(p.numel() for _, p in trainable_parameters(student))
    assert record["kl"][-1]["tokens"] == 512 and all(row["kl"] > 0 for row in record["kl"])


def test_an_interrupted_distillation_resumes_to_the_uninterrupted_result(models, tmp_path, monkeypatch):
    teacher, student, train_ids, eval_ids = models
    reference, _ = run_stage(_copy(student), teacher, train_ids, eval_ids, tmp_path / "whole")

    monkeypatch.setattr(distill_module, "CHECKPOINT_SECONDS", 0.0)  # a checkpoint after every step
    calls = {"n": 0}
    original_forward = type(student).forward

    def crash_after_five_steps(self, *args, **kwargs):
        if self.training:
            calls["n"] += 1
            if calls["n"] > 5:
                raise KeyboardInterrupt
        return original_forward(self, *args, **kwargs)

    monkeypatch.setattr(type(student), "forward", crash_after_five_steps)
    with pytest.raises(KeyboardInterrupt):
        run_stage(_copy(student), teacher, train_ids, eval_ids, tmp_path / "split")
    monkeypatch.setattr(type(student), "forward", original_forward)
    resumed, record = run_stage(_copy(student), teacher, train_ids, eval_ids, tmp_path / "split")
    assert record["resumed_at_step"] == 5
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_lora_adapters_are_merged_into_the_unchanged_linears(models, tmp_path):
    teacher, student, train_ids, eval_ids = models
    names = set(student.state_dict())
    v_before = student.model.layers[1].self_attn.v_proj.weight.clone()
    options = DistillOptions(tokens=4 * 2 * 32, seq_len=32, batch_size=2, lr=5e-3, lora_rank=2, curve_tokens=128)
    merged, _ = run_stage(student, teacher, train_ids, eval_ids, tmp_path, options)
    assert set(merged.state_dict()) == names  # no adapter left: the saved shapes are the converted ones
    assert not torch.equal(merged.model.layers[1].self_attn.v_proj.weight, v_before)


def test_the_quality_gate_covers_every_text():
    def pair(original, converted):
        return PerplexityResult(original, 100, 64, 64), PerplexityResult(converted, 100, 64, 64)

    rows, passed, message = quality_gate({"own (x)": pair(10.0, 10.5), "other (y)": pair(20.0, 23.0)}, 10.0)
    assert not passed and [round(r["perplexity_increase_pct"], 1) for r in rows] == [5.0, 15.0]
    assert "own 10.000 -> 10.500 (+5.00%)" in message and "other 20.000 -> 23.000 (+15.00%)" in message
    assert quality_gate({"own": pair(10.0, 10.5), "other": pair(20.0, 21.0)}, 10.0)[1]


def test_other_domain_text(tiny_llama_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert other_domain_ids(tokenizer, "none", "python-language-reference") is None
    own = tmp_path / "own.txt"
    own.write_text("word " * 500)
    with pytest.raises(HfcompressError, match="--ood-text is the calibration text"):
        other_domain_ids(tokenizer, str(own), f"{own}, first 75%")
    if news_file() is None:
        pytest.skip("gensim (the news corpus) is not installed")
    ids, name = other_domain_ids(tokenizer, "news", "python-language-reference (pydoc_data.topics), first 75%")
    assert name == NEWS_TEXT_NAME and len(ids) > 50_000


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def test_gradient_checkpointing_trains_the_same_weights(models, tmp_path):
    """`--distill-gradient-checkpointing` recomputes activations in backward: the same weights, only less memory."""
    from copy import deepcopy
    from dataclasses import replace

    teacher, student, train_ids, eval_ids = models
    checkpointed = deepcopy(student)
    calls = []
    for layer in checkpointed.model.layers:  # the recomputation really happens: each layer's first module runs twice
        layer.input_layernorm.register_forward_hook(lambda *args: calls.append(1))
    plain, _ = run_stage(student, teacher, train_ids, eval_ids, tmp_path / "plain")
    options = replace(OPTIONS, gradient_checkpointing=True)
    checkpointed, record = run_stage(checkpointed, teacher, train_ids, eval_ids, tmp_path / "checkpointed", options)
    assert record["gradient_checkpointing"] and not checkpointed.is_activation_checkpointing
    steps, layers = OPTIONS.steps, len(checkpointed.model.layers)
    assert len(calls) >= 2 * steps * layers  # forward + recompute per step (plus the curve's forwards)
    for (name, a), (_, b) in zip(plain.state_dict().items(), checkpointed.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_low_rank_rates_are_scaled_by_their_input_rms(models, tmp_path):
    """As in the local fit, each shared layer's low-rank Q/K weights train at lr x LOWRANK_INPUT_RMS / RMS(their input)
    (measured on the first window; Gemma 3's inputs are 4-10x SmolLM2's), the Align at lr."""
    from hfcompress.distill import window_starts
    from hfcompress.lisa import LOWRANK_INPUT_RMS

    teacher, student, train_ids, eval_ids = models
    first = train_ids[window_starts(train_ids, OPTIONS.seq_len, OPTIONS.batch_size, OPTIONS.steps, 0)[0][:1, None] + torch.arange(OPTIONS.seq_len)]
    rms = {}
    hooks = [student.model.layers[i].input_layernorm.register_forward_hook(
        lambda _, __, out, i=i: rms.__setitem__(str(i), out.pow(2).mean().sqrt().item())) for i in (2, 3)]
    with torch.no_grad():
        student(input_ids=first, use_cache=False)
    for hook in hooks:
        hook.remove()
    rates = []
    real_adamw = torch.optim.AdamW
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(torch.optim, "AdamW", lambda groups, **kw: rates.extend(groups) or real_adamw(groups, **kw))
        _, record = run_stage(student, teacher, train_ids, eval_ids, tmp_path)
    assert record["lowrank_lr_scale"] == pytest.approx({k: LOWRANK_INPUT_RMS / v for k, v in rms.items()}, rel=1e-3)
    names = {id(p): n for n, p in student.named_parameters()}
    for group in rates:
        for p in group["params"]:
            name = names[id(p)]
            layer = name.split("layers.")[1].split(".")[0]
            expected = OPTIONS.lr * record["lowrank_lr_scale"][layer] if "_lowrank" in name else OPTIONS.lr
            assert group["initial_lr"] == pytest.approx(expected, rel=1e-3), name  # the schedule multiplies it


def test_generated_windows_are_the_originals_own_full_length_text(models):
    """Windows the original writes: full length (end-of-text suppressed), seeded (a rerun writes the same, another seed
    others), a random first token followed by the original's greedy choices, the prefix not counted."""
    from hfcompress.distill import GREEDY_START_TOKENS, generated_windows

    teacher = models[0]
    first = generated_windows(teacher, 5, 24, [], seed=3)
    assert first.shape == (5, 24) and first.dtype == torch.long
    assert torch.equal(first, generated_windows(teacher, 5, 24, [], seed=3))
    assert not torch.equal(first, generated_windows(teacher, 5, 24, [], seed=4))
    with torch.no_grad():  # the greedy start is the original's argmax after the random first token
        greedy = teacher(first[:, : GREEDY_START_TOKENS]).logits.argmax(-1)
    assert torch.equal(greedy, first[:, 1 : GREEDY_START_TOKENS + 1])
    with_bos = generated_windows(teacher, 2, 24, [7], seed=3)
    assert with_bos.shape == (2, 24)  # the prefix is not part of the window


@pytest.mark.parametrize("data", ["generated", "mixed"])
def test_distillation_on_generated_text_lowers_kl_on_the_originals_text(models, tmp_path, data):
    """A random model's own text is nothing like English, so the KL that must fall is on more of its own text (fresh
    windows of another seed)."""
    from hfcompress.distill import generated_windows

    teacher, student, train_ids, eval_ids = models
    own_text = generated_windows(teacher, 4, 64, [], seed=99).flatten()
    kl_before = kl(student, teacher, own_text)
    options = DistillOptions(**{**OPTIONS.__dict__, "data": data, "tokens": 32 * 2 * 32, "lr": 1e-3})
    trained, record = run_stage(student, teacher, train_ids, eval_ids, tmp_path, options)
    assert kl(trained, teacher, own_text) < 0.99 * kl_before and record["data"] == data
    generated = list(tmp_path.glob("distill-*/generated-*.pt"))
    assert [p.name for p in generated] == [f"generated-{32 * 2 if data == 'generated' else 16 * 2}x32.pt"]
