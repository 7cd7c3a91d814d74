"""Peak resident memory of this process, for the report and the terminal."""

import resource
import sys


def peak_memory() -> dict[str, float]:
    """{"peak_rss_mb": the largest resident set this process has had} (ru_maxrss: KiB on Linux, bytes on macOS).

    Children are left out on purpose: a child's ru_maxrss starts from its parent's resident set at fork time."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_mb": round(maxrss / (2**20 if sys.platform == "darwin" else 2**10), 1)}
