"""Layer-by-layer conversion (`convert --layer-by-layer`) for models larger than memory, optionally data-parallel.

Only one decoder layer's weights are in memory at a time: they are read from the safetensors shards with
`safe_open` (only that layer's keys) into a LisaLlama decoder layer built on the meta device, computed in float32.
The calibration activations (N x T x d per layer) live on disk in the work directory. Four passes:

1. forward   embeddings -> every layer's input hidden state (saved) and its attention similarity to the layer below
             (lisa.layer_similarity).
2. backward  FASC only: the final norm + lm_head loss gives dL/dh_L; for l = L-1 .. 0 the layer is reloaded, its
             forward recomputed from the saved input with calibrate.py's C/G hooks, and dL/dh_l backpropagated.
             Each layer's factorisations (fasc.decompose, cut at the break-even rank) and spectra go to disk.
3. convert   the shared layers (lisa.select_layers) and the FASC ranks (fasc.plan_ranks) from all layers'
             summaries; then per layer: fit its LISA module on the saved inputs anchored on the converted layer
             below (as lisa.fit_lisa does), assemble and save its converted weights (one file per layer: a rerun
             resumes at the next layer), and move the evaluation windows through the original and the converted
             layer, so perplexity needs no whole model either.
4. write     the layer files are packed into shards of at most --max-shard-size (+ model.safetensors.index.json) in
             the atomically written output directory, with config, remote code, tokenizer, card and report.

Data parallel: under `accelerate launch --num_processes K`, each process holds N/K calibration sequences and its
share of the evaluation windows; the C/G sums, token counts and negative log-likelihoods are all-reduced, the
inputs of the similarity measure and of the LISA fits are all-gathered (so every process fits the same modules), and
only the main process writes files. The processes share the work directory, so they must run on one machine.
"""

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from .build import converted_config, converted_state, count_parameters, lisa_spec, refuse_existing_output, save_companion_files, write_output_dir
from .calibrate import LinearStats, RHO_PROBES, cache_key, new_linear_stats, tensor_fingerprint, track_linear_stats
from .errors import HfcompressError
from .fasc import Decomposition, decompose, dependence_violation, layer_result, plan_ranks, trusted_layers
from .lisa import SIMILARITY_SEQUENCES, causal_mask, converted_scores, fit_shared_layer, layer_similarity, lowrank_rank, select_layers
from .memory import peak_memory, return_freed_memory
from .progress import console, progress_bar
from .remote import import_remote
from .source import ResolvedSource, load_tokenizer, resolve_source
from .speed import hardware_description
from .validate import PerplexityResult, reload_in_fresh_process

RELOAD_MEMORY_FRACTION = 0.4  # the fresh-process reload (float32, whole model) runs only if it needs less of the free RAM


def _available_memory() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


class Processes:
    """This process's place among the data-parallel processes accelerate started (one process without it)."""

    def __init__(self) -> None:
        from accelerate import PartialState

        self.state = PartialState(cpu=True)  # gloo: every tensor here lives on the CPU
        self.count, self.index, self.is_main = self.state.num_processes, self.state.process_index, self.state.is_main_process

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.count > 1:
            torch.distributed.all_reduce(tensor)
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenation of every process's tensor along dim 0, in process order (all have the same shape)."""
        if self.count == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.count)]
        torch.distributed.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def first_missing(self, paths: list[Path]) -> int:
        """Index of the first path this process has not written, agreed on by all processes (their minimum)."""
        local = next((i for i, p in enumerate(paths) if not p.is_file()), len(paths))
        if self.count == 1:
            return local
        agreed = torch.tensor(local)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        return int(agreed)

    def wait(self) -> None:
        self.state.wait_for_everyone()


class Checkpoint:
    """The source's tensors by name, read one group at a time from its safetensors files (sharded or not)."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.directory = directory
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            self.files = json.loads(index.read_text())["weight_map"]
        else:
            self.files = {}
            for path in sorted(directory.glob("*.safetensors")):
                with safe_open(path, "pt") as handle:
                    self.files.update({key: path.name for key in handle.keys()})

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        missing = [n for n in names if n not in self.files]
        if missing:
            raise HfcompressError(f"{self.directory} lacks the weights {missing[:3]}: the checkpoint is incomplete.")
        tensors = {}
        for file in sorted({self.files[n] for n in names}):
            with safe_open(self.directory / file, "pt") as handle:
                tensors.update({n: handle.get_tensor(n) for n in names if self.files[n] == file})
        return tensors


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors file written under a temporary name and renamed: a file that exists is complete."""
    from safetensors.torch import save_file

    tmp = path.with_suffix(".partial")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"format": "pt"})
    tmp.replace(path)


