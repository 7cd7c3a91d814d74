"""Step 8, push: create the repo and upload the output's own files in one commit, retrying transient failures."""

import glob
import shlex
from pathlib import Path

import httpx2
from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError

from ..errors import GATE_FAILED_EXIT, PUSH_FAILED_EXIT, HfcompressError, interruption_leaves
from ..sources.hub import configure_http, describe, status_code, with_retries
from ..evidence.report import REPORT_FILE
from ..sources.source import read_json_object


def require_token() -> str:
    """The user's Hub token (HF_TOKEN or `hf auth login`), checked before any long work starts."""
    token = get_token()
    if not token:
        raise HfcompressError("Pushing needs a Hub token: run `hf auth login` or set HF_TOKEN, then rerun.")
    return token


def check_output_dir(directory: Path, force: bool) -> None:
    """Refuse a directory that is not a finished hfcompress output, or whose quality gate failed (unless force)."""
    report = directory / REPORT_FILE
    if not directory.is_dir():
        what = "is a file" if directory.exists() else "does not exist"
        raise HfcompressError(f"{directory} {what}: pass the directory `hfcompress convert --out` wrote.")
    weights = any(directory.glob("*.safetensors"))
    missing = [name for name in ("config.json", REPORT_FILE, "README.md") if not (directory / name).is_file()]
    missing += [] if weights else ["*.safetensors weights"]
    if missing:
        raise HfcompressError(
            f"{directory} is not a finished hfcompress output: it lacks {', '.join(missing)}; pass the directory "
            "`hfcompress convert --out` wrote (a run that failed or was interrupted writes none)."
        )
    validation = read_json_object(report).get("validation") or {}
    if not validation.get("gate_passed") and not force:
        raise HfcompressError(
            f"Not pushing {directory}: it failed the quality gate ({validation.get('gate_message', 'no result')}); "
            "pass --force to push it anyway.",
            exit_code=GATE_FAILED_EXIT,
        )


def check_output_files(directory: Path) -> None:
    """Every file the output needs to load is there: the remote-code modules config.json's auto_map names, the modules
    they import from the same directory (transformers requires each one), and every shard the weight index names.
    Refuses, naming the first missing file, what would otherwise be uploaded and fail for every user."""
    from ..remote import relative_imports
    from ..sources.source import WEIGHT_INDEX

    later = "convert again, or copy the file from the directory `hfcompress convert` wrote"
    config = read_json_object(directory / "config.json")
    auto_map = config.get("auto_map") or {}
    if not isinstance(auto_map, dict):
        raise HfcompressError(f"The config.json of {directory} has an auto_map that is not a map of classes: {later}.")
    # "module.Class", or "repo--module.Class" for code kept in another repo (nothing to find here)
    named = {ref.rsplit(".", 1)[0] for ref in auto_map.values() if isinstance(ref, str) and "--" not in ref}
    pending, seen = sorted(named), set()
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        path = directory / f"{module}.py"
        if not path.is_file():
            which = "config.json's auto_map names" if module in named else "the remote code imports"
            raise HfcompressError(f"{directory} lacks {module}.py, which {which}: the model would not load; {later}.")
        try:
            pending.extend(relative_imports(path))
        except (SyntaxError, ImportError) as err:
            raise HfcompressError(f"{path} is not valid remote code ({err.__class__.__name__}: {err}): {later}.") from None
    if (directory / WEIGHT_INDEX).is_file():
        shards = (read_json_object(directory / WEIGHT_INDEX).get("weight_map") or {}).values()
        if missing := sorted({shard for shard in shards if not (directory / str(shard)).is_file()}):
            raise HfcompressError(
                f"{directory} lacks the weight shard {missing[0]}, which {WEIGHT_INDEX} names"
                + (f" ({len(missing)} shards missing)" if len(missing) > 1 else "") + f": {later}."
            )


def check_loads(directory: Path) -> None:
    """The output builds in a fresh process as a user loads it (config and remote code with trust_remote_code=True,
    on the meta device), and its shards hold every tensor the model expects at its shape; no weight is read."""
    from ..evidence.validate import check_structure

    try:
        check_structure(directory.resolve())
    except HfcompressError as err:
        reason = str(err).split(": ", 1)[-1]
        raise HfcompressError(
            f"{directory} does not load in a fresh process with trust_remote_code=True ({reason.rstrip('.')}): convert "
            "it again; nothing was pushed."
        ) from None


