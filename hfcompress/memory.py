"""Peak resident memory of this process, for the report and the terminal."""

import ctypes
import resource
import sys

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


def peak_memory() -> dict[str, float]:
    """{"peak_rss_mb": the largest resident set this process has had} (ru_maxrss: KiB on Linux, bytes on macOS).

    Children are left out on purpose: a child's ru_maxrss starts from its parent's resident set at fork time."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_mb": round(maxrss / (2**20 if sys.platform == "darwin" else 2**10), 1)}


def return_freed_memory() -> None:
    """Serve large blocks (>= 1 MiB) straight from mmap, so a freed layer or activation goes back to the OS.

    glibc otherwise raises its mmap threshold after the first large free (up to 32 MiB) and keeps later blocks in
    its heap, where a streamed run that allocates and frees layer after layer leaves them resident. No-op where
    glibc is not the allocator."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)


def available_memory(device) -> int:
    """Bytes free for new tensors: the CUDA device's free memory, or the system's MemAvailable."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024
