"""The one exception type the CLI turns into a single clear sentence and a non-zero exit, the exit codes, the
redaction that keeps Hub tokens out of every message, termination signals turned into an interruption, and the test
for a write that failed on a full disk or a file size limit."""

import errno
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager

USAGE_EXIT = 2  # bad input, unreachable or refused source: nothing was written
GATE_FAILED_EXIT = 3  # the model was written (its card says it failed) and is not pushed without --force
PUSH_FAILED_EXIT = 4  # the output directory is complete and kept; only the push failed
WRITE_FAILED_EXIT = 5  # the output directory could not be written (disk full, permissions); nothing was left behind
INTERRUPTED_EXIT = 130  # Ctrl-C (128 + SIGINT); SIGTERM and SIGHUP exit 128 + their number, as the shell reports them

# Hub user-access tokens look like hf_ + 30-40 letters/digits; redact them even when they are not the active one.
_TOKEN_PATTERN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")
REDACTED = "hf_***"


def redact(text: str) -> str:
    """`text` with the active Hub token and anything shaped like a Hub token replaced by hf_***."""
    from huggingface_hub import get_token

    token = get_token()
    if token and len(token) >= 8:  # a very short string would mangle ordinary words
        text = text.replace(token, REDACTED)
    return _TOKEN_PATTERN.sub(REDACTED, text)


class HfcompressError(Exception):
    """A user-facing failure: `str(err)` says what is wrong and what to do; `exit_code` is the CLI's exit status.

    The message is redacted on construction, so a server reply or URL quoted in it can never leak the token.
    """

    def __init__(self, message: str, exit_code: int = USAGE_EXIT):
        super().__init__(redact(message))
        self.exit_code = exit_code


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (what `timeout`, systemd and job schedulers send), raised where the run is, like Ctrl-C: every
    `finally` runs, so partial files and directories are removed and the output lock is released."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# what an interruption leaves unless the step it came in says otherwise (`interruption_leaves`)
NOTHING_WRITTEN = "nothing was written; rerun the same command to resume from the cache"


@contextmanager
def interruption_leaves(what: str) -> Iterator[None]:
    """An interruption (Ctrl-C, SIGTERM, SIGHUP) within the block leaves `what` (say, a complete output whose push was
    cut short), not nothing: the CLI says so (`left_by`) instead of "nothing was written"."""
    try:
        yield
    except KeyboardInterrupt as err:
        err.leaves = what  # read by the CLI after every `finally` ran
        raise


def left_by(err: KeyboardInterrupt) -> str:
    """What the interruption `err` left, as the CLI's sentence after "interrupted:"."""
    return getattr(err, "leaves", NOTHING_WRITTEN)


@contextmanager
def termination_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise `Terminated` in the main thread; a second one while the first is
    being cleaned up is ignored, so the cleanup finishes (SIGKILL still ends it). SIGXFSZ is ignored, so a write past
    a file size limit (RLIMIT_FSIZE) fails with EFBIG instead of killing the process without a word."""

    def terminate(signum: int, frame) -> None:
        for number in TERMINATING_SIGNALS:
            signal.signal(number, signal.SIG_IGN)
        raise Terminated(signum)

    try:
        previous = {number: signal.signal(number, terminate) for number in TERMINATING_SIGNALS}
    except ValueError:  # not the main thread (an embedding application): its own signal handling stays
        yield
        return
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


# OSError numbers of a write the system refused for room: a full disk, a quota, a file size limit
FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# the same refusals as writers that are not Python's own report them (safetensors' Rust writer: "File too large")
_FULL_DISK_TEXTS = {"No space left": errno.ENOSPC, "Disk quota": errno.EDQUOT, "File too large": errno.EFBIG}


def full_disk_errno(err: BaseException) -> int | None:
    """The errno when `err` is a write refused for room (ENOSPC, EDQUOT, EFBIG), also as safetensors reports it;
    None for any other error."""
    if isinstance(err, OSError):
        return err.errno if err.errno in FULL_DISK_ERRNOS else None
    text = str(err)
    return next((number for needle, number in _FULL_DISK_TEXTS.items() if needle in text), None)
