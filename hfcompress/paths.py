"""Where hfcompress keeps its cache: $HFCOMPRESS_CACHE, else ~/.cache/hfcompress."""

import os
from pathlib import Path


def default_cache_dir() -> Path:
    return Path(os.environ.get("HFCOMPRESS_CACHE", "~/.cache/hfcompress")).expanduser()
