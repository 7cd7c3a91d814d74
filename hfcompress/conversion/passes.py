"""The streamed passes over decoder layers: the conversion's pipeline, in the sense of llm-compressor's sequential one.

Decoder layers are built one at a time from the source's tensors (`stream.LayerStream`), onloaded to the device and
offloaded again; hidden states live on disk in the calibration cache. The methods (methods.py) plug in at fixed
points; nothing here names one.

1. forward   embeddings -> every layer's input hidden state (saved per layer: a rerun resumes), methods observe
2. backward  only if a method needs gradients: dL/dh from the final norm + lm_head, then layer by layer, with the
             methods' linear statistics hooked in; the per-layer results are saved as they are computed
3. convert   each method plans (and may score candidate plans by streaming them), then per layer every method
             applies its change; the layer is saved (a rerun resumes at the next layer) and the evaluation windows
             move through the original and the converted layer, so perplexity needs no whole model

The steps the driver calls are `calibrate` (passes 1 and 2), `plan` and `convert_layers` (pass 3).
"""

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .atomic import save_atomic
from .build import cast_floating, converted_config
from .calibrate import cache_key, new_linear_stats, tensor_fingerprint, track_linear_stats
from .checkpoint import save_tensors
from ..errors import HfcompressError
from ..evidence.gate import refuse_non_finite
from .methods import Method, Planner, merged_config_entries
from ..progress import console, progress_bar
from .run import Run
from .stream import Processes, token_nll
from ..sources.token_streams import windows
from ..evidence.validate import PerplexityResult


@dataclass
class Evaluation:
    """Token windows moving through the original and the converted layers, in step."""

    ids: list[torch.Tensor]  # this process's windows
    original: list[torch.Tensor]  # hidden states (1, T, d) on the CPU
    converted: list[torch.Tensor]
    handed: list  # what each window's converted layer hands to the next one


def reused(done: int, total: int, what: str, where: Path) -> None:
    """A resumed step says what it took from the cache instead of recomputing."""
    if done:
        rest = "all of them" if done == total else f"computing the other {total - done}"
        console.log(f"{what} of {done} of {total} layers reused from the cache ({where}); {rest}", highlight=False)


def forward_pass(run: Run, methods: list[Method]) -> None:
    """Saves every layer's input hidden states while the methods observe each layer; resumes at the first layer
    that some process or some method has not finished."""
    stream, processes = run.stream, run.processes
    marks = [[run.hidden_dir / f"forward-{idx}.done"] + [run.process_dir(m.store) / f"observed-{idx}.done" for m in methods] for idx in range(stream.num_layers)]
    start = processes.agreed_minimum(next((i for i, group in enumerate(marks) if not all(m.is_file() for m in group)), len(marks)))
    reused(start, stream.num_layers, "calibrate: forward: hidden states and statistics", run.calib_dir)
    if start == stream.num_layers:
        return
    hidden = stream.embed([run.sequences])[0] if start == 0 else run.hidden(start)
    if start == 0:
        save_atomic(hidden, run.hidden_dir / "hidden-0.pt")
    with torch.no_grad():
        for idx in progress_bar(range(start, stream.num_layers), "calibrate: forward, layer by layer", total=stream.num_layers, done=start):
            layer = stream.original_layer(idx)
            ctx = run.context(idx, layer, hidden)
            for method in methods:
                method.observe(ctx)
            hidden, _ = stream.run(layer, hidden)
            if not torch.isfinite(hidden).all():
                shutil.rmtree(run.calib_dir, ignore_errors=True)  # nothing broken stays cached
                raise HfcompressError(f"Layer {idx} produced NaN/inf activations on the calibration text; its weights are broken.")
            save_atomic(hidden, run.hidden_dir / f"hidden-{idx + 1}.pt")
            for mark in marks[idx]:
                mark.touch()
            del layer, ctx
    processes.wait()  # the main process's last observations are on disk before anyone plans from them


def _sum_stats(stats: dict, processes: Processes) -> None:
    for entry in stats.values():
        entry.extra.clear()
        for name in ("xx", "gg", "probe_a", "probe_b", "probe_ab"):
            processes.sum(getattr(entry, name))
        entry.tokens = int(processes.sum(torch.tensor(entry.tokens)))


