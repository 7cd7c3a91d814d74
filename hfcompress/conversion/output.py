"""The output: the converted model as a Hugging Face model directory, written atomically (atomic.atomic_directory).

Shards of at most `--max-shard-size`, the config, tokenizer, generation config and remote code, the weights quantized
when asked, then the fresh-process reload check of what was written, plots, the source's licence, the card and
`hfcompress_report.json`, which lists the files written. Only the main process writes.

--overwrite replaces what an earlier run wrote (the files its report lists) and keeps everything else the directory
holds (the user's notes, evaluation runs): it is copied into the new output before the swap.
"""

import fnmatch
import json
import math
import shutil
import time
from pathlib import Path

from transformers import GenerationConfig

from .atomic import atomic_directory
from .build import count_parameters, save_companion_files
from ..evidence.card import carry_licence, write_card
from .checkpoint import pack_shards, save_tensors
from ..errors import interruption_leaves
from ..memory import peak_memory
from .passes import Converted
from ..evidence.plots import write_plots
from ..progress import console
from .push import push_command
from ..serving.quantize import quantize_written, reloaded_logits
from ..evidence.report import REPORT_FILE, Report
from .run import Run
from ..evidence.validate import verify_written


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
        out_dir = atomic_directory(out_dir, lambda directory: write_model(run, report, converted, repo_id, directory), user_entries)
    written, options = f"the output in {out_dir} is complete", run.options
    if options.push_to:  # the push comes next
        written += f" but not pushed: run `{push_command(out_dir, options.push_to, options.private, options.force)}`"
    with interruption_leaves(written):  # from here on an interruption leaves a complete output, not nothing
        shutil.rmtree(converted.work, ignore_errors=True)  # the layers are in the output now; the calibration cache stays
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
    report.licence = carry_licence(source.to_dict(), directory, options.licence_files)  # the source's local files
    write_card(report.to_dict(), repo_id, directory)
    report.files = sorted({str(p.relative_to(directory)) for p in directory.rglob("*") if not p.is_dir()} | {REPORT_FILE})
    report.save(directory)


# what hfcompress writes into an output, for an earlier output whose report does not list its files
WRITTEN_BY_HFCOMPRESS = (
    "config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json", "tokenizer*",
    "special_tokens_map.json", "chat_template.jinja", "*.py", "README.md", "NOTICE", "LICENSE*", "LICENCE*",
    "USE_POLICY*", "plots", REPORT_FILE,
)


def listed_files(output: Path) -> list[str] | None:
    """The files (paths relative to `output`) that its report lists as written by hfcompress; None for a report from
    before that list, or one that cannot be read."""
    try:
        written = json.loads((output / REPORT_FILE).read_text()).get("files")
    except (OSError, ValueError, AttributeError):  # unreadable: only the names hfcompress writes are its own
        return None
    return [str(name) for name in written] if isinstance(written, list) else None


def written_by_hfcompress(name: str) -> bool:
    """Whether a top-level entry of this name is one hfcompress writes (for an output whose report lists no files)."""
    return any(fnmatch.fnmatch(name, pattern) for pattern in WRITTEN_BY_HFCOMPRESS)


def user_entries(earlier: Path) -> list[str]:
    """The entries of an earlier output that it did not write (the user's files and directories, paths relative to
    it, also inside a directory hfcompress writes such as plots/): what --overwrite keeps. The earlier report's list
    of files says what was written; one without that list, the names hfcompress writes. The new output's own names
    replace the earlier ones in any case."""
    written = listed_files(earlier)
    if written is None:
        return sorted(entry.name for entry in earlier.iterdir() if not written_by_hfcompress(entry.name))
    ours = set(written)
    # directories that hold something hfcompress wrote: the user's files inside them (plots/mine.png) are kept one by one
    mixed = {"/".join(name.split("/")[:depth]) for name in ours for depth in range(1, name.count("/") + 1)}
    kept = []

    def walk(directory: Path) -> None:
        for entry in sorted(directory.iterdir()):
            name = str(entry.relative_to(earlier))
            if name in mixed and entry.is_dir() and not entry.is_symlink():
                walk(entry)
            elif name not in ours:
                kept.append(name)

    walk(earlier)
    return kept


def pushed_files(output: Path) -> tuple[list[str], list[str]]:
    """(the files of `output` a push uploads, those it leaves out), paths relative to `output`: only what hfcompress
    wrote (the report's list, or for a report without one the names hfcompress writes), never the user's notes or
    evaluation runs that --overwrite keeps in the directory."""
    written = listed_files(output)
    ours = set(written or ())
    pushed, left_out = [], []
    for name in sorted(str(path.relative_to(output)) for path in output.rglob("*") if path.is_file()):
        mine = name in ours if written is not None else written_by_hfcompress(name.split("/")[0])
        (pushed if mine else left_out).append(name)
    return pushed, left_out