def save_atomic(value, path: Path) -> None:
    tmp = path.with_suffix(".partial")
    torch.save(value, tmp)
    tmp.replace(path)


class Stream:
    """Builds decoder layers from tensors and runs hidden states through them in batches."""

    def __init__(self, source_config, checkpoint: Checkpoint, batch_size: int) -> None:
        self.modeling = import_remote("modeling_lisa_llama")
        self.source_config = source_config
        self.config = self.layer_config({}, {})  # the original model, in LisaLlama classes
        self.checkpoint = checkpoint
        self.batch_size = batch_size
        self.rotary_emb = self.modeling.LlamaRotaryEmbedding(config=self.config)
        self.num_layers = self.config.num_hidden_layers
        with torch.device("meta"):
            self.layer_keys = list(self.modeling.LisaLlamaDecoderLayer(self.config, 0).state_dict())

    def layer_config(self, lisa: dict[str, dict], fasc_ranks: dict[str, int]):
        """Converted config for building layers here; SDPA reads the explicit additive mask `run` passes."""
        config = converted_config(self.source_config, lisa, fasc_ranks)
        config._attn_implementation = "sdpa"
        return config

    def original_state(self, idx: int) -> dict[str, torch.Tensor]:
        return self.checkpoint.load([f"model.layers.{idx}.{key}" for key in self.layer_keys])

    def build(self, config, idx: int, state: dict[str, torch.Tensor]) -> nn.Module:
        """Decoder layer `idx` of `config` holding `state` (full key names), in float32."""
        with torch.device("meta"):
            layer = self.modeling.LisaLlamaDecoderLayer(config, idx)
        prefix = f"model.layers.{idx}."
        layer.load_state_dict({k.removeprefix(prefix): v.float() for k, v in state.items()}, assign=True)
        return layer.eval().requires_grad_(False)

    def original_layer(self, idx: int) -> nn.Module:
        return self.build(self.config, idx, self.original_state(idx))

    def cos_sin(self, seq_len: int):
        positions = torch.arange(seq_len).unsqueeze(0)
        return self.rotary_emb(torch.zeros(1, seq_len, 1), position_ids=positions)

    def run(self, layer: nn.Module, hidden: torch.Tensor, prev: torch.Tensor | None = None, handoff: str | None = None):
        """(layer output, what it hands to the next layer) for a batch of sequences of one length. The explicit
        additive causal mask serves every attention backend; handoff "scores" materialises the layer's scores."""
        seq_len = hidden.shape[1]
        mask, cos_sin, positions = causal_mask(seq_len), self.cos_sin(seq_len), torch.arange(seq_len).unsqueeze(0)
        outputs, passed = [], []
        for start in range(0, len(hidden), self.batch_size):
            part = slice(start, start + self.batch_size)
            out, handed = layer(
                hidden[part], attention_mask=mask, additive_mask=mask, position_ids=positions.expand(len(hidden[part]), -1),
                position_embeddings=cos_sin, prev=None if prev is None else prev[part], handoff=handoff,
            )
            outputs.append(out)
            passed.append(handed)
        return torch.cat(outputs), torch.cat(passed) if handoff else None

    def head(self) -> tuple[nn.Module, torch.Tensor]:
        """(final norm, lm_head weight) in float32; a tied lm_head is the embedding matrix."""
        tied = self.config.tie_word_embeddings
        names = ["model.norm.weight", "model.embed_tokens.weight" if tied else "lm_head.weight"]
        tensors = self.checkpoint.load(names)
        norm = self.modeling.LlamaRMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
        norm.weight.data = tensors[names[0]].float()
        return norm.requires_grad_(False), tensors[names[1]].float()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.checkpoint.load(["model.embed_tokens.weight"])["model.embed_tokens.weight"].float())


NLL_CHUNK = 128  # positions per lm_head product: the logits of a whole sequence (T x vocab) are never held


