"""The conversion driver: fetch -> calibrate -> plan -> convert -> finish -> validate -> write -> card -> push.

There is one path. Decoder layers are always streamed: built one at a time from the source's safetensors (a GGUF is
dequantised once into the cache), onloaded to the device for their statistics, fits and conversion, and offloaded;
hidden states live on disk in the calibration cache. Steps that need a whole model (probe, speed, distillation)
run when it fits in memory (`wholemodel.py`). The methods (methods.py) plug in at fixed points of three streamed
passes; the driver never names one:

1. forward   embeddings -> every layer's input hidden state (saved per layer: a rerun resumes), methods observe
2. backward  only if a method needs gradients: dL/dh from the final norm + lm_head, then layer by layer, with the
             methods' linear statistics hooked in; the per-layer results are saved as they are computed
3. convert   each method plans (and may score candidate plans by streaming them), then per layer every method
             applies its change; the layer is saved (a rerun resumes at the next layer) and the evaluation windows
             move through the original and the converted layer, so perplexity needs no whole model

Data parallel under `accelerate launch --num_processes K`: each process holds N/K calibration sequences and its
share of the evaluation windows; statistics and log-likelihoods are all-reduced, the methods' calibration inputs
all-gathered, and only the main process writes files.
"""

import math
import shlex
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from . import __version__
from .atomic import save_atomic
from .build import (
    cast_floating,
    converted_config,
    count_parameters,
    refuse_existing_output,
    save_companion_files,
    write_output_dir,
)
from .calibrate import cache_key, code_fingerprint, new_linear_stats, tensor_fingerprint, track_linear_stats
from .card import carry_licence, write_card
from .checkpoint import Checkpoint, check_checkpoint, open_checkpoint, pack_shards, save_tensors
from .config import ConvertOptions, resolve_device
from .distill import DistillData
from .errors import GATE_FAILED_EXIT, HfcompressError
from .memory import peak_memory, return_freed_memory
from .methods import LayerContext, Method, Planner
from .peers import log_verdict
from .plots import write_plots
from .preflight import check_distill_context, check_output, check_push_target, check_run_disk, check_source, output_lock
from .progress import console, progress_bar
from .push import push_folder, require_token
from .registry import build_methods
from .report import Report, Validation
from .source import ResolvedSource, load_tokenizer, resolve_source, source_identity
from .speed import hardware_description
from .stream import LayerStream, Processes, token_nll
from .text import chunk, hub_dataset, other_domain_ids, prefixed, text_streams, window_prefix
from .validate import PerplexityResult, verify_written
from .quantize import quantize_written, reloaded_logits
from .wholemodel import WholeModelSteps

SELECTION_TOKENS = 2048  # calibration-text tokens after the sequences: score candidate plans
RELOAD_PROBE_TOKENS = 256  # prompt whose logits the reloaded output must reproduce
OUTPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def output_dtype(requested: str, source: ResolvedSource, source_config) -> torch.dtype:
    """The saved weights' dtype: as requested, or for "auto" the dtype the source checkpoint declares (a GGUF
    declares none: its dequantised weights are saved as bfloat16, the dtype Llama checkpoints ship in)."""
    if requested != "auto":
        return OUTPUT_DTYPES[requested]
    if source.gguf_file:
        return torch.bfloat16
    declared = getattr(source_config, "dtype", None) or getattr(source_config, "torch_dtype", None) or torch.float32
    declared = getattr(torch, declared) if isinstance(declared, str) else declared
    return declared if declared in OUTPUT_DTYPES.values() else torch.float32


