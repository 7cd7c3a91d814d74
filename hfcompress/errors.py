"""The one exception type the CLI turns into a single clear sentence and a non-zero exit."""


class HfcompressError(Exception):
    """A user-facing failure: `str(err)` says what is wrong and what to do; `exit_code` is the CLI's exit status."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