def token_nll(
    norm: nn.Module, lm_head: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor, with_grad: bool = False
) -> tuple[float, torch.Tensor | None]:
    """Summed next-token negative log-likelihood of one sequence (T, d) as calibrate.py and validate.py compute it,
    and (with_grad) its gradient with respect to `hidden`; computed a chunk of positions at a time
    (each position's loss depends on its own hidden state only)."""
    total, grads = 0.0, []
    for start in range(0, len(ids) - 1, NLL_CHUNK):
        end = min(start + NLL_CHUNK, len(ids) - 1)
        part = hidden[start:end].detach().requires_grad_(with_grad)
        with torch.set_grad_enabled(with_grad):
            loss = nn.functional.cross_entropy((norm(part) @ lm_head.T).float(), ids[start + 1 : end + 1], reduction="sum")
            if with_grad:
                grads.append(torch.autograd.grad(loss, part)[0])
        total += loss.item()
    if not with_grad:
        return total, None
    return total, torch.cat([*grads, torch.zeros_like(hidden[-1:])])  # the last position predicts nothing


@dataclass
class Run:
    """One layer-by-layer conversion: its settings, where its files go, and this process's share of the data."""

    options: object  # ConvertOptions
    stream: Stream
    processes: Processes
    sequences: torch.Tensor  # this process's calibration sequences
    calib_dir: Path  # hidden states, similarity (per process), FASC statistics (per process for gradients)
    saved_dtype: torch.dtype

    def process_dir(self, directory: Path) -> Path:
        path = directory / f"process{self.processes.index}-of-{self.processes.count}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def hidden_dir(self) -> Path:
        return self.process_dir(self.calib_dir)

    def hidden(self, idx: int) -> torch.Tensor:
        return torch.load(self.hidden_dir / f"hidden-{idx}.pt")


def forward_pass(run: Run) -> list:
    """Saves every layer's input hidden states and returns each layer's similarity to the one below (None for 0)."""
    stream, processes = run.stream, run.processes
    marks = [run.hidden_dir / f"similarity-{idx}.pt" for idx in range(stream.num_layers)]
    start = processes.first_missing(marks)
    if start < stream.num_layers:
        _forward_from(run, start, marks)
    return [torch.load(mark, weights_only=False) for mark in marks]


def _forward_from(run: Run, start: int, marks: list[Path]) -> None:
    stream, processes = run.stream, run.processes
    previous = None
    if start == 0:
        hidden = stream.embed(run.sequences)
        save_atomic(hidden, run.hidden_dir / "hidden-0.pt")
    else:  # resume: the layer below hands its scores to the first layer still to do
        hidden = run.hidden(start)
        layer = stream.original_layer(start - 1)
        x = processes.gather(layer.input_layernorm(run.hidden(start - 1)))[:SIMILARITY_SEQUENCES]
        _, previous = layer_similarity(start - 1, layer.self_attn, x, stream.cos_sin(x.shape[1]), None)
    with torch.no_grad():
        for idx in progress_bar(range(start, stream.num_layers), "calibrate: forward, layer by layer", total=stream.num_layers - start):
            layer = stream.original_layer(idx)
            x = processes.gather(layer.input_layernorm(hidden))[:SIMILARITY_SEQUENCES]
            similarity, previous = layer_similarity(idx, layer.self_attn, x, stream.cos_sin(x.shape[1]), previous)
            hidden, _ = stream.run(layer, hidden)
            if not torch.isfinite(hidden).all():
                raise HfcompressError(f"Layer {idx} produced NaN/inf activations on the calibration text; its weights are broken.")
            save_atomic(hidden, run.hidden_dir / f"hidden-{idx + 1}.pt")
            save_atomic(similarity, marks[idx])
            del layer


def _probe_generator_states(stream: Stream, targets: tuple[str, ...], seed: int) -> list[torch.Tensor]:
    """The rho-probe generator's state at the start of every layer, as if all layers' probes were drawn in order
    (calibrate.collect_linear_stats' order), so the streamed backward draws the same probes layer by layer."""
    with torch.device("meta"):
        layer = stream.modeling.LisaLlamaDecoderLayer(stream.config, 0)
    shapes = [(layer.get_submodule(t).in_features, layer.get_submodule(t).out_features) for t in targets]
    generator, states = torch.Generator().manual_seed(seed), []
    for _ in range(stream.num_layers):
        states.append(generator.get_state())
        for n, m in shapes:
            torch.randn(n, RHO_PROBES, generator=generator, dtype=torch.float64)
            torch.randn(m, RHO_PROBES, generator=generator, dtype=torch.float64)
    return states


