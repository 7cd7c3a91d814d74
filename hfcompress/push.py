"""Step 8, push: create the repo and upload the whole output folder in one commit."""

from pathlib import Path

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError

from .errors import HfcompressError


def require_token() -> str:
    """The user's Hub token (HF_TOKEN or `hf auth login`), checked before any long work starts."""
    token = get_token()
    if not token:
        raise HfcompressError("Pushing needs a Hub token: run `hf auth login` or set HF_TOKEN, then rerun.")
    return token


def push_folder(directory: Path, repo_id: str, token: str, private: bool, commit_message: str) -> str:
    """create_repo(exist_ok) + one upload commit of `directory`; returns the commit URL."""
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            folder_path=str(directory), repo_id=repo_id, repo_type="model", commit_message=commit_message
        )
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else "no response"
        raise HfcompressError(
            f"Push to {repo_id} failed (HTTP {status}); the converted model is intact in {directory}: "
            f"push it later with `hfcompress push {directory} {repo_id}`."
        ) from err
    return commit.commit_url
