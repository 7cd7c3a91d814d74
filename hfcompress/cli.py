"""`hfcompress` command line (Typer)."""

import errno
import os
import sys
from pathlib import Path

import typer

from .conversion.config import TEXT_HELP, ConvertOptions, DeviceOptions, OutputOptions, QuantizeOptions, TextOptions
from .distill import DistillOptions
from .errors import (
    INTERRUPTED_EXIT, WRITE_FAILED_EXIT, HfcompressError, Terminated, left_by, redact, termination_as_interrupt,
)
from .fasc import FascOptions
from .keys import KeyOptions
from .families import FAMILIES
from .lisa import SHOWN_SHARE_RATIO, LisaOptions
from .conversion.options import option_spec
from .sources.source import BUILTIN_SOURCE

# the supported families, named from the one registry (families/__init__.py)
_TITLES = [family.title for family in FAMILIES.values()]
FAMILY_TITLES = ", ".join(_TITLES[:-1]) + " and " + _TITLES[-1]

app = typer.Typer(
    help=f"Convert {FAMILY_TITLES} models (LISA attention sharing + FASC low-rank), validate, push.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # click's plain help: option names in full and their help beside them, at any width
)


def option(group: type, name: str, **overrides):
    """The typer.Option of field `name` of option group `group` (LisaOptions, TextOptions, ...): its default, flags and
    help as the group declares them (options.option), so they are written once; `overrides` give what the command line
    shows otherwise (a comma-separated list's default, analyze's reading of --share-ratio)."""
    spec = option_spec(group, name)
    settings = {"default": spec.default, "help": spec.help, **spec.cli, **overrides}
    return typer.Option(settings.pop("default"), *spec.flags, **settings)


def _run(action) -> None:
    """Turn HfcompressError into one red sentence and its exit code; Ctrl-C into exit 130, SIGTERM and SIGHUP likewise
    (exit 143, 129). An unexpected OSError (disk full, permissions, a vanished file) or an allocation failure becomes
    one sentence too; HFCOMPRESS_TRACEBACK=1 keeps the traceback."""
    from .progress import console

    try:
        with termination_as_interrupt():
            action()
    except HfcompressError as err:
        _fail(console, str(err), err.exit_code)
    except KeyboardInterrupt as err:
        by = f" by {err}" if isinstance(err, Terminated) else ""
        console.print(f"[bold red]interrupted{by}:[/] {left_by(err)}.", highlight=False, soft_wrap=True)
        raise typer.Exit(err.exit_code if isinstance(err, Terminated) else INTERRUPTED_EXIT) from None
    except (OSError, MemoryError, RuntimeError) as err:
        if os.environ.get("HFCOMPRESS_TRACEBACK") or not (
            isinstance(err, (OSError, MemoryError)) or _out_of_memory(err) or _torch_write_failed(err)
        ):
            raise
        if _torch_write_failed(err):  # torch.save reports a short write (full disk, file size limit) as RuntimeError
            _fail(console, f"A cache file could not be written completely (torch: {_last_line(err)}): the disk is full "
                           f"or a file size limit was reached; {UNFINISHED}: free space, then {RERUN}.", WRITE_FAILED_EXIT)
        if isinstance(err, OSError):
            where = f" ({err.filename})" if err.filename else ""
            disk = err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EFBIG)
            _fail(console, redact(f"{err.strerror or err}{where}; {UNFINISHED}: check free space and permissions, then {RERUN}."),
                  WRITE_FAILED_EXIT if disk else 1)
        from .conversion.preflight import gb, remove_unfinished_entries

        freed = remove_unfinished_entries()  # a smaller run has another cache key: nothing unusable stays behind
        removed = f" (the unfinished calibration cache it began, {gb(freed)}, was removed)" if freed is not None else ""
        _fail(console, f"Out of memory; {UNFINISHED}{removed}: give fewer --calib-sequences, a shorter --seq-len or a "
                       "smaller --distill-batch-size or --distill-seq-len, or use a machine with more memory "
                       "(HFCOMPRESS_TRACEBACK=1 shows where it failed).", 1)


