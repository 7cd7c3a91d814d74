"""The one exception type the CLI turns into a single clear sentence and a non-zero exit, the exit codes, and the
redaction that keeps Hub tokens out of every message."""

import re

USAGE_EXIT = 2  # bad input, unreachable or refused source: nothing was written
GATE_FAILED_EXIT = 3  # the model was written (its card says it failed) and is not pushed without --force
PUSH_FAILED_EXIT = 4  # the output directory is complete and kept; only the push failed
WRITE_FAILED_EXIT = 5  # the output directory could not be written (disk full, permissions); nothing was left behind

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