def backward_pass(run: Run, methods: list[Method]) -> None:
    """Streamed backward: per layer, the gradient-statistics of every method that needs them; dL/dh of each layer's
    input is saved per layer, so a rerun resumes at the next layer."""
    methods = [m for m in methods if m.needs_gradients]
    if not methods:
        return
    stream, processes, seed = run.stream, run.processes, run.options.seed
    grads_dir = run.process_dir(run.calib_dir / f"backward-{cache_key([m.store.name for m in methods])}")  # per stat set
    order = list(reversed(range(stream.num_layers)))
    done = processes.agreed_minimum(next((i for i, idx in enumerate(order) if not (grads_dir / f"grad-{idx}.pt").is_file()), len(order)))
    reused(done, len(order), "calibrate: backward: gradient statistics", run.calib_dir)
    if done == len(order):
        return
    if done == 0:  # d(summed loss)/d(final hidden state), one sequence at a time (logits are T x vocab)
        norm, lm_head = stream.head()
        hidden = run.hidden(stream.num_layers)
        grad = torch.empty_like(hidden)
        for i, ids in enumerate(run.sequences):
            loss, grad[i] = token_nll(norm, lm_head, hidden[i], ids, with_grad=True)
            if not math.isfinite(loss):
                raise HfcompressError("The calibration loss is NaN/inf: the source weights are broken.")
        del norm, lm_head
    else:
        grad = torch.load(grads_dir / f"grad-{order[done - 1]}.pt")
    for idx in progress_bar(order[done:], "calibrate: gradient statistics, layer by layer", total=len(order), done=done):
        layer = stream.original_layer(idx)
        hidden = run.hidden(idx)
        ctx = run.context(idx, layer, hidden, output_gradient=grad)
        wanted = {m.name: m.gradient_linears(ctx) for m in methods}
        linears = {name: linear for per_method in wanted.values() for name, linear in per_method.items()}
        stats = new_linear_stats(linears, torch.Generator().manual_seed(seed * 100_003 + idx), run.device)
        hooks = track_linear_stats(linears, stats)
        new_grad = torch.empty_like(grad)
        try:
            for start in range(0, len(hidden), stream.batch_size):
                part = slice(start, start + stream.batch_size)
                h = hidden[part].to(run.device).requires_grad_(True)
                out, _ = stream.run(layer, h)
                out.backward(grad[part].to(run.device))
                new_grad[part] = h.grad.cpu()
        finally:
            for hook in hooks:
                hook.remove()
        _sum_stats(stats, processes)
        for method in methods:
            method.observe_gradients(ctx, {name: stats[name] for name in wanted[method.name]})
        grad = new_grad
        save_atomic(grad, grads_dir / f"grad-{idx}.pt")
        del layer, linears, stats, ctx
    processes.wait()


def new_evaluation(run: Run, ids: torch.Tensor, max_tokens: int | None) -> Evaluation:
    """This process's share of the windows of `ids`, embedded: the original's embeddings, and the converted model's
    as it will be saved (rounded to the saved dtype)."""
    mine = windows(ids, run.options.eval_context, max_tokens, run.prefix)[run.processes.index :: run.processes.count]
    batches = [w.unsqueeze(0) for w in mine]
    return Evaluation(mine, run.stream.embed(batches), run.stream.embed(batches, run.saved_dtype), [None] * len(mine))


def convert_pass(run: Run, methods: list[Method], evaluations: list[Evaluation], work: Path | None) -> list[Evaluation]:
    """Every layer in depth order: each method applies its change, the converted layer is saved to `work` (None:
    a candidate plan, only scored), and the evaluation windows move through the original and the converted layer.
    With `work`, the progress is saved after every layer and a rerun resumes at the next one."""
    stream, processes = run.stream, run.processes
    config = stream.layer_config(merged_config_entries(methods))
    progress_file = run.process_dir(work) / "progress.pt" if work is not None else None
    start = 0
    if progress_file is not None and progress_file.is_file():
        saved = torch.load(progress_file, weights_only=False)
        start, evaluations = saved["next"], saved["evaluations"]
        for method in methods:
            method.restore(saved["methods"][method.name])
        reused(start, stream.num_layers, "convert: converted layers", work)
    label = "convert: layer by layer" if work is not None else "plan: score a candidate, layer by layer"
    for idx in progress_bar(range(start, stream.num_layers), label, total=stream.num_layers, done=start):
        state = stream.original_state(idx)
        layer = stream.build(stream.config, idx, state)
        hidden = run.hidden(idx) if any(m.touches(idx) for m in methods) else None
        ctx = run.context(idx, layer, hidden)
        for method in methods:
            state = method.apply(ctx, state)
        tensors = {k: cast_floating(v.detach().cpu(), run.saved_dtype) for k, v in state.items()}
        if work is not None and processes.is_main:
            save_tensors(tensors, work / f"layer-{idx:05d}.safetensors")
        converted = stream.build(config, idx, tensors)  # validated as saved: rounded to the saved dtype
        handoff = stream.handoff(config, idx)
        with torch.no_grad():
            for evaluation in evaluations:
                for i, hidden_state in enumerate(evaluation.original):
                    evaluation.original[i], _ = stream.run(layer, hidden_state)
                    evaluation.converted[i], evaluation.handed[i] = stream.run(converted, evaluation.converted[i], evaluation.handed[i], handoff)
        if progress_file is not None:
            save_atomic({"next": idx + 1, "evaluations": evaluations, "methods": {m.name: m.resume_state() for m in methods}}, progress_file)
        del layer, converted, ctx
    return evaluations


