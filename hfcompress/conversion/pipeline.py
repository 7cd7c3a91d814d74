"""The conversion driver: its steps in order, each one named function.

    check targets     the Hub token and push target, --out                                     (here)
    fetch             the source resolved and checked, texts tokenised, the layer stream set up  run.Run.open
    check resources   disk, which whole-model steps fit in memory, the distillation's context  (here)
    calibrate         streamed forward pass; backward pass when a method needs gradients        passes.calibrate
    plan              every method plans (a plan may be scored by streaming it)                  passes.plan
    convert           per layer every method applies its change; perplexities in the same pass passes.convert_layers
    finish            distillation, when the whole model fits                                   (here), wholemodel.py
    back off          a failed gate converts again with fewer changed layers (--back-off)        (here)
    check             probe, peers, speed of the attempt kept: when the whole model fits        (here), wholemodel.py
    report            the gate on every text, every method's section                             report.build_report
    write             shards, config, remote code, reload check, card: atomically               output.write_output
    push              when asked and the gate passed (or --force)                                (here)

Decoder layers are always streamed (passes.py): built one at a time from the source's safetensors, onloaded to the
device, offloaded; hidden states live on disk in the calibration cache, so a rerun resumes. The methods (methods.py)
plug in at fixed points of the passes; the driver never names one.

Data parallel under `accelerate launch --num_processes K`: each process holds N/K calibration sequences and its
share of the evaluation windows; statistics and log-likelihoods are all-reduced, the methods' calibration inputs
all-gathered, and only the main process writes files.
"""

import math
import shutil
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from .build import refuse_existing_output
from .config import ConvertOptions
from ..errors import GATE_FAILED_EXIT, HfcompressError
from ..evidence.gate import quality_gate, refuse_non_finite
from ..memory import return_freed_memory
from .methods import Finisher, FrontierPoint, Method
from .output import save_rest, write_output
from .passes import Converted, calibrate, convert_layers, plan
from ..evidence.peers import kv_values_per_token
from .preflight import check_distill_text, check_output, check_search_text, check_push_target, check_run_disk, output_lock
from ..progress import console, heartbeat
from .push import push_folder, require_token
from .registry import build_methods
from ..evidence.report import Report, build_report
from .run import Run, Steps
from ..sources.source import is_local_source
from ..evidence.speed import speed_threads
from .stream import Processes
from ..sources.text import local_source_texts
from .wholemodel import WholeModelResults, WholeModelSteps


def convert(options: ConvertOptions, argv: list[str] | None = None) -> Report:
    """Run the whole conversion; returns the report. Raises HfcompressError on bad input or a failed gate push.
    What needs no model is checked first (preflight.py: --out against the source and caches, writable), and the main
    process holds --out's lock until the end, push included: a second run into the same --out is refused at once."""
    options.validate()
    out_dir = check_output(options)
    with output_lock(out_dir) if Processes().is_main else nullcontext():
        return _convert(options, argv)


def _convert(options: ConvertOptions, argv: list[str] | None) -> Report:
    with heartbeat("convert"):  # a line at least every PLAIN_INTERVAL seconds, also through steps that count nothing
        return _convert_steps(options, argv)


def _convert_steps(options: ConvertOptions, argv: list[str] | None) -> Report:
    steps = Steps()
    token, out_dir = check_targets(options)
    tried: list[dict] = []
    while True:
        run, methods, whole, converted, results = attempt(options, token, argv, steps, out_dir)
        gate_rows, gate_passed, gate_message = quality_gate(converted.perplexities, options.max_ppl_increase)
        fewer = fewer_changes(options, methods, gate_rows) if options.backs_off and not gate_passed else None
        if fewer is None:
            break
        tried.append(attempt_record(run, converted, methods, gate_rows, gate_passed))
        whole.release()
        shutil.rmtree(converted.work, ignore_errors=True)  # the failed attempt's layer files
        console.log(
            f"back-off: the gate failed with {changes(methods)} changed layers ({gate_message}); converting again with "
            f"{fewer[1]}", highlight=False,
        )  # fmt: skip
        options = fewer[0]
    if run.processes.is_main:  # probe, peers, speed: only for the attempt that is written
        whole.check(run, converted.config, converted.layer_files, results, frontier_points(methods))
    report = build_report(run, methods, whole, results, converted.perplexities)
    if tried:
        report.back_off = [*tried, attempt_record(run, converted, methods, gate_rows, gate_passed)]
    if not run.processes.is_main:
        return report
    out_dir = write_output(run, report, converted, out_dir)
    return publish(run, report, out_dir, token)


def attempt(options: ConvertOptions, token: str | None, argv: list[str] | None, steps: Steps, out_dir: Path
            ) -> tuple[Run, list[Method], WholeModelSteps, Converted, WholeModelResults]:  # fmt: skip
    """One conversion with `options`, through its distillation: what the gate scores. Nothing is written to --out."""
    return_freed_memory()
    torch.manual_seed(options.seed)
    methods, finishers = build_methods(options)
    active = [m for m in methods if m.active()]
    with steps.step("fetch"), local_source_texts() if is_local_source(options.source) else nullcontext():
        run = Run.open(options, methods, token, argv, steps)
    whole = check_resources(run, active, finishers, out_dir)
    calibrate(run, active)
    plan(run, active)
    log_plan(active)
    converted = convert_layers(run, active)
    save_rest(run, converted)
    converted, results = finish(run, whole, converted)
    return run, methods, whole, converted, results


def log_plan(methods: list[Method]) -> None:
    """One console line per method with what its plan chose (its config entries: the layers it shares or drops, the
    ranks it keeps), before hours of converting them."""
    for method in methods:
        parts = [f"{key} {_plan_entry(value)}" for key, value in method.config_entries().items()]
        console.log(f"plan: {method.name}: {'; '.join(parts) or 'no layer changed'}", highlight=False)


