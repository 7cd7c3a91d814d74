"""The output: the converted model as a Hugging Face model directory, written atomically (build.write_output_dir).

Shards of at most `--max-shard-size`, the config, tokenizer, generation config and remote code, the weights quantized
when asked, then the fresh-process reload check of what was written, plots, the source's licence, the card and
`hfcompress_report.json`. Only the main process writes.
"""

import math
import shutil
import time
from pathlib import Path

from transformers import GenerationConfig

from .build import count_parameters, save_companion_files, write_output_dir
from .card import carry_licence, write_card
from .checkpoint import pack_shards, save_tensors
from .memory import peak_memory
from .passes import Converted
from .plots import write_plots
from .progress import console
from .quantize import quantize_written, reloaded_logits
from .report import Report
from .run import Run
from .validate import verify_written


def save_rest(run: Run, converted: Converted) -> None:
    """The tensors outside the decoder layers (embeddings, final norm, an untied lm_head) in the saved dtype, beside
    the converted layer files: the main process writes them, the others wait."""
    checkpoint, source_config = run.checkpoint, run.source_config
    if run.processes.is_main:
        rest = [k for k in checkpoint.files if not k.startswith("model.layers.") and not (source_config.tie_word_embeddings and k == "lm_head.weight")]
        save_tensors({k: v.to(run.saved_dtype) for k, v in checkpoint.load(rest).items()}, converted.work / "rest.safetensors")
    run.processes.wait()


def write_output(run: Run, report: Report, converted: Converted, out_dir: Path) -> Path:
    """Step: the output directory (main process only), atomically in place of `out_dir`; the converted layer files
    leave the calibration cache (which stays). Returns where it was written."""
    repo_id = run.options.push_to or out_dir.name  # the card's name for the model
    with run.step("write"):
        out_dir = write_output_dir(out_dir, run.options.overwrite, lambda directory: write_model(run, report, converted, repo_id, directory))
    shutil.rmtree(converted.work, ignore_errors=True)  # the layer files are in the output now; the calibration cache stays
    gate_rows = report.validation.texts
    if report.parameters["converted"]["total"] == report.parameters["original"]["total"]:  # not "+0.00%" as if it had
        console.log(f"wrote {out_dir}: nothing was converted (no layer was shared or factorised), so it computes what "
                    "the source does: " + "; ".join(f"perplexity on {row['eval_text'].split(' (')[0]} "
                                                    f"{row['converted']['perplexity']:.3f}" for row in gate_rows), highlight=False)
    else:
        console.log(f"wrote {out_dir}: {report.validation.gate_message}; peak memory {report.memory['peak_rss_mb']:.0f} MB")
    return out_dir


def write_model(run: Run, report: Report, converted: Converted, repo_id: str, directory: Path) -> None:
    """Everything the output holds, into `directory`; the report gains what only writing tells (parameters, the
    reload check, plots, memory, the licence)."""
    options, source, source_config = run.options, run.source, run.source_config
    original_sizes = {k: math.prod(shape) for k, shape in run.checkpoint.shapes.items() if not (source_config.tie_word_embeddings and k == "lm_head.weight")}
    probe_ids, expected_logits = run.streams.reload_prompt, converted.expected_logits
    sizes = pack_shards(converted.layers_dir, directory, converted.layer_files, options.max_shard_bytes)
    report.parameters = {"original": count_parameters(original_sizes), "converted": count_parameters(sizes)}
    converted.config.save_pretrained(directory)
    generation = Path(source.path) / "generation_config.json"
    generation_config = (  # a GGUF or a directory without one: the config's special tokens
        GenerationConfig.from_pretrained(source.path) if generation.is_file() else GenerationConfig(
            **{k: getattr(source_config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if getattr(source_config, k, None) is not None}
        )
    )
    save_companion_files(run.tokenizer, generation_config, directory)
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
    report.wall_seconds = round(time.perf_counter() - run.steps.started, 1)
    report.memory = {**peak_memory(), "peak_rss_mb_after_step": run.steps.peaks}
    report.licence = carry_licence(report.source, directory, options.licence_files)
    write_card(report.to_dict(), repo_id, directory)
    report.save(directory)
