"""The steps that need a whole model in memory: distillation (finishers), the factual probe, the speed comparison, the
training-free peers (peers.py).

They run after the streamed conversion, on the main process, when the model fits; `decide` settles that before any
work. An option left at its default (`--probe`/`--speed` not given) is skipped with a notice when the model does not
fit; one asked for explicitly is refused with one sentence instead.

Memory: at most one whole float32 model is resident for probe and speed. The converted model in the speed run
shares the original's unchanged tensors (speed does not depend on their values; only new tensors are loaded).
Distillation holds the original (teacher) and the converted model (student) together.
"""

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .build import assemble, cast_floating, cast_parameters
from .calibrate import cache_key
from .checkpoint import Checkpoint, load_tensors, save_tensors
from ..distill import DistillData, trainable_parameters
from ..errors import HfcompressError
from ..families import family_of
from ..memory import available_memory
from .methods import Finisher, FrontierPoint
from ..evidence.peers import compute_peers, speed_peers
from ..evidence.probe import run_probe
from ..progress import console
from ..evidence.speed import measure_speed
from ..evidence.validate import PerplexityResult, perplexity

MEMORY_FRACTION = 0.8  # of the memory free when the run starts
FOOTPRINT = {"probe": 1.3, "speed": 1.3, "peers": 1.3, "distill": 3.5}  # multiples of the float32 model each step needs


@dataclass
class WholeModelResults:
    finished: dict = field(default_factory=dict)  # finisher name -> record
    probe: dict = field(default_factory=dict)
    speed: dict | None = None
    peers: dict | None = None
    expected_logits: torch.Tensor | None = None  # of the finished model on the reload prompt
    converted_perplexity: dict[str, PerplexityResult] = field(default_factory=dict)  # of the finished model, per text
    layers_dir: Path | None = None  # where the layer files to write are (the finished ones when a finisher ran)


