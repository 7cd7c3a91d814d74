"""The local fit of one shared layer: Align + low-rank Q/K trained so the layer's attention output (after o_proj)
matches the original layer's on the same input, anchored on what the converted layer below hands over (so errors of a
chain of shared layers are seen while fitting).

Align starts from the head matching (mix[h, pi(h)] = least-squares scale of S_{l-1}[pi(h)] onto S_l[h]; "dense": a full
head mix + FFN trained from there, "sparse": only that scale trained; with identity_align, a research ablation, no
alignment: the same head copied); the low-rank Q/K (none with lowrank=False, a research ablation) starts small and
random.
"""

import math
import time

import torch
from torch import nn

from ..remote import import_remote
from .attention import attention_output, causal_mask, full_attention_scores
from .handoff import Below, rows, scores_of
from .options import LisaOptions
from .rank import lowrank_key_heads
from .similarity import alignment_mix, group_matching, js_matrix
from .weights import FittedLayer

# Input RMS at which --lisa-lr is the low-rank Q/K weights' own Adam rate (SmolLM2's deep layers, where the defaults
# were measured). Adam's step has a fixed size in weight space, so its effect on the low-rank scores grows with the
# input's scale: the weights' rate and initial scale are multiplied by LOWRANK_INPUT_RMS / RMS(input). Gemma 3's
# inputs are 4-10x SmolLM2's; at the unscaled rate its fits diverged (Gemma-3-270M, 2026-12-01, shared layers
# 13, 14, 16: fit loss 0.156 -> 0.213, 0.260 -> 0.391, 0.134 -> 0.477, initial -> final).
LOWRANK_INPUT_RMS = 0.35
FIT_REPORT_SEQUENCES = 16  # the fit record's initial and final losses are on the first 16 calibration sequences


def fit_inputs(x: torch.Tensor, options: LisaOptions) -> torch.Tensor:
    """The calibration sequences a local fit draws from: the first `steps x batch_size` (at least the report's
    FIT_REPORT_SEQUENCES). Its draws could reach no more distinct sequences than that, so a larger calibration (for
    FASC's statistics, say) costs LISA neither the memory of its inputs, targets and handed-over features nor their
    time. With fewer calibration sequences than that, as in every run measured so far, the fit reads them all."""
    return x[: max(options.steps * options.batch_size, FIT_REPORT_SEQUENCES)]


def fit_shared_layer(
    config,
    original: nn.Module,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    layer_idx: int,
    x: torch.Tensor,
    below: Below,
    matching: list[int],
    rank: int,
    options: LisaOptions,
) -> tuple[nn.Module, FittedLayer]:
    """Train Align + low-rank Q/K of one shared layer (original attention module `original`, its calibration inputs
    x, what the converted layer below hands over: `Below`) on x's device; returns the module and its fit record."""
    start = time.perf_counter()
    align = options.align
    align_hidden = options.align_hidden if align == "dense" else 0
    key_heads = lowrank_key_heads(config, options.lowrank_keys)
    module = import_remote("lisa_attention").LisaSharedAttention(config, layer_idx, rank, align_hidden, align, key_heads)
    module.v_proj.load_state_dict(original.v_proj.state_dict())
    module.o_proj.load_state_dict(original.o_proj.state_dict())
    module.v_proj.requires_grad_(False)
    module.o_proj.requires_grad_(False)
    generator = torch.Generator().manual_seed(options.seed * 1000 + layer_idx)
    input_scale = LOWRANK_INPUT_RMS / x.float().pow(2).mean().sqrt().clamp_min(1e-6).item()
    with torch.no_grad():
        for lin in (module.q_lowrank, module.k_lowrank):
            std = 0.3 / math.sqrt(config.hidden_size) * input_scale
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=generator) * std)
        if align == "dense":
            if module.align.ffn_in is not None:
                w = module.align.ffn_in.weight
                w.copy_(torch.randn(w.shape, generator=generator) / math.sqrt(w.shape[1]))
                module.align.ffn_in.bias.zero_()
                module.align.ffn_out.weight.zero_()
            module.align.bias.zero_()
    module.to(x.device)

    seq_len = x.shape[1]
    mask = causal_mask(seq_len, device=x.device, window=original.sliding_window)
    positions = torch.arange(seq_len, device=x.device).unsqueeze(0)
    with torch.no_grad():
        target = torch.cat(
            [
                attention_output(original, xb, full_attention_scores(original, xb, cos_sin), mask)
                for xb in x.split(options.batch_size)
            ]
        )
        sample = slice(0, min(len(x), 8))
        if not options.identity_align:
            scores, below_scores = full_attention_scores(original, x[sample], cos_sin), scores_of(rows(below, sample))
            if options.group_heads and align == "sparse":
                probs = [torch.softmax(s + mask, dim=-1) for s in (scores, below_scores)]
                matching = group_matching(js_matrix(*probs), config.num_key_value_heads)
            mix = alignment_mix(scores, below_scores, matching)
            if align == "dense":
                module.align.mix.copy_(mix)
            else:
                module.align.source.copy_(torch.tensor(matching))
                module.align.scale.copy_(mix[torch.arange(len(matching)), matching])
    if options.identity_align:
        module.align.requires_grad_(False)
    target_power = target.pow(2).mean()

    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and p.numel()]  # none: identity, rank 0
    trainable = [p for _, p in named]
    if trainable:
        groups = [
            {"params": [p for n, p in named if n.startswith(("q_lowrank", "k_lowrank"))], "lr": options.lr * input_scale},
            {"params": [p for n, p in named if not n.startswith(("q_lowrank", "k_lowrank"))], "lr": options.lr},
        ]
        optimizer = torch.optim.Adam([g for g in groups if g["params"]])
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, options.steps))

    def loss_on(idx: torch.Tensor) -> torch.Tensor:
        out, _ = module(x[idx], positions.expand(len(idx), -1), mask, rows(below, idx))
        return (out - target[idx]).pow(2).mean() / target_power

    with torch.no_grad():
        everything = torch.arange(min(len(x), FIT_REPORT_SEQUENCES))
        loss_initial = loss_on(everything).item()
    for _ in range(options.steps if trainable else 0):
        idx = torch.randint(len(x), (options.batch_size,), generator=generator)
        loss = loss_on(idx)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        loss_final = loss_on(everything).item()
    module.requires_grad_(False).eval()
    record = FittedLayer(
        layer=layer_idx,
        rank=rank,
        align=align,
        align_hidden=align_hidden,
        state={k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
        loss_initial=loss_initial,
        loss_final=loss_final,
        seconds=time.perf_counter() - start,
        key_heads=key_heads,
    )
    return module, record


def shared_attention(config, record: FittedLayer, device: torch.device | str = "cpu") -> nn.Module:
    """The LisaSharedAttention module of a fit record (weights from `record.state`), in eval mode."""
    module = import_remote("lisa_attention").LisaSharedAttention(
        config, record.layer, record.rank, record.align_hidden, record.align, record.key_heads
    )
    module.load_state_dict(record.state)
    return module.to(device).requires_grad_(False).eval()