def versions() -> dict:
    import huggingface_hub
    import transformers

    return {
        "hfcompress": __version__,
        "transformers": transformers.__version__,
        "huggingface_hub": huggingface_hub.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


@dataclass
class TokenStreams:
    calib_ids: torch.Tensor  # the calibration text's ids (distillation draws its windows from all of them)
    calib_name: str
    sequences: torch.Tensor  # (N, T) calibration sequences from its start
    selection_ids: torch.Tensor  # up to SELECTION_TOKENS calibration-text ids after the sequences
    evaluations: dict[str, torch.Tensor]  # held-out text name -> ids: the calibration domain first, then another domain
    prefix: list[int]  # in front of every window: [BOS] where the tokenizer starts texts with it (text.window_prefix)


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
    return TokenStreams(calib_ids, calib_name, sequences, selection_ids, evaluations, prefix)


def windows(ids: torch.Tensor, context: int, max_tokens: int | None = None, prefix: list[int] = ()) -> list[torch.Tensor]:
    """Disjoint windows of `context` tokens (`prefix`, then text), as validate.perplexity scores them by default."""
    ids = ids[:max_tokens] if max_tokens else ids
    if len(ids) < 2:
        raise HfcompressError("The evaluation text has fewer than two tokens.")
    body = context - len(prefix)
    return [prefixed(list(prefix), ids[begin : begin + body]) for begin in range(0, max(1, len(ids) - (0 if prefix else 1)), body)]


@dataclass
class Evaluation:
    """Token windows moving through the original and the converted layers, in step."""

    ids: list[torch.Tensor]  # this process's windows
    original: list[torch.Tensor]  # hidden states (1, T, d) on the CPU
    converted: list[torch.Tensor]
    handed: list  # what each window's converted layer hands to the next one


class Run:
    """One conversion's shared state: options, stream, processes, where its files go, timings."""

    def __init__(self, options: ConvertOptions, argv: list[str] | None) -> None:
        self.options = options
        self.command = shlex.join(["hfcompress", *(argv if argv is not None else sys.argv[1:])])
        self.started = time.perf_counter()
        self.timings: dict[str, float] = {}
        self.peaks: dict[str, float] = {}  # running peak RSS after each step: which step set the peak
        self.processes = Processes()
        self.device = resolve_device(options.device, self.processes.state.local_process_index)
        self.stream: LayerStream | None = None
        self.sequences: torch.Tensor | None = None  # this process's calibration sequences
        self.prefix: list[int] = []  # in front of every window (TokenStreams.prefix)
        self.calib_dir: Path | None = None
        self.saved_dtype = torch.float32

    @contextmanager
    def step(self, name: str):
        console.log(f"[bold cyan]{name}[/]")
        start = time.perf_counter()
        yield
        self.timings[name] = round(time.perf_counter() - start, 2)
        self.peaks[name] = peak_memory()["peak_rss_mb"]

    def process_dir(self, directory: Path) -> Path:
        path = directory / f"process{self.processes.index}-of-{self.processes.count}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def hidden_dir(self) -> Path:
        return self.process_dir(self.calib_dir / "hidden")

    def hidden(self, idx: int) -> torch.Tensor:
        return torch.load(self.hidden_dir / f"hidden-{idx}.pt")

    def bind(self, methods: list[Method]) -> None:
        """Give every method its own directory, keyed by the settings that change what it computes."""
        for method in methods:
            method.store = self.calib_dir / f"{method.name}-{cache_key(method.calibration_settings())}"
            method.store.mkdir(parents=True, exist_ok=True)

    def context(self, idx: int, layer: torch.nn.Module, hidden: torch.Tensor) -> LayerContext:
        """The LayerContext of layer idx, whose input hidden states (this process's) are `hidden`."""
        stream, processes, cache = self.stream, self.processes, {}

        def attention_input() -> torch.Tensor:
            if "x" not in cache:
                with torch.no_grad():
                    parts = [layer.input_layernorm(hidden[i : i + stream.batch_size].to(self.device)) for i in range(0, len(hidden), stream.batch_size)]
                cache["x"] = processes.gather(torch.cat(parts))
            return cache["x"]

        def hidden_input() -> torch.Tensor:
            return processes.gather(hidden.to(self.device))

        def previous() -> LayerContext | None:
            if idx == 0:
                return None
            return self.context(idx - 1, stream.original_layer(idx - 1), self.hidden(idx - 1))

        return LayerContext(
            index=idx, num_layers=stream.num_layers, layer=layer, device=self.device, attention_input=attention_input,
            cos_sin=lambda seq_len: stream.cos_sin(seq_len, idx), previous=previous, is_main=processes.is_main,
            hidden_input=hidden_input,
        )


# ----------------------------------------------------------------------------------------------------- passes
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
        ctx = run.context(idx, layer, hidden)
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
    config = stream.layer_config({k: v for m in methods for k, v in m.config_entries().items()})
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


def refuse_non_finite(results: dict[str, tuple[PerplexityResult, PerplexityResult]]) -> None:
    for text, pair in results.items():
        for name, ppl in zip(("source", "converted"), pair):
            if not math.isfinite(ppl.perplexity):  # NaN would slip through the gate comparison as "failed"
                raise HfcompressError(
                    f"The {name} model's perplexity is {ppl.perplexity} on {text.split(' (')[0]} (NaN/inf logits): its "
                    "weights overflow; nothing was written."
                )


def quality_gate(results: dict[str, tuple[PerplexityResult, PerplexityResult]], limit: float) -> tuple[list[dict], bool, str]:
    """Per text {eval_text, original, converted, perplexity_increase_pct}; passed when every text is within `limit`."""
    rows = [
        {"eval_text": text, "original": original.to_dict(), "converted": converted.to_dict(),
         "perplexity_increase_pct": 100.0 * (converted.perplexity / original.perplexity - 1.0)}
        for text, (original, converted) in results.items()
    ]
    passed = all(row["perplexity_increase_pct"] <= limit for row in rows)
    message = "; ".join(
        f"perplexity on {row['eval_text'].split(' (')[0]} {row['original']['perplexity']:.3f} -> "
        f"{row['converted']['perplexity']:.3f} ({row['perplexity_increase_pct']:+.2f}%)" for row in rows
    )
    return rows, passed, f"{message}; limit +{limit:g}% on each"


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


# ------------------------------------------------------------------------------------------------------ driver
@dataclass
class Fetched:
    source: ResolvedSource
    tokenizer: object
    checkpoint: Checkpoint
    source_config: object
    streams: TokenStreams


def fetch(run: Run, methods: list[Method], token: str | None = None) -> Fetched:
    """Step 1: resolve and check the source, tokenise the texts, set up the stream and the methods' cache."""
    options, processes = run.options, run.processes
    source = resolve_source(options.source, options.revision, token, options.trust_remote_code)
    check_source(options, source)  # sequence lengths vs. the context, disk for a GGUF's dequantising: before both
    tokenizer = load_tokenizer(source)
    checkpoint, source_config = open_checkpoint(source, options.cache_dir)
    options.check_against_model(source_config)
    for method in methods:
        method.check_model(source_config)
    check_checkpoint(checkpoint, source_config)
    streams = token_streams(options, tokenizer)
    sequences = streams.sequences
    if int(max(ids.max() for ids in (streams.calib_ids, *streams.evaluations.values()))) >= source_config.vocab_size:
        raise HfcompressError(f"The tokenizer of {source.name} makes ids beyond the model's vocabulary ({source_config.vocab_size}).")
    if len(sequences) % processes.count:
        raise HfcompressError(f"--calib-sequences {len(sequences)} must be a multiple of the {processes.count} processes.")
    run.saved_dtype = output_dtype(options.dtype, source, source_config)
    run.prefix = streams.prefix
    run.stream = LayerStream(source_config, checkpoint, run.device)
    share = len(sequences) // processes.count
    run.sequences = sequences[processes.index * share : (processes.index + 1) * share]
    run.calib_dir = options.cache_dir / cache_key(source_identity(source), tensor_fingerprint(sequences), code_fingerprint())
    run.bind(methods)
    return Fetched(source, tokenizer, checkpoint, source_config, streams)


def calibrate(run: Run, methods: list[Method]) -> None:
    """Step 2: the streamed forward pass, and the backward pass when a method needs gradients."""
    with run.step("calibrate: forward"):
        forward_pass(run, methods)
    if any(m.needs_gradients for m in methods):
        with run.step("calibrate: backward"):
            backward_pass(run, methods)


def convert(options: ConvertOptions, argv: list[str] | None = None) -> Report:
    """Run the whole conversion; returns the report. Raises HfcompressError on bad input or a failed gate push.
    What needs no model is checked first (preflight.py: --out against the source and caches, writable), and the main
    process holds --out's lock until the end, push included: a second run into the same --out is refused at once."""
    options.validate()
    out_dir = check_output(options)
    with output_lock(out_dir) if Processes().is_main else nullcontext():
        return _convert(options, argv)


def _convert(options: ConvertOptions, argv: list[str] | None) -> Report:
    return_freed_memory()
    run = Run(options, argv)
    processes = run.processes
    token = require_token() if options.push_to and processes.is_main else None  # before an hour of work, not after
    out_dir = refuse_existing_output(Path(options.out).expanduser().resolve(), options.overwrite)
    if token:
        check_push_target(options.push_to, token, out_dir)  # reachable, token valid and can write: before the work
    torch.manual_seed(options.seed)
    methods, finishers = build_methods(options)
    active = [m for m in methods if m.active()]

    with run.step("fetch"):
        fetched = fetch(run, methods, token)
    check_run_disk(run, active, out_dir)  # free space for what the run will still write, before calibration
    source, tokenizer, checkpoint, source_config = fetched.source, fetched.tokenizer, fetched.checkpoint, fetched.source_config
    streams = fetched.streams
    sequences, selection_ids, texts = streams.sequences, streams.selection_ids, streams.evaluations
    eval_ids = next(iter(texts.values()))  # the calibration domain's held-out text
    whole = WholeModelSteps.decide(options, checkpoint, finishers, run.device)
    check_distill_context(options, source_config)  # windows within the context, before calibration

    calibrate(run, active)

    with run.step("plan"):
        planner = Planner(
            run.stream.config, run.stream.num_layers, selection_scorer(run, selection_ids),
            {"tokens": len(selection_ids), "context": options.eval_context},
        )
        for method in active:
            method.plan(planner)

    plan = [(m.name, m.settings(), m.config_entries()) for m in active]  # what each method computes and chose
    fingerprints = [tensor_fingerprint(ids) for ids in texts.values()]
    work = run.calib_dir / f"convert-{cache_key(plan, str(run.saved_dtype), options.eval_tokens, options.eval_context, fingerprints)}"
    # long enough for RoPE errors to show
    probe_ids = prefixed(run.prefix, eval_ids[: min(RELOAD_PROBE_TOKENS, len(eval_ids)) - len(run.prefix)]).unsqueeze(0)
    reload_probe = Evaluation([probe_ids[0]], run.stream.embed([probe_ids]), run.stream.embed([probe_ids], run.saved_dtype), [None])
    with run.step("convert"):
        *evaluations, reload_probe = convert_pass(
            run, active, [*(new_evaluation(run, ids, options.eval_tokens) for ids in texts.values()), reload_probe], work
        )
    with run.step("validate: perplexity"):
        perplexities = {text: finish_perplexity(run, evaluation) for text, evaluation in zip(texts, evaluations)}
        norm, lm_head = run.stream.head(run.saved_dtype)
        with torch.no_grad():
            expected_logits = (norm(reload_probe.converted[0].to(run.device)) @ lm_head.T).cpu()
        del evaluations, reload_probe, norm, lm_head
    refuse_non_finite(perplexities)

    entries = {k: v for m in active for k, v in m.config_entries().items()}
    config = converted_config(source_config, entries)
    config.dtype = run.saved_dtype
    layer_files = [f"layer-{i:05d}.safetensors" for i in range(run.stream.num_layers)] + ["rest.safetensors"]
    if processes.is_main:
        rest = [k for k in checkpoint.files if not k.startswith("model.layers.") and not (source_config.tie_word_embeddings and k == "lm_head.weight")]
        save_tensors({k: v.to(run.saved_dtype) for k, v in checkpoint.load(rest).items()}, work / "rest.safetensors")
    processes.wait()

    finished, probe, speed, peers, layers_dir = {}, {}, None, None, work
    if processes.is_main:
        distill_data = DistillData(streams.calib_ids, texts, options.eval_context, work, options.seed, streams.prefix)
        results = whole.run(run, checkpoint, source_config, config, work, layer_files, tokenizer, distill_data, probe_ids)
        finished, probe, speed, layers_dir = results.finished, results.probe, results.speed, results.layers_dir
        peers = results.peers
        if results.converted_perplexity:  # a finisher changed the weights: score the result again
            perplexities = {text: (perplexities[text][0], ppl) for text, ppl in results.converted_perplexity.items()}
            expected_logits = results.expected_logits
            refuse_non_finite(perplexities)
    gate_rows, gate_passed, gate_message = quality_gate(perplexities, options.max_ppl_increase)
    for row in gate_rows:  # the Hub dataset split a text is (id, config, split, revision), for the card's model-index
        row["dataset"] = hub_dataset(row["eval_text"])
    main_row = gate_rows[0]
    if peers is not None:
        converted_ppl = {text: pair[1].perplexity for text, pair in perplexities.items()}
        peers["dominated_by"] = [peer["name"] for peer in log_verdict(peers, converted_ppl)]
    report = Report(
        versions=versions(), command=run.command, source=source.to_dict(), num_layers=run.stream.num_layers,
        hardware=hardware_description(run.device), device=str(run.device), processes=processes.count,
        calibration={"text": streams.calib_name, "sequences": len(sequences), "seq_len": int(sequences.shape[1]),
                     "tokens": int(sequences.numel()), "text_tokens": len(streams.calib_ids), "cache_dir": str(run.calib_dir),
                     "dataset": hub_dataset(streams.calib_name)},
        methods={m.name: m.report() for m in methods}, finishers=finished,
        validation=Validation(
            eval_text=main_row["eval_text"], original=main_row["original"], converted=main_row["converted"],
            perplexity_increase_pct=main_row["perplexity_increase_pct"], max_ppl_increase_pct=options.max_ppl_increase,
            gate_passed=gate_passed, gate_message=gate_message, probe=probe, texts=gate_rows,
        ),
        speed=speed, peers=peers, dtype=str(run.saved_dtype).removeprefix("torch."), max_shard_size=options.max_shard_size,
        whole_model_steps=whole.describe(), timings=run.timings,
    )
    if not processes.is_main:
        return report
    repo_id = options.push_to or out_dir.name
    original_sizes = {k: math.prod(shape) for k, shape in checkpoint.shapes.items() if not (source_config.tie_word_embeddings and k == "lm_head.weight")}

    def write(directory: Path) -> None:
        from transformers import GenerationConfig

        sizes = pack_shards(layers_dir, directory, layer_files, options.max_shard_bytes)
        report.parameters = {"original": count_parameters(original_sizes), "converted": count_parameters(sizes)}
        config.save_pretrained(directory)
        generation = Path(source.path) / "generation_config.json"
        generation_config = (  # a GGUF or a directory without one: the config's special tokens
            GenerationConfig.from_pretrained(source.path) if generation.is_file() else GenerationConfig(
                **{k: getattr(source_config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if getattr(source_config, k, None) is not None}
            )
        )
        save_companion_files(tokenizer, generation_config, directory)
        expected = expected_logits
        if options.quantize.weights != "none":  # the written weights become torchao's (quantize.py); reload checks those
            with run.step(f"quantize weights: {options.quantize.weights}"):
                quantize_written(directory, options.quantize.weights, options.max_shard_size)
                expected = reloaded_logits(directory, probe_ids)
        with run.step("validate: fresh-process reload"):
            report.validation.reload = verify_written(directory, probe_ids, expected, 4 * sum(sizes.values()))
        if options.quantize.weights != "none":
            report.validation.reload["quantized_weights"] = options.quantize.weights
            report.validation.reload["max_abs_logit_diff_to_unquantized"] = (expected - expected_logits).abs().max().item()
        report.plots = write_plots(report.to_dict(), directory / "plots")
        report.wall_seconds = round(time.perf_counter() - run.started, 1)
        report.memory = {**peak_memory(), "peak_rss_mb_after_step": run.peaks}
        report.licence = carry_licence(report.source, directory, options.licence_files)
        write_card(report.to_dict(), repo_id, directory)
        report.save(directory)

    with run.step("write"):
        out_dir = write_output_dir(out_dir, options.overwrite, write)
    shutil.rmtree(work, ignore_errors=True)  # the layer files are in the output now; the calibration cache stays
    if report.parameters["converted"]["total"] == report.parameters["original"]["total"]:  # not "+0.00%" as if it had
        console.log(f"wrote {out_dir}: nothing was converted (no layer was shared or factorised), so it computes what "
                    "the source does: " + "; ".join(f"perplexity on {row['eval_text'].split(' (')[0]} "
                                                    f"{row['converted']['perplexity']:.3f}" for row in gate_rows), highlight=False)
    else:
        console.log(f"wrote {out_dir}: {gate_message}; peak memory {report.memory['peak_rss_mb']:.0f} MB")
    return publish(report, options, out_dir, token, run)


def publish(report: Report, options: ConvertOptions, out_dir: Path, token: str | None, run: Run) -> Report:
    """Push when asked and the gate passed (or --force); a failed gate is exit code 3 once the output is written."""
    validation = report.validation
    if options.push_to:
        if not validation.gate_passed and not options.force:
            raise HfcompressError(
                f"Not pushing to {options.push_to}: the quality gate failed ({validation.gate_message}); the model is "
                f"in {out_dir}. Raise --max-ppl-increase or pass --force to push anyway.",
                exit_code=GATE_FAILED_EXIT,
            )
        with run.step("push"):
            url = push_folder(
                out_dir, options.push_to, token, options.private, f"hfcompress: {validation.gate_message}",
                force=not validation.gate_passed,
            )
        report.push = {"repo_id": options.push_to, "commit_url": url}
        console.log(f"pushed {options.push_to}: {url}")
    elif not validation.gate_passed:
        raise HfcompressError(
            f"The quality gate failed ({validation.gate_message}); the model was written to {out_dir} but is marked as failed.",
            exit_code=GATE_FAILED_EXIT,
        )
    return report