def verify_output(directory: Path, force: bool) -> None:
    """Before any network call of `hfcompress push`: a finished output, every file it needs, the gate passed (or
    --force), and it loads in a fresh process."""
    check_output_dir(directory, force)
    check_output_files(directory)
    check_loads(directory)


def push_command(directory: Path, repo_id: str, private: bool, force: bool = False) -> str:
    """The `hfcompress push` command line that retries this push later."""
    args = ["hfcompress", "push", str(directory), repo_id] + ["--private"] * private + ["--force"] * force
    return shlex.join(args)


def push_folder(
    directory: Path, repo_id: str, token: str, private: bool, commit_message: str, force: bool = False
) -> str:
    """create_repo(exist_ok) + one commit that makes the repo hold exactly the files hfcompress wrote into
    `directory` (output.pushed_files: the user's own files there are left out, and named); returns the commit URL.

    Files of an earlier version that are not pushed now (say, old weight shards) are deleted in that same commit, so
    the repo holds either the old file set or the complete new one, never a mix. Transient failures are retried
    (see hub.py); on a final failure the local directory is untouched and the message says how to push it later.
    Ctrl-C or SIGTERM here says that the output is complete and gives the command that pushes it.
    """
    later = push_command(directory, repo_id, private, force)
    with interruption_leaves(f"the output in {directory} is complete and kept; the push to {repo_id} was interrupted: "
                             f"run `{later}` to push it"):
        return _push(directory, repo_id, token, private, commit_message, later)


def _push(directory: Path, repo_id: str, token: str, private: bool, commit_message: str, later: str) -> str:
    """push_folder's work; `later` is the command that pushes again."""
    from huggingface_hub import constants

    from .output import pushed_files

    check_output_files(directory)  # convert's own output was reload-checked when written; its files are checked here
    if constants.HF_HUB_OFFLINE:
        raise HfcompressError(
            f"Not pushing to {repo_id}: HF_HUB_OFFLINE=1 is set, which turns off every Hub request; unset it (`unset "
            f"HF_HUB_OFFLINE`) and run `{later}`; the converted model is kept in {directory}.",
            exit_code=PUSH_FAILED_EXIT,
        )
    pushed, left_out = pushed_files(directory)
    if left_out:  # the user's notes and runs that --overwrite kept: private, never uploaded
        from ..progress import console

        shown = ", ".join(left_out[:3]) + (", ..." if len(left_out) > 3 else "")
        console.log(f"push: leaving out {len(left_out)} file{'s' * (len(left_out) > 1)} that hfcompress did not write "
                    f"({shown}); they stay in {directory} only", highlight=False)
    configure_http()
    api = HfApi(token=token)

    def attempt() -> str:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            folder_path=str(directory), repo_id=repo_id, repo_type="model", commit_message=commit_message,
            allow_patterns=[glob.escape(name) for name in pushed],  # each file by its exact name, no user file
            delete_patterns="*",  # every remote file not pushed now; .gitattributes is always kept by huggingface_hub
        )
        return commit.commit_url

    try:
        return with_retries(attempt, f"push to {repo_id}")
    except ConnectionError as err:  # a dropped socket
        raise HfcompressError(
            f"Push to {repo_id} failed ({type(err).__name__}: the Hub cannot be reached from here); the converted model "
            f"is kept in {directory}: push it later with `{later}`.",
            exit_code=PUSH_FAILED_EXIT,
        ) from err
    except (HfHubHTTPError, httpx2.TransportError) as err:
        if status_code(err) in (401, 403):
            reason = getattr(err, "server_message", None) or "token not accepted"
            raise HfcompressError(
                f"The Hub refused the push to {repo_id} (HTTP {status_code(err)}: {reason.rstrip('.')}): log in with "
                f"a token that can write to it (`hf auth login`), then run `{later}`; the converted model is kept in "
                f"{directory}.",
                exit_code=PUSH_FAILED_EXIT,
            ) from err
        raise HfcompressError(
            f"Push to {repo_id} failed ({describe(err)}); the converted model is kept in {directory}: push it later "
            f"with `{later}`.",
            exit_code=PUSH_FAILED_EXIT,
        ) from err
