"""The conversion pipeline: fetch -> calibrate -> lisa -> fasc -> build -> validate -> card -> push.

Configuration (`ConvertOptions`) is separate from execution (`convert`); every step's output lands in one
report dict that is saved as `hfcompress_report.json` and rendered into the card.
"""

import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import __version__
from .build import (
    build_converted_model,
    cast_parameters,
    parameter_counts,
    refuse_existing_output,
    save_model_files,
    write_output_dir,
)
from .calibrate import cache_key, collect_attention_inputs, collect_linear_stats, load_or_compute, tensor_fingerprint
from .card import write_card
from .errors import GATE_FAILED_EXIT, HfcompressError
from .fasc import FascOptions, compress_linears
from .heal import heal_with_lora, tune_lisa_end_to_end
from .lisa import (
    FittedLayer,
    LisaOptions,
    fit_lisa,
    measure_similarity,
    ranked_candidates,
    search_layers_by_perplexity,
    select_layers,
)
from .memory import peak_memory
from .plots import fasc_ranks_and_rho, perplexity_bars, similarity_heatmap, speed_bars
from .probe import run_probe
from .progress import console
from .push import push_folder, require_token
from .source import ResolvedSource, load_source, resolve_source
from .speed import hardware_description, measure_speed
from .text import AUTO, chunk, text_streams
from .validate import compare_reload, perplexity

REPORT_FILE = "hfcompress_report.json"
SELECTION_TOKENS = 2048  # calibration-text tokens scored by the LISA perplexity-budget search


@dataclass
class ConvertOptions:
    source: str
    out: Path
    push_to: str | None = None
    private: bool = False
    revision: str | None = None
    overwrite: bool = False
    force: bool = False
    trust_remote_code: bool = False  # accept a source that declares custom code (its code is still never run)
    max_ppl_increase: float = 10.0  # percent
    calib_text: str = AUTO  # FILE path, "builtin", "wikitext-2" or "auto" (text.py)
    eval_text: str = AUTO
    calib_sequences: int = 16
    seq_len: int = 256
    eval_tokens: int = 4096
    eval_context: int = 512
    cache_dir: Path = field(default_factory=lambda: Path(os.environ.get("HFCOMPRESS_CACHE", "~/.cache/hfcompress")).expanduser())
    seed: int = 0
    probe: bool = True  # factual-recall probe on original and converted
    heal_steps: int = 0  # LoRA distillation steps after FASC (0 = no healing)
    lisa_tune_steps: int = 0  # joint end-to-end distillation steps of all shared layers (0 = off)
    dtype: str = "auto"  # dtype of the saved weights: auto | float32 | bfloat16 | float16
    speed: bool = True  # measure prefill/decode speed of original and converted side by side
    layer_by_layer: bool = False  # one decoder layer in memory at a time (sequential.py)
    max_shard_size: str = "2GB"  # --layer-by-layer output shards
    lisa: LisaOptions = field(default_factory=LisaOptions)
    fasc: FascOptions = field(default_factory=FascOptions)


