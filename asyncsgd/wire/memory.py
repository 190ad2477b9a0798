"""Keep large freed buffers in the process instead of returning them to the OS.

glibc serves large allocations (libzmq's message buffers, tensors) with fresh mmaps and trims
freed heap; where the host reclaims freed pages every message then pays for page faults, so
raising the mmap and trim thresholds (as MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_
would) reuses the same memory. Figures: experiments/README.md, "Freed memory".
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory(mmap_threshold: int = 128 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Tune glibc malloc for reuse of big buffers; False where it is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = all(libc.mallopt(opt, val) == 1 for opt, val in (
            (_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold),
            (_M_TOP_PAD, 64 << 20)))
    except (OSError, AttributeError):
        return False
    if not ok:
        log.debug("mallopt refused a setting; keeping glibc's defaults")
    return ok
