"""Talking to the Hub over a flaky network: request timeouts, which failures are transient, bounded retries.

huggingface_hub 2.x already retries (exponential backoff, 5 retries, on 408/429/5xx, timeouts and dropped
connections) the requests that go through its `http_backoff`: during `upload_folder` those are the preupload call
and the LFS batch, upload (PUT) and verify calls. It does not retry `create_repo`, the commit itself, or the
metadata calls (`model_info`, paths-info, validate-yaml). `with_retries` retries a whole push on a transient
failure of those, and leaves alone a failure that huggingface_hub has already retried. Re-running a push is safe:
LFS files already on the server are not uploaded again, and the commit is all-or-nothing on the server.

Settings (environment): HFCOMPRESS_HTTP_TIMEOUT (seconds a request may send or receive nothing, default 60),
HFCOMPRESS_PUSH_ATTEMPTS (default 4), HFCOMPRESS_RETRY_DELAY (first wait in seconds, doubled each retry, default 2).
"""

import os
import time
from collections.abc import Callable
from typing import TypeVar

import httpx2  # huggingface_hub's HTTP client library
from huggingface_hub import set_client_factory
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils._http import default_client_factory  # not re-exported; keeps the Hub's request hook

from ..progress import console

T = TypeVar("T")
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# The requests huggingface_hub sends through its own http_backoff during an upload (see the module docstring).
_HUB_RETRIED_PATHS = ("/preupload/", "/info/lfs/objects/")


def http_timeout() -> float:
    return float(os.environ.get("HFCOMPRESS_HTTP_TIMEOUT", "60"))


def configure_http() -> None:
    """Give huggingface_hub's shared client a timeout: its default waits forever on a stalled connection."""
    timeout = http_timeout()

    def factory() -> httpx2.Client:
        client = default_client_factory()
        client.timeout = httpx2.Timeout(timeout)
        return client

    set_client_factory(factory)


def status_code(err: BaseException) -> int | None:
    response = getattr(err, "response", None)
    return response.status_code if isinstance(err, HfHubHTTPError) and response is not None else None


def is_transient(err: BaseException) -> bool:
    """5xx, 408, 429, timeouts and connection failures: worth trying again. Auth errors (401/403) never are."""
    if isinstance(err, HfHubHTTPError):
        return status_code(err) in TRANSIENT_STATUS
    return isinstance(err, httpx2.TransportError)


def _failed_request(err: BaseException) -> httpx2.Request | None:
    if isinstance(err, HfHubHTTPError):
        return err.response.request if err.response is not None else None
    try:
        return err.request  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # httpx raises RuntimeError when no request was attached
        return None


def retried_by_huggingface_hub(err: BaseException) -> bool:
    """True when the failed request went through huggingface_hub's own backoff (an LFS transfer or preupload)."""
    request = _failed_request(err)
    if request is None:
        return False
    return request.method == "PUT" or any(p in request.url.path for p in _HUB_RETRIED_PATHS)


def describe(err: BaseException) -> str:
    """A short name for a network failure, e.g. 'HTTP 503' or 'ReadTimeout'."""
    code = status_code(err)
    return f"HTTP {code}" if code is not None else type(err).__name__


def with_retries(action: Callable[[], T], what: str) -> T:
    """`action()`, retried with exponential backoff while it fails transiently (bounded attempts)."""
    attempts = max(1, int(os.environ.get("HFCOMPRESS_PUSH_ATTEMPTS", "4")))
    delay = float(os.environ.get("HFCOMPRESS_RETRY_DELAY", "2"))
    attempt = 1
    while True:
        try:
            return action()
        except (HfHubHTTPError, httpx2.TransportError) as err:
            if attempt >= attempts or not is_transient(err) or retried_by_huggingface_hub(err):
                raise
            console.log(f"{what} failed ({describe(err)}); retry {attempt}/{attempts - 1} in {delay:g} s")
            time.sleep(delay)
            delay *= 2
            attempt += 1