UNFINISHED = "the output was not completed"
RERUN = "rerun the same command, which resumes from the cache (HFCOMPRESS_TRACEBACK=1 shows where it failed)"


def _torch_write_failed(err: BaseException) -> bool:
    """torch's zip writer failing on a write the system refused (its C++ checks, not an OSError)."""
    text = str(err)
    return isinstance(err, RuntimeError) and ("PytorchStreamWriter" in text or "inline_container.cc" in text)


def _last_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[-1] if lines else type(err).__name__)[:160]


def _out_of_memory(err: RuntimeError) -> bool:
    """torch reports a failed allocation as RuntimeError (CPU) or its subclass OutOfMemoryError (CUDA)."""
    import torch

    return isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err)


def _fail(console, message: str, exit_code: int) -> None:
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(exit_code) from None


def _layers(value: str | None, option: str = "--lisa-layers") -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise HfcompressError(f"{option} must be comma-separated layer numbers, got '{value}'.") from None


@app.command(
    short_help="Convert a model to LISA (and FASC), validate it, write it, push it.",
    epilog=(
        "\b\nExamples:\n"  # \b: click keeps these lines as they are
        f"  hfcompress convert {BUILTIN_SOURCE} --out smollm2-lisa  # built in\n"
        "  hfcompress convert HuggingFaceTB/SmolLM2-135M --push-to me/smollm2-lisa\n"
        "  hfcompress convert ./my-llama --share-ratio 0.3 --fasc-budget 0.8 \\\n"
        "      --out my-llama-lisa\n"
        "  hfcompress convert model.gguf --lisa-layers 10,12,14 --max-ppl-increase 5\n\n"
        "Every option, failure and exit code: README.md (Commands; Failures, exit codes and safety)."
    ),
)
def convert(
    source: str = typer.Argument(
        BUILTIN_SOURCE, help=f"Hub id (user/model), local model directory, .gguf file, or '{BUILTIN_SOURCE}' (built in)."
    ),
    out: Path = typer.Option(None, "--out", "-o", help="Output directory (default: ./NAME-lisa); never the source's."),
    push_to: str = option(OutputOptions, "push_to"),
    private: bool = option(OutputOptions, "private"),
    revision: str = option(ConvertOptions, "revision"),
    overwrite: bool = option(OutputOptions, "overwrite"),
    force: bool = option(OutputOptions, "force"),
    trust_remote_code: bool = option(ConvertOptions, "trust_remote_code"),
    max_ppl_increase: float = option(ConvertOptions, "max_ppl_increase"),
    back_off: bool = option(ConvertOptions, "back_off"),
    share_ratio: float = option(LisaOptions, "share_ratio"),
    lisa_layers: str = option(LisaOptions, "layers"),
    lisa_ppl_budget: float = option(LisaOptions, "ppl_budget"),
    protect_first: int = option(LisaOptions, "protect_first"),
    layer_plan: str = option(LisaOptions, "plan"),
    drop_attention_layers: str = option(LisaOptions, "drop_layers"),
    lisa_max_chain: int = option(LisaOptions, "max_chain"),
    qk_compression: float = option(LisaOptions, "qk_compression"),
    lisa_align: str = option(LisaOptions, "align"),
    align_hidden: int = option(LisaOptions, "align_hidden"),
    lisa_lowrank_keys: str = option(LisaOptions, "lowrank_keys"),
    lisa_group_heads: bool = option(LisaOptions, "group_heads"),
    lisa_steps: int = option(LisaOptions, "steps"),
    lisa_batch_size: int = option(LisaOptions, "batch_size"),
    kv_budget: float = option(KeyOptions, "kv_budget"),
    kv_plan: str = option(KeyOptions, "plan"),
    kv_ppl_budget: float = option(KeyOptions, "ppl_budget"),
    fasc_budget: float = option(FascOptions, "budget"),
    fasc_method: str = option(FascOptions, "method"),
    fasc_targets: str = option(FascOptions, "targets", default=",".join(FascOptions.targets)),
    fasc_rho_keep: float = option(FascOptions, "rho_keep_threshold"),
    distill_tokens: int = option(DistillOptions, "tokens"),
    distill_seq_len: int = option(DistillOptions, "seq_len"),
    distill_batch_size: int = option(DistillOptions, "batch_size"),
    distill_lr: float = option(DistillOptions, "lr"),
    distill_weight_lr: float = option(DistillOptions, "weight_lr"),
    distill_lora_rank: int = option(DistillOptions, "lora_rank"),
    distill_curve_tokens: int = option(DistillOptions, "curve_tokens"),
    distill_data: str = option(DistillOptions, "data"),
    distill_gradient_checkpointing: bool = option(DistillOptions, "gradient_checkpointing"),
    calib_text: str = option(TextOptions, "calib_text"),
    eval_text: str = option(TextOptions, "eval_text"),
    ood_text: str = option(TextOptions, "ood_text"),
    calib_sequences: int = option(TextOptions, "calib_sequences"),
    seq_len: int = option(TextOptions, "seq_len"),
    eval_tokens: int = option(TextOptions, "eval_tokens"),
    seed: int = option(ConvertOptions, "seed"),
    probe: bool = option(ConvertOptions, "probe"),
    speed: bool = option(ConvertOptions, "speed"),
    peers: bool = option(ConvertOptions, "peers"),
    dtype: str = option(OutputOptions, "dtype"),
    device: str = option(DeviceOptions, "device"),
    max_shard_size: str = option(OutputOptions, "max_shard_size"),
    quantize_weights: str = option(QuantizeOptions, "weights"),
    licence_file: list[Path] = option(OutputOptions, "licence_files", default=None),
) -> None:
    """Convert SOURCE into a LISA model of its family (LisaLlama, LisaQwen2, ...), validate it, write --out and optionally push it."""

    def action() -> None:
        name = Path(source).stem if Path(source).suffix == ".gguf" else source.rstrip("/").split("/")[-1]
        options = ConvertOptions(
            source=source,
            out=out or Path(f"{name}-lisa"),
            push_to=push_to,
            private=private,
            revision=revision,
            overwrite=overwrite,
            force=force,
            trust_remote_code=trust_remote_code,
            max_ppl_increase=max_ppl_increase,
            back_off=back_off,
            calib_text=calib_text,
            eval_text=eval_text,
            ood_text=ood_text,
            calib_sequences=calib_sequences,
            seq_len=seq_len,
            eval_tokens=eval_tokens,
            seed=seed,
            probe=probe,
            speed=speed,
            peers=peers,
            dtype=dtype,
            device=device,
            max_shard_size=max_shard_size,
            quantize=QuantizeOptions(weights=quantize_weights),
            licence_files=list(licence_file or []),
            lisa=LisaOptions(
                share_ratio=share_ratio,
                layers=_layers(lisa_layers),
                ppl_budget=lisa_ppl_budget,
                protect_first=protect_first,
                max_chain=lisa_max_chain,
                plan=layer_plan,
                drop_layers=_layers(drop_attention_layers, "--drop-attention-layers"),
                qk_compression=qk_compression,
                align=lisa_align,
                align_hidden=align_hidden,
                lowrank_keys=lisa_lowrank_keys,
                group_heads=lisa_group_heads,
                steps=lisa_steps,
                batch_size=lisa_batch_size,
                seed=seed,
            ),
            keys=KeyOptions(kv_budget=kv_budget, plan=kv_plan, ppl_budget=kv_ppl_budget),
            fasc=FascOptions(
                method=fasc_method,
                budget=fasc_budget,
                targets=tuple(t.strip() for t in fasc_targets.split(",") if t.strip()),
                rho_keep_threshold=fasc_rho_keep,
            ),
            distill=DistillOptions(
                tokens=distill_tokens,
                seq_len=distill_seq_len,
                batch_size=distill_batch_size,
                lr=distill_lr,
                weight_lr=distill_weight_lr,
                lora_rank=distill_lora_rank,
                curve_tokens=distill_curve_tokens,
                gradient_checkpointing=distill_gradient_checkpointing,
                data=distill_data,
            ),
        ).validate()  # every value and combination, before any network or model work
        from .conversion.atomic import remove_leftovers
        from .conversion.pipeline import convert as run_convert

        remove_leftovers(options.out)  # what killed runs left beside --out: before the disk check counts it as used
        run_convert(options, argv=sys.argv[1:])

    _run(action)


