"""Bundle the converter's remote-code files into this plugin's wheel (hfcompress_vllm/remote_code/), so the plugin reads
the family table and config classes of its own version without importing hfcompress (remote_config.py says why).

In the repository they are ../modeling; the sdist carries them as modeling/, from which its wheel is built. An
editable install bundles nothing: remote_config.py reads the checkout's modeling/ in place.
"""

from __future__ import annotations

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class RemoteCodeHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        root = Path(self.root)
        source = next((d for d in (root.parent / "modeling", root / "modeling") if (d / "configuration_lisa.py").is_file()), None)
        if source is None:
            raise FileNotFoundError(f"no modeling/ folder with configuration_lisa.py beside or inside {root}")
        if self.target_name == "sdist":
            if source.parent != root:  # in the repository: carry the files into the sdist
                build_data["force_include"][str(source)] = "modeling"
        elif version != "editable":
            for path in sorted(source.glob("*.py")):
                build_data["force_include"][str(path)] = f"hfcompress_vllm/remote_code/{path.name}"