def _sum_stats(stats: dict[str, LinearStats], processes: Processes) -> None:
    for entry in stats.values():
        entry.extra.clear()
        for name in ("xx", "gg", "probe_a", "probe_b", "probe_ab"):
            processes.sum(getattr(entry, name))
        entry.tokens = int(processes.sum(torch.tensor(entry.tokens)))


def fisher_pass(run: Run, fasc_dir: Path) -> None:
    """Streamed backward: per layer, C/G statistics -> rho and factorisations on disk (fasc-<l>.pt, factors-<l>.pt)."""
    stream, processes, fasc = run.stream, run.processes, run.options.fasc
    grads_dir = run.process_dir(fasc_dir)
    order = list(reversed(range(stream.num_layers)))
    done = processes.first_missing([grads_dir / f"grad-{idx}.pt" for idx in order])
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
    states = _probe_generator_states(stream, fasc.targets, run.options.seed)
    for idx in progress_bar(order[done:], "calibrate: Fisher statistics, layer by layer", total=len(order) - done):
        layer = stream.original_layer(idx)
        linears = {f"{idx}.{t}": layer.get_submodule(t) for t in fasc.targets}
        stats = new_linear_stats(linears, torch.Generator().set_state(states[idx]))
        hooks = track_linear_stats(linears, stats)
        hidden, new_grad = run.hidden(idx), torch.empty_like(grad)
        try:
            for start in range(0, len(hidden), stream.batch_size):
                part = slice(start, start + stream.batch_size)
                h = hidden[part].clone().requires_grad_(True)
                out, _ = stream.run(layer, h)
                out.backward(grad[part])
                new_grad[part] = h.grad
        finally:
            for hook in hooks:
                hook.remove()
        _sum_stats(stats, processes)
        if processes.is_main:
            _save_factorisations(linears, stats, run, fasc_dir, idx)
        grad = new_grad
        save_atomic(grad, grads_dir / f"grad-{idx}.pt")
        del layer, linears, stats
    processes.wait()


def _save_factorisations(linears: dict[str, nn.Linear], stats: dict[str, LinearStats], run: Run, fasc_dir: Path, idx: int) -> None:
    """rho of every targeted linear of layer idx; for the trusted ones the factorisation, cut at the break-even rank
    (no allocation can give a layer more: it would stay dense), in float32 as the in-memory pipeline holds it."""
    options = run.options.fasc
    rhos = {name: dependence_violation(stats[name]) for name in linears}
    factors, spectra = {}, {}
    for name in sorted(trusted_layers(rhos, options), key=list(linears).index):
        dec = decompose(linears[name].weight, stats[name], options.method)
        m, n = linears[name].weight.shape
        keep = min(len(dec.spectrum), math.ceil(m * n / (m + n)))
        factors[name] = (dec.left[:, :keep].float(), dec.right[:keep].float())
        spectra[name] = dec.spectrum
    shapes = {name: tuple(lin.weight.shape) for name, lin in linears.items()}
    save_atomic(factors, fasc_dir / f"factors-{idx}.pt")
    save_atomic({"rhos": rhos, "shapes": shapes, "spectra": spectra}, fasc_dir / f"fasc-{idx}.pt")


def plan_fasc(run: Run, fasc_dir: Path) -> tuple[dict[str, int | None], list]:
    """Global FASC ranks from every layer's spectrum (the factors stay on disk) and the per-linear report rows."""
    rhos, shapes, spectra = {}, {}, {}
    for idx in range(run.stream.num_layers):
        summary = torch.load(fasc_dir / f"fasc-{idx}.pt")
        rhos.update(summary["rhos"])
        shapes.update(summary["shapes"])
        spectra.update(summary["spectra"])
    # only the spectra drive the allocation: decompositions without their (on-disk) factors
    empty = torch.empty(0)
    decompositions = {name: Decomposition(left=empty, right=empty, spectrum=s) for name, s in spectra.items()}
    ranks = plan_ranks(decompositions, shapes, run.options.fasc)
    results = [layer_result(name, shapes[name], ranks.get(name), rhos[name], decompositions.get(name)) for name in shapes]
    return ranks, results


