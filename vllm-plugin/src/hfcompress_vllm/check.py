"""Whether this environment can serve a converted model, before any model work: `hfcompress eval DIR --engine vllm`
runs `python -m hfcompress_vllm.check DIR` in vLLM's environment first. Exit 0 and prints this plugin's version; else
exit 2 and one sentence on stderr naming what to install (a vLLM outside the supported range, a model converted by
another hfcompress version). Reads config.json and package metadata only: imports neither vllm nor torch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import __version__
from .versions import VersionMismatch, check_converter, check_vllm


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m hfcompress_vllm.check MODEL_DIR", file=sys.stderr)
        return 2
    config_path = Path(argv[0]) / "config.json"
    try:
        check_vllm()
        if Path(argv[0]).is_dir():  # a Hub id: vLLM checks the converter when it reads config.json (configs.from_dict)
            check_converter(json.loads(config_path.read_text()))
    except VersionMismatch as err:
        print(err, file=sys.stderr)
        return 2
    except (OSError, ValueError) as err:
        print(f"{config_path} is not a readable config.json ({err}).", file=sys.stderr)
        return 2
    print(__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
