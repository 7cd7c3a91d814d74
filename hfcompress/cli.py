"""`hfcompress` command line (Typer)."""

import errno
import os
import sys
from pathlib import Path

import typer

from .distill import DEFAULT_TOKENS, DistillOptions
from .errors import WRITE_FAILED_EXIT, HfcompressError, redact
from .fasc import DEFAULT_TARGETS, METHODS, FascOptions
from .lisa import DEFAULT_SHARE_RATIO, LisaOptions
from .config import QUANTIZE_WEIGHTS_HELP, QuantizeOptions
from .families import FAMILIES
from .source import BUILTIN_SOURCE

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

INTERRUPTED_EXIT = 130
TEXT_HELP = "auto, mix, wiki, builtin, wikitext-2, hf:OWNER/NAME[:CONFIG] or a UTF-8 FILE (README: Calibration and evaluation text)"


def _run(action) -> None:
    """Turn HfcompressError into one red sentence and its exit code; Ctrl-C into exit 130. An unexpected OSError (disk
    full, permissions, a vanished file) or an allocation failure becomes one sentence too; HFCOMPRESS_TRACEBACK=1
    keeps the traceback."""
    from .progress import console

    try:
        action()
    except HfcompressError as err:
        _fail(console, str(err), err.exit_code)
    except KeyboardInterrupt:
        console.print("[bold red]interrupted:[/] nothing was written; rerun the same command to resume from the cache.")
        raise typer.Exit(INTERRUPTED_EXIT) from None
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
        from .preflight import gb, remove_unfinished_entries

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
    push_to: str = typer.Option(None, "--push-to", help="Hub repo to create/update with the converted model."),
    private: bool = typer.Option(False, "--private", help="Create the pushed repo as private."),
    revision: str = typer.Option(None, "--revision", help="Branch, tag or commit of a Hub source (default: main)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier hfcompress output at --out."),
    force: bool = typer.Option(False, "--force", help="Push even when the perplexity gate failed."),
    trust_remote_code: bool = typer.Option(
        False, "--trust-remote-code", help="Accept a source that declares custom code (auto_map); its code is never run."
    ),
    max_ppl_increase: float = typer.Option(10.0, help="Quality gate: largest allowed perplexity increase, in percent."),
    share_ratio: float = typer.Option(
        None, help=f"Fraction of layers to share (LISA), best-aligned first (default {DEFAULT_SHARE_RATIO})."
    ),
    lisa_layers: str = typer.Option(None, help="Explicit comma-separated layers to share (instead of --share-ratio)."),
    lisa_ppl_budget: float = typer.Option(
        None, help="Share as many layers as keep perplexity within +PCT (a search; instead of --share-ratio)."
    ),
    protect_first: int = typer.Option(LisaOptions.protect_first, help="Number of shallow layers never shared."),
    layer_plan: str = typer.Option(
        LisaOptions.plan, help="What --share-ratio / --lisa-ppl-budget may do to a layer: share, drop (its attention), mixed (per layer)."
    ),
    drop_attention_layers: str = typer.Option(None, help="Comma-separated layers whose attention is dropped outright."),
    lisa_max_chain: int = typer.Option(
        LisaOptions.max_chain, help="At most this many consecutive shared layers (default: no cap)."
    ),
    qk_compression: float = typer.Option(LisaOptions.qk_compression, help="Shared layers' Q/K parameters are at least this many times smaller."),
    lisa_align: str = typer.Option(
        LisaOptions.align, help="Head alignment: dense, sparse (SDPA fast path) or identity."
    ),
    align_hidden: int = typer.Option(LisaOptions.align_hidden, help="Width of the dense alignment FFN (0 = linear head mix only)."),
    lowrank: bool = typer.Option(True, "--lowrank/--no-lowrank", help="Low-rank Q/K correction in shared layers."),
    lisa_lowrank_keys: str = typer.Option(
        LisaOptions.lowrank_keys, help="Low-rank keys of a shared layer: one per head, or per KV group."
    ),
    lisa_group_heads: bool = typer.Option(
        LisaOptions.group_heads, help="Sparse Align: the heads of one KV group read one KV head of the layer below, so vLLM caches no more than the original (docs/serving-vllm.md)."
    ),
    lisa_steps: int = typer.Option(LisaOptions.steps, help="Adam steps of each shared layer's local fit."),
    lisa_batch_size: int = typer.Option(LisaOptions.batch_size, help="Calibration sequences per step of a shared layer's local fit."),
    fasc_budget: float = typer.Option(1.0, help="FASC: fraction of targeted linear parameters kept (1.0 = off)."),
    fasc_method: str = typer.Option("fisher", help=f"FASC subspace: {', '.join(METHODS)}."),
    fasc_targets: str = typer.Option(",".join(DEFAULT_TARGETS), help="FASC: linear layers to factorise."),
    fasc_rho_keep: float = typer.Option(
        None, help="FASC: linears whose rho (activation-gradient dependence) exceeds this stay dense (default: none)."
    ),
    distill_tokens: int = typer.Option(
        None, help=f"Distillation tokens (KL to the original; default {DEFAULT_TOKENS} when the model fits; 0 = off)."
    ),
    distill_seq_len: int = typer.Option(DistillOptions.seq_len, help="Distillation: tokens per training window."),
    distill_batch_size: int = typer.Option(DistillOptions.batch_size, help="Distillation: windows per step."),
    distill_lr: float = typer.Option(DistillOptions.lr, help="Distillation: learning rate of LISA's new modules."),
    distill_weight_lr: float = typer.Option(DistillOptions.weight_lr, help="Distillation: learning rate of FASC factors and LoRA adapters."),
    distill_lora_rank: int = typer.Option(
        DistillOptions.lora_rank, help="Distillation: LoRA rank on the unchanged linears, merged (0 = off)."
    ),
    distill_curve_tokens: int = typer.Option(
        DistillOptions.curve_tokens, help="Distillation: evaluation tokens per text at each learning-curve point."
    ),
    distill_data: str = typer.Option(
        DistillOptions.data, help="Distillation windows: calibration (text), generated (by the original) or mixed."
    ),
    distill_gradient_checkpointing: bool = typer.Option(
        False, "--distill-gradient-checkpointing", help="Distillation: recompute activations (less memory, slower)."
    ),
    calib_text: str = typer.Option("auto", help=f"Calibration text: {TEXT_HELP}."),
    eval_text: str = typer.Option("auto", help=f"Perplexity text (held out): {TEXT_HELP}."),
    ood_text: str = typer.Option(
        "auto", help="Second gated perplexity text, of another domain: auto, numpy-docs, news, usenet, FILE, ... or none."
    ),
    calib_sequences: int = typer.Option(16, help="Number of calibration sequences."),
    seq_len: int = typer.Option(256, help="Calibration sequence length in tokens."),
    eval_tokens: int = typer.Option(4096, help="Tokens of held-out text scored for perplexity."),
    seed: int = typer.Option(0, help="Random seed (fitting and probes)."),
    probe: bool = typer.Option(None, "--probe/--no-probe", help="Factual-recall probe of both models (default: when they fit)."),
    speed: bool = typer.Option(None, "--speed/--no-speed", help="Tokens/s of both models side by side (default: when they fit)."),
    peers: bool = typer.Option(
        None, "--peers/--no-peers", help="Score attention/layer dropping and a 4-bit KV cache at this KV saving (default: when the model fits)."
    ),
    dtype: str = typer.Option("auto", help="Saved weights: auto (the source's), float32, bfloat16, float16."),
    device: str = typer.Option("auto", help="Where layers are computed: auto, cpu, cuda or cuda:N."),
    max_shard_size: str = typer.Option("2GB", help="Largest output safetensors shard, e.g. 2GB or 500MB."),
    quantize_weights: str = typer.Option("none", help=QUANTIZE_WEIGHTS_HELP),
    licence_file: list[Path] = typer.Option(
        None, "--licence-file", help="A licence or terms file to ship too (repeatable)."
    ),
    layer_by_layer: bool = typer.Option(
        False, "--layer-by-layer", hidden=True, help="No effect: every conversion streams layer by layer."
    ),
) -> None:
    """Convert SOURCE into a LISA model of its family (LisaLlama, LisaQwen2, ...), validate it, write --out and optionally push it."""
    from .config import ConvertOptions

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
                lowrank=lowrank,
                lowrank_keys=lisa_lowrank_keys,
                group_heads=lisa_group_heads,
                steps=lisa_steps,
                batch_size=lisa_batch_size,
                seed=seed,
            ),
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
        if layer_by_layer:
            from .progress import console

            console.log("--layer-by-layer has no effect any more: every conversion streams one layer at a time.")
        from .pipeline import convert as run_convert

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
    share_ratio: float = typer.Option(DEFAULT_SHARE_RATIO, help="Show which layers convert would share at this ratio."),
    protect_first: int = typer.Option(2, help="Number of shallow layers never shared."),
    calib_text: str = typer.Option("auto", help=f"Calibration text: {TEXT_HELP}."),
    calib_sequences: int = typer.Option(16, help="Number of calibration sequences."),
    seq_len: int = typer.Option(256, help="Calibration sequence length in tokens."),
    revision: str = typer.Option(None, help="Branch, tag or commit of a Hub source."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    trust_remote_code: bool = typer.Option(
        False, "--trust-remote-code", help="Accept a source that declares custom code (auto_map); its code is never run."
    ),
) -> None:
    """Measure per-layer attention similarity (LISA) and optionally rho (FASC); cached for `convert`."""
    from .analyze import analyze as run_analyze
    from .config import ConvertOptions

    def action() -> None:
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
    engine: str = typer.Option("transformers", help="Perplexity of MODEL through transformers (the remote code) or vllm (served by vLLM with the hfcompress plugin, from .venv-vllm: scripts/install_vllm.sh)."),
) -> None:
    """Perplexity, factual recall, speed and lm-eval tasks of a converted model (and its baseline, same tokens, same run)."""
    import json
    import shlex

    from .evaluate import evaluate as run_evaluate
    from .harness import LmEvalOptions

    def action() -> None:
        harness = None
        if lm_eval is not None:  # lm-eval installed, tasks known: checked before any model loads
            harness = LmEvalOptions.parse(lm_eval, lm_eval_include, lm_eval_batch_size, lm_eval_fewshot, lm_eval_limit)
        command = shlex.join(["hfcompress", *sys.argv[1:]])
        result = run_evaluate(
            model, baseline, eval_text, ood_text, context, stride, eval_tokens, speed, probe, trust_remote_code, harness, command,
            engine=engine,
        )
        if json_out:
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
    from .push import check_output_dir, push_folder, require_token

    def action() -> None:
        check_output_dir(directory, force)
        url = push_folder(directory, repo_id, require_token(), private, "hfcompress: upload converted model", force)
        typer.echo(url)

    _run(action)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