@app.command(
    short_help="Per-layer attention similarity (LISA) and rho (FASC) of a model.",
    epilog=f"\b\nExample:\n  hfcompress analyze {BUILTIN_SOURCE} --plot similarity.png \\\n      --json analysis.json",
)
def analyze(
    source: str = typer.Argument(BUILTIN_SOURCE, help="Same SOURCE forms as `convert`."),
    plot: Path = typer.Option(Path("similarity.png"), help="Where to write the heatmap PNG."),
    json_out: Path = typer.Option(None, "--json", help="Also write the measurements as JSON."),
    rho: bool = typer.Option(False, "--rho", help="Also measure FASC rho per linear (needs backward passes)."),
    share_ratio: float = option(
        LisaOptions, "share_ratio", default=SHOWN_SHARE_RATIO, help="Show which layers convert --share-ratio R would share."
    ),
    protect_first: int = option(LisaOptions, "protect_first"),
    calib_text: str = option(TextOptions, "calib_text"),
    calib_sequences: int = option(TextOptions, "calib_sequences"),
    seq_len: int = option(TextOptions, "seq_len"),
    revision: str = option(ConvertOptions, "revision"),
    device: str = option(DeviceOptions, "device"),
    trust_remote_code: bool = option(ConvertOptions, "trust_remote_code"),
) -> None:
    """Measure per-layer attention similarity (LISA) and optionally rho (FASC); cached for `convert`."""
    from .evidence.analyze import analyze as run_analyze

    def action() -> None:
        from .conversion.preflight import check_output_file

        for path, flag in ((plot, "--plot"), (json_out, "--json")):  # written at the end: checked before the work
            if path is not None:
                check_output_file(path, flag)
        options = ConvertOptions(
            source=source, out=Path("."), revision=revision, trust_remote_code=trust_remote_code, calib_text=calib_text,
            calib_sequences=calib_sequences, seq_len=seq_len, device=device,
            lisa=LisaOptions(share_ratio=share_ratio, protect_first=protect_first),
            fasc=FascOptions(budget=0.5 if rho else 1.0),  # rho comes from FASC's statistics; nothing is converted
        ).validate()
        run_analyze(options, plot, json_out)

    _run(action)