@dataclass
class Evaluation:
    """Held-out windows moving through the original and the converted layers, and the reload-check prompt."""

    ids: list[torch.Tensor]  # this process's windows
    original: list[torch.Tensor]
    converted: list[torch.Tensor]
    converted_scores: list[torch.Tensor | None]
    probe_ids: torch.Tensor  # (1, T) prompt whose converted logits the reloaded model must reproduce
    probe: torch.Tensor
    probe_scores: torch.Tensor | None = None


def _windows(eval_ids: torch.Tensor, context: int, max_tokens: int | None) -> list[torch.Tensor]:
    """Disjoint windows of `context` tokens: the windows validate.perplexity scores with stride = context."""
    ids = eval_ids[:max_tokens] if max_tokens else eval_ids
    if len(ids) < 2:
        raise HfcompressError("The evaluation text has fewer than two tokens.")
    return [ids[begin : begin + context] for begin in range(0, max(1, len(ids) - 1), context)]


def convert_pass(run: Run, similarity: list, fasc_ranks: dict, fasc_dir: Path | None, work: Path, evaluation: Evaluation):
    """Fit, assemble, save and evaluate every layer in depth order; returns (LISA fit records, qk parameter counts)."""
    stream, processes, options = run.stream, run.processes, run.options
    chosen = select_layers([s for s in similarity if s is not None], stream.num_layers, options.lisa)
    rank = lowrank_rank(stream.config, options.lisa.qk_compression) if chosen and options.lisa.lowrank else 0
    matching = {s.layer: s.matching for s in similarity if s is not None}
    fasc_spec = {name: r for name, r in fasc_ranks.items() if r is not None}
    view = SimpleNamespace(config=stream.config, model=SimpleNamespace(layers={}, rotary_emb=stream.rotary_emb))
    progress_file = run.process_dir(work) / "progress.pt"
    state = torch.load(progress_file, weights_only=False) if progress_file.is_file() else {
        "next": 0, "records": [], "qk_params": [], "prev_scores": None, "evaluation": evaluation
    }
    evaluation = state["evaluation"]
    for idx in progress_bar(range(state["next"], stream.num_layers), "convert: layer by layer", total=stream.num_layers - state["next"]):
        original = stream.original_state(idx)
        layer = stream.build(stream.config, idx, original)
        fitted = []
        if idx in chosen or idx + 1 in chosen:
            x = layer.input_layernorm(processes.gather(run.hidden(idx)))
            module = layer.self_attn
            if idx in chosen:
                view.model.layers = {idx: layer}
                module, record = fit_shared_layer(view, idx, x, state["prev_scores"], matching[idx], rank, options.lisa)
                fitted = [record]
                state["qk_params"].append(
                    sum(v.numel() for k, v in record.state.items() if any(t in k for t in ("q_lowrank", "k_lowrank", "align")))
                )
            prev = state["prev_scores"] if idx in chosen else None
            state["prev_scores"] = converted_scores(module, x, prev, stream.cos_sin(x.shape[1]), options.lisa.batch_size) if idx + 1 in chosen else None
        factors = {}
        if fasc_dir is not None and any(name.startswith(f"{idx}.") for name in fasc_spec):
            stored = torch.load(fasc_dir / f"factors-{idx}.pt")
            factors = {name: Decomposition(a, b, torch.empty(0)).factors(fasc_spec[name]) for name, (a, b) in stored.items() if name in fasc_spec}
        tensors = {k: v.to(run.saved_dtype) for k, v in converted_state(original, fitted, factors).items()}
        if processes.is_main:
            save_tensors(tensors, work / f"layer-{idx:05d}.safetensors")
        records = state["records"] + [replace(r, state={}) for r in fitted]  # the weights are in the layer file now
        config = stream.layer_config(lisa_spec(records), {k: v for k, v in fasc_spec.items() if int(k.split(".")[0]) <= idx})
        _evaluate_layer(stream, layer, stream.build(config, idx, tensors), evaluation, "scores" if idx + 1 in chosen else None)
        state.update(next=idx + 1, records=records)
        save_atomic(state, progress_file)
    return state["records"], state["qk_params"], state["evaluation"]


@torch.no_grad()
def _evaluate_layer(stream: Stream, original: nn.Module, converted: nn.Module, evaluation: Evaluation, handoff: str | None) -> None:
    """One layer of the original and the converted model on the evaluation windows; a layer below a shared one
    hands it its scores (a sparse Align reads them as well as the features the model code would pass)."""
    for i, hidden in enumerate(evaluation.original):
        evaluation.original[i], _ = stream.run(original, hidden)
        evaluation.converted[i], evaluation.converted_scores[i] = stream.run(
            converted, evaluation.converted[i], evaluation.converted_scores[i], handoff
        )
    evaluation.probe, evaluation.probe_scores = stream.run(converted, evaluation.probe, evaluation.probe_scores, handoff)