@dataclass
class WholeModelSteps:
    probe: bool
    speed: bool
    peers: bool
    finishers: list[Finisher]
    model_bytes: int
    available: int
    skipped: dict[str, str]
    original: nn.Module | None = None  # the source model while the whole-model steps run (_original)

    @classmethod
    def decide(cls, options, checkpoint: Checkpoint, finishers: list[Finisher], device: torch.device) -> "WholeModelSteps":
        model_bytes, available = checkpoint.float32_bytes(), available_memory(device)

        def fits(step: str) -> bool:
            return FOOTPRINT[step] * model_bytes <= MEMORY_FRACTION * available

        where = f"{device.type} memory ({available / 2**30:.1f} GiB free, the float32 model is {model_bytes / 2**30:.1f} GiB)"
        skipped, chosen = {}, {}
        if finishers and not fits("distill"):
            if any(f.asked for f in finishers):
                raise HfcompressError(
                    f"{', '.join(f.name for f in finishers)} train the whole model, which does not fit in {where}: pass "
                    "--distill-tokens 0, or run on a device with more memory."
                )
            for finisher in finishers:
                skipped[finisher.name] = f"the whole model does not fit in {where}"
                console.log(f"[yellow]{finisher.name} skipped: {skipped[finisher.name]}[/]")
            finishers = []
        for step, asked in (("probe", options.probe), ("speed", options.speed), ("peers", options.peers)):
            if asked is False:
                skipped[step] = "turned off"
            elif fits(step):
                chosen[step] = True
            elif asked:
                raise HfcompressError(f"--{step} needs the whole model, which does not fit in {where}: pass --no-{step}.")
            else:
                skipped[step] = f"the whole model does not fit in {where}"
                console.log(f"[yellow]{step} skipped: {skipped[step]}[/]")
        return cls(
            chosen.get("probe", False), chosen.get("speed", False), chosen.get("peers", False), finishers, model_bytes,
            available, skipped,
        )  # fmt: skip

    def describe(self) -> dict:
        steps = (("probe", self.probe), ("speed", self.speed), ("peers", self.peers))
        ran = [name for name, on in steps if on] + [f.name for f in self.finishers]
        return {"ran": ran, "skipped": self.skipped, "model_float32_mb": round(self.model_bytes / 2**20, 1)}

    def finish(self, run, config, work: Path, layer_files: list[str]) -> WholeModelResults:
        """The finishers (distillation) on the converted layer files in `work` (`config`: the converted model's); what
        the gate scores is then their result. `run` is the conversion's run.Run: its source, tokens, device, step log."""
        results = WholeModelResults(layers_dir=work)
        if self.finishers:
            original, streams = self._original(run), run.streams
            with run.step("whole model: distill"):
                data = DistillData(streams.calib_ids, streams.evaluations, run.options.eval_context, work, run.options.seed, streams.prefix)
                self._distill(run, original, config, work, layer_files, data, results)
        return results

    def check(self, run, config, layer_files: list[str], results: WholeModelResults, frontier: list[FrontierPoint] = ()) -> None:
        """The factual probe, the training-free peers (with the `frontier` of the conversion's plan) and the speed
        comparison of the finished model (the layer files in `results.layers_dir`), into `results`. Only for the attempt
        that is written: --back-off's failed attempts skip them."""
        if not (self.probe or self.speed or self.peers):
            self.release()
            return
        original, streams = self._original(run), run.streams
        if self.probe:
            with run.step("validate: factual probe (original)"):
                results.probe["original"] = _probe_record(run_probe(original.to(run.device), run.tokenizer))
                original.to("cpu")
        if self.peers:
            with run.step("validate: training-free peers"):
                results.peers = compute_peers(
                    original.to(run.device), config, run.sequences, streams.evaluations, run.options.eval_context,
                    run.options.eval_tokens, streams.prefix, frontier,
                )  # fmt: skip
                original.to("cpu")
        if self.speed:
            with run.step("validate: speed"):
                view = converted_model(config, results.layers_dir, layer_files, share_with=original)
                eval_ids = next(iter(streams.evaluations.values()))
                peers = speed_peers(original, results.peers) if results.peers else None  # timed beside them
                results.speed = measure_speed(original, view, eval_ids, gpu_dtype=run.saved_dtype, device=run.device, peers=peers)
                results.speed["note"] = "the converted model shares the original's unchanged float32 tensors"
                del view, peers
        del original
        self.release()
        if self.probe:
            with run.step("validate: factual probe (converted)"):
                converted = converted_model(config, results.layers_dir, layer_files).to(run.device)
                results.probe["converted"] = _probe_record(run_probe(converted, run.tokenizer))
                del converted

    def _original(self, run) -> nn.Module:
        """The source model, whole, in transformers' own classes (the teacher, and what probe, peers and speed compare
        against): loaded once, held from the distillation to the checks."""
        if self.original is None:
            _, causal_lm = family_of(run.source_config).transformers_classes()
            with run.step("whole model: load the original"):
                self.original = assemble(run.source_config, run.checkpoint.load(list(run.checkpoint.files)), cls=causal_lm)
        return self.original

    def release(self) -> None:
        """Let the original model go (after the checks, or when --back-off discards the attempt)."""
        self.original = None

    def _distill(self, run, original: nn.Module, config, work: Path, layer_files: list[str], data: DistillData, results) -> None:
        """Train from the converted layer files; the result goes to its own directory (keyed by the finishers'
        settings), so a rerun starts from the same converted layers and resumes the training from its checkpoint."""
        options, device = run.options, run.device
        student = converted_model(config, work, layer_files).to(device)
        if not trainable_parameters(student) and not options.distill.lora_rank:  # the plan only dropped attention
            self.skipped["distillation"] = "the layer plan created no parameters to train (it only dropped attention)"
            console.log(f"[yellow]distillation skipped: {self.skipped['distillation']}[/]")
            self.finishers = []
            return
        teacher = original.to(device)
        for finisher in self.finishers:
            student, results.finished[finisher.name] = finisher.finish(student, teacher, data)
        student = cast_parameters(cast_parameters(student, run.saved_dtype), torch.float32)  # as it will be saved
        state = student.state_dict()
        finished = work / f"finished-{cache_key([(f.name, f.settings()) for f in self.finishers])}"
        finished.mkdir(exist_ok=True)
        for idx in range(config.num_hidden_layers):
            prefix = f"model.layers.{idx}."
            save_tensors({k: cast_floating(v, run.saved_dtype) for k, v in state.items() if k.startswith(prefix)}, finished / f"layer-{idx:05d}.safetensors")
        shutil.copyfile(work / "rest.safetensors", finished / "rest.safetensors")  # embeddings, norm: never trained
        results.layers_dir = finished
        for text, ids in data.evaluations.items():
            results.converted_perplexity[text] = perplexity(
                student, ids.to(device), options.eval_context, max_tokens=options.eval_tokens,
                label=f"perplexity: distilled ({text.split(' (')[0]})", prefix=data.prefix,
            )
        with torch.no_grad():
            results.expected_logits = student(run.streams.reload_prompt.to(device), use_cache=False).logits.float().cpu()
        original.to("cpu")
        del student


def _probe_record(result) -> dict:
    data = result.to_dict()
    return {k: data[k] for k in ("correct", "total", "accuracy")}


def converted_model(config, work: Path, layer_files: list[str], share_with: nn.Module | None = None) -> nn.Module:
    """The converted model (float32) from the saved layer files. With `share_with` (the original), every tensor the
    conversion left unchanged is the original's own tensor, so only the new ones take memory."""
    shared = share_with.state_dict() if share_with is not None else {}
    state = {}
    for name in layer_files:
        for key, tensor in load_tensors(work / name).items():
            same = key in shared and shared[key].shape == tensor.shape
            state[key] = shared[key] if same else cast_floating(tensor, torch.float32)
    return assemble(config, state)