@app.command(
    "eval",
    short_help="Perplexity, recall, speed and lm-eval tasks of a converted model.",
    epilog=f"\b\nExample:\n  hfcompress eval smollm2-lisa --baseline {BUILTIN_SOURCE} \\\n      --json eval.json",
)
def evaluate(
    model: str = typer.Argument(..., help="A converted model: hfcompress output directory or Hub id."),
    baseline: str = typer.Option(None, help="Original model to measure beside it (any SOURCE form of `convert`)."),
    eval_text: str = typer.Option("auto", help=f"Perplexity text (held out): {TEXT_HELP}."),
    ood_text: str = typer.Option("auto", help="Second perplexity text, of another domain: numpy-docs (auto), news, usenet, FILE, builtin, wiki, wikitext-2 or none."),
    context: int = typer.Option(512, help="Perplexity window in tokens."),
    stride: int = typer.Option(None, help="Window stride in tokens (default: = context)."),
    eval_tokens: int = typer.Option(None, help="Score only the first N tokens (default: all)."),
    speed: bool = typer.Option(True, "--speed/--no-speed", help="Measure prefill/decode tokens/s side by side."),
    probe: bool = typer.Option(True, "--probe/--no-probe", help="Run the factual-recall probe."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Needed for Hub ids: runs the modeling code the repo ships."),
    lm_eval: str = typer.Option(None, "--lm-eval", help="lm-evaluation-harness tasks (comma-separated) to run on the converted model and the original (--baseline, or the source in the report); results go into the card."),
    lm_eval_include: Path = typer.Option(None, help="A folder of lm-eval task YAML files (local, offline tasks)."),
    lm_eval_batch_size: int = typer.Option(1, help="lm-eval batch size (recorded in the card)."),
    lm_eval_fewshot: int = typer.Option(None, help="lm-eval few-shot examples (default: each task's own)."),
    lm_eval_limit: float = typer.Option(None, help="lm-eval documents per task (below 1: a fraction); for quick checks only."),
    json_out: Path = typer.Option(None, "--json", help="Also write the results as JSON."),
    engine: str = typer.Option("transformers", help="Perplexity of MODEL through transformers (the remote code) or vllm (served by vLLM with the hfcompress-vllm plugin, in the environment HFCOMPRESS_VLLM_PYTHON names: docs/serving-vllm.md)."),
    kv_cache_dtype: str = typer.Option(None, help="With --engine vllm: vLLM's KV cache dtype (auto, fp8, fp8_e4m3, fp8_e5m2), passed to the engine as its kv_cache_dtype."),
) -> None:
    """Perplexity, factual recall, speed and lm-eval tasks of a converted model (and its baseline, same tokens, same run)."""
    import json

    from .evidence.evaluate import evaluate as run_evaluate
    from .evidence.harness import LmEvalOptions
    from .evidence.report import public_command

    def action() -> None:
        from .conversion.preflight import check_output_file

        if json_out is not None:  # written after the evaluation: checked before it
            check_output_file(json_out, "--json")
        harness = None
        if lm_eval is not None:  # lm-eval installed, tasks known: checked before any model loads
            harness = LmEvalOptions.parse(lm_eval, lm_eval_include, lm_eval_batch_size, lm_eval_fewshot, lm_eval_limit)
        command = public_command(sys.argv[1:])  # for the card: no local directory in it
        result = run_evaluate(
            model, baseline, eval_text, ood_text, context, stride, eval_tokens, speed, probe, trust_remote_code, harness, command,
            engine=engine, kv_cache_dtype=kv_cache_dtype,
        )
        if json_out:
            json_out.parent.mkdir(parents=True, exist_ok=True)  # check_output_file found it can be made
            json_out.write_text(json.dumps(result, indent=2))

    _run(action)


@app.command(short_help="Push a finished output directory to the Hub in one commit.")
def push(
    directory: Path = typer.Argument(..., help="A directory written by `hfcompress convert`."),
    repo_id: str = typer.Argument(..., help="Hub repo to create/update, e.g. me/model-lisa."),
    private: bool = typer.Option(False, "--private", help="Create the repo as private."),
    force: bool = typer.Option(False, "--force", help="Push even when the directory failed the quality gate."),
) -> None:
    """Push an already converted directory (for example after a failed push) in one commit."""
    from .conversion.push import push_folder, require_token, verify_output

    def action() -> None:
        verify_output(directory, force)  # complete, gate passed (or --force), loads: before any network call
        url = push_folder(directory, repo_id, require_token(), private, "hfcompress: upload converted model", force)
        typer.echo(url)

    _run(action)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