def finish_perplexity(run: Run, evaluation: Evaluation) -> tuple[PerplexityResult, PerplexityResult]:
    """Perplexities of original and converted (its head as saved), NLL summed over all processes' windows."""
    sums = torch.zeros(3, dtype=torch.float64)  # original NLL, converted NLL, tokens
    sums[2] = sum(len(ids) - 1 for ids in evaluation.ids)
    for i, (states, dtype) in enumerate(((evaluation.original, None), (evaluation.converted, run.saved_dtype))):
        norm, lm_head = run.stream.head(dtype)  # one head at a time: a tied lm_head is the whole embedding matrix
        with torch.no_grad():
            sums[i] = sum(token_nll(norm, lm_head, hidden[0], ids)[0] for ids, hidden in zip(evaluation.ids, states))
        del norm, lm_head
    run.processes.sum(sums)
    tokens, context = int(sums[2]), run.options.eval_context
    return tuple(PerplexityResult(math.exp(sums[i].item() / tokens), tokens, context, context) for i in (0, 1))


def selection_scorer(run: Run, selection_ids: torch.Tensor):
    """Perplexity of a candidate plan (methods planned alone) on calibration text that no fit saw; [] = original."""
    cache: dict = {}

    def score(methods: list[Method]) -> float:
        if not methods and "original" in cache:
            return cache["original"]
        evaluation = convert_pass(run, methods, [new_evaluation(run, selection_ids, None)], work=None)[0]
        original, converted = finish_perplexity(run, evaluation)
        cache["original"] = original.perplexity
        return converted.perplexity

    return score



# ------------------------------------------------------------------------------------------------------ steps
def calibrate(run: Run, methods: list[Method]) -> None:
    """Step: the streamed forward pass, and the backward pass when a method needs gradients."""
    with run.step("calibrate: forward"):
        forward_pass(run, methods)
    if any(m.needs_gradients for m in methods):
        with run.step("calibrate: backward"):
            backward_pass(run, methods)


def plan(run: Run, methods: list[Method]) -> None:
    """Step: every method plans; a plan may be scored by streaming it over the selection tokens."""
    with run.step("plan"):
        selection_ids = run.streams.selection_ids
        planner = Planner(
            run.stream.config, run.stream.num_layers, selection_scorer(run, selection_ids),
            {"tokens": len(selection_ids), "context": run.options.eval_context},
        )
        for method in methods:
            method.plan(planner)


@dataclass(frozen=True)
class Converted:
    """The converted model as files, and how it scores against the original on every evaluation text."""

    config: object  # the converted model's config: the methods' entries, the saved dtype
    work: Path  # the convert pass's directory in the calibration cache: its layer files, then rest.safetensors
    layers_dir: Path  # where the files to write are: `work`, or the finished ones when a finisher trained the model
    layer_files: list[str]  # in both directories
    perplexities: dict[str, tuple[PerplexityResult, PerplexityResult]]  # text -> (original, converted)
    expected_logits: torch.Tensor  # the converted model's logits on the reload prompt: what the written output must give


def convert_layers(run: Run, methods: list[Method]) -> Converted:
    """Step: every layer converted and saved (a rerun resumes at the next one) while the evaluation windows and the
    reload prompt move through the original and the converted layers; then both models' perplexities on each text."""
    options, texts = run.options, run.streams.evaluations
    chosen = [(m.name, m.settings(), m.config_entries()) for m in methods]  # what each method computes and chose
    fingerprints = [tensor_fingerprint(ids) for ids in texts.values()]
    work = run.calib_dir / f"convert-{cache_key(chosen, str(run.saved_dtype), options.eval_tokens, options.eval_context, fingerprints)}"
    prompt = run.streams.reload_prompt
    reload_probe = Evaluation([prompt[0]], run.stream.embed([prompt]), run.stream.embed([prompt], run.saved_dtype), [None])
    with run.step("convert"):
        *evaluations, reload_probe = convert_pass(
            run, methods, [*(new_evaluation(run, ids, options.eval_tokens) for ids in texts.values()), reload_probe], work
        )
    with run.step("validate: perplexity"):
        perplexities = {text: finish_perplexity(run, evaluation) for text, evaluation in zip(texts, evaluations)}
        norm, lm_head = run.stream.head(run.saved_dtype)
        with torch.no_grad():
            expected_logits = (norm(reload_probe.converted[0].to(run.device)) @ lm_head.T).cpu()
        del evaluations, reload_probe, norm, lm_head
    refuse_non_finite(perplexities)
    config = converted_config(run.source_config, merged_config_entries(methods))
    config.dtype = run.saved_dtype
    layer_files = [f"layer-{i:05d}.safetensors" for i in range(run.stream.num_layers)] + ["rest.safetensors"]
    return Converted(config, work, work, layer_files, perplexities, expected_logits)