def finish_evaluation(run: Run, evaluation: Evaluation, context: int) -> tuple[PerplexityResult, PerplexityResult, torch.Tensor]:
    """Perplexities of original and converted (NLL summed over all processes' windows), converted probe logits."""
    norm, lm_head = run.stream.head()
    with torch.no_grad():
        sums = torch.zeros(3, dtype=torch.float64)  # original NLL, converted NLL, tokens
        for ids, original, converted in zip(evaluation.ids, evaluation.original, evaluation.converted):
            nll = [token_nll(norm, lm_head, hidden[0], ids)[0] for hidden in (original, converted)]
            sums += torch.tensor([*nll, len(ids) - 1], dtype=torch.float64)
        logits = norm(evaluation.probe) @ lm_head.T
    run.processes.sum(sums)
    tokens = int(sums[2])
    results = [PerplexityResult(math.exp(sums[i].item() / tokens), tokens, context, context) for i in (0, 1)]
    return results[0], results[1], logits


ELEMENT_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def write_shard(sources: list[Path], dest: Path) -> dict[str, int]:
    """Concatenate safetensors files into one, one tensor in memory at a time; returns {name: numel}.

    Same layout rules as safetensors' own writer: header padded to 8 bytes, tensors by decreasing element size, so
    every tensor starts aligned to its element size and the data has no holes."""
    from safetensors import safe_open

    handles = [safe_open(path, "pt") for path in sources]
    entries = []  # (element bytes, name, handle, dtype, shape)
    for handle in handles:
        for name in handle.keys():
            piece = handle.get_slice(name)
            entries.append((ELEMENT_BYTES[piece.get_dtype()], name, handle, piece.get_dtype(), piece.get_shape()))
    entries.sort(key=lambda e: -e[0])  # stable: keeps each file's order within an element size
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for size, name, _, dtype, shape in entries:
        nbytes = size * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = dest.with_suffix(".partial")
    with open(tmp, "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        for _, name, handle, _, _ in entries:
            out.write(handle.get_tensor(name).contiguous().view(-1).view(torch.uint8).numpy())  # no bytes copy
    tmp.replace(dest)
    return {name: math.prod(shape) for _, name, _, _, shape in entries}


def pack_shards(work: Path, directory: Path, names: list[str], max_bytes: int) -> dict[str, int]:
    """Groups consecutive layer files into shards of at most max_bytes (a larger layer gets its own shard) and
    writes them into `directory`, with model.safetensors.index.json when there is more than one. Returns
    {tensor name: numel}."""
    groups, size = [[]], 0
    for name in names:
        file_size = (work / name).stat().st_size
        if groups[-1] and size + file_size > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += file_size
    weight_map, sizes = {}, {}
    for number, group in enumerate(progress_bar(groups, "write: shards"), start=1):
        shard = "model.safetensors" if len(groups) == 1 else f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        written = write_shard([work / name for name in group], directory / shard)
        weight_map.update({key: shard for key in written})
        sizes.update(written)
    if len(groups) > 1:
        total = sum((directory / shard).stat().st_size for shard in set(weight_map.values()))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return sizes


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


def _source(options, token: str | None) -> ResolvedSource:
    source = resolve_source(options.source, options.revision, token, options.trust_remote_code)
    if source.gguf_file:
        raise HfcompressError(
            f"--layer-by-layer reads safetensors shards and {source.name} is a GGUF: convert it without --layer-by-layer, "
            "or save it as a safetensors directory first."
        )
    return source


def convert_layer_by_layer(options, argv: list[str] | None = None) -> dict:
    """`convert --layer-by-layer`: the same conversion as convert.convert with one layer in memory at a time."""
    from transformers import GenerationConfig, LlamaConfig

    from . import convert as pipeline  # shared report pieces; imported here because convert.py dispatches to us
    from .card import write_card

    started = time.perf_counter()
    timings: dict[str, float] = {}
    peaks: dict[str, float] = {}  # running peak RSS after each step: which step set the peak

    @contextmanager
    def step(name: str):
        with pipeline._step(name, timings):
            yield
        peaks[name] = peak_memory()["peak_rss_mb"]

    if options.heal_steps or options.lisa_tune_steps or options.lisa.max_ppl_increase is not None:
        raise HfcompressError(
            "--heal-steps, --lisa-tune-steps and --lisa-ppl-budget run the whole model at once: "
            "they cannot run with --layer-by-layer (choose the shared layers with --share-ratio or --lisa-layers)."
        )
    return_freed_memory()
    processes = Processes()
    token = pipeline.require_token() if options.push_to and processes.is_main else None
    out_dir = refuse_existing_output(Path(options.out).expanduser().resolve(), options.overwrite)
    torch.manual_seed(options.seed)

    with step("fetch"):
        source = _source(options, token)
        tokenizer = load_tokenizer(source)
        source_config = LlamaConfig.from_pretrained(source.path)  # never the source's own config class
        sequences, eval_ids, calib_name, eval_name, _ = pipeline.token_streams(options, tokenizer)
        if int(max(sequences.max(), eval_ids.max())) >= source_config.vocab_size:
            raise HfcompressError(f"The tokenizer of {source.name} makes ids beyond the model's vocabulary ({source_config.vocab_size}).")
        if len(sequences) % processes.count:
            raise HfcompressError(f"--calib-sequences {len(sequences)} must be a multiple of the {processes.count} processes.")
        saved_dtype = pipeline.output_dtype(options.dtype, source)
        stream = Stream(source_config, Checkpoint(Path(source.path)), batch_size=4)
        share = len(sequences) // processes.count
        calib_dir = options.cache_dir / cache_key(pipeline._source_identity(source), tensor_fingerprint(sequences)) / "layer-by-layer"
        run = Run(options, stream, processes, sequences[processes.index * share : (processes.index + 1) * share], calib_dir, saved_dtype)

    with step("calibrate: forward"):
        similarity = forward_pass(run)

    fasc_dir, fasc_ranks, fasc_results = None, {}, []
    if options.fasc.budget < 1.0:
        fasc_dir = calib_dir / f"fasc-{cache_key(asdict(options.fasc), options.seed)}"
        with step("calibrate + fasc: backward"):
            fisher_pass(run, fasc_dir)
            fasc_ranks, fasc_results = plan_fasc(run, fasc_dir)

    work = calib_dir / f"convert-{cache_key(asdict(options.lisa), asdict(options.fasc), str(saved_dtype), options.eval_tokens, options.eval_context, tensor_fingerprint(eval_ids))}"
    work.mkdir(parents=True, exist_ok=True)
    windows = _windows(eval_ids, options.eval_context, options.eval_tokens)[processes.index :: processes.count]
    probe_ids = eval_ids[: min(64, len(eval_ids))].unsqueeze(0)
    embedded = [stream.embed(w.unsqueeze(0)) for w in windows]
    evaluation = Evaluation(windows, embedded, [e.clone() for e in embedded], [None] * len(windows), probe_ids, stream.embed(probe_ids))
    with step("lisa + fasc: convert layer by layer"):
        records, qk_params, evaluation = convert_pass(run, similarity, fasc_ranks, fasc_dir, work, evaluation)
    with step("validate: perplexity"):
        ppl_original, ppl_converted, probe_logits = finish_evaluation(run, evaluation, options.eval_context)

    names = [f"model.layers.{i}." for i in range(stream.num_layers)]
    rest = [k for k in stream.checkpoint.files if not k.startswith(tuple(names))]
    if source_config.tie_word_embeddings:
        rest = [k for k in rest if k != "lm_head.weight"]
    if processes.is_main:
        save_tensors({k: v.to(saved_dtype) for k, v in stream.checkpoint.load(rest).items()}, work / "rest.safetensors")
    processes.wait()

    fasc_spec = {name: r for name, r in fasc_ranks.items() if r is not None}
    config = converted_config(source_config, lisa_spec(records), fasc_spec)
    config.dtype = saved_dtype
    increase = 100.0 * (ppl_converted.perplexity / ppl_original.perplexity - 1.0)
    gate_passed = increase <= options.max_ppl_increase
    gate_message = (
        f"perplexity {ppl_original.perplexity:.3f} -> {ppl_converted.perplexity:.3f} ({increase:+.2f}%), limit +{options.max_ppl_increase:g}%"
    )
    original_sizes = {k: math.prod(shape) for k, shape in _checkpoint_shapes(stream.checkpoint).items()}
    if source_config.tie_word_embeddings:
        original_sizes.pop("lm_head.weight", None)
    dense_qk = count_parameters(original_sizes)["attention_qk"] // stream.num_layers
    report = {
        "versions": pipeline._versions(),
        "command": shlex.join(["hfcompress", *(argv if argv is not None else sys.argv[1:])]),
        "source": source.to_dict(),
        "num_layers": stream.num_layers,
        "hardware": hardware_description(),
        "mode": {"layer_by_layer": True, "processes": processes.count, "max_shard_size": options.max_shard_size},
        "calibration": {"text": calib_name, "sequences": len(sequences), "seq_len": int(sequences.shape[1]), "cache_dir": str(calib_dir)},
        "lisa": {
            "layers": [r.layer for r in records],
            "rank": records[0].rank if records else None,
            "options": asdict(options.lisa),
            "similarity": [s.to_dict() for s in similarity if s is not None],
            "fitted": [{k: v for k, v in asdict(r).items() if k != "state"} for r in records],
            "end_to_end_tuning": None,
            "qk_compression_measured": (dense_qk / max(qk_params)) if qk_params else None,
        },
        "fasc": {
            "method": options.fasc.method, "budget": options.fasc.budget, "targets": list(options.fasc.targets),
            "layers": [r.to_dict() for r in fasc_results], "healing": None,
        },
        "validation": {
            "eval_text": eval_name, "original": ppl_original.to_dict(), "converted": ppl_converted.to_dict(),
            "perplexity_increase_pct": increase, "max_ppl_increase_pct": options.max_ppl_increase,
            "gate_passed": gate_passed, "gate_message": gate_message, "probe": {},
        },
        "speed": None,
        "dtype": str(saved_dtype).removeprefix("torch."),
        "timings": timings,
    }
    if not processes.is_main:
        return report
    repo_id = options.push_to or out_dir.name
    layer_files = [f"layer-{i:05d}.safetensors" for i in range(stream.num_layers)] + ["rest.safetensors"]

    def write(directory: Path) -> None:
        from transformers.utils.hub import convert_file_size_to_int

        sizes = pack_shards(work, directory, layer_files, convert_file_size_to_int(options.max_shard_size))
        report["parameters"] = {"original": count_parameters(original_sizes), "converted": count_parameters(sizes)}
        config.save_pretrained(directory)
        generation = Path(source.path) / "generation_config.json"
        save_companion_files(tokenizer, GenerationConfig.from_pretrained(source.path) if generation.is_file() else None, directory)
        with step("validate: fresh-process reload"):
            if 4 * sum(sizes.values()) < RELOAD_MEMORY_FRACTION * _available_memory():
                cls, logits = reload_in_fresh_process(directory, probe_ids)
                diff = (logits.float() - probe_logits).abs().max().item()
                report["validation"]["reload"] = {"mode": "logits", "class": cls, "max_abs_logit_diff": diff}
                if diff > 1e-4:
                    raise HfcompressError(f"The written model reloads with different logits (max diff {diff:.2e}); nothing was written.")
            else:
                report["validation"]["reload"] = check_structure(directory)
        report["plots"] = pipeline.write_plots(report, directory / "plots")
        report["wall_seconds"] = round(time.perf_counter() - started, 1)
        report["memory"] = {**peak_memory(), "peak_rss_mb_after_step": peaks}
        write_card(report, repo_id, directory)
        (directory / pipeline.REPORT_FILE).write_text(json.dumps(report, indent=2, default=str))

    with step("write"):
        out_dir = write_output_dir(out_dir, options.overwrite, write)
    shutil.rmtree(work, ignore_errors=True)  # the layer files are in the output now; the calibration cache stays
    memory = report["memory"]
    console.log(f"wrote {out_dir}: {gate_message}; peak memory {memory['peak_rss_mb']:.0f} MB")
    return pipeline.publish(report, options, out_dir, gate_passed, gate_message, token, timings)


def _checkpoint_shapes(checkpoint: Checkpoint) -> dict[str, list[int]]:
    from safetensors import safe_open

    shapes = {}
    for file in sorted(set(checkpoint.files.values())):
        with safe_open(checkpoint.directory / file, "pt") as handle:
            shapes.update({k: handle.get_slice(k).get_shape() for k in handle.keys()})
    return shapes