def _plan_entry(value) -> str:
    """A config entry in words: a list joined, {layer: spec} as the layers and their spec when all share it, {name:
    rank} as name=rank pairs."""
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        specs = [dict(v) for v in value.values()]
        common = specs[0] if all(spec == specs[0] for spec in specs) else None
        shown = f" ({', '.join(f'{k} {v}' for k, v in common.items())})" if common else ""
        return ", ".join(value) + shown
    if isinstance(value, dict):
        return ", ".join(f"{name}={v}" for name, v in value.items()) or "none"
    return str(value)


def frontier_points(methods: list[Method]) -> list[FrontierPoint]:
    """The frontier of the one active method that changed layers (its plan at other budgets, Method.frontier); none
    where several did: the peers step scores a plan alone, which would then not be the conversion's."""
    changing = [m for m in methods if m.active() and any(m.changed_layers().values())]
    return changing[0].frontier() if len(changing) == 1 else []


def changes(methods: list[Method]) -> int:
    """How many layers the methods' plans changed in ways --back-off can lower."""
    return sum(len(layers) for m in methods if m.active() for layers in m.changed_layers().values())


def fewer_changes(options: ConvertOptions, methods: list[Method], gate_rows: list[dict]) -> tuple[ConvertOptions, str] | None:
    """--back-off's next attempt after a failed gate, and what it changes in words: the first method in the
    registry's order (a share count, then the key budget) that can lower its changes to as many as the worst text's
    overshoot allows if every changed layer cost the same share of the increase, and at least one fewer. None when no
    method can."""
    worst = max(row["perplexity_increase_pct"] for row in gate_rows)
    limit = options.max_ppl_increase
    for method in (m for m in methods if m.active() and m.changed_layers()):  # the registry's order
        changed = sum(len(layers) for layers in method.changed_layers().values())
        count = min(changed - 1, math.floor(changed * limit / worst) if worst > 0 and limit > 0 else changed - 1)
        fewer = method.with_fewer_changes(options, count) if count >= 1 else None
        if fewer is not None:
            return fewer
    return None


def attempt_record(run: Run, converted: Converted, methods: list[Method], gate_rows: list[dict], gate_passed: bool) -> dict:
    """One attempt of --back-off, for the report and the card: the layers it changed, its KV cache and its gate."""
    changed = {kind: layers for m in methods if m.active() for kind, layers in m.changed_layers().items()}
    kv_ratio = kv_values_per_token(converted.config) / kv_values_per_token(run.source_config)
    return {
        "changed_layers": changed, "kv_ratio": kv_ratio, "gate_passed": gate_passed,
        "texts": [{"eval_text": row["eval_text"], "perplexity_increase_pct": row["perplexity_increase_pct"]} for row in gate_rows],
    }  # fmt: skip


def check_targets(options: ConvertOptions) -> tuple[str | None, Path]:
    """Before an hour of work, not after: the Hub token, --out (not an existing output unless --overwrite) and the
    push target (reachable, the token valid and allowed to write). Returns (token, output directory)."""
    token = require_token() if options.push_to and Processes().is_main else None
    if options.speed is not False:
        speed_threads()  # a bad HFCOMPRESS_SPEED_THREADS fails now, not at the speed step
    out_dir = refuse_existing_output(Path(options.out).expanduser().resolve(), options.overwrite)
    if token:
        check_push_target(options.push_to, token, out_dir)
    return token, out_dir


def check_resources(run: Run, methods: list[Method], finishers: list[Finisher], out_dir: Path) -> WholeModelSteps:
    """Before calibration: free disk for what the run will still write, which whole-model steps fit in memory (one
    asked for that does not fit is refused), the distillation's windows within the calibration text (within the
    model's context: Run.open's check_source)."""
    check_run_disk(run, methods, out_dir)
    whole = WholeModelSteps.decide(run.options, run.checkpoint, finishers, run.device)
    check_distill_text(run.options, len(run.streams.calib_ids), len(run.streams.prefix))
    check_search_text(run.options, len(run.streams.selection_ids))
    return whole


def finish(run: Run, whole: WholeModelSteps, converted: Converted) -> tuple[Converted, WholeModelResults]:
    """The finishers (distillation, wholemodel.py) on the main process. A finisher that changed the weights hands on
    its own layer files, and the result is scored again: its perplexities and reload logits replace the streamed ones."""
    if not run.processes.is_main:
        return converted, WholeModelResults(layers_dir=converted.work)
    results = whole.finish(run, converted.config, converted.work, converted.layer_files)
    converted = replace(converted, layers_dir=results.layers_dir)
    if results.converted_perplexity:
        perplexities = {text: (converted.perplexities[text][0], ppl) for text, ppl in results.converted_perplexity.items()}
        refuse_non_finite(perplexities)
        converted = replace(converted, perplexities=perplexities, expected_logits=results.expected_logits)
    return converted, results


def publish(run: Run, report: Report, out_dir: Path, token: str | None) -> Report:
    """Push when asked and the gate passed (or --force); a failed gate is exit code 3 once the output is written."""
    options, validation = run.options, report.validation
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
        tried = ""
        if report.back_off:
            counts = ", ".join(str(sum(len(layers) for layers in a["changed_layers"].values())) for a in report.back_off)
            tried = f" --back-off tried {counts} changed layers and none passed;"
        raise HfcompressError(
            f"The quality gate failed ({validation.gate_message});{tried} the model was written to {out_dir} but is "
            "marked as failed.",
            exit_code=GATE_FAILED_EXIT,
        )
    return report
