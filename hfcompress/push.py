"""Step 8, push: create the repo and upload the whole output folder in one commit, retrying transient failures."""

import json
import shlex
from pathlib import Path

import httpx2
from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError

from .errors import GATE_FAILED_EXIT, PUSH_FAILED_EXIT, HfcompressError
from .hub import configure_http, describe, status_code, with_retries
from .report import REPORT_FILE


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
    validation = json.loads(report.read_text()).get("validation", {})
    if not validation.get("gate_passed") and not force:
        raise HfcompressError(
            f"Not pushing {directory}: it failed the quality gate ({validation.get('gate_message', 'no result')}); "
            "pass --force to push it anyway.",
            exit_code=GATE_FAILED_EXIT,
        )


def push_command(directory: Path, repo_id: str, private: bool, force: bool = False) -> str:
    """The `hfcompress push` command line that retries this push later."""
    args = ["hfcompress", "push", str(directory), repo_id] + ["--private"] * private + ["--force"] * force
    return shlex.join(args)


def push_folder(
    directory: Path, repo_id: str, token: str, private: bool, commit_message: str, force: bool = False
) -> str:
    """create_repo(exist_ok) + one commit that makes the repo hold exactly `directory`; returns the commit URL.

    Files of an earlier version that `directory` lacks (say, old weight shards) are deleted in that same commit, so
    the repo holds either the old file set or the complete new one, never a mix. Transient failures are retried
    (see hub.py); on a final failure the local directory is untouched and the message says how to push it later.
    """
    configure_http()
    api = HfApi(token=token)

    def attempt() -> str:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            folder_path=str(directory), repo_id=repo_id, repo_type="model", commit_message=commit_message,
            delete_patterns="*",  # .gitattributes is always kept by huggingface_hub
        )
        return commit.commit_url

    try:
        return with_retries(attempt, f"push to {repo_id}")
    except ConnectionError as err:  # huggingface_hub's OfflineModeIsEnabled (HF_HUB_OFFLINE), a dropped socket
        later = push_command(directory, repo_id, private, force)
        raise HfcompressError(
            f"Push to {repo_id} failed ({type(err).__name__}: the Hub cannot be reached from here); the converted model "
            f"is kept in {directory}: push it later with `{later}`.",
            exit_code=PUSH_FAILED_EXIT,
        ) from err
    except (HfHubHTTPError, httpx2.TransportError) as err:
        later = push_command(directory, repo_id, private, force)
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