def _source_identity(source: ResolvedSource) -> str:
    """Stable id of the source weights for the calibration cache key."""
    if source.commit_sha:
        return f"{source.repo_id}@{source.commit_sha}"
    files = sorted(Path(source.path).glob(source.gguf_file or "*.safetensors"))
    return ";".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def _versions() -> dict:
    import huggingface_hub
    import transformers

    return {
        "hfcompress": __version__,
        "transformers": transformers.__version__,
        "huggingface_hub": huggingface_hub.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


OUTPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def output_dtype(requested: str, source: ResolvedSource) -> torch.dtype:
    """The saved weights' dtype: as requested, or for "auto" the dtype the source checkpoint declares
    (a GGUF declares none: its dequantised weights are saved as bfloat16, the dtype Llama checkpoints ship in)."""
    if requested != "auto":
        if requested not in OUTPUT_DTYPES:
            raise HfcompressError(f"Unknown --dtype '{requested}': choose auto, {', '.join(OUTPUT_DTYPES)}.")
        return OUTPUT_DTYPES[requested]
    config_path = Path(source.path) / "config.json"
    if source.gguf_file or not config_path.is_file():
        return torch.bfloat16
    config = json.loads(config_path.read_text())
    return OUTPUT_DTYPES.get(config.get("dtype") or config.get("torch_dtype") or "float32", torch.float32)


def _step(name: str, timings: dict):
    class _Timer:
        def __enter__(self):
            console.log(f"[bold cyan]{name}[/]")
            self.start = time.perf_counter()

        def __exit__(self, *exc):
            timings[name] = round(time.perf_counter() - self.start, 2)

    return _Timer()


def write_plots(report: dict, directory: Path) -> dict[str, str]:
    """The card's PNGs; returns {name: path relative to the repo root}."""
    directory.mkdir(parents=True, exist_ok=True)
    plots = {}
    if report["lisa"]["similarity"]:
        similarity_heatmap(report["lisa"]["similarity"], report["lisa"]["layers"], directory / "similarity.png")
        plots["similarity"] = "plots/similarity.png"
    if report["fasc"]["layers"]:
        fasc_ranks_and_rho(report["fasc"]["layers"], directory / "fasc.png")
        plots["fasc"] = "plots/fasc.png"
    validation = report["validation"]
    perplexity_bars(validation["original"]["perplexity"], validation["converted"]["perplexity"], directory / "perplexity.png")
    plots["perplexity"] = "plots/perplexity.png"
    if report["speed"]:
        speed_bars(report["speed"], directory / "speed.png")
        plots["speed"] = "plots/speed.png"
    return plots


@dataclass
class Prepared:
    """The loaded source model and the token streams every step works on."""

    source: ResolvedSource
    model: torch.nn.Module
    tokenizer: object
    sequences: torch.Tensor  # (N, T) calibration sequences
    eval_ids: torch.Tensor  # held-out tokens for perplexity
    selection_ids: torch.Tensor  # calibration text after the sequences: scores the LISA perplexity-budget search
    calib_name: str
    eval_name: str
    cache: Path  # calibration cache of this (model, text, settings)

    def attention_inputs(self) -> list[torch.Tensor]:
        return load_or_compute(self.cache / "attention_inputs.pt", lambda: collect_attention_inputs(self.model, self.sequences))

    def similarity(self, attn_inputs: list[torch.Tensor]) -> list:
        return load_or_compute(self.cache / "similarity.pt", lambda: measure_similarity(self.model, attn_inputs))

    def linear_stats(self, targets: tuple[str, ...], seed: int) -> dict:
        """FASC statistics of `targets` (e.g. "mlp.down_proj") in every layer, keyed "layer.target"."""
        names = [f"{i}.{t}" for i in range(self.model.config.num_hidden_layers) for t in targets]
        return load_or_compute(
            self.cache / f"linear_stats-{cache_key(sorted(names), seed)}.pt",
            lambda: collect_linear_stats(self.model, self.sequences, names, seed=seed),
        )


def prepare(options: ConvertOptions, token: str | None = None) -> Prepared:
    """Resolve and load SOURCE, tokenise calibration and evaluation text."""
    source = resolve_source(options.source, options.revision, token, options.trust_remote_code)
    model, tokenizer = load_source(source)
    sequences, eval_ids, calib_name, eval_name, selection_ids = token_streams(options, tokenizer)
    cache = options.cache_dir / cache_key(_source_identity(source), tensor_fingerprint(sequences))
    return Prepared(source, model, tokenizer, sequences, eval_ids, selection_ids, calib_name, eval_name, cache)


def token_streams(options: ConvertOptions, tokenizer) -> tuple[torch.Tensor, torch.Tensor, str, str, torch.Tensor]:
    """(calibration sequences (N, T), held-out evaluation ids, calibration text name, evaluation text name,
    up to SELECTION_TOKENS calibration-text ids after the sequences)."""
    calib_tokens = options.calib_sequences * options.seq_len
    calib_ids, calib_name, eval_ids, eval_name = text_streams(
        tokenizer, options.calib_text, options.eval_text, calib_tokens + SELECTION_TOKENS
    )
    sequences = chunk(calib_ids, options.seq_len, options.calib_sequences)
    selection_ids = calib_ids[sequences.numel() : sequences.numel() + SELECTION_TOKENS]
    return sequences, eval_ids, calib_name, eval_name, selection_ids


def choose_layers_by_perplexity(
    prepared: Prepared, fit: Callable[[list[int]], list[FittedLayer]], similarity: list, options: ConvertOptions
) -> tuple[list[int], dict]:
    """LISA layers under --lisa-ppl-budget: the most layers (best aligned first) whose converted model stays within
    the budget on calibration text the fits never saw (not the held-out evaluation text, which stays unseen)."""
    ids = prepared.selection_ids
    if len(ids) < options.eval_context:
        raise HfcompressError(
            f"--lisa-ppl-budget needs {options.eval_context} calibration tokens beyond the calibration sequences, "
            f"the text has {len(ids)}: give a longer --calib-text or fewer --calib-sequences."
        )
    model = prepared.model
    base = perplexity(model, ids, options.eval_context, label="lisa search: original").perplexity
    limit = base * (1 + options.lisa.max_ppl_increase / 100)

    def perplexity_of(layers: list[int]) -> float:
        converted = build_converted_model(model, fit(layers), {})
        return perplexity(converted, ids, options.eval_context, label=f"lisa search: {len(layers)} layers").perplexity

    chosen, probes = search_layers_by_perplexity(ranked_candidates(similarity, options.lisa), perplexity_of, limit)
    console.log(f"lisa search: {len(chosen)} layers within +{options.lisa.max_ppl_increase:g}% ({len(probes)} fits)")
    return chosen, {"tokens": len(ids), "original_perplexity": base, "limit": limit, "probes": probes}


def convert(options: ConvertOptions, argv: list[str] | None = None) -> dict:
    """Run the whole conversion; returns the report. Raises HfcompressError on bad input or a failed gate push."""
    if options.layer_by_layer:
        from .sequential import convert_layer_by_layer

        return convert_layer_by_layer(options, argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise HfcompressError("Several processes (accelerate launch) need --layer-by-layer: the in-memory pipeline runs in one.")
    started = time.perf_counter()
    timings: dict[str, float] = {}
    torch.manual_seed(options.seed)
    token = require_token() if options.push_to else None  # fail before an hour of work, not after
    out_dir = refuse_existing_output(Path(options.out).expanduser().resolve(), options.overwrite)

    with _step("fetch", timings):
        prepared = prepare(options, token)
    source, model, tokenizer, cache = prepared.source, prepared.model, prepared.tokenizer, prepared.cache
    sequences, eval_ids, eval_name, calib_name = prepared.sequences, prepared.eval_ids, prepared.eval_name, prepared.calib_name
    num_layers = model.config.num_hidden_layers
    saved_dtype = output_dtype(options.dtype, source)

    with _step("calibrate", timings):
        attn_inputs = prepared.attention_inputs()
        similarity = prepared.similarity(attn_inputs)
        fasc_stats = prepared.linear_stats(options.fasc.targets, options.seed) if options.fasc.budget < 1.0 else None

    with _step("lisa", timings):

        def fit(layers: list[int]) -> list[FittedLayer]:
            return load_or_compute(
                cache / f"lisa-{cache_key(layers, asdict(options.lisa))}.pt",
                lambda: fit_lisa(model, attn_inputs, layers, similarity, options.lisa, cache_dir=cache),
            )

        search = None
        if options.lisa.max_ppl_increase is not None and options.lisa.layers is None:
            chosen, search = choose_layers_by_perplexity(prepared, fit, similarity, options)
        else:
            chosen = select_layers(similarity, num_layers, options.lisa)
        fitted = fit(chosen)
        attn_inputs.clear()  # frees the per-layer activations; nothing fits after this

    with _step("fasc", timings):
        fasc_factors, fasc_results = {}, []
        if fasc_stats is not None:
            linears = {name: model.model.layers.get_submodule(name) for name in fasc_stats}
            fasc_factors, fasc_results = compress_linears(linears, fasc_stats, options.fasc)

    with _step("build", timings):
        converted = build_converted_model(model, fitted, fasc_factors)

    if options.lisa_tune_steps and fitted:
        with _step("lisa: end-to-end tuning", timings):
            lisa_tuning = tune_lisa_end_to_end(converted, model, sequences, options.lisa_tune_steps, seed=options.seed)
    else:
        lisa_tuning = None

    healing = None
    if options.heal_steps:
        with _step("heal", timings):
            converted, healing = heal_with_lora(converted, model, sequences, options.heal_steps, seed=options.seed)

    if saved_dtype != torch.float32:  # validate the weights that will be saved, rounded to their dtype
        cast_parameters(cast_parameters(converted, saved_dtype), torch.float32)

    probe = {}
    if options.probe:
        with _step("validate: factual probe", timings):
            probe = {name: run_probe(m, tokenizer).to_dict() for name, m in (("original", model), ("converted", converted))}

    with _step("validate: perplexity", timings):
        ppl_original = perplexity(model, eval_ids, options.eval_context, max_tokens=options.eval_tokens, label="perplexity: original")
        ppl_converted = perplexity(converted, eval_ids, options.eval_context, max_tokens=options.eval_tokens, label="perplexity: converted")
    for name, ppl in (("source", ppl_original), ("converted", ppl_converted)):
        if not math.isfinite(ppl.perplexity):  # NaN would slip through the gate comparison as "failed"
            raise HfcompressError(
                f"The {name} model's perplexity is {ppl.perplexity} (NaN/inf logits on the evaluation text): its "
                "weights overflow; nothing was written."
            )
    increase = 100.0 * (ppl_converted.perplexity / ppl_original.perplexity - 1.0)
    gate_passed = increase <= options.max_ppl_increase
    gate_message = (
        f"perplexity {ppl_original.perplexity:.3f} -> {ppl_converted.perplexity:.3f} ({increase:+.2f}%), "
        f"limit +{options.max_ppl_increase:g}%"
    )

    speed = None
    if options.speed:
        with _step("validate: speed", timings):
            speed = measure_speed(model, converted, eval_ids, gpu_dtype=saved_dtype)

    params_original, params_converted = parameter_counts(model), parameter_counts(converted)
    dense_qk = params_original["attention_qk"] // num_layers
    shared_qk = [
        sum(v.numel() for k, v in f.state.items() if any(t in k for t in ("q_lowrank", "k_lowrank", "align")))
        for f in fitted
    ]
    report = {
        "versions": _versions(),
        "command": shlex.join(["hfcompress", *(argv if argv is not None else sys.argv[1:])]),
        "source": source.to_dict(),
        "num_layers": num_layers,
        "hardware": hardware_description(),
        "calibration": {
            "text": calib_name,
            "sequences": int(sequences.shape[0]),
            "seq_len": int(sequences.shape[1]),
            "cache_dir": str(cache),
        },
        "lisa": {
            "layers": chosen,
            "perplexity_search": search,
            "rank": fitted[0].rank if fitted else None,
            "options": asdict(options.lisa),
            "similarity": [s.to_dict() for s in similarity],
            "fitted": [{k: v for k, v in asdict(f).items() if k != "state"} for f in fitted],
            "end_to_end_tuning": lisa_tuning,
            "qk_compression_measured": (dense_qk / max(shared_qk)) if shared_qk else None,
        },
        "fasc": {
            "method": options.fasc.method,
            "budget": options.fasc.budget,
            "targets": list(options.fasc.targets),
            "layers": [r.to_dict() for r in fasc_results],
            "healing": healing,
        },
        "parameters": {"original": params_original, "converted": params_converted},
        "validation": {
            "eval_text": eval_name,
            "original": ppl_original.to_dict(),
            "converted": ppl_converted.to_dict(),
            "perplexity_increase_pct": increase,
            "max_ppl_increase_pct": options.max_ppl_increase,
            "gate_passed": gate_passed,
            "gate_message": gate_message,
            "probe": {
                name: {k: result[k] for k in ("correct", "total", "accuracy")} for name, result in probe.items()
            },
        },
        "speed": speed,
        "dtype": str(saved_dtype).removeprefix("torch."),
        "timings": timings,
    }
    repo_id = options.push_to or f"{out_dir.name}"
    probe_ids = eval_ids[: min(256, len(eval_ids))].unsqueeze(0)  # long enough for RoPE errors to show

    def write(directory: Path) -> None:
        save_model_files(converted, tokenizer, getattr(model, "generation_config", None), directory, saved_dtype)
        with _step("validate: fresh-process reload", timings):
            report["validation"]["reload"] = compare_reload(converted, directory, probe_ids)
        if report["validation"]["reload"]["max_abs_logit_diff"] > 1e-4:
            raise HfcompressError(
                f"The written model reloads with different logits "
                f"(max diff {report['validation']['reload']['max_abs_logit_diff']:.2e}); nothing was written."
            )
        report["plots"] = write_plots(report, directory / "plots")
        report["wall_seconds"] = round(time.perf_counter() - started, 1)
        report["memory"] = peak_memory()
        write_card(report, repo_id, directory)
        (directory / REPORT_FILE).write_text(json.dumps(report, indent=2, default=str))

    with _step("write", timings):
        out_dir = write_output_dir(out_dir, options.overwrite, write)
    console.log(f"wrote {out_dir}: {gate_message}")
    return publish(report, options, out_dir, gate_passed, gate_message, token, timings)


def publish(
    report: dict, options: ConvertOptions, out_dir: Path, gate_passed: bool, gate_message: str, token: str | None, timings: dict
) -> dict:
    """Push when asked and the gate passed (or --force); a failed gate is exit code 3 once the output is written."""
    if options.push_to:
        if not gate_passed and not options.force:
            raise HfcompressError(
                f"Not pushing to {options.push_to}: the quality gate failed ({gate_message}); the model is in "
                f"{out_dir}. Raise --max-ppl-increase or pass --force to push anyway.",
                exit_code=GATE_FAILED_EXIT,
            )
        with _step("push", timings):
            url = push_folder(
                out_dir, options.push_to, token, options.private, f"hfcompress: {gate_message}", force=not gate_passed
            )
        report["push"] = {"repo_id": options.push_to, "commit_url": url}
        console.log(f"pushed {options.push_to}: {url}")
    elif not gate_passed:
        raise HfcompressError(
            f"The quality gate failed ({gate_message}); the model was written to {out_dir} but is marked as failed.",
            exit_code=GATE_FAILED_EXIT,
        )
    return report
